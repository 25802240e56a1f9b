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


def _floor(requirement):
    """The lowest version a requirement allows (its ``>=`` clause), or None."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    floors = [Version(s.version) for s in Requirement(requirement).specifier if s.operator == ">="]
    return max(floors, default=None)


def test_no_floor_is_below_what_megatron_core_or_torch_require():
    """A floor under what megatron-core (pinned) or torch ask for can never be installed beside
    them: ``typing_extensions>=4.8`` was one (torch asks for >= 4.10 and imports ``TypeIs``)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    ours = {
        canonicalize_name(Requirement(r).name): r
        for r in PROJECT["dependencies"] + sum(PROJECT["optional-dependencies"].values(), [])
    }
    checked = []
    for dist in ("megatron-core", "torch"):
        for theirs in requires(dist) or []:
            req = Requirement(theirs)
            name = canonicalize_name(req.name)
            if name not in ours or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            want, have = _floor(theirs), _floor(ours[name])
            if want is not None:
                checked.append(name)
                assert have is not None and have >= want, f"{ours[name]!r}: {dist} needs {theirs!r}"
    assert {"torch", "packaging", "typing-extensions"} <= set(checked), checked
