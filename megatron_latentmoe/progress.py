"""When to draw a tqdm progress bar: Hugging Face's rule, for the converter and the preprocessor.

huggingface_hub (``utils/tqdm.py``) draws its bars with tqdm's ``disable=None`` (only when the
stream is a terminal, so that logs and pipes get no carriage-return frames), never when
``HF_HUB_DISABLE_PROGRESS_BARS`` is true (it has priority), and always when ``TQDM_POSITION=-1``.
"""

from __future__ import annotations

import os

_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub.constants._is_true


def tqdm_disable(progress: bool | None = None) -> bool | None:
    """tqdm's ``disable`` for a bar the caller asked for with ``progress``: False never, True
    always, None on a terminal; ``HF_HUB_DISABLE_PROGRESS_BARS`` turns any of them off."""
    if progress is False:
        return True
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").upper() in _TRUE:
        return True
    if progress is True or os.environ.get("TQDM_POSITION") == "-1":
        return False
    return None
