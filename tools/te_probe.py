"""Probes of the Transformer Engine kit's known risks, one per call, for tools/gpu_checks.sh.

    python tools/te_probe.py imports   # torch, TE, megatron-core (HAVE_TE), pydantic (no CUDA)
    python tools/te_probe.py norm      # TE RMSNorm / LayerNormLinear fwd+bwd (NVRTC-built kernels)
    python tools/te_probe.py fp8       # te.Linear fwd+bwd under FP8 autocast (delayed scaling)
    python tools/te_probe.py grouped   # te.GroupedLinear fwd+bwd (cuBLASLt grouped GEMM)

Exit status 0: the probe ran; 1: it failed (the error is printed: gpu_checks.sh decides on a
fallback and records it); 3: skipped (no CUDA: a CPU ``--check`` run).
"""

from __future__ import annotations

import importlib
import sys
import time

SKIP = 3


def imports() -> int:
    import torch  # first: TE's core needs the NCCL / CUDA libraries torch loads

    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()}"
    )
    t = time.time()
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # noqa: BLE001 - report any import failure (GLIBCXX, ABI, ...)
        print(f"transformer_engine import FAILED: {type(exc).__name__}: {exc}")
        return 1 if torch.cuda.is_available() else SKIP
    print(f"TE {te.__version__} imported in {time.time() - t:.1f} s")
    import megatron.core
    from megatron.core.extensions.transformer_engine import HAVE_TE

    print(f"megatron-core {megatron.core.__version__}, HAVE_TE {HAVE_TE}")
    import pydantic

    print(f"pydantic {pydantic.__version__} from {pydantic.__file__}")
    return 0 if HAVE_TE else 1


def _cuda_or_skip():
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        sys.exit(SKIP)
    return torch


def norm() -> int:
    torch = _cuda_or_skip()
    import transformer_engine.pytorch as te

    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for module in (te.RMSNorm(1024), te.LayerNormLinear(1024, 1024, normalization="RMSNorm")):
        y = module.to(device="cuda", dtype=torch.bfloat16)(x)
        y.float().square().sum().backward()
    ref = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-5)
    err = (te.RMSNorm(1024).cuda().to(torch.bfloat16)(x).float() - ref).abs().max().item()
    torch.cuda.synchronize()
    print(f"TE RMSNorm / LayerNormLinear fwd+bwd OK; max |RMSNorm - reference| = {err:.3g}")
    return 0 if err < 0.05 else 1


def fp8() -> int:
    torch = _cuda_or_skip()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    ok, reason = te.is_fp8_available(return_reason=True)
    print(f"FP8 available: {ok} {reason or ''}")
    m = te.Linear(1024, 1024, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        y = m(x)
    y.float().sum().backward()
    torch.cuda.synchronize()
    amax = m.fp8_meta["scaling_fwd"].amax_history.abs().max().item()
    print(f"FP8 te.Linear fwd+bwd OK; amax history max {amax:.3g}")
    return 0 if amax > 0 else 1


def grouped() -> int:
    torch = _cuda_or_skip()
    import transformer_engine.pytorch as te

    m = te.GroupedLinear(4, 512, 512, params_dtype=torch.bfloat16).cuda()
    splits = [128, 0, 256, 128]
    x = torch.randn(sum(splits), 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = m(x, splits)
    y.float().sum().backward()
    ref = torch.cat([xi @ getattr(m, f"weight{i}").t() for i, xi in enumerate(x.split(splits))])
    err = ((y - ref).float().norm() / ref.float().norm()).item()
    torch.cuda.synchronize()
    print(f"te.GroupedLinear (cuBLASLt grouped GEMM) fwd+bwd OK; rel err vs matmul {err:.2e}")
    return 0 if err < 1e-2 else 1


PROBES = {"imports": imports, "norm": norm, "fp8": fp8, "grouped": grouped}

if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__.strip())
        sys.exit(0)
    if len(sys.argv) != 2 or sys.argv[1] not in PROBES:
        print(
            f"usage: python tools/te_probe.py {{{','.join(PROBES)}}}; got {sys.argv[1:]}",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(PROBES[sys.argv[1]]())
