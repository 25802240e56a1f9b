"""The one error line every command line of the package prints for a bad flag (the entry point,
``tools/``, ``python -m megatron_latentmoe.data.corpus``): here, below ``training/`` and
``data/``, so that the data layer does not import the training layer for it."""

from __future__ import annotations

import argparse


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """A misspelt flag or a bad value is argparse's one error line, without the usage text
    argparse prints first (Megatron's parser has ~700 flags: the usage is ~800 lines, with the
    error at the very end)."""

    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message} (all flags: --help)\n")

    parser.error = error
