"""compat.core's optimizer shims on small dicts and a two-parameter torch Adam: the distributed
optimizer's Adam step (no apex/TE) and the chained optimizer's regrouping of a checkpoint saved
with another number of chained optimizers. The kill-and-resume tests (tests/training) meet the
same walls end to end; these call the patched methods directly."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_latentmoe.compat import core, registry


@pytest.fixture
def core_compat():
    """The core shims applied for this test (re-applied afterwards if they were on before)."""
    was_applied = registry.is_applied(core.GROUP)
    registry.revert(core.GROUP)
    assert core.apply_core_compat()
    yield
    registry.revert(core.GROUP)
    if was_applied:
        core.apply_core_compat()


# ------------------------------------------------------------------ distributed optimizer step
def _distributed_optimizer(steps: int):
    """A DistributedOptimizer with only what state_dict / load_state_dict / the state setter read
    (fp32: the main params are the model's), its torch Adam stepped ``steps`` times."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        pytest.skip("with apex/TE Megatron keeps Adam's step itself")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2))]
    opt = distrib_optimizer.DistributedOptimizer.__new__(distrib_optimizer.DistributedOptimizer)
    opt.optimizer = torch.optim.Adam(params, lr=1e-3)
    opt.grad_scaler = None
    opt.config = types.SimpleNamespace(
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=False, fp16=False
    )
    opt.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
    opt.model_param_group_index_map = {p: (0, i) for i, p in enumerate(params)}
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.optimizer.step()
    return opt, params


def _steps(opt) -> list[float]:
    return [float(s["step"]) for s in opt.optimizer.state.values()]


def test_distributed_optimizer_state_dict_reads_the_step_once_adam_stepped(core_compat):
    """Before the first step the state_dict shows step 0; after it, Adam's own step (the step-0
    stand-in must be gone)."""
    opt, params = _distributed_optimizer(steps=0)
    assert [g["step"] for g in opt.state_dict()["optimizer"]["param_groups"]] == [0.0]
    # a save reads each parameter's state through the defaultdict: an empty entry, still fresh
    # (an --fp16 run whose steps the loss scaler all skipped failed its second save)
    assert opt.optimizer.state[params[0]] == {}
    assert [g["step"] for g in opt.state_dict()["optimizer"]["param_groups"]] == [0.0]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.optimizer.step()
    assert [g["step"] for g in opt.state_dict()["optimizer"]["param_groups"]] == [1.0]


def test_distributed_optimizer_load_gives_each_parameter_its_own_step(core_compat):
    """Megatron puts ONE step tensor into every parameter's state; torch's Adam increments it in
    place once per parameter: one step after loading step 3 must give 4, not 3 + 2."""
    opt, params = _distributed_optimizer(steps=3)
    opt.load_state_dict(opt.state_dict())
    assert _steps(opt) == [3.0, 3.0]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.optimizer.step()
    assert _steps(opt) == [4.0, 4.0]


@pytest.mark.parametrize("loaded_step", [None, 0.0], ids=["fully_reshardable", "dp_reshardable"])
def test_distributed_optimizer_state_load_keeps_the_param_groups_step(core_compat, loaded_step):
    """The per-parameter tensors load into the main param (the model's own leaf in fp32: the copy
    needs no_grad) and Adam's moments; the step stays the param groups' whether the loaded
    tensors lack it (fully_reshardable: KeyError 'step') or bring the template's (0)."""
    opt, params = _distributed_optimizer(steps=2)
    loaded = {"param": torch.full((4,), 5.0), "exp_avg": torch.full((4,), 0.25)}
    loaded["exp_avg_sq"] = torch.full((4,), 0.5)
    if loaded_step is not None:
        loaded["step"] = torch.tensor(loaded_step)
    opt._set_main_param_and_optimizer_states(params[0], loaded)
    state = opt.optimizer.state[params[0]]
    assert params[0].tolist() == [5.0] * 4 and params[0].requires_grad
    assert state["exp_avg"].tolist() == [0.25] * 4 and state["exp_avg_sq"].tolist() == [0.5] * 4
    assert float(state["step"]) == 2.0


# ------------------------------------------------------------------ chained optimizer regroup
class _Recorder:
    """A chained optimizer's member: records the state it is given."""

    def __init__(self):
        self.loaded = None
        self.optimizer = types.SimpleNamespace(param_groups=[])  # for _synchronize_steps

    def load_state_dict(self, state):
        self.loaded = state


def _chained(count: int):
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    chained = ChainedOptimizer.__new__(ChainedOptimizer)
    chained.chained_optimizers = [_Recorder() for _ in range(count)]
    return chained


def _group(lr, step, expert):
    return {"lr": lr, "step": step, "is_expert_parallel": expert}


def test_chained_two_saved_optimizers_load_into_one(core_compat):
    """EP2 -> EP1: the one optimizer gets every saved param group, offered with either
    is_expert_parallel, all at the largest step (the dense-only stage's expert optimizer saved
    0); the common state is entry 0's (integer keys in any order) and the tensors this run's."""
    chained = _chained(1)
    chained.load_state_dict(
        {
            1: {"optimizer": {"param_groups": [_group(2.0, 0, True)]}, "common": "entry 1"},
            0: {"optimizer": {"param_groups": [_group(1.0, 5, False)]}, "common": "entry 0"},
            "param_state": "this run's tensors",
        }
    )
    (loaded,) = [o.loaded for o in chained.chained_optimizers]
    assert loaded == {
        "common": "entry 0",
        "param_state": "this run's tensors",
        "optimizer": {
            "param_groups": [
                _group(1.0, 5, False),
                _group(2.0, 5, True),
                _group(1.0, 5, True),
                _group(2.0, 5, False),
            ]
        },
    }


def test_chained_one_saved_optimizer_loads_into_two(core_compat):
    """EP1 -> EP2: each optimizer gets the saved common state with every group; one without
    parameters on this rank gets no tensor entry from the load, and the groups alone."""
    chained = _chained(2)
    chained.load_state_dict(
        {
            "optimizer": {"param_groups": [_group(1.0, 3, False)]},
            "param_state_sharding_type": "fully_reshardable",
            0: {"param_state": "tensors of optimizer 0"},
        }
    )
    groups = [_group(1.0, 3, False), _group(1.0, 3, True)]
    common = {
        "param_state_sharding_type": "fully_reshardable",
        "optimizer": {"param_groups": groups},
    }
    assert [o.loaded for o in chained.chained_optimizers] == [
        {**common, "param_state": "tensors of optimizer 0"},
        common,
    ]


def test_chained_equal_counts_and_plain_state_go_to_megatron_unchanged(core_compat):
    chained = _chained(2)
    entries = [{"optimizer": {"param_groups": [_group(1.0, 4, e)]}} for e in (False, True)]
    entries[0]["grad_scaler"] = "optimizer 0's"
    chained.load_state_dict({0: entries[0], 1: entries[1]})
    assert [o.loaded for o in chained.chained_optimizers] == entries
    chained = _chained(1)
    entry = {"optimizer": {"param_groups": [_group(1.0, 4, False)]}, "param_state": "tensors"}
    chained.load_state_dict(entry)
    assert chained.chained_optimizers[0].loaded == entry
    # one chained plain optimizer: neither "optimizer" nor integer keys, nothing to regroup
    chained = _chained(1)
    plain = {"state": {"common_step": 2}, "param_groups": [_group(1.0, None, False)]}
    chained.load_state_dict(plain)
    assert chained.chained_optimizers[0].loaded == plain
    # two chained plain optimizers' states into one: not the distributed format, not regrouped
    chained = _chained(1)

    def plain_pair():
        return {
            i: {"state": {"common_step": 2}, "param_groups": [_group(1.0 + i, None, i == 1)]}
            for i in (0, 1)
        }

    chained.load_state_dict(plain_pair())
    assert chained.chained_optimizers[0].loaded == plain_pair()


def test_one_step_for_all_saved_optimizers():
    """Differing distributed-optimizer steps all become the largest; a plain optimizer's entry
    without common_step (no parameters on rank 0) gets the others' (FP32Optimizer's and
    Float16Optimizer's layouts)."""
    saved = [
        {"optimizer": {"param_groups": [_group(1.0, 0, False)]}},
        {"optimizer": {"param_groups": [_group(1.0, 6, True), _group(2.0, None, True)]}},
    ]
    core._one_step(saved)
    assert [g["step"] for e in saved for g in e["optimizer"]["param_groups"]] == [6, 6, None]
    saved = [{"optimizer": {"state": {"common_step": 9}}}, {"state": {}, "param_groups": []}]
    core._one_step(saved)
    assert [saved[0]["optimizer"]["state"], saved[1]["state"]] == [{"common_step": 9}] * 2


# ------------------------------------------------------------------ LR / weight-decay scheduler
def _scheduler(weight_decay: float, **flags):
    """An OptimizerParamScheduler over a decayed param group and a no-decay one (``wd_mult``
    0), weight decay ``weight_decay`` throughout, cosine LR over 40 samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}]
    return OptimizerParamScheduler(
        types.SimpleNamespace(param_groups=groups),
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=2,
        lr_decay_steps=40,
        lr_decay_style="cosine",
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=40,
        wd_incr_style="constant",
        **flags,
    )


def _set(scheduler, key: str) -> list[float]:
    return [g[key] for g in scheduler.optimizer.param_groups]


def test_scheduler_load_sets_the_checkpoints_weight_decay(core_compat):
    """--use-checkpoint-opt_param-scheduler with another weight decay than the checkpoint's:
    right after the load (before the resumed run's first optimizer step) the param groups carry
    the checkpoint's weight decay and the LR of its step (megatron-core 0.19.2 left this run's
    weight decay there for that step); with --override-opt_param-scheduler, this run's."""
    saving = _scheduler(0.01)
    saving.step(increment=16)
    resumed = _scheduler(0.1, use_checkpoint_opt_param_scheduler=True)
    resumed.load_state_dict(saving.state_dict())
    assert _set(resumed, "weight_decay") == [0.01, 0.0]
    assert _set(resumed, "lr") == _set(saving, "lr")
    overridden = _scheduler(
        0.1, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True
    )
    overridden.load_state_dict(saving.state_dict())
    assert _set(overridden, "weight_decay") == [0.1, 0.0]
    assert _set(overridden, "lr") == _set(saving, "lr")
