"""The model and the training code do not depend on the converter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _runs(code: str) -> None:
    """``code`` runs in a fresh interpreter at the repository root (its asserts pass)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_model_and_training_import_no_converter_module():
    code = (
        "import sys\n"
        "from megatron_latentmoe.compat.python311 import apply_python311_compat\n"
        "apply_python311_compat()\n"
        "import megatron_latentmoe.model, megatron_latentmoe.moe.layer, megatron_latentmoe.specs\n"
        "import megatron_latentmoe.training.model_provider\n"
        "bad = [m for m in sys.modules if m.startswith('megatron_latentmoe.convert')]\n"
        "assert not bad, bad\n"
    )
    _runs(code)


def _imports_the_entry_point(node) -> bool:
    entry = "megatron_latentmoe.training.pretrain"
    if isinstance(node, ast.Import):
        return any(alias.name == entry for alias in node.names)
    if not isinstance(node, ast.ImportFrom):
        return False
    names = {alias.name for alias in node.names}
    if node.level:  # relative, inside megatron_latentmoe/training/
        return node.module == "pretrain" or (node.module is None and "pretrain" in names)
    return node.module == entry or (
        node.module == "megatron_latentmoe.training" and "pretrain" in names
    )


def test_no_package_module_imports_the_entry_point():
    """``training/pretrain.py`` is the entry point: the modules it uses do not import it back
    (``file_checks`` once took ``repair_checkpoint_tracker`` from it, a cycle; what ``--load``
    resumes from is ``training/resume.py``'s)."""
    package = os.path.join(REPO, "megatron_latentmoe")
    entry = os.path.join(package, "training", "pretrain.py")
    assert not _imports_where(package, _imports_the_entry_point, skip=entry)


def _imports_where(folder: str, matches, skip: str | None = None) -> list[str]:
    """``path:line`` of every import statement in the ``.py`` files below ``folder`` (but
    ``skip``) for which ``matches(node)`` is true."""
    found = []
    for below, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(below, name)
            if not name.endswith(".py") or path == skip:
                continue
            with open(path) as f:
                tree = ast.parse(f.read())
            found += [
                f"{os.path.relpath(path, REPO)}:{n.lineno}" for n in ast.walk(tree) if matches(n)
            ]
    return found


def _imports_training(node) -> bool:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):  # relative ones stay inside megatron_latentmoe/data/
        names = [] if node.level else [node.module or ""]
    else:
        return False
    training = "megatron_latentmoe.training"
    return any(n == training or n.startswith(training + ".") for n in names)


def test_the_data_layer_imports_nothing_from_training():
    """``megatron_latentmoe/data/`` sits below ``training/`` (which imports it): the file-system
    checks and the one-line argparse errors both use are ``megatron_latentmoe.files``' and
    ``megatron_latentmoe.cli_errors``' (the corpus CLI once took them from ``training/``)."""
    assert not _imports_where(os.path.join(REPO, "megatron_latentmoe", "data"), _imports_training)


def test_the_shared_file_checks_import_neither_megatron_nor_torch():
    """``megatron_latentmoe.files`` and ``cli_errors`` sit below ``data/`` and ``training/``:
    importing them loads neither Megatron nor torch (the tools that use them stay light)."""
    code = (
        "import sys\n"
        "import megatron_latentmoe.files, megatron_latentmoe.cli_errors\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch')]\n"
        "assert not bad, bad\n"
    )
    _runs(code)


def test_the_flag_checks_import_no_preprocessing():
    """The entry point's flag checks (``training/arguments.py``, ``training/data_args.py``) read
    ``--data-path``'s ``.bin``/``.idx`` pairs and refuse tokenizer flags with
    ``data/index_file.py`` and ``data/hf_tokenizer.py``: importing them loads neither the
    preprocessing (``data/indexed.py``: ``multiprocessing``, ``gzip``, ``json`` and the rest: 226
    modules loaded with ``arguments`` when the checks lived there, 207 at the split) nor
    ``transformers``."""
    code = (
        "import sys\n"
        "import megatron_latentmoe.training.arguments\n"
        "heavy = ('megatron_latentmoe.data.indexed', 'transformers')\n"
        "bad = [m for m in heavy if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    _runs(code)
