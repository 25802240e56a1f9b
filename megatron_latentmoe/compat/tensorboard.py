"""The TensorBoard writer's thread (``--tensorboard-dir``: Megatron's ``SummaryWriter`` on the last
rank; torch's writer over tensorboard 2.21's ``EventFileWriter``), patched through :mod:`.registry`.

The writer writes from its own thread (``_AsyncWriterThread``). A write that fails there (a full
disk: ``OSError: [Errno 28] No space left on device``, no file named) is kept in the thread's
``exception`` and re-raised, and the writer raises that same exception in the training thread at
its next write or flush (Megatron's next ``add_scalar``; its flush at the end of training), where
the entry point says it in one line (``files.write_disk_failure_error``). The re-raise inside
the thread also reached ``threading.excepthook``, which printed it as a second, thread traceback
("Exception in thread Thread-1: ...", seen in a 2-rank run whose ``--tensorboard-dir`` was on a
full 4 KiB tmpfs), interleaved with that line. Only that thread's kept exception is left
unprinted: Megatron's ``train`` flushes the writer before each way it ends (the last iteration,
``--exit-interval``, a signal), so a run that ends through it raises the error; one that stops on
another error says that one. Python's ``threading.excepthook`` is the attribute patched.
"""

from __future__ import annotations

import threading

from . import registry

GROUP = "tensorboard"
_WRITER_THREAD = ("tensorboard.summary.writer.event_file_writer", "_AsyncWriterThread")


def _shim_writer_thread_excepthook() -> None:
    original = threading.excepthook

    def excepthook(args) -> None:
        # only an exception the writer raises again in the training thread: the one its
        # thread kept, which _AsyncWriter's write and flush re-raise
        kind = type(args.thread)
        if (kind.__module__, kind.__name__) == _WRITER_THREAD and (
            getattr(args.thread, "exception", None) is args.exc_value
        ):
            return
        original(args)

    registry.patch(GROUP, threading, "excepthook", excepthook)


def apply_tensorboard_compat() -> bool:
    """The writer thread's failure is left to the training thread, which raises it (every
    other thread's exception prints as before); idempotent. True if applied now."""
    return registry.apply_group(GROUP, [_shim_writer_thread_excepthook])
