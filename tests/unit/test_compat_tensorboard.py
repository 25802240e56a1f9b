"""compat.tensorboard: a failed write in the TensorBoard writer's thread is said once, by the
training thread the writer raises it in (the entry point's one line), not also as a thread
traceback; another thread's exception still prints. tensorboard's own ``_AsyncWriter`` (what
``SummaryWriter`` writes through) over a record writer whose disk is full."""

from __future__ import annotations

import errno
import threading

import pytest
from tensorboard.summary.writer.event_file_writer import _AsyncWriter

from megatron_latentmoe.compat import registry, tensorboard


class _FullDisk:
    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass

    def close(self):
        pass


@pytest.fixture
def printed(monkeypatch):
    """The exceptions that reach the hook the shim wraps (Python's prints them; pytest's, which
    is in place during a test, turns them into warnings)."""
    seen = []
    registry.revert(tensorboard.GROUP)  # applied by an earlier test's run of the entry point
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    assert tensorboard.apply_tensorboard_compat()
    yield seen
    registry.revert(tensorboard.GROUP)


def test_the_writer_threads_failure_is_raised_in_the_training_thread_only(printed):
    writer = _AsyncWriter(_FullDisk())
    writer.write(b"event")
    writer._worker.join(10)  # the thread ended on the failed write
    assert not writer._worker.is_alive() and printed == []
    with pytest.raises(OSError) as raised:
        writer.flush()
    assert raised.value.errno == errno.ENOSPC


def test_another_threads_exception_still_prints(printed):
    bug = RuntimeError("a real bug")

    def fail():
        raise bug

    thread = threading.Thread(target=fail)
    thread.start()
    thread.join()
    assert printed == [bug]


def test_the_hook_is_reverted_with_its_group():
    original = threading.excepthook
    assert tensorboard.apply_tensorboard_compat() and threading.excepthook is not original
    registry.revert(tensorboard.GROUP)
    assert threading.excepthook is original
