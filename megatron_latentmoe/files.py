"""Can this process write there, and did a write fail for its disk (full, or turned read-only):
the file-system checks every writer of the package shares (the entry point's ``--save`` and
other folders, ``tools/preprocess_data.py``'s and the corpus CLI's ``--output-prefix``,
:func:`~megatron_latentmoe.data.indexed.preprocess_jsonl`'s ``output_prefix``, the converter's
``--output`` and ``--summary-json``), so that each says a read-only, unwritable or full output
the same way. Below ``data/`` and ``training/`` (both import it): no Megatron, no torch. What is
a run's alone (checkpoint sizes, a save that filled its disk) is
:mod:`megatron_latentmoe.training.file_checks`'."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

WRITABLE_FOLDER = "give a folder this run can create or write in"
"""What to do about a :func:`folder_problem`: the end of every such line."""

REMOUNT = "once the disk is checked (the kernel log says why), remount it read-write"
"""What to do about a file system the kernel turned read-only under a write (EROFS): said by
:func:`write_disk_failure_error` and by a checkpoint save's line (``training.file_checks``)."""


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path``, or the nearest of its parents that exists (where it would be created)."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot become a folder this process writes in: it, or the nearest of its
    parents that exists, is not a folder or not writable (None: it can). Nothing is created. A
    read-only file system (``statvfs``'s ``ST_RDONLY``) is named as such; ``os.access`` refuses
    it too (access(2)'s EROFS, root included: checked on a read-only tmpfs and a read-only bind
    mount), as "not writable". A name the file system cannot hold (``ENAMETOOLONG``: a part
    of 300 bytes, measured; an ``OSError`` traceback from ``Path.exists`` before) is
    refused in the error's words."""
    try:
        existing = nearest_existing(path)
        read_only = existing.is_dir() and os.statvfs(existing).f_flag & os.ST_RDONLY
    except OSError as e:
        return f"the file system refuses the name ({e.strerror})"
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if read_only:
        return f"{existing} is on a read-only file system"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def folder_refusal(flag: str, path: str | None) -> str | None:
    """One line naming ``flag`` when ``path`` cannot become a folder this process writes in
    (:func:`folder_problem`); None: it can, or no path."""
    why = folder_problem(path) if path else None
    return None if why is None else f"{flag} {path}: {why}; {WRITABLE_FOLDER}"


def os_error(err: BaseException | None, code: int, seen: set[int] | None = None) -> OSError | None:
    """The ``OSError`` of errno ``code`` that ``err`` is, was raised from or during, or holds as
    a rank's error in a torch DCP ``CheckpointException`` (its ``failures``); None if none."""
    seen = set() if seen is None else seen
    if err is None or id(err) in seen:
        return None
    seen.add(id(err))
    if isinstance(err, OSError) and err.errno == code:
        return err
    failures = getattr(err, "failures", None)
    wrapped = [f[0] for f in failures.values()] if isinstance(failures, dict) else []
    for e in (err.__cause__, err.__context__, *wrapped):
        found = os_error(e, code, seen)
        if found is not None:
            return found
    return None


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def free_bytes(path: str) -> int | None:
    """Free bytes on ``path``'s file system (its nearest existing folder), None if unreadable."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return None


_NAMES = {"--balance-log-file": "file", "--output-prefix": "path", "--summary-json": "path"}
"""What each flag of a ``(flag, folder)`` pair names where it is not a folder (the line's "give
FLAG a ... on a larger disk"); a "path" is a prefix: its files are the paths that start with it."""


def _holds(flag: str, folder: str, path: str) -> bool:
    """Whether ``path`` (absolute) is a file of the pair ``(flag, folder)``: inside the folder,
    or for a prefix (``--output-prefix PREFIX``) one whose path starts with it - the files a
    preprocessing run writes are ``PREFIX.bin``, ``PREFIX_<key>.idx``, their temporaries
    ``PREFIX.bin.tmp<pid>``, none of them under ``PREFIX/``."""
    if _NAMES.get(flag) == "path":
        return path.startswith(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def write_disk_failure_error(
    err: BaseException, folders: list[tuple[str, str]], written: bool = False
) -> str | None:
    """The one line for ``err`` where it is (or came from) an ``OSError`` ENOSPC, or EROFS, a
    write ran into outside a checkpoint save (that one is ``training.file_checks``'
    ``disk_failure_error``), else None.

    EROFS: a file system the kernel turned read-only under the run (ext4's ``errors=remount-ro``
    after a disk error; measured with ext4's ``trigger_fs_error`` under
    ``tools/preprocess_data.py``: an ``OSError: [Errno 30]`` traceback, exit 1). A plain
    ``mount -o remount,ro`` is refused (EBUSY) while a file is open for writing, so it is seen
    before a run (:func:`folder_problem`), this one only by the write.

    The file is the error's own name (ours, the balance JSONL, sets it; an ``open`` on a
    read-only file system too), the second where it names two: ``shutil.copyfile``'s ENOSPC
    names the source, then the file it was writing (its ``sendfile`` sets both); where the error
    names none (numpy's ``.npy`` writer, TensorBoard's event file, Megatron's dataset builder, the
    converter's shards: a buffered write or close), the first of the ``(flag, folder)`` pairs
    ``folders`` (a run's: ``training.file_checks.written_folders``) whose file system has no
    block left, or the first of them where the caller knows it was ``written`` (the shipped
    corpus's tokenization, ``tools/preprocess_data.py``'s ``--output-prefix``, the converter's
    ``--output``: their cut files are removed, so the disk is no longer full). A file
    system turned read-only is found only so: ``statvfs`` has no ``ST_RDONLY`` and ``os.access``
    allows writing there (ext4's ``emergency_ro``, measured). The flag whose folder (or prefix:
    :func:`_holds`) holds it is what the user can move elsewhere."""
    found = os_error(err, errno.ENOSPC)
    read_only = found is None and (found := os_error(err, errno.EROFS)) is not None
    if found is None:
        return None
    name = found.filename if found.filename2 is None else found.filename2  # a copy's target
    path = os.fsdecode(name) if name is not None else None
    if path is None:
        full = [(f, d) for f, d in folders if not read_only and free_bytes(d) == 0]
        named = folders[:1] if written else full
        flag, where = named[0] if named else (None, None)
        what = f"in {flag} {where}" if flag else "a file of the run (the error names none)"
    else:
        where = os.path.abspath(path)
        inside = [(f, d) for f, d in folders if _holds(f, d, where)]
        flag = max(inside, key=lambda fd: len(fd[1]))[0] if inside else None
        what = where
    kind = _NAMES.get(flag, "folder")
    there = "there" if where else "on the disks the run writes to"
    if read_only:
        move = f" or give {flag} a {kind} on another disk" if flag else ""
        return f"the file system turned read-only writing {what}; {REMOUNT}{move}"
    free = free_bytes(where) if where else None
    shown = f" ({megabytes(free)} free)" if free is not None else ""
    move = f" or give {flag} a {kind} on a larger disk" if flag else ""
    return f"the disk filled up writing {what}{shown}; free space {there}{move}"
