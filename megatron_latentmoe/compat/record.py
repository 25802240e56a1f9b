"""torch's ``record`` (``torch.distributed.elastic.multiprocessing.errors``), which also records
torch DCP's ``CheckpointException``: a process's crash reaches torchrun's error file.

``record`` writes the traceback of an ``Exception`` to ``TORCHELASTIC_ERROR_FILE`` (torch's
``ErrorHandler``) and re-raises it. ``CheckpointException``, which a failed DCP save or load
raises on every rank (the failures of all ranks in its text), derives from ``BaseException``
(torch 2.13), so it passed ``record`` unwritten: torchrun's table showed ``error_file: <N/A>``
and "To enable traceback see ...", with the root cause only in the rank's stderr. Here it is
written through the same handler, the same way (``py_callstack``: its traceback) and re-raised
unchanged: the same traceback on stderr, the same exit code (1). Where a torch's
``CheckpointException`` is an ``Exception``, ``record`` alone is used. No patch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps


def record(fn: Callable) -> Callable:
    """``fn`` wrapped in torch's ``record``, recording a ``CheckpointException`` too."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler
    from torch.distributed.elastic.multiprocessing.errors import record as torch_record

    handler = get_error_handler()
    recorded = torch_record(fn, handler)
    if issubclass(CheckpointException, Exception):  # record catches it
        return recorded

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return recorded(*args, **kwargs)
        except CheckpointException as err:
            handler.record_exception(err)  # its traceback: the one being handled, as record's
            raise

    return wrapper
