#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron's indexed dataset (.bin/.idx) for Megatron's GPTDataset.

    python tools/preprocess_data.py --input my.jsonl --output-prefix data/my_corpus
    # then train with:  --data-path data/my_corpus
    #   --tokenizer-type HuggingFaceTokenizer --tokenizer-model <the same tokenizer folder>

Each input line is a JSON object; the string under each --json-keys key (default: text) is one
document. Input may be gzip-compressed (.gz). The tokenizer defaults to the one shipped with the
package (megatron_latentmoe/data/assets/tokenizer); any Hugging Face tokenizer folder works.
An EOD token (the tokenizer's EOS) ends every document unless --no-append-eod.

Megatron-LM's tools/preprocess_data.py command lines work where they mean the same here:
--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR [--trust-remote-code], --append-eod,
--workers N, --partitions 1, and the flags Megatron's tool ignores in such a run (e.g. --lang,
--keep-newlines without --split-sentences, --vocab-size), named in a note. The others
(--split-sentences, --partitions N > 1, other tokenizer types, ...) are refused in one line naming
the flag.

The embedded default corpus itself is prepared with
    python -m megatron_latentmoe.data.corpus --output-prefix DIR/name

Exit status: 0 on success, 1 on bad input (the message names the file, line and key), 2 on a
bad option (one line naming the flag: a Megatron flag refused, --workers below 1, a negative
--log-interval, an --output-prefix that names a folder (DIR/) or whose folder is on a read-only
file system or not writable, a --json-keys key given twice or, among several, holding a path
separator), a full disk (one line naming --output-prefix and the space left there) or a file
system the kernel turns read-only mid-run (after a disk error; one line naming --output-prefix),
130 on Ctrl-C, 143 on SIGTERM (temporaries removed either way). Output is written atomically:
a failed or interrupted run leaves no dataset behind, nor the output folders it created (if
still empty).
A SIGTERM or Ctrl-C that comes as the finished dataset is being renamed into place waits until
it is (it no longer leaves an older dataset there half replaced) and is then too late to stop
the run: the dataset is complete, so it exits 0 with the summary and a note on stderr naming
the signal (what a SIGTERM just after the exit gives; a workflow manager then keeps the
dataset, not redoes it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_latentmoe.data.hf_tokenizer import TOKENIZER_FLAGS_NOT_HONOURED  # noqa: E402

# Megatron-LM's tools/preprocess_data.py (core_v0.19, with megatron.training's tokenizer flags)
# has more flags than this tool; --tokenizer-type and --partitions are checked in megatron_refusal.
# Each other one maps to (its argparse kwargs, None if Megatron's tool ignores it in the only run
# this tool does - HuggingFaceTokenizer, one partition, no sentence splitting - else why it is
# refused: it would change the output, or asks for a run this tool does not do). Ignored ones are
# accepted and named in a note.
_FLAG = {"action": "store_true"}
_NO_SEARCH = "this tool has no worker-count search; set --workers N"
_TOKENIZER_FLAG_KWARGS = {
    "--tokenizer-special-tokens": {"nargs": "+"},
    "--tokenizer-hf-no-use-fast": _FLAG,
    "--tokenizer-hf-no-include-special-tokens": _FLAG,
}
MEGATRON_FLAGS: dict[tuple[str, ...], tuple[dict, str | None]] = {
    ("--keep-newlines",): (_FLAG, None),  # read only with --split-sentences
    ("--lang",): ({}, None),  # read only with --split-sentences
    ("--keep-sequential-samples",): (_FLAG, None),  # read only with --partitions > 1
    ("--vocab-size",): ({"type": int}, None),  # read only for TikTokenizer / NullTokenizer
    ("--padded-vocab-size",): ({"type": int}, None),  # the model's embedding size
    ("--no-pad-vocab-size", "--disable-pad-vocab-size"): (_FLAG, None),
    ("--vocab-extra-ids",): ({"type": int}, None),  # Megatron's tool sets it to 0
    ("--chat-template",): ({}, None),  # documents are tokenized as plain text
    ("--tiktoken-pattern",): ({}, None),  # TikTokenizer's
    ("--tiktoken-num-special-tokens",): ({"type": int}, None),
    ("--tokenizer-sentencepiece-legacy",): (_FLAG, None),  # SentencePiece's
    (
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
    ): (_FLAG, None),
    ("--null-tokenizer-eod-id",): ({"type": int}, None),  # NullTokenizer's
    ("--null-tokenizer-pad-id",): ({"type": int}, None),
    ("--split-sentences",): (
        _FLAG,
        "this tool does not split documents into sentences (NLTK); without the flag each JSON "
        "document is written as one sequence",
    ),
    ("--find-optimal-num-workers",): (_FLAG, _NO_SEARCH),
    ("--workers-to-check",): ({"nargs": "+", "type": int}, _NO_SEARCH),
    ("--max-documents",): ({"type": int}, _NO_SEARCH),
    **{
        (flag,): (_TOKENIZER_FLAG_KWARGS.get(flag, {}), why)
        for flag, (_, why) in TOKENIZER_FLAGS_NOT_HONOURED.items()
    },
}
HF_TOKENIZER_TYPE = "HuggingFaceTokenizer"


def _dest(flags: tuple[str, ...]) -> str:
    return "megatron_" + flags[0].lstrip("-").replace("-", "_")


def _shown(flag: str, value) -> str:
    if value is True:
        return flag
    return " ".join([flag, *map(str, value if isinstance(value, list) else [value])])


def _int_at_least(low: int):
    """argparse type: an integer >= ``low``, else the one error line naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: an integer >= {low}")
        return value

    return parse


def megatron_refusal(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(the one-line refusal of a Megatron flag this tool cannot honour, or None; the Megatron
    flags given that Megatron's own tool ignores in this run, as typed)."""
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type not in (None, HF_TOKENIZER_TYPE):
        return (
            f"--tokenizer-type {tokenizer_type}: not supported; this tool tokenizes with a "
            f"Hugging Face tokenizer: --tokenizer-type {HF_TOKENIZER_TYPE} --tokenizer-model DIR",
            [],
        )
    partitions = getattr(args, "partitions", None)
    if partitions not in (None, 1):
        return (
            f"--partitions {partitions}: not supported; this tool reads the input in one pass "
            "(tokenizing in parallel with --workers N): use --partitions 1 or drop the flag",
            [],
        )
    ignored = [] if partitions is None else ["--partitions 1"]
    for flags, (_, why) in MEGATRON_FLAGS.items():
        value = getattr(args, _dest(flags), None)
        if value is None:
            continue
        if why is not None:
            return f"{_shown(flags[0], value)}: not supported; {why}", []
        ignored.append(_shown(flags[0], value))
    return None, ignored


def build_parser() -> argparse.ArgumentParser:
    from megatron_latentmoe.cli_errors import one_line_errors
    from megatron_latentmoe.data.corpus import default_tokenizer_dir

    p = argparse.ArgumentParser(
        prog="preprocess_data.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--input", required=True, help="JSONL file (optionally .gz), one JSON object per line"
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        help="output path prefix: writes PREFIX.bin and PREFIX.idx "
        "(PREFIX_KEY.* with several --json-keys)",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys of the text to tokenize (default: text)",
    )
    p.add_argument(
        "--tokenizer",
        "--tokenizer-model",
        dest="tokenizer",
        default=default_tokenizer_dir(),
        help="Hugging Face tokenizer folder (default: the shipped tokenizer)",
    )
    p.add_argument(
        "--tokenizer-type",
        default=None,
        help=f"Megatron's tokenizer flag; only {HF_TOKENIZER_TYPE} (the default) is supported",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a tokenizer whose tokenizer_config.json names its own Python code (auto_map) "
        "run it (as Megatron's flag; default: such a tokenizer is refused)",
    )
    p.add_argument("--partitions", type=int, default=None, help=argparse.SUPPRESS)
    for flags, (kwargs, _) in MEGATRON_FLAGS.items():
        p.add_argument(*flags, dest=_dest(flags), default=None, help=argparse.SUPPRESS, **kwargs)
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end every document with the tokenizer's EOS token as Megatron's EOD (default: on)",
    )
    p.add_argument(
        "--workers", type=_int_at_least(1), default=1, help="tokenizing processes (default: 1)"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: only on a terminal, and not when "
        "HF_HUB_DISABLE_PROGRESS_BARS is set)",
    )
    p.add_argument(
        "--log-interval",
        type=_int_at_least(0),
        default=1000,
        help="without a progress bar, print Megatron's 'Processed N documents (D docs/s, M MB/s).' "
        "to stderr every N documents (default: 1000; 0: never)",
    )
    one_line_errors(p)
    return p


def _missing_folders(folder: str) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, deepest first: what
    ``preprocess_jsonl`` creates for the output."""
    from megatron_latentmoe.files import nearest_existing

    existing, path, missing = nearest_existing(folder), Path(folder), []
    while path != existing:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(created: list[Path]) -> None:
    """Remove the folders of ``created`` (deepest first) that are still empty: a run that ended
    without a dataset (bad input, a full disk, Ctrl-C) left the output folder it had created,
    empty. One that holds anything (another process's files) is kept, with its parents."""
    for folder in created:
        try:
            folder.rmdir()
        except FileNotFoundError:  # not created yet (a run refused before the mkdir)
            continue
        except OSError:  # not empty
            return


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refusal, ignored = megatron_refusal(args)
    output_folder = os.path.dirname(os.path.abspath(args.output_prefix))
    if refusal is None:  # an --output-prefix DIR/, a --json-keys key given twice
        from megatron_latentmoe.data.indexed import output_names_refusal

        refusal = output_names_refusal(args.output_prefix, args.json_keys)
    if refusal is None:  # the output's folder (created if need be), a read-only file system named
        from megatron_latentmoe.files import folder_refusal

        refusal = folder_refusal("--output-prefix", output_folder)
    if refusal is not None:
        parser.exit(2, f"{parser.prog}: error: {refusal}\n")
    if ignored:
        print(
            f"note: ignored, as Megatron-LM's preprocess_data.py ignores them with "
            f"{HF_TOKENIZER_TYPE}, one partition and no sentence splitting: {', '.join(ignored)}",
            file=sys.stderr,
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if args.workers == 1 else "false")
    import warnings

    with warnings.catch_warnings():  # megatron.core's import-time notes about TE/Apex: noise here
        warnings.simplefilter("ignore")
        import megatron.core.datasets.indexed_dataset  # noqa: F401
    from megatron_latentmoe.data.errors import PreprocessError
    from megatron_latentmoe.data.indexed import preprocess_jsonl
    from megatron_latentmoe.data.signals import StopOnSignals

    stop = StopOnSignals()
    created = _missing_folders(output_folder)
    summary = None
    try:
        with stop:
            summary = preprocess_jsonl(
                args.input,
                args.output_prefix,
                tokenizer=args.tokenizer,
                json_keys=args.json_keys,
                append_eod=args.append_eod,
                workers=args.workers,
                progress=args.progress,
                log_interval=args.log_interval,
                trust_remote_code=args.trust_remote_code,
                interrupted=stop.interrupted,
                on_commit=stop.on_commit,
            )
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk, or one turned read-only: a traceback before
        from megatron_latentmoe.files import write_disk_failure_error

        output = os.path.abspath(args.output_prefix)  # its cut files are removed: room again
        line = write_disk_failure_error(err, [("--output-prefix", output)], written=True)
        if line is None:
            raise
        print(f"{parser.prog}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(stop.INTERRUPTED, file=sys.stderr)
        return stop.exit_status()  # 143 on SIGTERM, 130 on Ctrl-C
    finally:
        if summary is None:
            _remove_empty(created)
    if stop.late_note():
        print(stop.late_note(), file=sys.stderr)
    print(summary)
    remote = " --trust-remote-code" if args.trust_remote_code else ""
    print(
        f"  tokenizer: --tokenizer-type HuggingFaceTokenizer --tokenizer-model {args.tokenizer}"
        + remote
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
