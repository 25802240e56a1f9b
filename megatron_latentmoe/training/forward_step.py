"""Batches, loss and datasets for Megatron's training loop (the roles of Megatron-LM's
pretrain_gpt).

* :func:`train_valid_test_datasets_provider` builds Megatron ``GPTDataset``s (blends, splits,
  per-split paths; ``--mock-data``) on every rank (``is_distributed``): each rank reads its own
  micro-batches, so every pipeline stage -- not only the first -- gets the loss mask it needs
  for the padding mask below, and no tensor-parallel broadcast is needed.
* :func:`get_batch` gives each context-parallel rank its share of every sequence, as
  Megatron-LM's pretrain_gpt does.
* :func:`forward_step` runs the model with ``padding_mask = (loss_mask == 0)``: tokens whose
  loss is masked (padding, and EOD with ``--eod-mask-loss``) are not observed by Quantile
  Balancing and not counted in the expert loads (the router's convention: True = padding). A
  micro-batch without masked tokens passes ``padding_mask=None`` (the same routing, decided on
  the loader's host tensor: no device sync), which Megatron's own ``quantile_balancing`` needs.
* :func:`forward_only_pass` runs given micro-batches forward through a training step's own
  schedule (QB rescoring and QB calibration).
* :func:`loss_func` returns Megatron's ``(loss sum, token count, {"lm loss": [sum, count]})``
  and feeds the same pair to the balance logger for the per-iteration JSONL.
"""

from __future__ import annotations

import inspect
import json
from functools import partial

import torch

_BALANCE_LOGGER = None


_BATCH_RECORDER = None


_VOCABULARY = None
_DATA = "the data"


class OutOfVocabularyError(ValueError):
    """A micro-batch holds a token id outside the run's vocabulary; the message is the line
    the entry point prints (exit 2)."""


def set_balance_logger(logger) -> None:
    """The :class:`.balance_logging.BalanceLogger` that receives training losses (None: none)."""
    global _BALANCE_LOGGER
    _BALANCE_LOGGER = logger


def set_batch_recorder(recorder) -> None:
    """The :class:`~megatron_latentmoe.training.qb_rescore.QBRescore` that records the training
    forward's micro-batches (None: none)."""
    global _BATCH_RECORDER
    _BATCH_RECORDER = recorder


def set_vocabulary(vocabulary, data: str = "the data") -> None:
    """The :class:`~megatron_latentmoe.data.index_file.Vocabulary` whose ids every micro-batch
    must hold (None: not checked), and how a refusal names the data (``data``: its flags)."""
    global _VOCABULARY, _DATA
    _VOCABULARY, _DATA = vocabulary, data


# ------------------------------------------------------------------------------------ data
def gpt_dataset_config_from_args(args, tokenizer):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    # config field <- args attribute, as Megatron-LM's pretrain_gpt passes them
    optional = {
        name: name
        for name in (
            "multiple_validation_sets",
            "full_validation",
            "num_dataset_builder_threads",
            "mmap_bin_files",
            "mid_level_dataset_surplus",
            "allow_ambiguous_pad_tokens",
            "object_storage_cache_path",
        )
    }
    optional.update(
        fast_cache_load="dataloader_fast_cache_load",
        defer_npy_index_mmap="dataloader_defer_npy_index_mmap",
    )
    sequences_per_dataset = None
    if getattr(args, "per_dataset_sequences_path", None) is not None:
        with open(args.per_dataset_sequences_path) as f:
            sequences_per_dataset = json.load(f)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        sequences_per_dataset=sequences_per_dataset,
        **{field: getattr(args, name) for field, name in optional.items() if hasattr(args, name)},
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's datasets provider: GPT datasets from ``--data-path`` (or mock data)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0

    from megatron_latentmoe.training.data_args import data_description, run_vocabulary

    args = get_args()
    tokenizer = get_tokenizer()
    config = gpt_dataset_config_from_args(args, tokenizer)
    # the ids every micro-batch of these datasets may hold (get_batch)
    set_vocabulary(run_vocabulary(args, tokenizer), data_description(args))
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets ({dataset_type.__name__}) ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


# Every rank builds its own loaders (and reads its own micro-batches).
train_valid_test_datasets_provider.is_distributed = True


# ------------------------------------------------------------------------------------ batch
def get_batch(batch, *, pre_process: bool, config=None):
    """This rank's micro-batch (the loader's dict) on its device, plus the router padding mask
    (True = padding)."""
    from megatron.core import parallel_state

    if _VOCABULARY is not None:
        _check_token_ids(batch)
    batch = _on_this_cp_rank(batch)
    # Decided on the loader's (host) tensor: no device sync. None == an all-False mask.
    has_padding = bool((batch["loss_mask"] == 0).any())
    from megatron_latentmoe.moe.router import megatron_device

    device = megatron_device()
    tokens = batch["tokens"].to(device, non_blocking=True).long()
    labels = batch["labels"].to(device, non_blocking=True).long()
    loss_mask = batch["loss_mask"].to(device, non_blocking=True).float()
    position_ids = batch["position_ids"].to(device, non_blocking=True).long()
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device, non_blocking=True)
    padding_mask = (loss_mask == 0) if has_padding else None
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if (
        has_padding
        and not pre_process
        and config is not None
        and config.sequence_parallel
        and tp > 1
    ):
        # GPTModel scatters the padding mask to this rank's sequence chunk only on the first
        # pipeline stage (with the embedding); later stages receive hidden states that are
        # already split, so split the mask the same way here.
        seq = padding_mask.shape[1]
        chunk = seq // tp
        rank = parallel_state.get_tensor_model_parallel_rank()
        padding_mask = padding_mask[:, rank * chunk : (rank + 1) * chunk].contiguous()
    return tokens, labels, loss_mask, attention_mask, position_ids, padding_mask


def _check_token_ids(batch) -> None:
    """Refuse a micro-batch holding a token id outside the run's vocabulary (the flag check
    reads only the head of each ``.bin``): :class:`OutOfVocabularyError`, where the embedding
    would raise ``IndexError: index out of range in self`` (or train its padding rows, or the
    loss read a label past the logits). One max over the loader's host tensors (tokens and
    labels): no device sync."""
    largest = int(torch.maximum(batch["tokens"].max(), batch["labels"].max()))
    refusal = _VOCABULARY.refusal(f"a micro-batch of {_DATA}", largest)
    if refusal:
        raise OutOfVocabularyError(refusal)


CP_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def _on_this_cp_rank(batch):
    """This context-parallel rank's share of every sequence of the micro-batch (Megatron's
    zigzag split, ``get_batch_on_this_cp_rank``, as Megatron-LM's pretrain_gpt takes it): the
    attention, the router and the loss of a CP rank see its own tokens only. A new dict (the
    loader's, which QB rescoring records, stays whole); with CP 1, the batch itself."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(
        {key: batch.get(key) for key in CP_BATCH_KEYS},
        is_hybrid_cp=False,
        cp_group=parallel_state.get_context_parallel_group(),
    )


# ------------------------------------------------------------------------------------ loss
def loss_func(
    loss_mask: torch.Tensor,
    output_tensor: torch.Tensor,
    *,
    training: bool = True,
    check_nan: bool = False,
    check_spiky: bool = False,
):
    """Sum of token losses over unmasked tokens, their count, and the report pair. As Megatron-LM's
    pretrain_gpt: ``check_nan`` (``--check-for-nan-in-loss-and-grad``, on by default) stops the
    run on a NaN or Inf local loss, ``check_spiky`` (``--check-for-spiky-loss``) warns on a loss
    10x the largest seen, through Megatron's rerun state machine (with ``--rerun-mode disabled``,
    CPU runs' default, it checks and raises / warns without rerunning)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).to(loss.dtype)])
    if check_nan or check_spiky:
        _validate_loss(loss, check_nan, check_spiky)
    if training and _BALANCE_LOGGER is not None:
        _BALANCE_LOGGER.add_loss(report)
    return loss, num_tokens, {"lm loss": report}


SPIKY_LOSS_FACTOR = 10
"""A loss this many times the largest seen is spiky (Megatron-LM's pretrain_gpt value)."""


def _validate_loss(loss: torch.Tensor, check_nan: bool, check_spiky: bool) -> None:
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    # a copy: the machine keeps a rejected result to compare the re-run's with, and Megatron's
    # schedule divides the returned loss in place (by its tokens and the micro-batches)
    loss = loss.detach().clone()
    if check_nan:
        for reject, name in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {name} in local forward loss calculation",
                tolerance=0.0,  # forward pass calculations are deterministic
                fatal=True,
            )
    if check_spiky:
        machine.validate_result(
            result=loss,
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron forward step: one micro-batch through the model, and its loss function.

    ``return_schedule_plan`` (Megatron's combined 1F1B schedule) is refused: the flag that asks
    for it, ``--overlap-moe-expert-parallel-comm``, is refused with the other flags."""
    if return_schedule_plan:
        raise NotImplementedError(
            "forward_step(return_schedule_plan=True): Megatron's combined 1F1B schedule plan is "
            "not supported; run without --overlap-moe-expert-parallel-comm"
        )
    from megatron.core.utils import get_attr_wrapped_model, get_model_config
    from megatron.training import get_args, get_timers

    args = get_args()
    timers = get_timers()
    config = get_model_config(model)
    pre_process = get_attr_wrapped_model(model, "pre_process")
    # not training: evaluation, and QB's rescoring pass (training mode under no_grad)
    training = model.training and torch.is_grad_enabled()
    if training and _BALANCE_LOGGER is not None:
        _BALANCE_LOGGER.mark_forward()

    timers("batch-generator", log_level=2).start()
    batch = next(data_iterator)
    if training and _BATCH_RECORDER is not None:
        _BATCH_RECORDER.record(data_iterator, batch)
    tokens, labels, loss_mask, attention_mask, position_ids, padding_mask = get_batch(
        batch, pre_process=pre_process, config=config
    )
    timers("batch-generator").stop()

    output_tensor = model(
        tokens,
        position_ids,
        attention_mask,
        labels=labels,
        loss_mask=loss_mask,
        padding_mask=padding_mask,
    )
    checks = dict(
        check_nan=bool(getattr(args, "check_for_nan_in_loss_and_grad", False)),
        check_spiky=bool(getattr(args, "check_for_spiky_loss", False)),
    )
    return output_tensor, partial(loss_func, loss_mask, training=training, **checks)


TRAIN_STEP_ARGS = (
    "forward_step_func",
    "data_iterator",
    "model",
    "config",
    "forward_backward_func",
    "iteration",
)
"""What a wrapped ``train_step`` must take by these names (megatron.training's ``train_step``
does): the rescoring pass and the calibration read them from each call."""


def train_step_signature(train_step, wrapper: str) -> inspect.Signature:
    """``train_step``'s signature, refused at wrap time (not after a step) without
    :data:`TRAIN_STEP_ARGS`."""
    signature = inspect.signature(train_step)
    missing = [name for name in TRAIN_STEP_ARGS if name not in signature.parameters]
    if missing:
        name = getattr(train_step, "__qualname__", repr(train_step))
        raise TypeError(
            f"{wrapper}: {name}{signature} is not allowed: a train step taking megatron.training "
            f"train_step's arguments by name ({', '.join(TRAIN_STEP_ARGS)}); missing "
            f"{', '.join(missing)}"
        )
    return signature


def forward_only_pass(call: dict, data_iterator, num_microbatches: int, schedule: dict) -> None:
    """One forward-only pass of ``data_iterator``'s micro-batches through the schedule of a
    ``train_step`` call (``call``: its arguments by name): pipeline and token dispatchers as in
    Megatron's ``evaluate()``, timers off; the caller decides ``no_grad``. ``schedule``: the
    ``seq_length``, ``micro_batch_size`` and ``decoder_seq_length`` of the run.

    As in ``evaluate()``, Megatron's rerun state machine is disabled during the pass: the pass
    runs outside ``train_step``'s rerun loop, where ``validate_result`` (the loss checks) in
    ``validate_results`` mode asserts; disabled, it still stops on a NaN / Inf loss."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    config = call["config"]
    machine = get_rerun_state_machine()
    # ``.mode``, not set_mode(): that logs a warning, here once per rescored step
    mode, machine.mode = machine.mode, RerunMode.DISABLED
    timers, config.timers = config.timers, None  # as Megatron's evaluate(): not timed
    try:
        call["forward_backward_func"](
            forward_step_func=call["forward_step_func"],
            data_iterator=data_iterator,
            model=call["model"],
            num_microbatches=num_microbatches,
            forward_only=True,
            **schedule,
            **{k: call[k] for k in ("pg_collection", "p2p_communicator") if k in call},
        )
    finally:
        config.timers = timers
        machine.mode = mode
