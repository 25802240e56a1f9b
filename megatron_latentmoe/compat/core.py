"""megatron-core 0.19.2 walls met on every device (CPU and GPU), one named shim per wall.

:func:`apply_core_compat` installs them through :mod:`.registry` (version-checked, revertible,
idempotent). It is applied by :func:`.cpu.apply_cpu_compat`, by the training entry point and by
the local spec (:mod:`megatron_latentmoe.specs`), whose norm needs the first shim.
"""

from __future__ import annotations

import copy
import os

from . import registry

GROUP = "core"


def _shim_torch_norm_sequence_parallel() -> None:
    """Let Megatron's torch norm run with sequence parallelism and megatron.training's defaults.

    ``transformer/torch_norm.WrappedTorchNorm`` (the local spec's norm without apex, and what
    ``LocalSpecProvider.layer_norm(rms_norm=True)`` always returns) asserts
    ``not config.sequence_parallel``, yet MoE with TP>1 requires sequence parallelism. The norm
    is per-token, so it is SP-safe once its weights carry ``sequence_parallel=True`` like
    Megatron's fused/TE norms: ``finalize_model_grads`` then all-reduces their grads over the TP
    group. It also asserts ``not config.persist_layer_norm``, which megatron.training turns on
    unless ``--no-persist-layer-norm``: a choice of apex kernel, meaningless for a torch norm.
    ``torch.nn.RMSNorm`` computes in fp32 for bf16 inputs (measured: bit-identical to an explicit
    fp32 ``x * rsqrt(mean(x^2) + eps) * w`` in fp32 and bf16, hidden 512).
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel or config.persist_layer_norm:
            config = copy.copy(config)
            config.sequence_parallel = config.persist_layer_norm = False
        norm = original(cls, config, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    registry.patch(GROUP, WrappedTorchNorm, "__new__", staticmethod(__new__))


def _shim_dataset_helpers() -> None:
    """Use the dataset helpers the megatron-core wheel ships compiled.

    ``megatron.training.initialize`` calls ``datasets.utils.compile_helpers()``, which runs
    ``make`` in the installed package; the wheel has no Makefile (but has the compiled
    ``helpers_cpp``), so ``make`` fails and Megatron calls ``sys.exit(1)``. Without a Makefile,
    ``compile_helpers`` becomes a check that the compiled extension imports (a clear error if
    not); a source checkout (Makefile present) keeps Megatron's build. ``GPTDataset`` itself
    never compiles: it imports ``megatron.core.datasets.helpers`` directly.
    """
    import importlib

    import megatron.core.datasets.utils as dutils

    if os.path.isfile(os.path.join(os.path.dirname(dutils.__file__), "Makefile")):
        return

    def compile_helpers() -> None:
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError as e:
            raise RuntimeError(
                "megatron.core.datasets.helpers_cpp (Megatron's compiled dataset helpers) is "
                "missing from this megatron-core install; reinstall the megatron-core wheel"
            ) from e

    registry.patch(GROUP, dutils, "compile_helpers", compile_helpers)


def _shim_distributed_optimizer_torch_adam_step() -> None:
    """Resume ``--use-distributed-optimizer`` with torch's Adam (no apex/TE), exactly.

    ``optimizer/distrib_optimizer.DistributedOptimizer`` keeps Adam's step in the param groups
    of its checkpoint; without apex/TE its inner ``torch.optim.Adam`` keeps one per parameter.
    The translation has three walls on loading a checkpoint, each met by the kill-and-resume test:

    * ``state_dict`` reads the step from the per-parameter state (``assert len(steps) == 1``).
      Torch creates that state at its first step, and loading calls ``state_dict()`` on the
      fresh optimizer first (``sharded_state_dict(is_loading=True)`` builds its template from
      it): no state, no step, AssertionError. A fresh optimizer now shows one step-0 entry,
      which Megatron reads as the template's step and drops; the checkpoint brings the real one.
      "Fresh" means no parameter has a step yet, not an empty state: saving reads each
      parameter's state through ``optimizer.state[param]``, a defaultdict that leaves an empty
      entry behind, so an ``--fp16`` run whose steps were all skipped by the loss scaler
      (2**32 at start, halved per overflow) failed its SECOND save with KeyError ``'step'``.
    * ``load_state_dict`` then puts ONE step tensor into every parameter's state; torch's Adam
      increments it in place once per parameter, so after a resume the step (and the bias
      correction) ran ahead by the number of parameters per iteration. Each parameter now gets
      its own copy.
    * ``_set_main_param_and_optimizer_states`` copies every tensor of a parameter's state from
      the loaded one. The ``fully_reshardable`` loader leaves ``step`` out of it (it comes from
      the param groups): KeyError ``'step'``; the ``dp_reshardable`` one (Megatron's default
      format) brings the load template's step, 0 or garbage, over the param groups' real one:
      the resumed Adam restarts its bias correction. The step now always stays the param
      groups'. The ``dp_reshardable`` loader also lacks its siblings' ``torch.no_grad``: in fp32
      the main param is the model's own, and the copy into it raised "a view of a leaf Variable
      that requires grad"; the copies now run under ``no_grad`` (on GPUs too).

    With apex/TE (GPU images) the first two take Megatron's other branch and the third never
    meets a ``step`` key, so the patches change nothing there but the ``no_grad``.
    """
    import torch
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    state_dict, load_state_dict = cls.state_dict, cls.load_state_dict
    set_states = cls._set_main_param_and_optimizer_states

    def fresh_state_dict(self):
        inner = self.optimizer
        if distrib_optimizer.HAVE_APEX_OR_TE or any("step" in s for s in inner.state.values()):
            return state_dict(self)
        fresh = type(inner).state_dict(inner)
        inner.state_dict = lambda: {**fresh, "state": {0: {"step": torch.tensor(0.0)}}}
        try:
            return state_dict(self)
        finally:
            del inner.state_dict

    def load_with_own_steps(self, state):
        load_state_dict(self, state)
        for param_state in self.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()

    def set_states_without_step(self, model_param, tensors):
        with torch.no_grad():  # fp32: the main param is the model's, a leaf that requires grad
            set_states(self, model_param, {**tensors, "step": None})  # None: not copied

    registry.patch(GROUP, cls, "state_dict", fresh_state_dict)
    registry.patch(GROUP, cls, "load_state_dict", load_with_own_steps)
    registry.patch(GROUP, cls, "_set_main_param_and_optimizer_states", set_states_without_step)


def _shim_chained_optimizer_regroup() -> None:
    """Load a distributed optimizer's state saved with another number of chained optimizers.

    ``optimizer/__init__.get_megatron_optimizer`` gives expert parameters their own optimizer
    only when they are expert-parallel (EP > 1 or expert-TP != TP), and
    ``ChainedOptimizer.load_state_dict`` expects the checkpoint's non-tensor optimizer state
    (param groups with step, LR, weight decay) in as many entries as it has optimizers: EP2 ->
    EP1 (e.g. TP2+SP or PP2 on 2 ranks) fails with KeyError ``'optimizer'``, EP1 -> EP2 with
    "Expected 2 entries". In the ``fully_reshardable`` format every tensor of the state is keyed
    by its model parameter (Megatron loads those for this run's layout), so only the param groups
    need regrouping: each optimizer of this run gets all saved groups, offered with either
    ``is_expert_parallel`` (a layout fact, not a hyper-parameter); ``DistributedOptimizer``
    picks its own by its groups' identifiers. Equal counts go to Megatron unchanged. An
    optimizer with no parameter on this rank (the expert one of a pipeline stage that holds only
    dense layers, e.g. ``--decoder-first-pipeline-num-layers`` with ``--first-k-dense-replace``)
    gets no tensor entry from the load (KeyError before): it gets the param groups alone.

    Such an optimizer also never steps, and without apex/TE it saves Adam's step as 0 (the fresh
    optimizer's, :func:`_shim_distributed_optimizer_torch_adam_step`); the checkpoint's param
    groups are rank 0's, so a checkpoint whose first stage holds only dense layers carried
    steps 0 and N, and every load of it failed (``assert len(steps) == 1``, or ``steps: [0.0,
    N]`` in ``_synchronize_steps``). Megatron keeps the chained optimizers' steps equal
    (``_synchronize_steps`` asserts it when saving), so the saved groups all get the largest.
    The plain optimizer saves one ``common_step`` per optimizer, none for one without
    parameters: the other stage's expert optimizer then loaded its moments without a step
    (KeyError ``'step'`` in torch's Adam); it gets the other optimizers' step.
    """
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    original = ChainedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        count = len(self.chained_optimizers)
        saved = (
            [state_dict]
            if "optimizer" in state_dict
            else [state_dict[k] for k in sorted(k for k in state_dict if isinstance(k, int))]
        )
        _one_step(saved)
        # nothing to regroup: no entries (the plain optimizer's state of one chained optimizer
        # has neither "optimizer" nor integer keys), equal counts, or another format
        if not saved or len(saved) == count or not all("optimizer" in e for e in saved):
            return original(self, state_dict)
        groups = [g for entry in saved for g in entry["optimizer"]["param_groups"]]
        groups += [{**g, "is_expert_parallel": not g.get("is_expert_parallel")} for g in groups]
        common = {k: v for k, v in saved[0].items() if not isinstance(k, int)}
        common["optimizer"] = {**saved[0]["optimizer"], "param_groups": groups}
        if count == 1:  # this run's tensors are the dict's non-integer keys
            mine = {k: v for k, v in state_dict.items() if not isinstance(k, int)}
            return original(self, {**common, **mine, "optimizer": common["optimizer"]})
        return original(self, {i: {**common, **state_dict.get(i, {})} for i in range(count)})

    registry.patch(GROUP, ChainedOptimizer, "load_state_dict", load_state_dict)


def _one_step(saved: list[dict]) -> None:
    """One Adam step for all the saved chained optimizers' entries (in place): the distributed
    optimizer's param groups whose numeric steps differ get the largest; the plain optimizer's
    entries without a ``common_step`` (the one step Megatron saves for all of an optimizer's
    parameters; none for an optimizer without parameters on rank 0, which writes the common
    state) get the others'."""
    groups = [
        g
        for e in saved
        if isinstance(e.get("optimizer"), dict)
        for g in e["optimizer"].get("param_groups", [])
    ]
    steps = {g["step"] for g in groups if isinstance(g.get("step"), (int, float))}
    if len(steps) > 1:
        for g in groups:
            if isinstance(g.get("step"), (int, float)):
                g["step"] = max(steps)
    # FP32Optimizer: {"state", "param_groups"}; Float16Optimizer: {"optimizer": {"state", ...}}
    states = [e["optimizer"] if isinstance(e.get("optimizer"), dict) else e for e in saved]
    states = [s["state"] for s in states if isinstance(s.get("state"), dict)]
    common = [s["common_step"] for s in states if "common_step" in s]
    if common:
        for state in states:
            state.setdefault("common_step", common[0])


def _shim_scheduler_load_sets_the_restored_weight_decay() -> None:
    """A resume with ``--use-checkpoint-opt_param-scheduler`` steps with the checkpoint's weight
    decay from its first iteration.

    ``OptimizerParamScheduler.load_state_dict`` restores the LR schedule, then steps the
    optimizer's param groups to the checkpoint's step (setting their LR and weight decay), and
    restores the weight-decay schedule (``start_wd``, ``end_wd``, ``wd_incr_steps``,
    ``wd_incr_style``) only after that. With ``--use-checkpoint-opt_param-scheduler`` and another
    ``--weight-decay`` (or ``--start-weight-decay``, ``--end-weight-decay``,
    ``--weight-decay-incr-style``) than the checkpoint's, the first optimizer step of the resumed
    run applied this run's weight decay and the next ones the checkpoint's (``train_step`` steps
    the optimizer before the scheduler). Proposed upstream after 0.19.2 (NVIDIA/Megatron-LM PR
    7468, open: step after restoring everything). Here the param groups are set once more from
    the restored schedule (a step of 0); where the restored values are this run's (the
    checkpoint's equal them, or ``--override-opt_param-scheduler``) that sets what the load set.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    original = OptimizerParamScheduler.load_state_dict

    def load_state_dict(self, state_dict):
        original(self, state_dict)
        self.step(increment=0)

    registry.patch(GROUP, OptimizerParamScheduler, "load_state_dict", load_state_dict)


def _shim_aux_loss_local_token_count() -> None:
    """The aux losses' local token count stays this rank's where padding is masked.

    ``moe_utils.get_tokens_per_expert_and_token_count`` (what ``TopKRouter``'s ``aux_loss``,
    ``seq_aux_loss`` and ``global_aux_loss`` call) all-reduces the per-expert counts over the
    loss's group (TP x CP; TP x DP x CP for ``global_aux_loss``) with Megatron's in-place
    all-reduce, and then, with a padding mask (our ``forward_step`` passes one where a
    micro-batch has masked tokens), takes the local token count from the reduced counts: the
    group's count. ``--calculate-per-token-loss`` scales the aux loss by that local count
    (``attach_and_log_load_balancing_loss``): its gradient was the group size times too large
    (reported upstream after 0.19.2: NVIDIA/Megatron-LM#7452, "router local count
    overwritten"). The loss itself takes the global counts and is unchanged; without a padding
    mask the local count is the routing map's rows, as before. Here the local count is taken
    from the routing map itself.
    """
    from megatron.core.transformer.moe import router

    original = router.get_tokens_per_expert_and_token_count

    def get_tokens_per_expert_and_token_count(
        routing_map, reduce_group, topk=None, with_padding_mask=False
    ):
        global_tokens_per_expert, local_num_tokens, total_num_tokens = original(
            routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask
        )
        if with_padding_mask:
            local_num_tokens = routing_map.sum() / topk
        return global_tokens_per_expert, local_num_tokens, total_num_tokens

    registry.patch(
        GROUP,
        router,
        "get_tokens_per_expert_and_token_count",
        get_tokens_per_expert_and_token_count,
    )


_SHIMS = (
    _shim_torch_norm_sequence_parallel,
    _shim_dataset_helpers,
    _shim_distributed_optimizer_torch_adam_step,
    _shim_chained_optimizer_regroup,
    _shim_scheduler_load_sets_the_restored_weight_decay,
    _shim_aux_loss_local_token_count,
)


def apply_core_compat() -> bool:
    """Install the shims of this module (idempotent; False if they already were)."""
    return registry.apply_group(GROUP, _SHIMS)
