"""The entry point's batch (``training/forward_step.get_batch``) under context and sequence
parallelism, its loss function, forward step and forward-only pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core import parallel_state

from megatron_latentmoe.training import forward_step as fs
from megatron_latentmoe.training.forward_step import get_batch


def _batch(seq: int = 8) -> dict:
    positions = torch.arange(seq).repeat(2, 1)  # micro-batch 2
    loss_mask = torch.ones(2, seq)
    loss_mask[1, -1] = 0  # one loss-masked token: the last of sequence 1 (CP rank 0's share)
    return {
        "tokens": positions + 100,
        "labels": positions + 200,
        "loss_mask": loss_mask,
        "attention_mask": torch.tril(torch.ones(seq, seq)).lt(0.5).expand(2, 1, seq, seq),
        "position_ids": positions,
    }


@pytest.mark.parametrize("cp_rank, positions", [(0, [0, 1, 6, 7]), (1, [2, 3, 4, 5])])
def test_each_context_parallel_rank_gets_its_zigzag_share(monkeypatch, cp_rank, positions):
    """CP 2: sequence chunks (0, 3) to rank 0 and (1, 2) to rank 1, as Megatron-LM's pretrain_gpt
    splits them; without the split every CP rank ran the whole sequence (attention, router and
    loss all on the same tokens twice)."""
    group = object()
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda: group)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda g=None: cp_rank)
    batch = _batch()
    tokens, labels, loss_mask, attention_mask, position_ids, padding = get_batch(
        batch, pre_process=True
    )
    expected = torch.tensor(positions).repeat(2, 1)
    assert torch.equal(position_ids, expected)
    assert torch.equal(tokens, expected + 100)
    assert torch.equal(labels, expected + 200)
    assert attention_mask.shape == (2, 1, 4, 8)  # this rank's queries, every key
    assert torch.equal(attention_mask[0, 0], _batch()["attention_mask"][0, 0, positions])
    if cp_rank == 0:
        assert padding is not None and padding.tolist() == [[False] * 4, [False] * 3 + [True]]
    else:
        assert padding is None and loss_mask.eq(1).all()
    assert batch["tokens"].shape == (2, 8)  # the loader's batch stays whole


def test_without_context_parallelism_the_batch_is_whole(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    tokens, *_, padding = get_batch(_batch(), pre_process=True)
    assert torch.equal(tokens, _batch()["tokens"]) and padding[1, -1] and padding.sum() == 1


@pytest.mark.parametrize("key", ["tokens", "labels"])
def test_a_batch_with_an_id_outside_the_vocabulary_is_refused(monkeypatch, key):
    """Every micro-batch's largest id (tokens and labels, on the loader's host tensors, before
    the CP split) is checked against the run's vocabulary: one line naming the id, the
    tokenizer and what is allowed, where the embedding raised an IndexError traceback (a label
    out of range: a loss of a logit that is not there)."""
    from megatron_latentmoe.data.index_file import Vocabulary

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(fs, "_VOCABULARY", None)  # both restored after the test
    monkeypatch.setattr(fs, "_DATA", fs._DATA)
    vocabulary = Vocabulary(300, 384, "HuggingFaceTokenizer /tok", "Remake it.")
    fs.set_vocabulary(vocabulary, "--data-path /data/corpus")
    get_batch(_batch(), pre_process=True)  # ids up to 207
    batch = _batch()
    batch[key][1, 3] = 300
    with pytest.raises(fs.OutOfVocabularyError) as err:
        get_batch(batch, pre_process=True)
    assert str(err.value) == (
        "a micro-batch of --data-path /data/corpus holds token id 300, but this run's tokenizer "
        "(HuggingFaceTokenizer /tok) has 300 ids (allowed: 0..299; the embedding's rows "
        "300..383 are padding): the dataset was made with another tokenizer. Remake it."
    )
    # CP 2: the id sits in CP rank 1's share (position 3); rank 0 refuses the batch alike
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda: object())
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda g=None: 0)
    with pytest.raises(fs.OutOfVocabularyError, match="holds token id 300"):
        get_batch(batch, pre_process=True)
    fs.set_vocabulary(None)
    get_batch(batch, pre_process=True)  # not checked


def test_dataset_config_carries_megatrons_validation_and_loader_flags(tmp_path, monkeypatch):
    """The GPT dataset config gets the data flags that Megatron-LM's pretrain_gpt passes on.
    ``--multiple-validation-sets`` was dropped: with ``--full-validation`` the validation
    prefixes were blended into one set and evaluated as one ("validation-0" only)."""
    import json
    import sys
    import types
    import warnings

    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import parse_args

    from megatron_latentmoe.training.forward_step import gpt_dataset_config_from_args

    counts = tmp_path / "sequences.json"
    counts.write_text(json.dumps({"/d/a": [10, 10], "/d/b": [20, 20], "/d/t": [5, 5]}))
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    flags += ["--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1"]
    flags += ["--train-data-path", "/d/t", "--valid-data-path", "/d/a", "/d/b"]
    flags += ["--multiple-validation-sets", "--full-validation", "--dataloader-fast-cache-load"]
    flags += ["--dataloader-defer-npy-index-mmap", "--per-dataset-sequences-path", str(counts)]
    flags += ["--data-cache-path", str(tmp_path / "cache")]
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags])
    args = parse_args()
    tokenizer = types.SimpleNamespace(vocab_size=4096)
    config = gpt_dataset_config_from_args(args, tokenizer)
    assert config.blend_per_split[1] == (["/d/a", "/d/b"], None)
    assert config.multiple_validation_sets is True
    assert config.full_validation is True
    assert config.fast_cache_load is True
    assert config.defer_npy_index_mmap is True
    assert config.sequences_per_dataset == {"/d/a": [10, 10], "/d/b": [20, 20], "/d/t": [5, 5]}
    assert config.sequence_length == 64 and config.path_to_cache == str(tmp_path / "cache")
    args.per_dataset_sequences_path = None  # the flag's default: counted when loading
    assert gpt_dataset_config_from_args(args, tokenizer).sequences_per_dataset is None


def test_dataset_config_carries_the_loss_mask_split_and_seed_flags(monkeypatch):
    """The GPT dataset config gets ``--eod-mask-loss`` (the EOD tokens' loss mask, hence the
    router's padding mask), the position / attention resets, ``--split``, ``--seed`` and
    ``--no-create-attention-mask-in-dataloader`` as given: each was a flag the datasets would
    silently not see if dropped (all differ from Megatron's defaults here)."""
    import sys
    import types
    import warnings

    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import parse_args

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    flags += ["--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1"]
    flags += ["--data-path", "0.25", "/d/a", "0.75", "/d/b", "--split", "90,10,0", "--seed", "7"]
    flags += ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]
    flags += ["--no-create-attention-mask-in-dataloader"]
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags])
    args = parse_args()
    config = fs.gpt_dataset_config_from_args(args, types.SimpleNamespace(vocab_size=4096))
    assert config.blend == (["/d/a", "/d/b"], [0.25, 0.75]) and config.blend_per_split is None
    assert config.split == "90,10,0" and config.random_seed == 7
    assert config.eod_mask_loss is True
    assert config.reset_position_ids is True and config.reset_attention_mask is True
    assert config.create_attention_mask is False


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize(
    "pre_process, sequence_parallel", [(False, True), (True, True), (False, False)]
)
def test_a_later_pipeline_stage_splits_the_padding_mask_as_sequence_parallelism(
    monkeypatch, tp_rank, pre_process, sequence_parallel
):
    """TP 2 with sequence parallelism: GPTModel scatters the padding mask with the embedding (the
    first stage); a later stage gets this rank's half of the sequence (rank 0: positions 0-3,
    rank 1: 4-7, the masked token's)."""
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp_rank)
    config = SimpleNamespace(sequence_parallel=sequence_parallel)
    tokens, labels, loss_mask, _, position_ids, padding = get_batch(
        _batch(), pre_process=pre_process, config=config
    )
    assert tokens.shape == labels.shape == loss_mask.shape == position_ids.shape == (2, 8)
    if sequence_parallel and not pre_process:
        want = [[False] * 4, [False] * 4 if tp_rank == 0 else [False] * 3 + [True]]
    else:
        want = [[False] * 8, [False] * 7 + [True]]
    assert padding.tolist() == want


def test_the_batch_goes_to_the_models_dtypes(monkeypatch):
    """Token ids as int64, the loss mask as float (loaders may hand int32 ids, a bool mask)."""
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    batch = _batch()
    batch["tokens"] = batch["tokens"].int()
    batch["labels"] = batch["labels"].int()
    batch["position_ids"] = batch["position_ids"].int()
    batch["loss_mask"] = batch["loss_mask"].bool()
    del batch["attention_mask"]  # optional: causal attention without a mask
    tokens, labels, loss_mask, attention_mask, position_ids, padding = get_batch(
        batch, pre_process=True
    )
    assert tokens.dtype == labels.dtype == position_ids.dtype == torch.int64
    assert loss_mask.dtype == torch.float32 and loss_mask.sum() == 15
    assert attention_mask is None and padding.sum() == 1


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_loss_func_sums_the_unmasked_token_losses_and_reports_them(monkeypatch):
    logger = _Recorder()
    monkeypatch.setattr(fs, "_BALANCE_LOGGER", None)  # restored after the test
    fs.set_balance_logger(logger)
    losses = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    loss, num_tokens, report = fs.loss_func(mask, losses)
    assert loss.dtype == torch.float32 and loss.item() == 29.0 and loss.requires_grad
    assert num_tokens.dtype == torch.int32 and num_tokens.item() == 4
    (pair,) = report.values()
    assert list(report) == ["lm loss"] and pair.tolist() == [29.0, 4.0]
    assert pair.dtype == torch.float32 and not pair.requires_grad
    ((name, (fed,), _),) = logger.calls
    assert name == "add_loss" and fed.tolist() == [29.0, 4.0]
    fs.loss_func(mask, losses, training=False)  # evaluation, rescoring: not a training loss
    assert len(logger.calls) == 1


def test_loss_func_checks_the_loss_for_nan_only_when_asked(monkeypatch):
    """As Megatron-LM's pretrain_gpt: NaN, then Inf (fatal); the spiky-loss check (a warning)."""
    from megatron.core import rerun_state_machine

    machine = _Recorder()
    monkeypatch.setattr(rerun_state_machine, "get_rerun_state_machine", lambda: machine)
    mask = torch.ones(1, 2)
    fs.loss_func(mask, torch.tensor([[1.0, 2.0]]), training=False)
    assert machine.calls == []
    loss, *_ = fs.loss_func(mask, torch.tensor([[1.0, 2.0]]), training=False, check_nan=True)
    assert [(name, args) for name, args, _ in machine.calls] == [("validate_result", ())] * 2
    assert [kwargs for *_, kwargs in machine.calls] == [
        dict(
            result=loss,
            rejection_func=reject,
            message=f"found {name} in local forward loss calculation",
            tolerance=0.0,
            fatal=True,
        )
        for reject, name in ((torch.isnan, "NaN"), (torch.isinf, "Inf"))
    ]
    machine.calls.clear()
    loss, *_ = fs.loss_func(mask, torch.tensor([[1.0, 2.0]]), check_spiky=True)
    ((name, args, kwargs),) = machine.calls
    spiky = kwargs.pop("rejection_func")
    assert (spiky.args, spiky.keywords) == ((), dict(threshold=10, context="loss"))
    assert kwargs == dict(result=loss, message="Spiky loss", tolerance=0.0, fatal=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_loss_stops_a_cpu_run(bad):
    """On CPU the run's --rerun-mode is 'disabled' by default (compat): Megatron's state machine
    still checks the loss and raises, naming the value and the check (before, the check was
    skipped there)."""
    from megatron_latentmoe.compat import apply_cpu_compat, apply_python311_compat

    apply_python311_compat()
    apply_cpu_compat()
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    assert get_rerun_state_machine().get_mode() == RerunMode.DISABLED
    mask = torch.ones(1, 2)
    fs.loss_func(mask, torch.tensor([[1.0, 2.0]]), check_nan=True)  # a finite loss passes
    with pytest.raises(RuntimeError) as e:
        fs.loss_func(mask, torch.tensor([[1.0, bad]]), check_nan=True)
    name = "NaN" if bad != bad else "Inf"
    assert str(e.value).endswith(
        f"Unexpected result {bad} (message='found {name} in local forward loss calculation')"
    )


@pytest.mark.parametrize("check", ["check_nan", "check_spiky"])
def test_the_rerun_machine_keeps_the_loss_it_rejected(monkeypatch, check):
    """--rerun-mode validate_results: the machine keeps the rejected loss to compare the re-run's
    with. Megatron's schedule then divides the returned loss IN PLACE by its token count and the
    micro-batches (forward_step_calc_loss); handed the same tensor, the machine compared the
    re-run's raw sum with that quotient (a CPU run: '4266.87 != 4.1670', 512 tokens x 2
    micro-batches), so every spike read as not reproducible ('Possible transient error')."""
    from megatron.core import rerun_state_machine as rsm

    machine = rsm.RerunStateMachine(
        mode=rsm.RerunMode.VALIDATE_RESULTS,
        error_injector=rsm.RerunErrorInjector(1, rsm.RerunDiagnostic.CORRECT_RESULT),
    )
    machine.state, machine.first_iteration_complete = rsm.RerunState.INITIAL_RUN, True
    monkeypatch.setattr(rsm, "get_rerun_state_machine", lambda: machine)
    loss, num_tokens, _ = fs.loss_func(
        torch.ones(1, 2), torch.tensor([[1.0, 2.0]]), **{check: True}
    )
    assert machine.rerun_requested  # the injected error rejected it
    loss /= num_tokens  # as Megatron's schedule does
    assert machine.initial_result.item() == 3.0


@pytest.fixture
def megatron_step(monkeypatch):
    """forward_step's Megatron state: args, timers, a one-stage model config, CP and TP 1."""
    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    import megatron.core.utils
    import megatron.training

    args = SimpleNamespace(check_for_nan_in_loss_and_grad=True, rerun_mode="validate_results")
    timers = _Recorder()
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    timer = lambda *a, **k: timers.calls.append(("timer", a, k)) or timers  # noqa: E731
    monkeypatch.setattr(megatron.training, "get_timers", lambda: timer)
    config = SimpleNamespace(sequence_parallel=False)
    monkeypatch.setattr(megatron.core.utils, "get_model_config", lambda model: config)
    monkeypatch.setattr(megatron.core.utils, "get_attr_wrapped_model", lambda m, name: True)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    logger, recorder = _Recorder(), _Recorder()
    monkeypatch.setattr(fs, "_BALANCE_LOGGER", None)  # restored after the test
    monkeypatch.setattr(fs, "_BATCH_RECORDER", None)
    fs.set_balance_logger(logger)
    fs.set_batch_recorder(recorder)
    return SimpleNamespace(args=args, logger=logger, recorder=recorder, timers=timers)


class _Model(torch.nn.Module):
    def forward(self, tokens, position_ids, attention_mask, **kwargs):
        self.seen = dict(tokens=tokens, position_ids=position_ids, **kwargs)
        return tokens.float()


def test_forward_step_runs_the_model_with_the_padding_mask(megatron_step):
    batch = _batch()
    data = iter([batch])
    model = _Model()
    output, loss_fn = fs.forward_step(data, model)
    assert torch.equal(output, batch["tokens"].float())
    assert torch.equal(model.seen["position_ids"], batch["position_ids"])
    assert torch.equal(model.seen["labels"], batch["labels"])
    assert torch.equal(model.seen["loss_mask"], batch["loss_mask"])
    assert model.seen["padding_mask"].tolist() == (batch["loss_mask"] == 0).tolist()
    assert loss_fn.func is fs.loss_func and torch.equal(loss_fn.args[0], batch["loss_mask"])
    assert loss_fn.keywords == dict(training=True, check_nan=True, check_spiky=False)
    assert [name for name, *_ in megatron_step.logger.calls] == ["mark_forward"]
    ((name, (it, recorded), _),) = megatron_step.recorder.calls
    assert (name, it, recorded) == ("record", data, batch)
    assert megatron_step.timers.calls == [  # the batch's time, as Megatron-LM's pretrain_gpt
        ("timer", ("batch-generator",), dict(log_level=2)),
        ("start", (), {}),
        ("timer", ("batch-generator",), {}),
        ("stop", (), {}),
    ]


@pytest.mark.parametrize("mode", ["eval", "no_grad", "no nan check, spiky check"])
def test_forward_step_outside_training_is_not_logged_nor_recorded(megatron_step, mode):
    """Evaluation and QB's forward-only passes (training mode under no_grad) are neither timed,
    nor recorded for rescoring, nor fed to the balance log; the loss checks follow
    --no-check-for-nan-in-loss-and-grad and --check-for-spiky-loss (not --rerun-mode)."""
    model = _Model()
    if mode == "eval":
        model.eval()
    training = mode == "no nan check, spiky check"
    if training:
        megatron_step.args.rerun_mode = "disabled"
        megatron_step.args.check_for_nan_in_loss_and_grad = False
        megatron_step.args.check_for_spiky_loss = True
    with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        _, loss_fn = fs.forward_step(iter([_batch()]), model)
    assert loss_fn.keywords == dict(training=training, check_nan=not training, check_spiky=training)
    assert len(megatron_step.logger.calls) == len(megatron_step.recorder.calls) == training


def test_forward_step_refuses_megatrons_combined_schedule_plan():
    with pytest.raises(NotImplementedError) as e:
        fs.forward_step(iter([]), None, return_schedule_plan=True)
    assert str(e.value) == (
        "forward_step(return_schedule_plan=True): Megatron's combined 1F1B schedule plan is not "
        "supported; run without --overlap-moe-expert-parallel-comm"
    )


def test_forward_only_pass_runs_the_schedule_untimed():
    """Forward only, through the train step's own schedule function, model, process groups and
    pipeline communicator; the timers are off during the pass and back after it, also after a
    failed one."""
    config = SimpleNamespace(timers="timers")
    seen = []

    def schedule(**kwargs):
        seen.append(dict(kwargs, timers=config.timers))
        if len(seen) == 2:
            raise RuntimeError("pass failed")

    call = dict(
        config=config,
        forward_backward_func=schedule,
        forward_step_func="step",
        model=["chunk"],
        pg_collection="groups",
        p2p_communicator="p2p",
        iteration=3,
    )
    shape = dict(seq_length=8, micro_batch_size=2, decoder_seq_length=None)
    fs.forward_only_pass(call, "batches", 4, shape)
    assert seen == [
        dict(
            forward_step_func="step",
            data_iterator="batches",
            model=["chunk"],
            num_microbatches=4,
            forward_only=True,
            seq_length=8,
            micro_batch_size=2,
            decoder_seq_length=None,
            pg_collection="groups",
            p2p_communicator="p2p",
            timers=None,
        )
    ]
    assert config.timers == "timers"
    with pytest.raises(RuntimeError, match="pass failed"):
        fs.forward_only_pass(call, "batches", 4, shape)
    assert config.timers == "timers"


def test_a_wrapped_train_step_must_take_every_argument_the_passes_read():
    """QB rescoring reads ``call.get("iteration")``: a train step without ``iteration`` would
    pass the wrap and then never rescore; it is refused at wrap time, naming what is missing."""

    def train_step(forward_step_func, data_iterator, model, config, forward_backward_func):
        return None

    with pytest.raises(TypeError) as e:
        fs.train_step_signature(train_step, "QBRescore.wrap_train_step")
    assert str(e.value) == (
        "QBRescore.wrap_train_step: test_a_wrapped_train_step_must_take_every_argument_the_"
        "passes_read.<locals>.train_step(forward_step_func, data_iterator, model, config, "
        "forward_backward_func) is not allowed: a train step taking megatron.training "
        "train_step's arguments by name (forward_step_func, data_iterator, model, config, "
        "forward_backward_func, iteration); missing iteration"
    )

    def megatron_like(
        forward_step_func, data_iterator, model, config, forward_backward_func, iteration=0, **rest
    ):
        return None

    assert list(fs.train_step_signature(megatron_like, "w").parameters)[-2:] == [
        "iteration",
        "rest",
    ]


def test_forward_only_pass_checks_the_loss_outside_the_rerun_loop():
    """QB's rescoring / calibration passes run outside train_step's rerun loop: with Megatron's
    default --rerun-mode validate_results the loss check would assert there, so the pass disables
    the state machine as Megatron's evaluate() does (a NaN still stops it), and restores it."""
    from megatron_latentmoe.compat import apply_cpu_compat, apply_python311_compat

    apply_python311_compat()
    apply_cpu_compat()
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    machine = get_rerun_state_machine()
    seen = []

    def schedule(**kwargs):
        seen.append(machine.get_mode())
        fs.loss_func(torch.ones(1, 2), torch.tensor([[1.0, 2.0]]), training=False, check_nan=True)
        fs.loss_func(torch.ones(1, 2), torch.tensor([[1.0, kwargs["seq_length"]]]), check_nan=True)

    call = dict(
        config=SimpleNamespace(timers=None),
        forward_backward_func=schedule,
        forward_step_func="step",
        model=["chunk"],
    )
    shape = dict(seq_length=8, micro_batch_size=2, decoder_seq_length=None)
    before = machine.get_mode()
    machine.set_mode(RerunMode.VALIDATE_RESULTS)
    try:
        fs.forward_only_pass(call, "batches", 1, shape)
        shape["seq_length"] = float("nan")
        with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
            fs.forward_only_pass(call, "batches", 1, shape)
        after = machine.get_mode()
    finally:
        machine.set_mode(before)
    assert seen == [RerunMode.DISABLED] * 2 and after == RerunMode.VALIDATE_RESULTS


@pytest.mark.parametrize("mock_data", [True, False])
def test_every_rank_builds_its_datasets(monkeypatch, mock_data):
    """Megatron's builder, on every rank (``is_distributed``: each rank reads its own loss
    masks), with ``--mock-data``'s dataset or the GPT dataset from ``--data-path``."""
    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    import megatron.training
    from megatron.core.datasets import blended_megatron_dataset_builder as builder_module
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    seen = {}

    class Builder:
        def __init__(self, dataset_type, sizes, is_built_on_rank, config):
            seen.update(type=dataset_type, sizes=sizes, on_rank=is_built_on_rank(), config=config)

        def build(self):
            return "train", "valid", "test"

    monkeypatch.setattr(builder_module, "BlendedMegatronDatasetBuilder", Builder)
    args = SimpleNamespace(
        mock_data=mock_data,
        data_path=None if mock_data else ["/data/corpus"],
        train_data_path=None,
        valid_data_path=None,
        test_data_path=None,
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model="/tok",
        vocab_file=None,
        vocab_size=None,
        padded_vocab_size=4352,  # a checkpoint's (--use-checkpoint-args), saved at TP 2
        make_vocab_size_divisible_by=128,  # this run pads 4100 to 4224: not what the model has
        tensor_model_parallel_size=1,
        rank=0,
    )
    tokenizer = SimpleNamespace(vocab_size=4100)
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    monkeypatch.setattr(megatron.training, "get_tokenizer", lambda: tokenizer)
    monkeypatch.setattr(megatron.training, "print_rank_0", lambda *a: None)
    monkeypatch.setattr(fs, "gpt_dataset_config_from_args", lambda args, tok: ("config", tok))
    monkeypatch.setattr(fs, "_VOCABULARY", None)  # both restored after the test
    monkeypatch.setattr(fs, "_DATA", fs._DATA)
    assert fs.train_valid_test_datasets_provider([8, 2, 1]) == ("train", "valid", "test")
    dataset_type = MockGPTDataset if mock_data else GPTDataset
    assert seen == dict(
        type=dataset_type, sizes=[8, 2, 1], on_rank=True, config=("config", tokenizer)
    )
    # the ids the batches of these datasets may hold: the tokenizer's (get_batch checks them)
    assert (fs._VOCABULARY.size, fs._VOCABULARY.padded) == (4100, 4352)
    assert fs._VOCABULARY.tokenizer == "HuggingFaceTokenizer /tok"
    assert fs._DATA == ("the data" if mock_data else "--data-path /data/corpus")
    assert fs.train_valid_test_datasets_provider.is_distributed is True
