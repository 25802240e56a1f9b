"""scripts/pyproject_requirements.py: what the install scripts install, read from pyproject.toml
(torch and megatron-core apart, every other dependency with the extras asked for, environment
markers dropped); a bad argument is refused in one line with exit 2, printing nothing to install."""

import importlib.util
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "pyproject_requirements", REPO / "scripts" / "pyproject_requirements.py"
)
requirements = importlib.util.module_from_spec(spec)
spec.loader.exec_module(requirements)
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _main(capsys, *argv):
    code = requirements.main(list(argv))
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_runtime_is_every_other_dependency_plus_the_extras(capsys):
    others = [r for r in PROJECT["dependencies"] if not r.startswith(("torch", "megatron-core"))]
    extras = PROJECT["optional-dependencies"]
    assert len(others) == len(PROJECT["dependencies"]) - 2
    assert _main(capsys, "runtime", "hf", "plot") == (0, others + extras["hf"] + extras["plot"], "")
    assert _main(capsys, "runtime") == (0, others, "")
    code, torch, _ = _main(capsys, "torch")
    assert code == 0 and len(torch) == 1 and torch[0].startswith("torch>=")


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["runtime", "hf", "gpu"],
            "pyproject_requirements.py: error: extra 'gpu' is not allowed: one of "
            + ", ".join(PROJECT["optional-dependencies"]),
        ),
        (["torch", "hf"], "usage: pyproject_requirements.py torch | megatron-core | runtime"),
        ([], "usage: pyproject_requirements.py torch | megatron-core | runtime"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(argv, message, capsys):
    code, out, err = _main(capsys, *argv)
    assert (code, out) == (2, [])
    assert err.startswith(message) and err.count("\n") == 1
