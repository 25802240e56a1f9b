#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron's indexed dataset (.bin/.idx) for Megatron's GPTDataset.

    python tools/preprocess_data.py --input my.jsonl --output-prefix data/my_corpus
    # then train with:  --data-path data/my_corpus
    #   --tokenizer-type HuggingFaceTokenizer --tokenizer-model <the same tokenizer folder>

Each input line is a JSON object; the string under each --json-keys key (default: text) is one
document. Input may be gzip-compressed (.gz). The tokenizer defaults to the one shipped with the
package (megatron_latentmoe/data/assets/tokenizer); any Hugging Face tokenizer folder works.
An EOD token (the tokenizer's EOS) ends every document unless --no-append-eod.

The embedded default corpus itself is prepared with
    python -m megatron_latentmoe.data.corpus --output-prefix DIR/name

Exit status: 0 on success, 1 on bad input (the message names the file, line and key), 130 on
Ctrl-C, 143 on SIGTERM (temporaries removed either way). Output is written atomically: a failed
or interrupted run leaves no dataset behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_parser() -> argparse.ArgumentParser:
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
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end every document with the tokenizer's EOS token as Megatron's EOD (default: on)",
    )
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: only on a terminal, and not when "
        "HF_HUB_DISABLE_PROGRESS_BARS is set)",
    )
    p.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="without a progress bar, print Megatron's 'Processed N documents (D docs/s, M MB/s).' "
        "to stderr every N documents (default: 1000; 0: never)",
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if args.workers == 1 else "false")
    import warnings

    with warnings.catch_warnings():  # megatron.core's import-time notes about TE/Apex: noise here
        warnings.simplefilter("ignore")
        import megatron.core.datasets.indexed_dataset  # noqa: F401
    from megatron_latentmoe.data.indexed import PreprocessError, preprocess_jsonl

    signals = []

    def _terminated(signum, frame):  # clean up temporaries on SIGTERM too (schedulers send it)
        signals.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminated)
    try:
        summary = preprocess_jsonl(
            args.input,
            args.output_prefix,
            tokenizer=args.tokenizer,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            progress=args.progress,
            log_interval=args.log_interval,
        )
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing written (temporary files removed)", file=sys.stderr)
        return 128 + (signals[0] if signals else signal.SIGINT)  # 143 on SIGTERM, 130 on Ctrl-C
    print(summary)
    print(f"  tokenizer: --tokenizer-type HuggingFaceTokenizer --tokenizer-model {args.tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
