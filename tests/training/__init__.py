"""End-to-end tests of the pretraining entry point: real ``torchrun`` processes on CPU + gloo.

Shared helpers: the tiny model's flags (read from ``examples/args/tiny.sh`` itself), a runner
for the entry point under torchrun, JSONL / checkpoint readers, and ONE cached reference run
(EP2, 40 iterations, a checkpoint every 10) used by both ``test_pretrain`` and ``test_resume``
so the whole folder stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "examples" / "pretrain_stable_latentmoe.py"
TINY_ARGS_FILE = REPO / "examples" / "args" / "tiny.sh"
PYTHON = sys.executable

# Smaller global batch than the main job (2 ranks x micro-batch 4): the tests need speed, not
# quality. --disable-jit-fuser: no torch.compile of SiTU-GLU's dense layer, ~5 s a run that a few
# iterations never win back (ops/situ.py); the Slurm test and the main job keep the compiled path.
TEST_BATCH = ["--global-batch-size", "8", "--micro-batch-size", "4", "--log-interval", "1"]
TEST_OVERRIDES = [*TEST_BATCH, "--disable-jit-fuser"]
REF_ITERS = 40
REF_SAVE_INTERVAL = 10

ENV = {
    "OMP_NUM_THREADS": "1",  # one thread per rank: also what makes CPU runs bit-reproducible
    "MKL_NUM_THREADS": "1",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NO_VCS_VERSION": "1",
    "PYTHONUNBUFFERED": "1",
}


@functools.cache
def args_file_args(path: Path) -> tuple:
    """The ARGS array of an args file (``examples/args/*.sh``), exactly as bash sees it."""
    out = subprocess.run(
        ["bash", "-c", f'source "{path}"; printf "%s\\0" "${{ARGS[@]}}"'],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return tuple(a for a in out.split("\0") if a)


def tiny_args() -> tuple:
    """The ARGS array of examples/args/tiny.sh."""
    return args_file_args(TINY_ARGS_FILE)


@functools.cache
def scratch_dir() -> Path:
    """One temporary folder for the test session (removed at exit)."""
    path = Path(tempfile.mkdtemp(prefix="latentmoe_training_tests_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str):
    """A real tmpfs mounted at ``path`` (created) with ``options`` (``size=34m``, ``ro``) for the
    block; the test is skipped where this process may not mount (not root, no CAP_SYS_ADMIN)."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip() or mount.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextlib.contextmanager
def mounted_ext4(path: Path, megabytes: int = 16):
    """A real ext4 of ``megabytes`` (an image file on a loop device) mounted at ``path``
    (created) with ``errors=remount-ro``; yields the function that makes the kernel turn it
    read-only as after a disk error (ext4's ``trigger_fs_error``: open files stay open, their
    writes get EROFS). Skipped where this process may not (no mkfs.ext4, no loop device, not
    root)."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    image = path.with_name(path.name + ".img")
    image.write_bytes(b"")
    os.truncate(image, megabytes << 20)
    mkfs = ["mkfs.ext4", "-q", "-F", str(image)]
    for cmd in (mkfs, ["mount", "-o", "loop,errors=remount-ro", str(image), str(path)]):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
            why = done.returncode and (done.stderr.strip() or f"{cmd[0]}: exit {done.returncode}")
        except FileNotFoundError as e:
            why = str(e)
        if why:
            image.unlink()
            pytest.skip(f"cannot mount an ext4 image here: {why}")
    try:
        source = subprocess.run(
            ["findmnt", "-n", "-o", "SOURCE", str(path)], capture_output=True, text=True
        ).stdout.strip()
        trigger = Path("/sys/fs/ext4", os.path.basename(source), "trigger_fs_error")
        if not trigger.exists():
            pytest.skip(f"no {trigger}: this kernel cannot fake an ext4 disk error")
        yield lambda: trigger.write_text("a test's disk error")
    finally:
        subprocess.run(["umount", str(path)], check=True)
        image.unlink()


def data_cache() -> str:
    """Where the shipped corpus is tokenized once for all test runs."""
    path = os.environ.get("LATENTMOE_TEST_DATA_CACHE") or str(scratch_dir() / "data_cache")
    os.makedirs(path, exist_ok=True)
    return path


LAUNCH = "megatron_latentmoe.training.launch"
"""torchrun as examples/run_torchrun.sh starts it: a rank's refusal ends the run in one line."""


def command(extra: list[str], nproc: int = 2, launcher: str = "torch.distributed.run") -> list[str]:
    return [
        PYTHON,
        "-m",
        launcher,
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(ENTRY),
        *tiny_args(),
        *TEST_OVERRIDES,
        "--data-cache-path",
        data_cache(),
        *extra,
    ]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(ENV)
    return env


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float

    def check(self) -> Run:
        assert self.returncode == 0, f"run failed (exit {self.returncode}):\n{self.output[-6000:]}"
        return self


def error_lines(output: str) -> list[str]:
    """The one-line errors (``...: error: ...``) the ranks printed in a run's ``output``; plain
    torchrun's failure table repeats a rank's line from its error file (``  traceback :
    pretrain_stable_latentmoe: error: ...``): not counted."""
    return [
        line
        for line in output.splitlines()
        if ": error: " in line and not line.lstrip().startswith("traceback :")
    ]


def logged_loss(output: str, iteration: int) -> str:
    """The lm loss Megatron printed for ``iteration`` in a run's ``output``, as printed."""
    import re

    found = re.search(rf"iteration\s+{iteration}/.*?lm loss: ([0-9.eE+-]+)", output)
    assert found, output[-3000:]
    return found.group(1)


def run_entry(
    extra: list[str],
    nproc: int = 2,
    timeout: float = 300.0,
    launcher: str = "torch.distributed.run",
    on_line: Callable[[str], None] | None = None,
) -> Run:
    """Run the entry point under torchrun (``launcher``: or :data:`LAUNCH`) to completion,
    calling ``on_line`` with each output line as it comes (to act on the run midway). A run
    still going after ``timeout`` seconds is killed with every rank (left alone, hung ranks would
    outlive the test and slow the rest of the session) and returns exit -9 with its output and a
    line saying so."""
    start = time.time()
    proc = start_launcher(command(extra, nproc, launcher), own_session=False)
    expired = threading.Event()

    def expire():
        expired.set()
        kill_tree(proc)

    timer = threading.Timer(timeout, expire)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            kill_tree(proc)
        proc.stdout.close()
    output = "".join(lines)
    if expired.is_set():
        output += f"\n[run_entry] timed out after {timeout:.0f} s: torchrun and every rank killed\n"
        return Run(-9, output, time.time() - start)
    return Run(proc.returncode, output, time.time() - start)


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """SIGKILL ``proc`` and all its descendants at once, like a node dying (or send them ``sig``,
    e.g. the SIGTERM a scheduler sends before its time limit), and wait up to 30 s for them.

    torchrun starts each worker in its own session, so killing torchrun's process group alone
    would leave the ranks running (and finishing the very save we mean to interrupt). ``proc``
    itself is waited for through its ``Popen``, which so keeps its real exit code (-9): psutil's
    wait reaps a child of this process, and ``Popen`` then reads 0 for it (a killed launcher
    looked like one that succeeded)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:  # Popen has reaped it
        return
    proc.send_signal(sig)
    for victim in descendants:
        try:
            victim.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(descendants, timeout=30)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass


def start_launcher(cmd: list[str], own_session: bool = True) -> subprocess.Popen:
    """``cmd`` (:func:`command`'s) started from the repository with the tests' environment, its
    output and errors one line-buffered text stream; ``own_session``: in a session of its own,
    so that a test can kill it and its ranks (:func:`kill_tree`) without killing itself."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=environment(),
        start_new_session=own_session,
        bufsize=1,
    )


def run_and_kill(
    extra: list[str],
    should_kill: Callable[[str], bool],
    nproc: int = 2,
    timeout: float = 300.0,
    sig: int = signal.SIGKILL,
) -> Run:
    """Run under torchrun and SIGKILL torchrun and every rank as soon as ``should_kill(line)``
    is true for an output line. Returns the output up to then; with another ``sig`` (SIGTERM),
    the output until the processes have exited."""
    start = time.time()
    proc = start_launcher(command(extra, nproc))
    lines, killed = [], False
    try:
        for line in proc.stdout:
            lines.append(line)
            if should_kill(line):
                kill_tree(proc, sig)
                killed = True
                if sig != signal.SIGKILL:
                    lines += proc.stdout  # what the ranks printed while they exited
                break
            if time.time() - start > timeout:
                break
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        proc.wait(30)
        proc.stdout.close()
    assert killed, "the kill condition never happened:\n" + "".join(lines)[-6000:]
    return Run(proc.returncode, "".join(lines), time.time() - start)


def kill_during_save(ckpt, iteration=10):
    """Kill condition: the save of ``iteration`` has started writing, and not finished."""
    target = iter_dir(ckpt, iteration)

    def should_kill(line: str) -> bool:
        if "saving checkpoint at iteration" not in line:
            return False
        deadline = time.time() + 20
        while time.time() < deadline:  # wait until shard files appear in the folder
            if target.is_dir() and any(p.suffix == ".distcp" for p in target.iterdir()):
                return True
            time.sleep(0.02)
        return True

    return should_kill


# ---------------------------------------------------------------------------------- results
def read_jsonl(path) -> dict[int, dict]:
    """{iteration: record}; the last record of an iteration wins (a resumed run re-runs some)."""
    records = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # cut by a kill
                records[record["iteration"]] = record
    return records


def checkpoint_tensors(ckpt_iter_dir, contains: str = "") -> dict[str, object]:
    """Tensors of a torch_dist checkpoint folder whose key contains ``contains`` (full,
    unsharded)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(tempfile.mkdtemp(prefix="ckpt_", dir=scratch_dir())) / "full.pt"
    dcp_to_torch_save(str(ckpt_iter_dir), str(out))
    state = torch.load(out, weights_only=False)

    def flatten(prefix, value, acc):
        if isinstance(value, dict):
            for k, v in value.items():
                flatten(f"{prefix}.{k}" if prefix else str(k), v, acc)
        elif isinstance(value, torch.Tensor):
            acc[prefix] = value
        return acc

    return {k: v for k, v in flatten("", state, {}).items() if contains in k}


def dcp_checkpoint(root: Path, iteration: int) -> Path:
    """A small real torch_dist folder (torch DCP's ``.metadata`` and shard file, Megatron's
    ``metadata.json``) at ``root/iter_N``, the tracker naming it; returns its folder."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name

    path = root / iteration_dir_name(iteration)
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (root / TRACKER_FILE).write_text(str(iteration))
    return path


def iter_dir(ckpt: Path, iteration: int) -> Path:
    return Path(ckpt) / f"iter_{iteration:07d}"


def copy_checkpoints(src: Path, dst: Path, upto: int | None = None) -> Path:
    """Copy a checkpoint folder, keeping iterations <= ``upto`` (tracker rewritten)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("balance.jsonl"))
    if upto is not None:
        for entry in dst.iterdir():
            if entry.name.startswith("iter_") and int(entry.name[5:]) > upto:
                shutil.rmtree(entry)
        (dst / "latest_checkpointed_iteration.txt").write_text(str(upto))
    return dst


@dataclass
class ReferenceRun:
    ckpt: Path
    jsonl: Path
    records: dict[int, dict]
    output: str
    seconds: float


REF_ARGS = ["--train-iters", str(REF_ITERS), "--save-interval", str(REF_SAVE_INTERVAL)]


@functools.cache
def reference_run() -> ReferenceRun:
    """EP2 on 2 ranks, 40 iterations, torch_dist checkpoints at 10/20/30/40 (cached per session)."""
    base = scratch_dir() / "reference"
    base.mkdir()
    ckpt, jsonl = base / "ckpt", base / "balance.jsonl"
    run = run_entry(REF_ARGS + ["--save", str(ckpt), "--balance-log-file", str(jsonl)]).check()
    return ReferenceRun(ckpt, jsonl, read_jsonl(jsonl), run.output, run.seconds)


def write_dataset(prefix: Path, documents) -> str:
    """A Megatron indexed dataset (uint16 ids, megatron-core's own builder) of ``documents``
    (arrays of token ids, one document each); returns the prefix for ``--data-path``."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for ids in documents:
        builder.add_document(numpy.asarray(ids, dtype=numpy.uint16), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def small_tokenizer(folder: Path, vocab_size: int = 600) -> Path:
    """Another Hugging Face tokenizer than the shipped one: a byte-level BPE of ``vocab_size`` ids
    (fewer than the shipped 4096, so a shipped id is out of its range), trained on the shipped
    corpus's first 300 documents in a quarter of a second, ``<|endoftext|>`` (id 0) its EOS.
    Byte-level: its ids decode back to the exact text. Written to ``folder`` (returned)."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_latentmoe.data.corpus import iter_corpus_texts

    texts = list(itertools.islice(iter_corpus_texts(), 300))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    assert core.get_vocab_size() == vocab_size
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(str(folder))
    return folder
