"""Where the benchmarks write and how, in one place: ``benchmarks/results/``, each JSON (and
picture) written to a temporary file beside its path and renamed into place, so a killed
benchmark never leaves a half-written result; ``--out`` of a one-JSON benchmark is a file or a
folder (which gets the benchmark's own file name)."""

from __future__ import annotations

import argparse
import json
import os

from megatron_latentmoe.files import (  # plain Python: no torch, no Megatron
    folder_refusal as writable_folder_refusal,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def json_path(parser: argparse.ArgumentParser, out: str | None, default_name: str) -> str:
    """The JSON a one-JSON benchmark writes: ``out`` itself, or ``out/default_name`` when ``out``
    is a folder (an existing one, or a path ending in '/'); ``RESULTS/default_name`` without.
    ``parser`` refuses, before the run, an ``out`` whose folder cannot be made or written (a file
    in its way: a FileExistsError traceback after the whole run, its results lost; measured)."""
    if out is None:
        return os.path.join(RESULTS, default_name)
    path = out
    if out.endswith(("/", os.sep)) or os.path.isdir(out):
        path = os.path.join(out, default_name)
    refusal = writable_folder_refusal("--out", os.path.dirname(os.path.abspath(path)))
    if refusal is not None:
        parser.error(refusal)
    return path


def folder_refusal(out: str, names: str) -> str | None:
    """Why ``out`` cannot be the output folder of a benchmark that writes ``names`` into it."""
    if out.endswith(".json") or out.endswith(".png") or os.path.isfile(out):
        return f"--out {out}: a folder is needed (this benchmark writes {names} there)"
    return writable_folder_refusal("--out", out)  # a file in its way, a read-only file system


def _replace(path: str, write) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str, obj, **dump_kwargs) -> None:
    """``json.dump(obj, **dump_kwargs)`` to ``path``, never half-written."""

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, **dump_kwargs)

    _replace(path, write)


def write_png(fig, path: str, dpi: int = 90) -> None:
    """A matplotlib figure as PNG at ``path``, never half-written."""

    def write(tmp):
        with open(tmp, "wb") as f:
            fig.savefig(f, dpi=dpi, format="png")

    _replace(path, write)
