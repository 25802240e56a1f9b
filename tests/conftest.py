"""Shared pytest set-up: one torch thread, deterministic algorithms, `gpu` tests skipped on CPU,
and the grouping of tests for pytest-xdist (``scripts/test.sh`` runs ``-n 2 --dist loadgroup``)."""

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
# The shared groups are the longest (the reference run's ~40 % of the suite), so a worker sorts
# them first and with --no-loadscope-reorder they start at once, beside everything else.
SHARED_GROUPS = {
    "tests/training/test_pretrain.py": "reference_run",
    "tests/training/test_resume.py": "reference_run",
    "tests/convert/": "convert_workspace",
}


def xdist_group(path: str) -> str:
    """The xdist group of a test file (its path relative to the repository)."""
    for prefix, group in SHARED_GROUPS.items():
        if path.startswith(prefix):
            return group
    return path


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: group, then shared groups first
        first = list(dict.fromkeys(SHARED_GROUPS.values()))
        groups = {item: xdist_group(item.nodeid.split("::")[0]) for item in items}
        for item, group in groups.items():
            item.add_marker(pytest.mark.xdist_group(group))
        items.sort(key=lambda item: first.index(groups[item]) if groups[item] in first else 99)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
