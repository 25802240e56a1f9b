"""Shared pytest set-up: one torch thread, deterministic algorithms, `gpu` tests skipped on CPU."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core expects it
os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron.core.package_info: no `git rev-parse`

import pytest  # noqa: E402
import torch  # noqa: E402

torch.use_deterministic_algorithms(True, warn_only=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
