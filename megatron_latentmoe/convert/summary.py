"""Progress bar, end-of-run summary and output-directory handling shared by export and import."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import resource
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConversionError


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux ``ru_maxrss`` is in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001
        return 0


@dataclass
class ConversionSummary:
    """What a conversion did (printed at the end; returned by the API; JSON-able)."""

    direction: str
    source: str
    output: str
    tensors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    files: int = 0
    peak_rss_bytes: int = 0
    max_rss_growth_bytes: int = 0
    largest_tensor_bytes: int = 0
    config_source: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["mb_per_s"] = self.mb_per_s
        return out

    def finish(self, timer: Timer, bar: Progress, bytes_read: int, stream_s: float, **extra):
        """Record the end of the run: times, bytes read, RSS and the streaming throughput."""
        self.bytes_read, self.seconds = bytes_read, timer.elapsed()
        self.peak_rss_bytes, self.max_rss_growth_bytes = peak_rss_bytes(), bar.max_growth
        self.extra.update(
            **extra,
            stream_seconds=round(stream_s, 3),
            stream_mb_per_s=round(self.bytes_written / 1e6 / max(stream_s, 1e-9), 1),
        )
        return self

    def format(self) -> str:
        gib = 1 << 30
        lines = [
            f"{self.direction}: {self.source} -> {self.output}",
            f"  model config from: {self.config_source}",
            f"  tensors: {self.tensors}   files: {self.files}",
            f"  read: {self.bytes_read / 1e6:.1f} MB   written: {self.bytes_written / 1e6:.1f} MB",
            f"  time: {self.seconds:.2f} s   throughput: {self.mb_per_s:.1f} MB/s (written)",
            f"  peak RSS: {self.peak_rss_bytes / gib:.3f} GiB   RSS growth during conversion: "
            f"{self.max_rss_growth_bytes / gib:.3f} GiB   largest tensor: "
            f"{self.largest_tensor_bytes / gib:.3f} GiB",
        ]
        lines += [f"  {k}: {v}" for k, v in self.extra.items()]
        return "\n".join(lines)


class Progress:
    """A tqdm bar over bytes on stderr that also tracks RSS growth. ``enabled``: None draws it
    on a terminal only, True always, False never; ``HF_HUB_DISABLE_PROGRESS_BARS=1`` turns it
    off (Hugging Face's rule: :func:`megatron_latentmoe.progress.tqdm_disable`)."""

    def __init__(self, total_bytes: int, desc: str, enabled: bool | None = None):
        from megatron_latentmoe.progress import tqdm_disable

        self.bar = None
        disable = tqdm_disable(enabled)
        if disable is not True:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_bytes,
                desc=desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                dynamic_ncols=True,
                file=sys.stderr,
                disable=disable,
            )
        self.rss0 = current_rss_bytes()
        self.max_growth = 0
        self._n = 0

    def update(self, nbytes: int) -> None:
        self._n += 1
        if self._n % 16 == 1:
            self.max_growth = max(self.max_growth, current_rss_bytes() - self.rss0)
        if self.bar is not None:
            self.bar.update(nbytes)

    def close(self) -> None:
        self.max_growth = max(self.max_growth, current_rss_bytes() - self.rss0)
        if self.bar is not None:
            self.bar.close()


def check_output_dir(output: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing non-empty output directory (or a file) unless ``overwrite``."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"output {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConversionError(
            f"output directory {str(out)!r} exists and is not empty; pass --overwrite to replace it"
        )
    parent = out.resolve().parent
    if not parent.is_dir():
        from megatron_latentmoe.files import nearest_existing

        blocker = nearest_existing(parent)  # a file on the way: "does not exist" misled there
        if blocker == parent:
            raise ConversionError(
                f"the parent directory of the output, {str(parent)!r}, is a file, not a directory"
            )
        if blocker.exists() and not blocker.is_dir():
            raise ConversionError(
                f"the parent directory of the output, {str(parent)!r}, cannot be created: "
                f"{str(blocker)!r} on its path is a file, not a directory"
            )
        raise ConversionError(
            f"the parent directory of the output, {str(parent)!r}, does not exist"
        )
    if not os.access(parent, os.W_OK):
        raise ConversionError(
            f"the parent directory of the output, {str(parent)!r}, is not writable"
        )
    return out


def check_not_an_input(output: str | os.PathLike, flag: str, path: str | os.PathLike) -> None:
    """Refuse an output that would replace the input ``path`` (read through ``flag``): the same
    directory or one that contains it. ``--overwrite`` would otherwise delete the input."""
    out, src = Path(output).resolve(), Path(path).resolve()
    if src == out or out in src.parents:
        raise ConversionError(
            f"--output {str(output)!r} would replace the input {flag} {str(path)!r} (it is that "
            "directory or contains it); allowed: an output directory outside the input"
        )


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """In the main thread, SIGTERM (what ``timeout``, Slurm and Kubernetes send) raises
    ``SystemExit(143)`` instead of ending the process at once, so the cleanup of
    :func:`atomic_output_dir` runs as it does for Ctrl-C. A SIGTERM handler of the caller's (the
    CLI's, which raises KeyboardInterrupt and prints the one line) is left in place."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT / SIGTERM wait until the block is done (delivered when it ends). Python-level
    handlers that only note the signal, not a thread signal mask: the kernel hands a process
    signal to any thread that lets it through (torch's pool, pytest-xdist's I/O thread), and
    Python then raises in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python runs signal handlers in the main thread only: nothing interrupts this one
        return
    received: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, frame: received.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if received:
            signal.raise_signal(received[0])  # as if it came now: the handler that was there


@contextlib.contextmanager
def atomic_output_dir(output: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``output``; on success it replaces ``output``
    (by rename), on any error, Ctrl-C or SIGTERM it is deleted: a failed conversion never leaves a
    partial output. (Only SIGKILL leaves the hidden ``.NAME.partial-*`` directory behind; the
    next run into ``output`` removes it, :func:`clear_stale_leftovers`.) An
    interrupt is re-raised without a word: the caller says it in one line (the CLI).

    A write into it that fills the disk (ENOSPC) or finds its file system turned read-only
    (EROFS) raises :class:`ConversionError`, the shared one line naming ``--output`` and the free
    space (:func:`megatron_latentmoe.files.write_disk_failure_error`): it was an OSError traceback,
    exit 1 (measured with export's shard write and import's torch_dist write made to raise
    ENOSPC)."""
    out = check_output_dir(output, overwrite).resolve()
    clear_stale_leftovers(out)
    tmp = _leftover_path(out, "partial")
    with _sigterm_raises():
        tmp.mkdir()
        _WRITING.add(tmp)
        written, old = False, None
        try:
            yield tmp
            with _signals_deferred():  # never stop between the two renames
                if out.exists():
                    old = _leftover_path(out, "old")
                    out.rename(old)
                tmp.rename(out)
                written = True
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
        except BaseException as e:
            if not written:
                if old is not None and not out.exists():
                    old.rename(out)  # the previous output stays as it was
                shutil.rmtree(tmp, ignore_errors=True)
                if line := _disk_failure(e, output, tmp):
                    raise ConversionError(line) from None
            raise
        finally:
            _WRITING.discard(tmp)


_WRITING: set[Path] = set()
"""The temporary directories this process is writing now (a stale one may carry its PID too)."""


def _host() -> str:
    return "".join(c if c.isalnum() or c == "." else "_" for c in socket.gethostname())


def _leftover_path(out: Path, kind: str) -> Path:
    """``.NAME.partial-HOST-PID-HEX`` (``kind`` "partial": the output being written) or
    ``.NAME.old-HOST-PID-HEX`` (the output it replaces, between the renames): the owner is named
    so that a later run can tell the leftovers of a killed one (:func:`clear_stale_leftovers`)."""
    return out.parent / f".{out.name}.{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _owner_is_dead(path: Path, kind: str, out: Path) -> bool:
    """Whether ``path`` was written by a process of this host that is gone (SIGKILL, a crash of
    the machine): the PID does not run or (this process's own PID, reused after a restart) is not
    one this process is writing now. Another host's, or an unnamed owner's (a leftover of a
    version without the owner in the name): not known, so not dead."""
    owner = path.name[len(f".{out.name}.{kind}-") :].rsplit("-", 2)
    if len(owner) != 3 or owner[0] != _host() or not owner[1].isdigit():
        return False
    pid = int(owner[1])
    if pid == os.getpid():
        return path not in _WRITING
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: another user's process runs under that PID
        return False
    return False


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def clear_stale_leftovers(out: Path) -> None:
    """Remove what a killed conversion into ``out`` left beside it (only SIGKILL or a crash
    leaves them: measured, a SIGKILL mid-export left ``.out.partial-*`` and the next run, another
    name, left it there without a word, a full-size hidden copy per kill), each one of this host
    whose process is gone (an ``.old-*`` only once ``out`` is back, else it is the previous
    output); name in one line those that may still be written (another host's, a running
    process's, or of an older version)."""
    removed, kept = [], []
    for kind in ("partial", "old"):
        for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.{kind}-*")):
            size = _tree_bytes(path)
            if _owner_is_dead(path, kind, out) and (kind == "partial" or out.exists()):
                shutil.rmtree(path, ignore_errors=True)
                removed.append((str(path), size))
            else:
                kept.append((str(path), size))
    from megatron_latentmoe.files import megabytes

    if removed:
        print(
            f"note: removed what a killed conversion into --output {str(out)!r} left: "
            f"{', '.join(repr(p) for p, _ in removed)} "
            f"({megabytes(sum(n for _, n in removed))})",
            file=sys.stderr,
        )
    if kept:
        print(
            f"note: {', '.join(repr(p) for p, _ in kept)} ({megabytes(sum(n for _, n in kept))}) "
            f"beside --output {str(out)!r} not removed: a conversion that may still run (here, "
            "on another machine, or of an older version) is writing it, or it holds the output "
            "being replaced; remove it once none does",
            file=sys.stderr,
        )


def _disk_failure(err: BaseException, output: str | os.PathLike, tmp: Path) -> str | None:
    """The one line for a full disk or a read-only file system under a write into ``tmp``, the
    temporary directory of ``output`` (already removed, so the disk is no longer full: the
    ``written`` case), else None. The line names the file the error names (in ``tmp``), or the
    ``--output`` folder where it names none (a buffered write)."""
    from megatron_latentmoe.files import write_disk_failure_error

    named = [("--output", os.path.abspath(output)), ("--output", str(tmp))]
    return write_disk_failure_error(err, named, written=True)


class Timer:
    def __init__(self):
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
