"""Shared pytest set-up: one torch thread, deterministic algorithms, `gpu` tests skipped on CPU,
and the grouping of tests for pytest-xdist (``scripts/test.sh`` runs ``-n 2``)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core expects it
os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron.core.package_info: no `git rev-parse`

import pytest  # noqa: E402
import torch  # noqa: E402

torch.use_deterministic_algorithms(True, warn_only=True)


# Test files that share one expensive result run on the same xdist worker, which builds it once:
# the cached EP2 reference run (tests/training/__init__.py) and the converter workspace
# (tests/convert/conftest.py). Every other file is a group of its own (its module fixtures).
# The shared groups are the longest (the reference run's ~40 % of the suite): the workers sort
# them first, and the scheduler keeps that order, so they start at once beside everything else.
SHARED_GROUPS = {
    "tests/training/test_pretrain.py": "reference_run",
    "tests/training/test_resume.py": "reference_run",
    "tests/convert/": "convert_workspace",
}


def xdist_group(nodeid: str) -> str:
    """The xdist group of a test: its file's shared group, or the file."""
    path = nodeid.split("::")[0]
    for prefix, group in SHARED_GROUPS.items():
        if path.startswith(prefix):
            return group
    return path


@pytest.hookimpl(optionalhook=True)  # a pytest without xdist (the GPU machine's) still runs
def pytest_xdist_make_scheduler(config, log):
    """Whole groups to a worker (not ``--dist loadgroup``: pytest-xdist 3.8 groups by renaming
    each test's ``_nodeid``, which pytest 9.2 no longer reads: its groups were silently ignored)."""
    from xdist.scheduler import LoadScopeScheduling

    class LoadSharedScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    config.option.loadscopereorder = False  # keep the workers' order: shared groups first
    return LoadSharedScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: the shared groups first
        first = list(dict.fromkeys(SHARED_GROUPS.values()))
        rank = {group: i for i, group in enumerate(first)}
        items.sort(key=lambda item: rank.get(xdist_group(item.nodeid), len(first)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
