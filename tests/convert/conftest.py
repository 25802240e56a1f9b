"""One shared workspace of REAL checkpoints for the converter tests (built once per session).

1. 1 rank: the reference model (random, non-trivial weights) saved single-rank (fp32 and bf16);
   the homogeneous variant end to end (save -> export -> import -> strict Megatron load).
2. parent: export the single-rank checkpoint to HF; import that HF dir back (layout-free).
3. 2 ranks: the same weights saved under TP2+SP, EP2 and PP2; the imported checkpoint loaded
   into those layouts with Megatron's loader.
4. 4 ranks: the same under TP2 x EP2 (ETP1).
5. parent: every layout's checkpoint exported to HF.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors import safe_open

from tests.parallel.launcher import run_distributed

from . import _workers

LAYOUTS_2 = {
    "tp2sp": dict(tp=2, pp=1, ep=1, etp=2),
    "ep2": dict(tp=1, pp=1, ep=2, etp=1),
    "pp2": dict(tp=1, pp=2, ep=1, etp=1),
}
LAYOUTS_4 = {"tp2ep2": dict(tp=2, pp=1, ep=2, etp=1)}
MAX_SHARD = "300KB"  # several safetensors shards even for the tiny model


def hf_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in an HF directory, by name."""
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(directory, f), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


class Workspace:
    def __init__(self, root: str):
        self.root = root
        self.timings: dict[str, float] = {}
        self.results: dict = {}

    def path(self, *parts) -> str:
        return os.path.join(self.root, *parts)


def _timed(ws: Workspace, name: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    ws.timings[name] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Workspace:
    from megatron_latentmoe.convert import export_checkpoint, import_checkpoint

    ws = Workspace(str(tmp_path_factory.mktemp("convert")))
    ws.results["reference"] = _timed(
        ws, "1 rank", run_distributed, _workers.make_reference, 1, ws.root, timeout=600
    )[0]
    ws.results["export_main"] = _timed(
        ws,
        "export",
        export_checkpoint,
        ws.path("ck_single"),
        ws.path("hf_main"),
        max_shard_size=MAX_SHARD,
        progress=False,
    )
    # HF -> Megatron once, layout-free; loaded below into every layout above
    ws.results["import_rt"] = import_checkpoint(
        ws.path("hf_main"), ws.path("mg_rt"), progress=False
    )
    # the import writes exactly the keys Megatron asks for: load it with its strictest check
    imported = [(ws.path("mg_rt", "release"), "raise_all")]
    for world, layouts in ((2, LAYOUTS_2), (4, LAYOUTS_4)):
        ws.results[f"load_{world}"] = _timed(
            ws,
            f"{world} ranks",
            run_distributed,
            _workers.save_and_load,
            world,
            layouts,
            imported,
            ws.root,
            timeout=600,
        )
    for name in (*LAYOUTS_2, *LAYOUTS_4):
        export_checkpoint(
            ws.path(f"ck_{name}"), ws.path(f"hf_{name}"), max_shard_size=MAX_SHARD, progress=False
        )
    return ws
