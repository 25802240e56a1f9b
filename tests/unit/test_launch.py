"""``megatron_latentmoe.training.launch``: torchrun whose failed run ends in one line (the first
failed rank and its exit code) and that exit code, instead of a traceback; and the error file
through which a rank's one-line error reaches torchrun's table (``error_file.tell_launcher``)."""

import errno
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_latentmoe import error_file
from megatron_latentmoe.training import launch
from tests.training import ENTRY, LAUNCH, REPO, environment

pytestmark = pytest.mark.timeout(120)

RANK_SCRIPT = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    print("rank 1: error: the one line a refusal prints", flush=True)
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[1]))
time.sleep(60)  # rank 0 is stopped by torchrun when rank 1 fails
"""


@pytest.mark.parametrize(
    "how, code, line",
    [
        ("2", 2, "[launch] rank 1 exited with code 2 (its output is above)"),
        ("signal", 137, "[launch] rank 1 was killed by signal 9 (its output is above)"),
        ("0", 0, None),
    ],
)
def test_a_failed_rank_ends_the_launch_in_one_line(tmp_path, how, code, line):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT if how != "0" else "pass\n")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_latentmoe.training.launch", "--standalone"]
        + ["--nproc-per-node", "2", str(script), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=environment(),
        timeout=100,
    )
    assert proc.returncode == code, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout and "ChildFailedError" not in proc.stdout
    if line is not None:
        assert proc.stdout.splitlines()[-1] == line, proc.stdout[-3000:]
        assert "rank 1: error: the one line a refusal prints" in proc.stdout


ERROR_SCRIPT = """
import os, pathlib, sys, time
from megatron_latentmoe.training.console import error
rank = int(os.environ["RANK"])
if rank == 1:
    error("the one line a refusal prints")
    sys.exit(2)
# rank 0 stops because rank 1 did (gloo's error in a real run), once rank 1 has said why
theirs = pathlib.Path(os.environ["TORCHELASTIC_ERROR_FILE"].replace("/0/error.json", "/1/"))
while not (theirs / "error.json").exists():
    time.sleep(0.01)
error("rank 0: another rank of this run stopped", after_peer=True)
sys.exit(1)
"""


def _two_ranks(tmp_path, launcher: str, script_text: str, *flags: str):
    """``script_text`` run as 2 ranks by ``launcher`` (torchrun's module or ours, ``flags``
    before ``--nproc-per-node``): the finished process, stdout and stderr together."""
    script = tmp_path / "rank.py"
    script.write_text(script_text)
    return subprocess.run(
        [sys.executable, "-m", launcher, "--standalone", *flags, "--nproc-per-node", "2"]
        + [str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**environment(), "PYTHONPATH": str(REPO)},  # the script imports this checkout
        timeout=100,
    )


@pytest.mark.parametrize(
    "launcher", ["torch.distributed.run", "megatron_latentmoe.training.launch"]
)
def test_torchrun_shows_the_ranks_one_line_error_and_the_rank_that_failed_first(tmp_path, launcher):
    """Plain torchrun showed ``error_file: <N/A>`` and "To enable traceback see ..." for a rank's
    one-line error, and on a tie of its whole-second timestamps named the lowest failed rank as
    the root cause: here rank 0, which only saw rank 1 stop. Both ranks fail within torchrun's
    --monitor-interval, so that it sees them in one poll, as when a rank's peers see it go at
    once."""
    proc = _two_ranks(tmp_path, launcher, ERROR_SCRIPT, "--monitor-interval", "2")
    out = proc.stdout
    if launcher == LAUNCH:
        assert out.splitlines()[-1] == "[launch] rank 1 exited with code 2 (its output is above)"
        assert proc.returncode == 2, out[-3000:]
        return
    assert proc.returncode == 1, out[-3000:]
    assert "<N/A>" not in out and "To enable traceback" not in out, out[-3000:]
    root = out[out.index("Root Cause (first observed failure):") :]
    assert "  rank      : 1 (local_rank: 1)" in root, out[-3000:]
    assert "  traceback : pretrain_stable_latentmoe: error: the one line a refusal prints" in root
    assert "  traceback : pretrain_stable_latentmoe: error: rank 0: another rank" in out


SAID_ONCE_SCRIPT = """
import os, sys, time
from megatron_latentmoe.error_file import say_once
if os.environ["RANK"] == "0":
    time.sleep(2)  # the slower rank: rank 1 refuses first
say_once("prog: error: the line every rank has")
sys.exit(2)
"""


@pytest.mark.parametrize("launcher", ["torch.distributed.run", LAUNCH])
def test_a_line_every_rank_has_is_printed_once_by_rank_0(tmp_path, launcher):
    """``error_file.say_once`` (a bad flag: the same on every rank) under torchrun, rank 0 the
    slower to refuse: rank 0 alone prints the line (each rank did), every rank exits 2 with it in
    its error file, and the rank torchrun and the launcher name is rank 0. Rank 1 waits for
    torchrun's SIGTERM: had it exited at once, torchrun (its 0.1 s poll) ended rank 0 before
    rank 0 printed the line, and named rank 1, which printed nothing."""
    proc = _two_ranks(tmp_path, launcher, SAID_ONCE_SCRIPT)
    out, line = proc.stdout, "prog: error: the line every rank has"
    assert out.splitlines().count(line) == 1, out[-3000:]
    if launcher == LAUNCH:
        assert out.splitlines()[-1] == "[launch] rank 0 exited with code 2 (its output is above)"
        assert proc.returncode == 2, out[-3000:]
        return
    assert re.findall(r"^\s+exitcode\s+: (\S+)", out, re.M) == ["2", "2"], out[-3000:]
    assert out.count(f"  traceback : {line}\n") == 2, out[-3000:]
    root = out[out.index("Root Cause (first observed failure):") :]
    assert "  rank      : 0 (local_rank: 0)" in root, out[-3000:]


@pytest.mark.parametrize(
    "rank, torchrun, ended, printed",
    [
        (None, False, False, True),
        ("1", False, False, True),
        ("0", True, False, True),
        ("1", True, True, False),
        ("1", True, False, True),
    ],
)
def test_a_line_every_rank_has_is_printed_by_rank_0_and_written_by_each(
    tmp_path, monkeypatch, capsys, rank, torchrun, ended, printed
):
    """``say_once`` in one process: under torchrun (``TORCHELASTIC_RUN_ID``) rank 0 alone prints
    the line, and a rank other than 0 returns when torchrun's SIGTERM ends its wait (``ended``),
    or prints the line itself when the wait runs out (rank 0 did not stop alike: a file only
    its node sees); without torchrun every process prints it (a tool's, whatever ``RANK``
    says). Every rank writes it to its error file."""
    import signal
    import threading

    monkeypatch.delenv("RANK", raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(error_file, "PEER_EXIT_WAIT_S", 30.0 if ended else 0.01)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    previous = signal.getsignal(signal.SIGTERM)
    if ended:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    error_file.say_once("prog: error: refused")
    assert signal.getsignal(signal.SIGTERM) is previous
    assert capsys.readouterr().err == ("prog: error: refused\n" if printed else "")
    message = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
    assert message == "prog: error: refused"


def _failure(tmp_path, rank: int, exitcode: int, line: str | None, after_peer: bool = False):
    """torchrun's record of a failed rank, whose error file ``line`` was written to (by
    ``tell_launcher``; None: none, as for a rank killed by a signal)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"{rank}.json"
    if line is not None:
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
        error_file.tell_launcher(line, after_peer=after_peer)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_error_file_holds_the_line_and_a_whole_second_that_names_the_first_failure(
    tmp_path, monkeypatch
):
    """All in one second: the refusing rank 1 stamped at its start, rank 0 (stopped because rank
    1 did) at its end; torchrun's own choice and this launcher's both name rank 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "")
    monkeypatch.setattr(error_file.time, "time", lambda: 1000.5)
    failures = {
        0: _failure(tmp_path, 0, 1, "rank 0: peer stopped", after_peer=True),
        1: _failure(tmp_path, 1, 2, "refused"),
    }
    assert [failures[r].timestamp for r in (0, 1)] == [1001, 1000]
    assert failures[1].message == {"message": "refused", "extraInfo": {"timestamp": "1000"}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.json", "1.json"]  # no temp file
    err = ChildFailedError("rank.py", failures)
    assert err.get_first_failure()[0] == 1
    assert launch._root_failure(err)[0] == 1
    assert "traceback : refused" in str(err)


def test_a_killed_rank_is_named_before_the_rank_that_saw_it_go(tmp_path, monkeypatch):
    """Rank 1 killed (no error file: torchrun stamps it when it sees it, 1001 here) and rank 0,
    that saw it go at 1000.5, stamped 1001 too: torchrun's tie names rank 0, this launcher
    rank 1; where every failed rank only saw another stop (that one on another node), the first
    of them."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    monkeypatch.setattr(error_file.time, "time", lambda: 1000.5)
    peer = _failure(tmp_path, 0, 1, "rank 0: peer stopped", after_peer=True)
    monkeypatch.setattr(error_file.time, "time", lambda: 1001.2)
    killed = _failure(tmp_path, 1, -9, None)
    err = ChildFailedError("rank.py", {0: peer, 1: killed})
    assert err.get_first_failure()[0] == 0
    assert launch._root_failure(err)[0] == 1
    later = _failure(tmp_path, 1, 1, "rank 1: peer stopped", after_peer=True)
    assert launch._root_failure(ChildFailedError("rank.py", {1: later, 0: peer}))[0] == 0


def test_a_rank_ended_by_sigterm_after_its_line_is_named_with_its_code(tmp_path, monkeypatch):
    """Rank 0 said its line (a save that filled the disk), rank 1 exited 2 first, silently, and
    torchrun ended rank 0 with SIGTERM on its way out: torchrun's root cause is rank 0 (its
    earlier stamp), exitcode -15. This launcher names it with the entry point's code, 2 (1 for a
    rank stopped by a peer), not "killed by signal 15" and 143 (measured in
    tests/training/test_disk_full.py's runs)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    monkeypatch.setattr(error_file.time, "time", lambda: 1000.5)
    said = _failure(tmp_path, 0, -15, "pretrain_stable_latentmoe: error: --save /c: full")
    monkeypatch.setattr(error_file.time, "time", lambda: 1002.5)
    quiet = _failure(tmp_path, 1, 2, None)
    err = ChildFailedError("rank.py", {0: said, 1: quiet})
    rank, failure = launch._root_failure(err)
    assert rank == 0 and launch._said_and_terminated(failure) == 2
    peer = _failure(tmp_path, 1, -15, "rank 1: peer stopped", after_peer=True)
    assert launch._said_and_terminated(peer) == 1
    assert launch._said_and_terminated(quiet) is None  # no line: its own exit code
    assert launch._said_and_terminated(_failure(tmp_path, 2, -9, None)) is None  # killed


def test_no_error_file_without_torchrun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in (None, ""):  # "": torchrun's, where its logs go to /dev/null
        if value is None:
            monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
        else:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", value)
        error_file.tell_launcher("refused")
    assert list(tmp_path.iterdir()) == []


def test_an_error_file_that_cannot_be_written_leaves_nothing_and_raises_nothing(
    tmp_path, monkeypatch
):
    """torchrun's ``<N/A>`` then: no traceback over the rank's one line, no temporary left."""
    for path in (tmp_path / "gone" / "error.json", tmp_path / "a_folder"):  # open, rename fail
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        (tmp_path / "a_folder").mkdir(exist_ok=True)
        error_file.tell_launcher("refused")
    assert [p.name for p in tmp_path.iterdir()] == ["a_folder"]
    assert list((tmp_path / "a_folder").iterdir()) == []


def test_a_line_said_first_stays_when_the_rank_then_stops_because_of_a_peer(tmp_path, monkeypatch):
    """Rank 0 said its save's full disk, then a peer went away in the ranks' barrier: the
    peer-stopped line (marked, stamped at the end of its second) replaced the cause before."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(error_file.time, "time", lambda: 1000.5)
    error_file.tell_launcher("--save /c: full")
    error_file.tell_launcher("rank 0: peer stopped", after_peer=True)
    message = json.loads((tmp_path / "error.json").read_text())["message"]
    assert message == {"message": "--save /c: full", "extraInfo": {"timestamp": "1000"}}
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temp file


def test_a_save_that_filled_the_disk_hands_its_line_to_torchrun(tmp_path, monkeypatch):
    """Rank 0's line for a checkpoint save that filled ``--save``'s disk (``file_checks``, which
    printed it with ``print``: plain torchrun's table showed ``<N/A>``)."""
    from megatron_latentmoe.training import file_checks

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("RANK", "0")
    save = tmp_path / "ckpt"
    save.mkdir()
    args = SimpleNamespace(save=str(save), ckpt_format="torch_dist")
    with pytest.raises(file_checks.SaveDiskFailure):
        file_checks.stop_if_save_disk_failed(args, OSError(errno.ENOSPC, "No space left"), 3)
    line = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
    assert line.startswith(
        f"pretrain_stable_latentmoe: error: --save {save}: the disk filled up while saving the "
        "checkpoint of iteration 3 ("
    ), line


def test_a_misspelt_flag_hands_its_line_to_torchrun(tmp_path, monkeypatch, capsys):
    """argparse's one line (``cli_errors.one_line_errors``: the entry point's parser, the tools')
    goes to torchrun's error file too, exit 2 as before."""
    import argparse

    from megatron_latentmoe.cli_errors import one_line_errors

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    parser = argparse.ArgumentParser(prog="prog.py")
    parser.add_argument("--train-iters", type=int)
    one_line_errors(parser)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--train-itres", "3"])
    assert stop.value.code == 2
    line = "prog.py: error: unrecognized arguments: --train-itres 3 (all flags: --help)"
    assert capsys.readouterr().err == line + "\n"
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == line


ENTRY_SCRIPT = """
import runpy, sys
from megatron_latentmoe.training import pretrain
from megatron_latentmoe.training.console import error


def refuse(check_only=False):
    error("the one line a refusal prints")
    return 2


def crash(check_only=False):
    raise RuntimeError("a bug the entry point does not expect")


def save_failed(check_only=False):  # torch DCP's, a BaseException: not a full disk
    import traceback
    from torch.distributed.checkpoint import CheckpointException

    try:
        raise OSError(5, "Input/output error", "/ckpt/iter_0000003/__0_0.distcp")
    except OSError as err:
        failure = (err, traceback.extract_tb(err.__traceback__))
    raise CheckpointException("CheckpointException", {0: failure})


how, entry = sys.argv[1:]
del sys.argv[1:]
pretrain._main = {
    "refuse": refuse,
    "crash": crash,
    "save_failed": save_failed,
    "help": lambda check_only: sys.exit(0),
}[how]
runpy.run_path(entry, run_name="__main__")
"""


@pytest.mark.parametrize("how", ["crash", "save_failed", "refuse", "help"])
def test_plain_torchrun_shows_a_crashs_traceback_and_a_refusals_one_line(tmp_path, how):
    """The entry point (``pretrain.process_main``, torch's ``record``) under plain torchrun: an
    unexpected exception's traceback is in torchrun's table (``error_file: <N/A>`` and "To enable
    traceback see ..." before), torch DCP's ``CheckpointException`` (a ``BaseException``, which
    ``record`` alone let through: ``<N/A>``) with the failure it carries, a refusal's one line is
    left as it is, and the exit codes are the rank's own (1 for the exceptions, 2 for the
    refusal, 0 for ``--help``'s ``SystemExit(0)``)."""
    (tmp_path / "rank.py").write_text(ENTRY_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
        + [str(tmp_path / "rank.py"), how, str(ENTRY)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**environment(), "PYTHONPATH": str(REPO)},
        timeout=100,
    )
    out = proc.stdout
    if how == "help":
        assert proc.returncode == 0, out[-3000:]
        return
    assert proc.returncode == 1, out[-3000:]  # torchrun's own, for any failed rank
    assert "<N/A>" not in out and "To enable traceback" not in out, out[-3000:]
    root = out[out.index("Root Cause (first observed failure):") :]
    raised = {
        "crash": ["RuntimeError: a bug the entry point does not expect"],
        "save_failed": [  # the exception, and the rank's failure it carries
            "checkpoint.api.CheckpointException: CheckpointException ranks:",
            "OSError: [Errno 5] Input/output error: '/ckpt/iter_0000003/__0_0.distcp'",
        ],
    }
    if how in raised:
        assert "  exitcode  : 1 " in root, out[-3000:]
        assert "  traceback : Traceback (most recent call last):" in root, out[-3000:]
        for text in raised[how]:
            assert text in root, out[-3000:]
    else:
        assert "  exitcode  : 2 " in root, out[-3000:]
        assert (
            "  traceback : pretrain_stable_latentmoe: error: the one line a refusal prints" in root
        )
