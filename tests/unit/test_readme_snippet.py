"""The README's "Using the block from Megatron-Core" snippet runs as printed, and its commands and
flags (and those of the converter's README and the balance race's report) are accepted by their
programs (docs do not rot).

The snippet is executed in a 1-process gloo world with Megatron's parallel state (what the README
says it needs); the model it builds must hold the README's Stable LatentMoE layers and the QB
hook. The commands are parsed by their programs' own parsers, not run.
"""

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.parallel.launcher import run_distributed

README = Path(__file__).resolve().parents[2] / "README.md"
CONVERT_README = README.parent / "megatron_latentmoe" / "convert" / "README.md"
BALANCE_RACE = README.parent / "benchmarks" / "BALANCE_RACE.md"


def _snippet() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"## Using the block from Megatron-Core.*?```python\n(.*?)```", text, re.S)
    assert match, "README lost its usage snippet"
    return match.group(1)


def _run(rank, world_size, code):
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.moe.balance_step import finalize_model_grads_with_quantile_balancing
    from megatron_latentmoe.moe.layer import StableLatentMoELayer
    from megatron_latentmoe.moe.router import QuantileBalancingRouter

    initialize_parallel_cpu()
    namespace = {}
    exec(compile(code, str(README), "exec"), namespace)
    model, config = namespace["model"], namespace["config"]
    layers = [m for m in model.modules() if isinstance(m, StableLatentMoELayer)]
    return dict(
        moe_layers=len(layers),
        qb_routers=sum(isinstance(layer.router, QuantileBalancingRouter) for layer in layers),
        latent=[layer.fc1_latent_proj.weight.shape for layer in layers][:1],
        hook=config.finalize_model_grads_func is finalize_model_grads_with_quantile_balancing,
    )


def test_readme_snippet_builds_the_model_it_describes():
    (out,) = run_distributed(_run, 1, _snippet(), timeout=600)
    # 4 layers, first_k_dense_replace=1 -> 3 MoE layers, each with the QB router, W_down 1024 -> 512
    assert out["moe_layers"] == 3 and out["qb_routers"] == 3
    assert tuple(out["latent"][0]) == (512, 1024)
    assert out["hook"]


# ---- the README's commands and flags: every one is accepted by the program it is given to ----

REPO = README.parent
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
# a command of this repository: its program (the rest of the span is its arguments)
PROGRAM = re.compile(
    r"^(?P<run>bash |python )?(?P<prog>examples/run_torchrun\.sh \S+|-m megatron_latentmoe\.convert"
    r"|(?:tools|benchmarks|scripts|examples)/\w+\.(?:py|sh))(?P<args>.*)$"
)
# flags the README names for programs that are not this repository's (pip, pytest)
FOREIGN_FLAGS = {"--no-deps", "--ignore-requires-python", "--durations"}
# the entry point, as the README's prose gives its flags (a flag alone)
PRETRAIN = "examples/run_torchrun.sh examples/args/tiny.sh"


class _Parsed(Exception):
    """Raised by a patched ``ArgumentParser.parse_args``: the parser a script built."""

    def __init__(self, parser):
        self.parser = parser


def _parser_of(script: str) -> argparse.ArgumentParser:
    """The argument parser ``script``'s main builds (the script stops where it would parse)."""

    def caught(self, args=None, namespace=None):
        raise _Parsed(self)

    saved = sys.argv
    sys.argv = [script]
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", caught):
            runpy.run_path(str(REPO / script), run_name="__main__")
    except _Parsed as parsed:
        return parsed.parser
    finally:
        sys.argv = saved
    raise AssertionError(f"{script} parsed no arguments")


def _pretrain_parser() -> argparse.ArgumentParser:
    """The entry point's parser: Megatron's flags and ours (``compat.training``)."""
    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    from megatron.training.arguments import add_megatron_arguments

    from megatron_latentmoe.training.arguments import add_stable_latentmoe_args

    parser = argparse.ArgumentParser(allow_abbrev=False)  # as Megatron's parse_args makes it
    return add_stable_latentmoe_args(add_megatron_arguments(parser))


def _parser_for(program: str) -> argparse.ArgumentParser | None:
    """The parser of a README program; None for a shell script without one (its file is
    checked instead)."""
    if program.startswith("examples/run_torchrun.sh"):
        return _pretrain_parser()
    if program == "-m megatron_latentmoe.convert":
        from megatron_latentmoe.convert.cli import build_parser

        return build_parser()
    return _parser_of(program) if program.endswith(".py") else None


def _argv(text: str) -> list[list[str]]:
    """A documented argument list as command lines: ``[--optional flags]`` kept, other
    ``[placeholders]``, ``...`` and a shell comment dropped, a placeholder in capitals (``N``,
    ``SAVE_DIR``) given the value 1, and ``a | b`` (a flag's alternatives) one command line per
    alternative, as is ``a|b|c`` (a value's: the other such values at their first)."""
    text = re.sub(r"\[([^]]*)\]", lambda m: m[1] if m[1].startswith("-") else "", text)
    text = re.sub(r"(^|\s)#.*", "", text).replace("...", " ")
    words = ["1" if re.fullmatch(r"[A-Z][A-Z_]*", w) else w for w in shlex.split(text)]
    if "|" in words:
        start = words.index("|") - 1
        choices = " ".join(words[start:]).split(" | ")
        return [words[:start] + choice.split() for choice in choices]
    first = [w.split("|")[0] for w in words]
    lines = [first]
    for i, word in enumerate(words):
        lines += [[*first[:i], value, *first[i + 1 :]] for value in word.split("|")[1:]]
    return lines


def readme_commands(doc: Path = README) -> list[tuple[str, str]]:
    """``(program, arguments)`` of every command in ``doc``: the lines of its code blocks (a
    line ending in ``\\`` continued) and its inline code that runs a program of this repository
    or, in the README, starts with a flag (a flag alone is the entry point's, as the README's
    prose gives it; the other docs' prose names flags of several programs)."""
    text = doc.read_text(encoding="utf-8")
    blocks = [block.replace("\\\n", " ") for block in FENCE.findall(text)]
    spans = [line for block in blocks for line in block.splitlines()]
    spans += [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", FENCE.sub("", text))]
    commands = []
    for span in spans:
        span = span.strip()
        match = PROGRAM.match(span)
        if match and (match["run"] or match["args"]):  # not a file named alone
            commands.append((match["prog"], match["args"].strip()))
        elif doc == README and span.startswith("--") and " " in span:
            if span.split()[0] not in FOREIGN_FLAGS:
                commands.append((PRETRAIN, span))
    return commands


def _refused(commands: list[tuple[str, str]]) -> list[str]:
    """The commands (one line each) their program refuses."""
    parsers = {program: _parser_for(program) for program in {p for p, _ in commands}}
    refused = []
    for program, args in commands:
        if not program.startswith("-m"):  # the script and its args file exist
            assert all((REPO / path).is_file() for path in program.split()), program
        parser = parsers[program]
        for argv in _argv(args):
            if parser is None:  # a shell script: its flags are in it
                refused += [
                    f"{program} {f}"
                    for f in argv
                    if f.startswith("--")
                    if f not in (REPO / program).read_text(encoding="utf-8")
                ]
                continue
            try:
                with contextlib.redirect_stderr(io.StringIO()) as err:
                    parser.parse_args(argv)
            except SystemExit:
                refused.append(f"{program} {shlex.join(argv)}: {err.getvalue().strip()}")
    return refused


def test_every_readme_command_is_accepted_by_its_program():
    commands = readme_commands()
    programs = {program for program, _ in commands}
    # the README's commands, found (a change of its wording must not empty this test)
    assert {
        PRETRAIN,
        "-m megatron_latentmoe.convert",
        "tools/generate_hf.py",
        "benchmarks/bench_training_balance.py",
        "tools/gpu_checks.sh",
    } <= programs and len(commands) >= 30
    assert _refused(commands) == []


def test_a_readme_block_that_converts_a_checkpoint_trains_it_with_save():
    """A code block that trains and then converts (the MXFP4 block) saves what it converts: its
    training command had no ``--save``, so the export after it had no SAVE_DIR to read."""
    checked = 0
    for block in FENCE.findall(README.read_text(encoding="utf-8")):
        lines = block.replace("\\\n", " ").splitlines()
        trains = [line for line in lines if "examples/run_torchrun.sh" in line]
        for checkpoint in re.findall(r"--checkpoint (\S+)", block) if trains else []:
            assert any(f"--save {checkpoint}" in line for line in trains), (checkpoint, trains)
            checked += 1
    assert checked  # the MXFP4 block: QAT training, then its export


@pytest.mark.parametrize(
    "doc, expected",
    [
        (CONVERT_README, {"-m megatron_latentmoe.convert"}),
        (
            BALANCE_RACE,
            {
                "examples/run_torchrun.sh examples/args/k3_sparse_tiny.sh",
                "benchmarks/bench_training_balance.py",
                "benchmarks/bench_step_balancers.py",
                "benchmarks/bench_balance_floor.py",
            },
        ),
    ],
    ids=["convert_readme", "balance_race"],
)
def test_every_command_of_the_other_docs_is_accepted_by_its_program(doc, expected):
    """The converter's README (its three commands, every ``--dtype`` / ``--expert-dtype``
    choice) and the balance race's report (each run's flags and ``--methods`` names, which the
    race's parser takes only from its ``METHODS``)."""
    commands = readme_commands(doc)
    assert expected <= {program for program, _ in commands}
    assert _refused(commands) == []


@pytest.mark.parametrize(
    "doc", [README, CONVERT_README, BALANCE_RACE], ids=["readme", "convert_readme", "balance_race"]
)
def test_every_flag_the_readme_names_is_one_of_its_programs(doc):
    """Every ``--flag`` in the README, prose included (``--split``, ``--eod-mask-loss``), is one
    of the entry point's or of another README program's (``--check``, ``--out``, and
    ``--split-sentences``, which tools/preprocess_data.py refuses by name), or pip's / pytest's;
    so is every one of the converter's README and the balance race's report (a family such as
    ``--verify-*``: some flag's prefix)."""
    programs = {program for program, _ in readme_commands(doc)} | {
        PRETRAIN,
        "tools/preprocess_data.py",
        "tools/plot_balance.py",
    }
    known = set(FOREIGN_FLAGS)
    for program in programs:
        parser = _parser_for(program)
        if parser is None:
            known |= set(re.findall(r"--[a-z][a-z0-9_-]*", (REPO / program).read_text("utf-8")))
            continue
        known |= set(parser._option_string_actions)
        for action in parser._actions:  # a command's subcommands (the converter's)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    known |= set(sub._option_string_actions)
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", doc.read_text(encoding="utf-8")))
    unknown = [
        flag
        for flag in sorted(named - known)
        if not (flag.endswith("-") and any(k.startswith(flag) for k in known))
    ]
    assert unknown == []
