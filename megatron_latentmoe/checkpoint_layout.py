"""The on-disk layout of a ``megatron.training`` save root, in one place::

    SAVE_ROOT/latest_checkpointed_iteration.txt   the tracker: an iteration number or "release"
    SAVE_ROOT/iter_0000100/                       the checkpoint of iteration 100 (iter_%07d)
    SAVE_ROOT/release/                            a checkpoint without an iteration

Used by the converter (reading a save root, writing one), the model provider (the checkpoint a
run will load) and the training entry point (repairing the tracker). Plain Python, no torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
_ITERATION_DIR = re.compile(r"iter_(\d+)")


def iteration_dir_name(iteration: int | None) -> str:
    """The directory of ``iteration``'s checkpoint: ``iter_0000100`` for 100, ``release`` for
    None."""
    return RELEASE if iteration is None else f"iter_{iteration:07d}"


def iteration_of_dir_name(name: str) -> int | None:
    """The iteration whose checkpoint directory is ``name`` (the inverse of
    :func:`iteration_dir_name`); None for any other name, ``release`` included."""
    m = _ITERATION_DIR.fullmatch(name)
    if m is None or iteration_dir_name(int(m.group(1))) != name:
        return None
    return int(m.group(1))


def tracker_text(iteration: int | None) -> str:
    """What the tracker holds for ``iteration``'s checkpoint (None: the ``release`` one)."""
    return RELEASE if iteration is None else str(iteration)


def tracked_checkpoint_dir(
    root: str | os.PathLike, error: type[Exception] = ValueError
) -> Path | None:
    """The checkpoint directory that ``root``'s tracker names (``root/iter_XXXXXXX`` or
    ``root/release``, whether it exists or not); None if ``root`` has no tracker. A tracker that
    cannot be read (or is not UTF-8 text), or holds neither an iteration number nor ``release``,
    raises ``error`` naming the file (and what it holds)."""
    tracker = Path(root) / TRACKER_FILE
    if not tracker.is_file():
        return None
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:  # unreadable, or not text (a corrupted file)
        raise error(f"checkpoint tracker {str(tracker)!r} cannot be read: {e}") from None
    if text == RELEASE:
        return Path(root) / RELEASE
    if not text.isdecimal():  # isdigit() takes "²", which int() refuses
        raise error(
            f"checkpoint tracker {str(tracker)!r} holds {text!r}: expected an iteration number "
            f"or {RELEASE!r}"
        )
    return Path(root) / iteration_dir_name(int(text))
