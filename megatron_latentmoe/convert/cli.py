"""Command line of the converter: ``python -m megatron_latentmoe.convert`` /
``tools/convert_checkpoint.py``.

    export   Megatron torch_dist checkpoint (any layout) -> HF directory   [--verify]
    import   HF directory -> Megatron torch_dist checkpoint (loads at any layout)   [--verify]
    verify   compare a Megatron checkpoint with an HF directory (logits + greedy generation)

Exit status: 0 success, 2 bad input (the message names the file / tensor / key / field),
3 verification outside tolerance, 130 / 143 interrupted by Ctrl-C / SIGTERM (a conversion cut
short leaves no output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence

from .options import (
    DEFAULT_ATOL,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_READ_BATCH_MB,
    DEFAULT_VERIFY_BATCH,
    DEFAULT_VERIFY_SEQ_LEN,
    DEFAULT_VERIFY_TOKENS,
    DTYPE_CHOICES,
    EXPERT_DTYPES,
)

EXIT_BAD_INPUT = 2
EXIT_VERIFY_FAILED = 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it; SIGTERM exits with 143


VERIFY_DEFAULTS = {  # the parser's defaults are None: a value given without --verify is refused
    "--verify-atol": DEFAULT_ATOL,
    "--verify-tokens": DEFAULT_VERIFY_TOKENS,
    "--verify-seq-len": DEFAULT_VERIFY_SEQ_LEN,
    "--verify-batch": DEFAULT_VERIFY_BATCH,
    "--verify-text": None,
}


def _add_verify_args(p: argparse.ArgumentParser, flag: bool = True) -> None:
    if flag:
        p.add_argument(
            "--verify",
            action="store_true",
            help="afterwards, run both models on the same tokens and compare",
        )
    p.add_argument(
        "--verify-atol",
        type=float,
        help=f"max |delta logits| allowed (fp32 both sides; default {DEFAULT_ATOL:g})",
    )
    for flag, what in (
        ("--verify-tokens", "greedy tokens to generate"),
        ("--verify-seq-len", "prompt length in tokens"),
        ("--verify-batch", "prompts"),
    ):
        p.add_argument(flag, type=int, help=f"{what} (default {VERIFY_DEFAULTS[flag]})")
    p.add_argument("--verify-text", help="prompt text (default: the shipped corpus)")


CHECKPOINT_HELP = (
    "torch_dist checkpoint dir, or a megatron.training save root (its tracker file picks the "
    "iteration)"
)
MEGATRON_CONFIG_HELP = (
    "model description (JSON/YAML of StableLatentMoETransformerConfig fields + vocab_size, "
    "max_sequence_length[, rotary_base, share_embeddings_and_output_weights], or an HF "
    "config.json); default: from the checkpoint"
)

IGNORED_IMPORT_FLAGS = ("--tp", "--pp", "--ep", "--etp")
"""Layout flags of earlier ``import`` versions: accepted and ignored (the output loads at any
layout)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_latentmoe.convert",
        description="Convert Stable LatentMoE checkpoints between Megatron torch_dist and "
        "Hugging Face.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    ex = sub.add_parser("export", help="Megatron torch_dist -> HF")
    ex.add_argument("--checkpoint", "--load", required=True, help=CHECKPOINT_HELP)
    ex.add_argument(
        "--output", required=True, help="HF output directory (must not exist or be empty)"
    )
    ex.add_argument("--megatron-config", default=None, help=MEGATRON_CONFIG_HELP)
    _dtype(ex, "exported weights", "the checkpoint's")
    ex.add_argument(
        "--expert-dtype",
        default="auto",
        choices=EXPERT_DTYPES,
        help="routed experts: 'auto' = like --dtype; 'mxfp4' = MXFP4-packed "
        "(compressed-tensors mxfp4-pack-quantized, 4.25 bits/weight; "
        "QAT-trained models export losslessly)",
    )
    ex.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"max bytes per safetensors shard (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    ex.add_argument(
        "--tokenizer",
        default="default",
        help="tokenizer directory to ship ('default' = the one the checkpoint was trained "
        "with (its --tokenizer-model), or the package's for a checkpoint without "
        "training args; 'none' = no tokenizer)",
    )
    ex.add_argument(
        "--read-batch-mb",
        type=int,
        default=DEFAULT_READ_BATCH_MB,
        help=f"checkpoint read batch (MiB, default {DEFAULT_READ_BATCH_MB})",
    )
    _common(ex)
    _add_verify_args(ex)

    im = sub.add_parser("import", help="HF -> Megatron torch_dist")
    im.add_argument("--hf", "--input", dest="hf", required=True, help="HF model directory")
    im.add_argument("--output", required=True, help="Megatron save root to create (--load it)")
    for flag in IGNORED_IMPORT_FLAGS:  # accepted so that existing job scripts keep working
        im.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    _dtype(im, "Megatron parameters", "the HF tensors'")
    im.add_argument(
        "--iteration",
        type=int,
        default=None,
        help="write iter_XXXXXXX instead of a 'release' checkpoint",
    )
    _common(im)
    _add_verify_args(im)

    vf = sub.add_parser("verify", help="compare a Megatron checkpoint with an HF directory")
    vf.add_argument("--checkpoint", "--load", required=True, help=CHECKPOINT_HELP)
    vf.add_argument("--hf", required=True, help="HF model directory (its export)")
    vf.add_argument("--megatron-config", default=None, help=MEGATRON_CONFIG_HELP)
    vf.add_argument("--summary-json", default=None, help="also write the report as JSON")
    _add_verify_args(vf, flag=False)
    return parser


def _dtype(p: argparse.ArgumentParser, what: str, default: str) -> None:
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help=f"dtype of the {what} (default: {default}); the expert bias stays fp32",
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (default: one on stderr when it is a terminal and "
        "HF_HUB_DISABLE_PROGRESS_BARS is not set)",
    )
    p.add_argument(
        "--summary-json", default=None, help="also write the summary (and verify report) as JSON"
    )


def _verify(args, checkpoint: str, hf_dir: str, config_file: str | None):
    from .verify import verify_export

    report = verify_export(
        checkpoint,
        hf_dir,
        config_file=config_file,
        atol=args.verify_atol,
        new_tokens=args.verify_tokens,
        batch=args.verify_batch,
        seq_len=args.verify_seq_len,
        text=args.verify_text,
    )
    print(report.format())
    return report


def _check_options(args) -> None:
    """Refuse bad options before any work (a typo must not cost a full conversion)."""
    from megatron_latentmoe.fields import not_allowed

    from .errors import ConversionError
    from .verify import check_hf_dir, check_verify_options

    verifying = args.command == "verify" or args.verify
    for flag, default in VERIFY_DEFAULTS.items():
        name = flag[2:].replace("-", "_")
        value = getattr(args, name)
        if value is None:
            setattr(args, name, default)
        elif not verifying:  # a forgotten --verify: the comparison would not run
            raise not_allowed(flag, value, "only with --verify", ConversionError)
    if verifying:
        check_verify_options(
            atol=args.verify_atol,
            new_tokens=args.verify_tokens,
            batch=args.verify_batch,
            seq_len=args.verify_seq_len,
            text=args.verify_text,
        )
    if args.command in ("import", "verify"):
        check_hf_dir(args.hf)
    if getattr(args, "read_batch_mb", 1) < 1:
        raise not_allowed("--read-batch-mb", args.read_batch_mb, "an integer >= 1", ConversionError)
    if args.summary_json:
        if os.path.isdir(args.summary_json):
            raise not_allowed(
                "--summary-json", args.summary_json, "a file path, not a directory", ConversionError
            )
        parent = os.path.dirname(os.path.abspath(args.summary_json))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConversionError(
                f"--summary-json {args.summary_json!r}: directory {parent!r} "
                "does not exist or is not writable"
            )


def _write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file (never a half-written summary). A write
    that fails (a full disk: ENOSPC; one turned read-only) removes the temporary file and raises
    :class:`ConversionError` naming --summary-json: it was an OSError traceback that left
    ``PATH.tmpPID`` behind (measured with the write made to raise ENOSPC)."""
    from megatron_latentmoe.files import write_disk_failure_error

    from .errors import ConversionError

    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, default=str)
        os.replace(tmp, path)
    except BaseException as err:  # Ctrl-C / SIGTERM too: no PATH.tmpPID left
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if not isinstance(err, OSError):
            raise
        named = [("--summary-json", os.path.abspath(path))]  # a "path": PATH.tmpPID is its file
        line = write_disk_failure_error(err, named, written=True)
        raise ConversionError(
            line or f"--summary-json {path!r}: cannot be written ({err.strerror or err})"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron.core's version string without git
    args = build_parser().parse_args(argv)
    from megatron_latentmoe.data.signals import StopOnSignals

    # Ctrl-C and SIGTERM (timeout, Slurm) raise KeyboardInterrupt anywhere in the run, as in
    # tools/preprocess_data.py: SIGTERM outside the output's writing killed the process without
    # a word (exit -15), and Ctrl-C inside it printed two lines (measured with the shard write,
    # DCP's _write_item and the verify stalled, each signal sent from another process)
    stop = StopOnSignals()
    before = _dir_identity(args.output) if args.command != "verify" else None
    try:
        with stop:
            return _run(args)
    except KeyboardInterrupt:
        print(_interrupted_line(args, stop, before), file=sys.stderr)
        return stop.exit_status()  # 130 on Ctrl-C, 143 on SIGTERM


def _dir_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the directory at ``path``, None if there is none: the output renamed
    into place is another inode than the one it replaced."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _interrupted_line(args, stop, before: tuple[int, int] | None) -> str:
    """The one line for a run stopped by Ctrl-C / SIGTERM: what the output holds now. The
    conversions leave no partial output (``summary.atomic_output_dir``); an interrupt after the
    rename (during ``--verify``, or held off by the rename) leaves the complete new output."""
    import signal

    what = "SIGTERM" if stop.exit_status() == 128 + signal.SIGTERM else "Ctrl-C"
    if args.command == "verify":
        return f"interrupted ({what}): the comparison did not finish; nothing written"
    out = args.output
    if _dir_identity(out) not in (None, before):
        tail = "; --verify did not finish" if args.verify else ""
        return f"interrupted ({what}) after the conversion: --output {out!r} is complete{tail}"
    kept = "kept as it was" if before else "not created"
    return (
        f"interrupted ({what}): nothing written, --output {out!r} {kept} (no partial output left)"
    )


def _run(args) -> int:
    from .errors import ConversionError

    result: dict = {}
    try:
        _check_options(args)
        if args.command == "export":
            from .export import export_checkpoint

            summary = export_checkpoint(
                args.checkpoint,
                args.output,
                config_file=args.megatron_config,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                tokenizer_dir=None if args.tokenizer == "none" else args.tokenizer,
                overwrite=args.overwrite,
                progress=False if args.no_progress else None,
                read_batch_bytes=args.read_batch_mb << 20,
                expert_dtype=args.expert_dtype,
                verify_seq_len=args.verify_seq_len if args.verify else None,
                verify_tokens=args.verify_tokens,
                verify_text=args.verify_text if args.verify else None,
            )
            dirs = (args.checkpoint, args.output, args.megatron_config)
        elif args.command == "import":
            from .importer import import_checkpoint

            ignored = [f for f in IGNORED_IMPORT_FLAGS if getattr(args, f.lstrip("-")) is not None]
            if ignored:
                print(
                    f"note: {' '.join(ignored)} ignored: import writes one layout-free checkpoint "
                    "that Megatron reshards on load at any layout",
                    file=sys.stderr,
                )
            summary = import_checkpoint(
                args.hf,
                args.output,
                dtype=args.dtype,
                iteration=args.iteration,
                overwrite=args.overwrite,
                progress=False if args.no_progress else None,
                verify_seq_len=args.verify_seq_len if args.verify else None,
                verify_tokens=args.verify_tokens,
                verify_text=args.verify_text if args.verify else None,
            )
            dirs = (args.output, args.hf, None)
        else:
            summary, dirs = None, (args.checkpoint, args.hf, args.megatron_config)
        if summary is not None:
            print(summary.format())
            result["summary"] = summary.to_dict()
        report = _verify(args, *dirs) if summary is None or args.verify else None
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if report is not None:
        result["verify"] = report.to_dict()
    if args.summary_json:
        try:
            _write_json(args.summary_json, result)
        except ConversionError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if report is not None and not report.passed:
        print("error: verification failed (see above)", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
