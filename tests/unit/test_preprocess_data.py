"""tools/preprocess_data.py's command line in-process, the tokenizing replaced by a spy: each
option reaches ``preprocess_jsonl`` with its value, what main() prints, its exit statuses on
Ctrl-C / SIGTERM, and the process state it leaves. (The real tokenizing: test_data.py.)"""

import os
import signal

import pytest

import megatron_latentmoe.data.indexed as indexed
from megatron_latentmoe.data import DEFAULT_TOKENIZER_DIR
from megatron_latentmoe.data.errors import PreprocessError
from megatron_latentmoe.files import REMOUNT
from tests.unit.test_data import _load_tool

DEFAULTS = dict(
    tokenizer=str(DEFAULT_TOKENIZER_DIR),
    json_keys=["text"],
    append_eod=True,
    workers=1,
    progress=None,
    log_interval=1000,
    trust_remote_code=False,
)


@pytest.fixture
def calls(monkeypatch):
    """The (input, output_prefix, keyword arguments but ``interrupted`` and ``on_commit``) of
    each preprocess_jsonl call; the call does ``calls.then()`` (return the summary by default),
    then records whether ``interrupted()`` says a signal came, in ``calls.interrupted``."""
    seen = []

    def spy(input, output_prefix, interrupted, on_commit, **kwargs):
        seen.append((input, output_prefix, kwargs))
        assert interrupted() is False
        try:
            return seen.then()
        finally:
            seen.interrupted.append(interrupted())

    seen = type("Calls", (list,), {"then": staticmethod(lambda: "SUMMARY")})()
    seen.interrupted = []
    monkeypatch.setattr(indexed, "preprocess_jsonl", spy)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    return seen


@pytest.fixture
def caller_handler():
    """A SIGTERM handler of the caller's, in place while the test runs: main() must put it
    back, and a SIGTERM that main() does not catch fails the test (not the test run)."""

    def handler(signum, frame):
        raise AssertionError("SIGTERM reached the caller's handler")

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


def test_defaults_and_each_option_reach_the_preprocessor(
    calls, caller_handler, capsys, monkeypatch, tmp_path
):
    tool = _load_tool("preprocess_data")
    assert tool.main(["--input", "in.jsonl", "--output-prefix", "out/x"]) == 0
    assert calls[-1] == ("in.jsonl", "out/x", DEFAULTS)
    assert capsys.readouterr() == (
        "SUMMARY\n  tokenizer: --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
        f"{DEFAULT_TOKENIZER_DIR}\n",
        "",
    )
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"  # one process: the Rust threads
    assert signal.getsignal(signal.SIGTERM) is caller_handler  # main() puts it back

    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    options = ["--json-keys", "a", "b", "--tokenizer-model", str(tmp_path), "--no-append-eod"]
    options += ["--workers", "3", "--progress", "--log-interval", "7", "--trust-remote-code"]
    assert tool.main(["--input", "i", "--output-prefix", "o", *options]) == 0
    assert calls[-1] == (
        "i",
        "o",
        dict(
            tokenizer=str(tmp_path),
            json_keys=["a", "b"],
            append_eod=False,
            workers=3,
            progress=True,
            log_interval=7,
            trust_remote_code=True,
        ),
    )
    assert capsys.readouterr().out.endswith(f"--tokenizer-model {tmp_path} --trust-remote-code\n")
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"  # forked workers: no Rust threads


@pytest.mark.parametrize(
    "then, code, message",
    [
        (
            PreprocessError("in.jsonl:3: malformed JSON"),
            1,
            "error: in.jsonl:3: malformed JSON",
        ),
        (KeyboardInterrupt(), 130, "interrupted: nothing written (temporary files removed)"),
        ("SIGTERM", 143, "interrupted: nothing written (temporary files removed)"),
    ],
)
def test_exit_status_of_a_failed_or_interrupted_run(
    calls, caller_handler, capsys, then, code, message
):
    """Bad input: 1; Ctrl-C: 130; SIGTERM (sent to this process while tokenizing): 143; one
    line on stderr, nothing on stdout; the SIGTERM handler is the caller's again."""

    def fail():
        if then == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
        raise then

    calls.then = fail
    assert _load_tool("preprocess_data").main(["--input", "i", "--output-prefix", "o"]) == code
    assert capsys.readouterr() == ("", message + "\n")
    assert calls.interrupted == [then == "SIGTERM"]  # the backstop sees only the SIGTERM
    assert signal.getsignal(signal.SIGTERM) is caller_handler


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workers", "0"], "argument --workers: '0' is not allowed: an integer >= 1"),
        (["--workers", "two"], "argument --workers: 'two' is not allowed: an integer >= 1"),
        (["--log-interval", "-1"], "argument --log-interval: '-1' is not allowed: an integer >= 0"),
    ],
)
def test_bad_counts_are_refused_by_flag(calls, capsys, flags, message):
    """(--workers 0 was "error: workers must be >= 1, got 0", exit 1, after loading megatron.core:
    the library's argument name, not the flag.)"""
    with pytest.raises(SystemExit) as e:
        _load_tool("preprocess_data").main(["--input", "i", "--output-prefix", "o", *flags])
    assert e.value.code == 2 and calls == []
    assert capsys.readouterr() == (
        "",
        f"preprocess_data.py: error: {message} (all flags: --help)\n",
    )


def test_only_a_full_disk_is_one_line_other_os_errors_raise(calls, capsys, tmp_path):
    """ENOSPC (the real disk: test_data.py) is the one line naming --output-prefix, exit 2;
    another OSError is no user-fixable disk problem of ours: its traceback as before."""
    import errno

    prefix = str(tmp_path / "o")
    calls.then = lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
    assert _load_tool("preprocess_data").main(["--input", "i", "--output-prefix", prefix]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"preprocess_data.py: error: the disk filled up writing in --output-prefix {prefix} ("
    ), err
    calls.then = lambda: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error"))
    with pytest.raises(OSError, match="Input/output error"):
        _load_tool("preprocess_data").main(["--input", "i", "--output-prefix", prefix])


@pytest.mark.parametrize(
    "code, name, advice",
    [
        (28, ".bin.tmp7", "free space there or give --output-prefix a path on a larger disk"),
        (28, "_b.idx", "free space there or give --output-prefix a path on a larger disk"),
        (30, ".idx.tmp7", f"{REMOUNT} or give --output-prefix a path on another disk"),
    ],
)
def test_a_full_or_read_only_disk_naming_an_output_file_names_the_flag(
    calls, capsys, tmp_path, code, name, advice
):
    """The error names the cut file (an ``open``'s does): the line said "free space there" (or
    only remount) without --output-prefix, as the file (``PREFIX.bin.tmp<pid>``,
    ``PREFIX_<key>.idx``) is not under the prefix as in a folder. Now a file whose path starts
    with the prefix is the flag's."""
    prefix = str(tmp_path / "o")
    calls.then = lambda: (_ for _ in ()).throw(OSError(code, os.strerror(code), prefix + name))
    assert _load_tool("preprocess_data").main(["--input", "i", "--output-prefix", prefix]) == 2
    err = capsys.readouterr().err
    what = "disk filled up" if code == 28 else "file system turned read-only"
    assert err.startswith(f"preprocess_data.py: error: the {what} writing {prefix}{name}"), err
    assert err.endswith(f"; {advice}\n"), err


@pytest.mark.parametrize("under", ["", "sub/"])
def test_an_output_folder_on_a_read_only_file_system_is_refused_by_flag(
    calls, capsys, tmp_path, under
):
    """A real read-only tmpfs: the folder (or the one it would be created in) was
    "error: output_prefix='...': '...' is not writable" (or "cannot create ... (Read-only file
    system)"), exit 1, after loading megatron.core and the tokenizer. Now the flag check names
    the read-only file system (``files.folder_refusal``), exit 2, nothing tokenized."""
    from tests.training import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        argv = ["--input", "i", "--output-prefix", f"{ro}/{under}out"]
        with pytest.raises(SystemExit) as e:
            _load_tool("preprocess_data").main(argv)
        assert e.value.code == 2 and calls == []
        assert capsys.readouterr() == (
            "",
            f"preprocess_data.py: error: --output-prefix {ro / under}: {ro} is on a read-only "
            "file system; give a folder this run can create or write in\n",
        )


@pytest.mark.parametrize(
    "then, code",
    [
        (OSError(28, "No space left on device"), 2),
        (PreprocessError("in.jsonl:3: malformed JSON"), 1),
        (KeyboardInterrupt(), 130),
        (OSError(5, "Input/output error"), None),  # re-raised
    ],
)
def test_a_run_without_a_dataset_removes_the_output_folders_it_created(
    calls, capsys, tmp_path, then, code
):
    """A full disk, bad input, Ctrl-C or another error left the output folders that
    ``preprocess_jsonl`` had created (``sub/deeper``), empty. Now removed; a folder that existed
    before (``tmp_path``, and ``kept`` though empty) or holds a file is kept; a run that wrote
    its dataset keeps its folders."""

    def fail(folder):
        def then_():
            folder.mkdir(parents=True, exist_ok=True)  # as preprocess_jsonl does first
            raise then

        return then_

    def run(prefix):
        argv = ["--input", "i", "--output-prefix", str(prefix)]
        if code is None:
            with pytest.raises(OSError):
                _load_tool("preprocess_data").main(argv)
        else:
            assert _load_tool("preprocess_data").main(argv) == code

    calls.then = fail(tmp_path / "sub" / "deeper")
    run(tmp_path / "sub" / "deeper" / "out")
    assert sorted(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    calls.then = fail(tmp_path / "kept" / "new")
    run(tmp_path / "kept" / "new" / "out")
    calls.then = fail(tmp_path / "kept")
    run(tmp_path / "kept" / "out")
    assert sorted(tmp_path.iterdir()) == [tmp_path / "kept"]
    assert sorted((tmp_path / "kept").iterdir()) == []

    def another_process_writes(folder):
        def then_():
            folder.mkdir(parents=True)
            (folder / "theirs.bin").write_text("")
            raise then

        return then_

    calls.then = another_process_writes(tmp_path / "a" / "b")
    run(tmp_path / "a" / "b" / "out")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "a",
        "a/b",
        "a/b/theirs.bin",
        "kept",
    ]
    capsys.readouterr()


def test_a_run_that_wrote_its_dataset_keeps_the_folders_it_created(calls, tmp_path):
    def then():
        (tmp_path / "new").mkdir()
        return "SUMMARY"

    calls.then = then
    argv = ["--input", "i", "--output-prefix", str(tmp_path / "new" / "out")]
    assert _load_tool("preprocess_data").main(argv) == 0
    assert (tmp_path / "new").is_dir()
