"""Progress bars follow Hugging Face's rule (``megatron_latentmoe/progress.py``): the converter's
and the preprocessor's tqdm bars are drawn on a terminal only, never when
``HF_HUB_DISABLE_PROGRESS_BARS`` is set, always with ``TQDM_POSITION=-1``; ``--no-progress``
turns them off. A log file or a pipe gets no carriage-return frames."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest

from megatron_latentmoe.convert.summary import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _drawn(monkeypatch, stream, enabled=None, **env):
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_POSITION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "stderr", stream)
    bar = Progress(1 << 20, "export", enabled=enabled)
    bar.update(1 << 20)
    bar.close()
    return "export: 100%" in stream.getvalue()


def test_bar_on_a_terminal_only(monkeypatch):
    assert _drawn(monkeypatch, Terminal())
    assert not _drawn(monkeypatch, io.StringIO())  # a log file, a pipe
    assert not _drawn(monkeypatch, Terminal(), enabled=False)  # --no-progress
    assert _drawn(monkeypatch, io.StringIO(), enabled=True)  # asked for by the caller


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_hf_hub_disable_progress_bars_wins(monkeypatch, value):
    assert not _drawn(monkeypatch, Terminal(), HF_HUB_DISABLE_PROGRESS_BARS=value)
    assert not _drawn(monkeypatch, Terminal(), True, HF_HUB_DISABLE_PROGRESS_BARS=value)
    assert _drawn(monkeypatch, Terminal(), HF_HUB_DISABLE_PROGRESS_BARS="0")


@pytest.mark.parametrize(
    "value, off",
    [("1", True), ("ON", True), ("on", True), ("yes", True), ("True", True)]
    + [("0", False), ("", False), ("off", False), ("2", False)],
)
def test_tqdm_disable_reads_hf_hub_disable_progress_bars_as_huggingface_hub_does(
    monkeypatch, value, off
):
    """huggingface_hub's ``_is_true``: 1 / ON / YES / TRUE in any case; anything else is not."""
    from megatron_latentmoe.progress import tqdm_disable

    monkeypatch.delenv("TQDM_POSITION", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", value)
    assert (tqdm_disable(), tqdm_disable(True), tqdm_disable(False)) == (
        (True, True, True) if off else (None, False, True)
    )


def test_tqdm_position_minus_one_forces_the_bar(monkeypatch):
    assert _drawn(monkeypatch, io.StringIO(), TQDM_POSITION="-1")


@pytest.mark.parametrize("command", ["export", "import"])
@pytest.mark.parametrize("flag, expected", [([], None), (["--no-progress"], False)])
def test_cli_leaves_the_bar_to_the_rule_unless_no_progress(
    monkeypatch, tmp_path, command, flag, expected
):
    from megatron_latentmoe.convert import cli, export, importer

    seen = {}

    def fake(*args, progress, **kwargs):
        seen["progress"] = progress
        return SimpleNamespace(format=lambda: "done", to_dict=dict)

    monkeypatch.setattr(export, "export_checkpoint", fake)
    monkeypatch.setattr(importer, "import_checkpoint", fake)
    monkeypatch.setattr(cli, "_check_options", lambda args: None)
    source = ["--checkpoint", "ck"] if command == "export" else ["--hf", "hf"]
    assert cli.main([command, *source, "--output", str(tmp_path / "o"), *flag]) == 0
    assert seen["progress"] is expected


def test_preprocess_bar_follows_the_rule(monkeypatch, tmp_path):
    from megatron_latentmoe.data.indexed import preprocess_jsonl

    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "one two three"}\n{"text": "four five"}\n')
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_POSITION"):
        monkeypatch.delenv(name, raising=False)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    preprocess_jsonl(docs, tmp_path / "a")
    assert "tokenizing docs.jsonl" in terminal.getvalue()
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    preprocess_jsonl(docs, tmp_path / "b")
    assert "tokenizing" not in terminal.getvalue()


def _preprocess_stderr(monkeypatch, tmp_path, stream, argv=()):
    import re

    from tools import preprocess_data

    docs = tmp_path / "many.jsonl"
    docs.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(3000)))
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_POSITION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "stderr", stream)
    code = preprocess_data.main(["--input", str(docs), "--output-prefix", str(tmp_path / "o")])
    code = code or preprocess_data.main(
        ["--input", str(docs), "--output-prefix", str(tmp_path / "o"), *argv]
    )
    assert code == 0, stream.getvalue()
    line = re.compile(r"Processed (\d+) documents \(\d+\.\d docs/s, \d+\.\d\d MB/s\)\.")
    return [int(m.group(1)) for m in line.finditer(stream.getvalue())], stream.getvalue()


def test_preprocess_prints_megatrons_progress_lines_without_a_bar(monkeypatch, tmp_path):
    """Megatron's ``tools/preprocess_data.py`` prints ``Processed N documents (D docs/s, M MB/s).``
    to stderr every ``--log-interval`` (1000) documents, which is what a log file of a long job
    shows; ours does where it draws no bar (documents counted in batches of 256 lines)."""
    counts, _ = _preprocess_stderr(monkeypatch, tmp_path, io.StringIO(), ["--log-interval", "1000"])
    assert counts == [1024, 2048, 3000] * 2  # default 1000, then the explicit flag
    counts, _ = _preprocess_stderr(monkeypatch, tmp_path, io.StringIO(), ["--log-interval", "0"])
    assert counts == [1024, 2048, 3000]  # the first run only
    counts, text = _preprocess_stderr(monkeypatch, tmp_path, Terminal())
    assert counts == [] and "tokenizing many.jsonl" in text  # the bar instead
