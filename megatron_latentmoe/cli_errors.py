"""The one error line every command line of the package prints for a bad flag (the entry point,
``tools/``, ``python -m megatron_latentmoe.data.corpus``), and the entry point's bad-flag
exception: here, below ``training/`` and ``data/``, so that the data layer does not import the
training layer for it."""

from __future__ import annotations

import argparse

from megatron_latentmoe.error_file import tell_launcher


class FlagError(ValueError):
    """A bad command line; the message names the flag(s). Raised before any heavy work."""


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """A misspelt flag or a bad value is argparse's one error line, without the usage text
    argparse prints first (Megatron's parser has ~700 flags: the usage is ~800 lines, with the
    error at the very end). The line goes to torchrun's error file too
    (:func:`megatron_latentmoe.error_file.tell_launcher`: a rank of the entry point under plain
    torchrun)."""

    def error(message: str):
        line = f"{parser.prog}: error: {message} (all flags: --help)"
        tell_launcher(line)
        parser.exit(2, line + "\n")

    parser.error = error
