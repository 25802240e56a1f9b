"""Python 3.11 support for megatron-core 0.19.2, which declares ``Requires-Python >=3.12``.

The only 3.12 API the 0.19.2 wheel uses is ``typing.override`` (PEP 698), imported by
``megatron/training/models/gpt.py`` and ``megatron/training/models/hybrid.py``;
``typing_extensions.override`` is the same decorator for older Pythons.
"""

from __future__ import annotations

import sys
import typing


def apply_python311_compat() -> bool:
    """Alias ``typing.override`` to ``typing_extensions.override`` when Python lacks it.

    Call before importing ``megatron.training``. Idempotent; returns True if the alias is (or was
    already) installed, False on Python >= 3.12 where nothing is needed.
    """
    if sys.version_info >= (3, 12):
        return False
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    return True
