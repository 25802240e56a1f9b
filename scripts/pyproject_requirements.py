"""Print requirements of pyproject.toml, one per line, for the install scripts (which must not
restate them): ``torch`` or ``megatron-core`` prints that one requirement; ``runtime [EXTRA...]``
prints every other dependency plus those extras' requirements. Environment markers are dropped
(the scripts decide how to install megatron-core on Python 3.11).

    python scripts/pyproject_requirements.py megatron-core     # megatron-core==0.19.2
"""

import re
import sys
import tomllib
from pathlib import Path

PINNED_SEPARATELY = ("torch", "megatron-core")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def main(argv: list[str]) -> int:
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    deps = [r.split(";")[0].strip() for r in project["dependencies"]]
    what, extras = (argv[0] if argv else ""), argv[1:]
    if what in PINNED_SEPARATELY and not extras:
        print(*(r for r in deps if _name(r) == what), sep="\n")
    elif what == "runtime":
        unknown = [e for e in extras if e not in project["optional-dependencies"]]
        if unknown:
            allowed = ", ".join(project["optional-dependencies"])
            print(
                f"pyproject_requirements.py: error: extra {unknown[0]!r} is not allowed: one of "
                f"{allowed}",
                file=sys.stderr,
            )
            return 2
        rows = [r for r in deps if _name(r) not in PINNED_SEPARATELY]
        rows += [r for e in extras for r in project["optional-dependencies"][e]]
        print(*rows, sep="\n")
    else:
        print(
            "usage: pyproject_requirements.py torch | megatron-core | runtime [EXTRA...]",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
