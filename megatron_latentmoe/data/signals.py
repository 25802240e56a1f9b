"""Ctrl-C and SIGTERM around a dataset write: held off while the output is renamed into place
(:func:`signals_held`), and a command's handlers that stop the write until then
(:class:`StopOnSignals`)."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM held off while the output is renamed into place, then delivered: the
    KeyboardInterrupt of Ctrl-C (or of tools/preprocess_data.py's SIGTERM handler) raised there
    stopped the commit halfway - an old ``.idx`` dropped and the new ``.bin`` not yet moved (the
    old dataset gone, the new one not there), or one key's dataset new and the next one's
    broken. Each one that comes meanwhile is recorded by a handler that only records it, and
    raised again (``signal.raise_signal``) once the caller's handlers are back: to them it
    arrives just after a finished commit.

    Not ``pthread_sigmask``: it blocks a signal in the calling thread only; the kernel hands a
    signal sent to the process to another thread (a run has several, e.g. torch's), whose C
    handler flags it for the main thread's Python handler all the same (measured: Ctrl-C still
    stopped the commit so). Python sets and runs handlers in the main thread only: called from
    another thread the commit is not interrupted by them, and nothing is held. A handler set
    outside Python (``getsignal`` None) cannot be put back, so it is left in place."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    stops = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in stops}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):  # each once, in the order they came
            signal.raise_signal(s)


class StopOnSignals:
    """Ctrl-C and SIGTERM (schedulers send it) for a command that writes a dataset with
    :func:`~.indexed.preprocess_jsonl`: inside ``with``, either raises ``KeyboardInterrupt``
    (its temporaries are then removed, nothing is written) until the dataset starts going into
    place; from then on (:meth:`on_commit`) they are recorded only, the run being complete. Give
    the command's ``preprocess_jsonl`` :meth:`interrupted` and :meth:`on_commit`; on a
    ``KeyboardInterrupt`` print :data:`INTERRUPTED` and exit :meth:`exit_status` (130 on Ctrl-C,
    143 on SIGTERM); after a complete run, :meth:`late_note` (None: no signal came). The caller's
    handlers are back after the ``with`` (a ``main()`` called in-process)."""

    INTERRUPTED = "interrupted: nothing written (temporary files removed)"
    STOPS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.committing = False
        self._previous: dict = {}

    def _stop(self, signum, frame) -> None:
        self.signals.append(signum)  # preprocess_jsonl's backstop if Python swallows the raise
        if not self.committing:  # else the dataset is going into place: stopping would lose it
            raise KeyboardInterrupt

    def interrupted(self) -> bool:
        return bool(self.signals)

    def on_commit(self) -> None:
        self.committing = True

    def exit_status(self) -> int:
        return 128 + (self.signals[0] if self.signals else signal.SIGINT)

    def late_note(self) -> str | None:
        """The note for stderr when a signal came after ``preprocess_jsonl``'s last check (held
        off until the commit's end): the dataset is complete."""
        if not self.signals:
            return None
        return (
            f"note: {signal.Signals(self.signals[0]).name} arrived as the dataset was renamed "
            "into place: it is complete"
        )

    def __enter__(self) -> StopOnSignals:
        self._previous = {s: signal.signal(s, self._stop) for s in self.STOPS}
        return self

    def __exit__(self, *exc) -> None:  # None: a handler not set from Python; the default then
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
