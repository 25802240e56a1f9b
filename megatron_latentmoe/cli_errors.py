"""The one error line every command line of the package prints for a bad flag (the entry point,
``tools/``, ``python -m megatron_latentmoe.data.corpus``), and the entry point's bad-flag
exception: here, below ``training/`` and ``data/``, so that the data layer does not import the
training layer for it."""

from __future__ import annotations

import argparse

from megatron_latentmoe.error_file import say_once


class FlagError(ValueError):
    """A bad command line; the message names the flag(s). Raised before any heavy work."""


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """A misspelt flag or a bad value is argparse's one error line, without the usage text
    argparse prints first (Megatron's parser has ~700 flags: the usage is ~800 lines, with the
    error at the very end). Every rank has it alike: under torchrun rank 0 alone prints it and
    every rank writes it to torchrun's error file (:func:`megatron_latentmoe.error_file.say_once`:
    the entry point's ranks under plain torchrun)."""

    def error(message: str):
        say_once(f"{parser.prog}: error: {message} (all flags: --help)")
        parser.exit(2)

    parser.error = error
