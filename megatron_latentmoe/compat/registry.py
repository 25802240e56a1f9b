"""The one registry of every patch this package makes to megatron-core, megatron.training and torch.

Each shim module of ``compat`` applies its patches with :func:`apply_group`: the installed
megatron-core is checked against the tested version first (:func:`check_megatron_core_version`),
then every ``patch(owner, name, value)`` is recorded under the group's name, so that
:func:`revert` can restore the originals (tests) and :func:`is_applied` makes applying idempotent.
Nothing outside ``compat`` rebinds a Megatron attribute. One change is made at import time
instead, and not recorded: :func:`import_megatron_core` (the version check's import) leaves
megatron-core's import-time ``torch.compile`` wrappers out where CUDA is not available.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable

TESTED_MEGATRON_CORE_VERSION = "0.19.2"
ALLOW_UNTESTED_ENV = "MEGATRON_LATENTMOE_ALLOW_UNTESTED_MCORE"

# (group, owner, attribute, original value, the owner's own entry or _INHERITED) of every attribute
# patched, in patch order.
_patched: list[tuple[str, object, str, object, object]] = []
_groups: set[str] = set()


def check_megatron_core_version() -> str:
    """Return the installed megatron-core version; raise unless it is the tested one.

    With ``MEGATRON_LATENTMOE_ALLOW_UNTESTED_MCORE=1`` an untested version only warns. A local
    suffix is ignored: ``megatron.core.package_info`` appends ``+<git hash>`` of whatever git
    checkout the installed package sits in (unless ``NO_VCS_VERSION=1``).
    """
    megatron_core = import_megatron_core()
    version = megatron_core.__version__.split("+")[0]
    if version != TESTED_MEGATRON_CORE_VERSION:
        msg = (
            f"megatron_latentmoe's compat shims were written for megatron-core "
            f"{TESTED_MEGATRON_CORE_VERSION}, found {version}: the patched functions may have "
            f"moved or changed. Install megatron-core=={TESTED_MEGATRON_CORE_VERSION} or set "
            f"{ALLOW_UNTESTED_ENV}=1 to try anyway."
        )
        if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
            raise RuntimeError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return version


def _compile_nothing(model=None, **_options):
    """``torch.compile``'s call forms, compiling nothing: ``@torch.compile``,
    ``torch.compile(fn, ...)`` and ``torch.compile(...)(fn)`` all give ``fn`` back."""
    return (lambda fn: fn) if model is None else model


def import_megatron_core():
    """``import megatron.core``; where CUDA is not available, with ``torch.compile`` compiling
    nothing while it imports (the first import in a process; later ones find it imported).

    megatron-core binds ``megatron.core.jit.jit_fuser = torch.compile`` at import and decorates
    ~40 CUDA fusions with it there (its ``--disable-jit-fuser`` rebinds the name later, too late
    for them). Creating those wrappers imports dynamo and inductor: measured on a 2-core EPYC,
    ``import megatron.core`` takes 4.9 s with them and 2.3 s without, in every process (each
    rank, each test worker). On CPU the fusions are off (``compat/training.py``) or would each
    compile C++ on their first call; here they stay the plain functions, as under Megatron's own
    ``noop_decorator``, and ``jit_fuser`` stays that no-op for modules imported later. A later
    ``torch.compile`` of this package (SiTU-GLU's CPU path) is untouched. On a CUDA machine the
    import is plain.
    """
    import torch

    compile_ = torch.compile
    if not torch.cuda.is_available():
        torch.compile = _compile_nothing
    try:
        import megatron.core
    finally:
        torch.compile = compile_
    return megatron.core


_INHERITED = object()
"""What :func:`revert` finds for an attribute the owner did not hold itself: delete it."""


def patch(group: str, owner: object, name: str, value: object) -> None:
    """Set ``owner.name = value``, remembering the original for :func:`revert`: the owner's own
    entry as stored (a ``staticmethod`` stays one), or that it had none (inherited)."""
    original = getattr(owner, name)
    _patched.append((group, owner, name, original, vars(owner).get(name, _INHERITED)))
    setattr(owner, name, value)


def is_applied(group: str) -> bool:
    return group in _groups


def apply_group(group: str, shims: Iterable[Callable[[], None]]) -> bool:
    """Run ``shims`` (each calls :func:`patch`) once per process under ``group``, after the
    version check. Returns False if the group was already applied."""
    if group in _groups:
        return False
    check_megatron_core_version()
    _groups.add(group)
    try:
        for shim in shims:
            shim()
    except BaseException:
        revert(group)
        raise
    return True


def patched(group: str | None = None) -> list[tuple[object, str, object]]:
    """(owner, attribute, original) of the live patches of ``group`` (all groups: None)."""
    return [(o, n, v) for g, o, n, v, _ in _patched if group is None or g == group]


def revert(group: str | None = None) -> None:
    """Restore the attributes patched under ``group`` (every group: None), newest first."""
    for i in range(len(_patched) - 1, -1, -1):
        g, owner, name, _, stored = _patched[i]
        if group is None or g == group:
            if stored is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, stored)
            del _patched[i]
    if group is None:
        _groups.clear()
    else:
        _groups.discard(group)
