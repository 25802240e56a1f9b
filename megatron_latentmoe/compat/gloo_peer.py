"""torch's gloo: the errors that say another rank's process is gone.

When one rank of a CPU (gloo) run stops (its own one-line error and exit 2, or ``kill -9``, the
OOM killer), the socket to it closes and every rank waiting on it in a collective gets a
``RuntimeError`` from ``work.wait()``, whose text torch's bundled gloo writes
(``third_party/gloo/gloo/transport/tcp/pair.cc``). Seen in 2-rank torchrun runs under torch 2.13:

* the peer exited (its sockets closed): ``[.../gloo/transport/tcp/pair.cc:553] Connection closed
  by peer [127.0.0.1]:62631. This is typically caused by a remote worker crashing. ...``;
* the peer was killed by SIGKILL mid-transfer: ``[.../pair.cc:537] Read error
  [127.0.0.1]:25795: Connection reset by peer. ...``;
* gloo's write side of the same, read from its source (``Pair::write``, a pair in sync mode;
  not met in those runs): ``writev <address>: Broken pipe`` or ``: Connection reset by peer``,
  the ``strerror`` text of ``EPIPE`` / ``ECONNRESET``.

While the ranks build their process groups (``init_process_group``, Megatron's
``initialize_model_parallel``: :func:`gloo_startup_peer_lost`), a rank that went away shows
otherwise, also seen in 2-rank torchrun runs (the peer killed by SIGKILL at start-up):

* it had published its address, and was gone before this rank connected to it: after gloo's
  retries (its ``debug_logger.cc`` lines), ``Gloo connectFullMesh failed with [.../pair.cc:152]
  timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:48031$0``;
* it was gone before publishing it: the store's wait for its key ends at the group's timeout
  (``--distributed-timeout-minutes``), a ``DistStoreError``: ``wait timeout after 3000ms, keys:
  /default_pg/0//3//cpu//0/1`` (torch's ``TCPStore``, which torchrun's ranks use);
* gloo's errors above, met in a connection under way.

Only these are recognised: gloo's timeouts (a peer that hangs), ``Socket closed`` (I/O on a pair an
earlier error closed) and every other error keep their traceback. A torch whose gloo words them
otherwise is recognised less, never wrongly: the traceback stays. Plain Python (no torch import).
"""

from __future__ import annotations

import re

_GLOO_PEER_LOST = re.compile(
    r"gloo/transport/tcp/pair\.cc:\d+\] "
    r"(Connection closed by peer \S+?|(?:Read error|writev) \S+?: "
    r"(?:Connection reset by peer|Broken pipe))\.? "
)


_GLOO_STARTUP_PEER_LOST = re.compile(
    r"^Gloo connectFullMesh failed with \[[^\]]*gloo/transport/tcp/pair\.cc:\d+\] "
    r"(timed out connecting: SO_ERROR: Connection refused, remote=\[[^\]]+\]:\d+)"
    r"|^(wait timeout after \d+ms), keys: "
)


def gloo_peer_lost(err: BaseException) -> str | None:
    """What gloo observed (``Connection closed by peer [127.0.0.1]:62631``) when ``err`` is its
    error for a peer process that went away; None for any other error."""
    if not isinstance(err, RuntimeError):  # torch's DistBackendError is one too
        return None
    match = _GLOO_PEER_LOST.search(str(err))
    return match.group(1) if match else None


def gloo_startup_peer_lost(err: BaseException) -> str | None:
    """What the rank observed (``timed out connecting: SO_ERROR: Connection refused,
    remote=[127.0.0.1]:48031``, ``wait
    timeout after 600000ms``) when ``err``, raised while the process groups were built, says
    another rank's process went away (or never came); None for any other error."""
    if not isinstance(err, RuntimeError):  # DistStoreError is one too
        return None
    match = _GLOO_STARTUP_PEER_LOST.search(str(err))
    if match:
        return match.group(1) or match.group(2)
    return gloo_peer_lost(err)
