"""The entry point's pieces (``training/pretrain.py``) called directly with small inputs: a tmp
dir, a namespace of flags, fakes for Megatron's loaders. Whole runs (these pieces wired into
Megatron's loop) are ``tests/training/test_pretrain.py``'s and ``test_resume.py``'s; what
``--load`` resumes from is ``test_resume_units.py``'s."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from megatron_latentmoe import error_file
from megatron_latentmoe.checkpoint_layout import RELEASE, TRACKER_FILE
from megatron_latentmoe.training import checkpoint_repair, console, pretrain, resume


def test_startup_env_sets_megatrons_variables_unless_given(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("NO_VCS_VERSION", "0")
    pretrain._startup_env()
    assert (os.environ["CUDA_DEVICE_MAX_CONNECTIONS"], os.environ["NO_VCS_VERSION"]) == ("1", "0")
    monkeypatch.delenv("NO_VCS_VERSION")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    pretrain._startup_env()
    assert (os.environ["CUDA_DEVICE_MAX_CONNECTIONS"], os.environ["NO_VCS_VERSION"]) == ("8", "1")


@pytest.mark.parametrize("rank, printed", [(None, "a 1\n"), ("0", "a 1\n"), ("1", "")])
def test_print0_prints_on_rank_0_only(monkeypatch, capsys, rank, printed):
    monkeypatch.delenv("RANK", raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    console.print0("a", 1)
    assert capsys.readouterr().out == printed


def test_main_runs_with_its_argv_and_puts_sys_argv_back(monkeypatch):
    seen = []

    def _main(check_only):
        seen.append((list(sys.argv), check_only))
        if "--boom" in sys.argv:
            raise RuntimeError("boom")
        return 7

    monkeypatch.setattr(pretrain, "_main", _main)
    monkeypatch.setattr(sys, "argv", ["run.py", "--train-iters", "2"])
    assert pretrain.main(["--seed", "1"], check_only=True) == 7
    assert pretrain.main() == 7  # sys.argv as it is
    assert pretrain.main([]) == 7  # no flags
    with pytest.raises(RuntimeError, match="boom"):
        pretrain.main(["--boom"])
    assert sys.argv == ["run.py", "--train-iters", "2"]
    monkeypatch.setattr(sys, "argv", [])
    assert pretrain.main(["--seed", "1"]) == 7
    assert sys.argv == []
    assert seen == [
        (["run.py", "--seed", "1"], True),
        (["run.py", "--train-iters", "2"], False),
        (["run.py"], False),
        (["run.py", "--boom"], False),
        (["pretrain_stable_latentmoe", "--seed", "1"], False),
    ]


MAIN_STEPS = (
    "apply_core_compat",
    "apply_cpu_compat",
    "begin_run",
    "checked_args",
    "set_global_variables",
    "save_space_warning",
    "init_cpu_world",
    "_make_balance_logger",
    "set_balance_logger",
    "wrap_train_step",
    "set_batch_recorder",
    "install_finalize_hook",
    "exclude_from_step_time",
    "log_each_iteration_once",
    "pretrain",
)
"""What ``main`` does, in order, on a machine without CUDA."""
CPU_ONLY_STEPS = {"apply_cpu_compat", "init_cpu_world"}
"""The steps ``main`` leaves out where CUDA is available."""


class _Run:
    """``pretrain._main`` with everything heavy faked (the flag check, Megatron's globals, its
    training loop, the CPU world, the loggers): what it wires, in order, in ``events``."""

    def __init__(self, monkeypatch, tmp_path, **flags):
        import torch

        from megatron_latentmoe import compat
        from megatron_latentmoe.compat import training as compat_training
        from megatron_latentmoe.data import corpus
        from megatron_latentmoe.ops import situ
        from megatron_latentmoe.training import (
            balance_logging,
            balance_summary,
            file_checks,
            forward_step,
        )

        self.events, self.raises, self.fstep = [], None, forward_step
        event = self.events.append
        layout = dict.fromkeys(resume.LAYOUT_FIELDS, 1)
        self.args = SimpleNamespace(
            **layout,
            disable_jit_fuser=False,
            load=None,
            save=None,
            finetune=False,
            no_load_optim=False,
            no_load_rng=False,
            use_checkpoint_opt_param_scheduler=False,
            use_flash_attn=False,
            ckpt_format="torch_dist",
            moe_qb_rescore_iters=0,
            moe_qb_rescore_solves=1,
            moe_qb_calibrate_batches=0,
            train_iters=10,
            global_batch_size=4,
            seq_length=8,
            micro_batch_size=1,
            decoder_seq_length=None,
        )
        vars(self.args).update(flags)
        self.cpu_notes, self.default_data_dir, self.flag_error = ["fusions"], None, None
        self.saved = None  # the checkpoint's args
        self.logger = SimpleNamespace(excluded="excluded", is_logging_rank=True, history=[])

        def checked_args(has_cuda):
            event(("checked_args", has_cuda))
            if self.flag_error:
                from megatron_latentmoe.cli_errors import FlagError

                raise FlagError(self.flag_error)
            return self.args, "transformer config", self.cpu_notes, self.default_data_dir

        def pretrain_loop(cfg_container, datasets_provider, model_type, forward_step_func):
            event(("pretrain", cfg_container, datasets_provider, model_type, forward_step_func))
            if self.raises:
                raise self.raises

        def recorder(name):
            return lambda *a, **k: event((name, *a, *k.values()))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("RANK", "0")
        for module, name in (
            (compat, "apply_core_compat"),
            (compat, "apply_cpu_compat"),
            (compat_training, "begin_run"),
            (compat_training, "init_cpu_world"),
            (compat_training, "exclude_from_step_time"),
            (compat_training, "log_each_iteration_once"),
            (compat_training, "load_optional_checkpoint_keys"),
            (compat_training, "load_optimizer_with_new_lr"),
            (compat_training, "wrap_train_step"),
            (compat_training, "on_save_error"),
            (file_checks, "save_space_warning"),
            (situ, "set_cpu_compile"),
            (forward_step, "set_balance_logger"),
            (forward_step, "set_batch_recorder"),
            (checkpoint_repair, "repair_non_persistent_checkpoints"),
            (resume, "plan_layout_change"),
            (resume, "legacy_layout_refusal"),  # reads the folder (tests/training meet it)
        ):
            monkeypatch.setattr(module, name, recorder(name))
        monkeypatch.setattr(pretrain, "checked_args", checked_args)
        # looked up in both: the entry point and the --save repair take it from checkpoint_repair,
        # loaded_arg and resumed_checkpoint from resume; its answers (write=False) are left to
        # tests/training
        for module in (checkpoint_repair, resume):
            monkeypatch.setattr(
                module,
                "repair_checkpoint_tracker",
                lambda d, f, write=True: (
                    event(("repair_checkpoint_tracker", d, f)) if write else None
                ),
            )
        monkeypatch.setattr(
            resume, "saved_args", lambda path: event(("saved_args", path)) or self.saved
        )
        monkeypatch.setattr(
            pretrain,
            "_make_balance_logger",
            lambda args, path: event(("_make_balance_logger", args, path)) or self.logger,
        )
        monkeypatch.setattr(
            corpus,
            "prepare_default_dataset",
            lambda d, **kw: event(("prepare_default_dataset", d, kw)) or f"{d}/default_corpus_x",
        )
        monkeypatch.setattr(balance_logging, "default_jsonl_path", lambda args: "balance.jsonl")
        monkeypatch.setattr(
            balance_logging, "make_finalize_model_grads_func", lambda *a: ("finalize", *a)
        )
        monkeypatch.setattr(balance_summary, "summarize", lambda history: ("summary", *history))
        monkeypatch.setattr(balance_summary, "summary_lines", lambda s: [f"{s}", "second line"])
        model_provider = SimpleNamespace(
            install_finalize_hook=recorder("install_finalize_hook"),
            model_config_from_args=lambda args, config: ("model config", config),
        )
        monkeypatch.setitem(
            sys.modules, "megatron_latentmoe.training.model_provider", model_provider
        )
        training = SimpleNamespace(pretrain=pretrain_loop)
        monkeypatch.setitem(sys.modules, "megatron.training", SimpleNamespace(training=training))
        monkeypatch.setitem(
            sys.modules,
            "megatron.training.argument_utils",
            SimpleNamespace(pretrain_cfg_container_from_args=lambda args, cfg: ("container", cfg)),
        )
        monkeypatch.setitem(
            sys.modules,
            "megatron.training.global_vars",
            SimpleNamespace(set_global_variables=recorder("set_global_variables")),
        )

    def __call__(self, check_only=False):
        return pretrain._main(check_only)

    def named(self, name):
        return [e[1:] for e in self.events if e[0] == name]


def test_main_hands_megatron_the_model_datasets_and_step_it_built(monkeypatch, tmp_path, capsys):
    from megatron.core.enums import ModelType

    from megatron_latentmoe.training.rerun_balance import RerunBalance

    run = _Run(monkeypatch, tmp_path)
    assert run() == 0
    container = ("container", ("model config", "transformer config"))
    ((_, provider, _, _),) = run.named("pretrain")  # the datasets checked against the load
    assert provider.__wrapped__ is run.fstep.train_valid_test_datasets_provider
    assert [e[0] for e in run.events] == list(MAIN_STEPS)
    assert run.named("checked_args") == [(False,)]
    assert run.named("set_global_variables") == run.named("init_cpu_world") == [(run.args,)]
    assert run.named("_make_balance_logger") == [(run.args, "balance.jsonl")]
    assert run.named("set_balance_logger") == [(run.logger,)]
    ((rerun_wrap,),) = run.named("wrap_train_step")  # the rerun state machine's hooks
    assert isinstance(rerun_wrap.__self__, RerunBalance)
    assert rerun_wrap == rerun_wrap.__self__.wrap_train_step
    assert rerun_wrap.__self__.balance_logger is run.logger
    assert run.named("set_batch_recorder") == [(None,)]
    assert run.named("install_finalize_hook") == [(("finalize", run.logger, None),)]
    assert run.named("exclude_from_step_time") == [("excluded",)]
    assert run.named("pretrain") == [
        (container, provider, ModelType.encoder_or_decoder, run.fstep.forward_step)
    ]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[pretrain_stable_latentmoe] no CUDA: gloo, local spec; off on CPU: fusions"
    assert out[1].startswith("[pretrain_stable_latentmoe] done in ") and len(out) == 2


def test_main_warns_of_a_small_save_disk_and_ends_a_full_one_with_exit_2(monkeypatch, capsys):
    """``--save``: rank 0's start-up warning when less than a checkpoint is free, and the
    disk-full handler on Megatron's save; a save that filled the disk (the handler raised
    ``SaveDiskFailure`` after rank 0 said so) ends ``main`` with exit 2 and nothing more printed."""
    from megatron_latentmoe.training import file_checks

    run = _Run(monkeypatch, None, save="ckpt")
    monkeypatch.setattr(file_checks, "save_space_warning", lambda args: "--save ckpt: 1 MB free")
    run.raises = file_checks.SaveDiskFailure()
    assert run() == 2
    assert len(run.named("on_save_error")) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "[pretrain_stable_latentmoe] WARNING: --save ckpt: 1 MB free"
    assert not any("done in" in line for line in out)
    run = _Run(monkeypatch, None)  # no --save: neither
    assert run() == 0 and run.named("on_save_error") == []


def test_main_stops_at_a_bad_flag_or_after_the_check(monkeypatch, tmp_path, capsys):
    run = _Run(monkeypatch, tmp_path)
    run.flag_error = "--train-iters 0 is not allowed; allowed: >= 1"
    assert run() == 2
    out, err = capsys.readouterr()
    assert (
        err == "pretrain_stable_latentmoe: error: --train-iters 0 is not allowed; allowed: >= 1\n"
    )
    assert out == "" and [e[0] for e in run.events][2:] == ["begin_run", "checked_args"]
    # the same refusal on every rank: under torchrun rank 0 alone prints it (error_file.say_once;
    # torchrun's SIGTERM ends the other rank's wait)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setattr(error_file, "_ended_by_torchrun", lambda: True)
    assert run() == 2 and capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    run.flag_error = None
    run.events.clear()
    assert run(check_only=True) == 0
    assert [e[0] for e in run.events][2:] == ["begin_run", "checked_args"]
    assert capsys.readouterr().out == ""


def test_main_prepares_the_shipped_corpus_and_eager_situ_when_asked(monkeypatch, tmp_path, capsys):
    """The shipped corpus is tokenized with the run's tokenizer, which the data line names (was
    the shipped tokenizer's dataset whatever the run's tokenizer)."""
    run = _Run(
        monkeypatch,
        tmp_path,
        disable_jit_fuser=True,
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model="/my/tokenizer",
        trust_remote_code=True,
    )
    run.default_data_dir, run.cpu_notes = "/cache/default_data", []
    assert run() == 0
    assert run.named("set_cpu_compile") == [(False,)]
    assert run.named("prepare_default_dataset") == [
        ("/cache/default_data", {"tokenizer": "/my/tokenizer", "trust_remote_code": True})
    ]
    assert capsys.readouterr().out.splitlines()[:2] == [
        "[pretrain_stable_latentmoe] --disable-jit-fuser: no torch.compile for SiTU-GLU on CPU "
        "(its eager math)",
        "[pretrain_stable_latentmoe] data: the shipped corpus, tokenized by HuggingFaceTokenizer "
        "/my/tokenizer (/cache/default_data/default_corpus_x.bin/.idx)",
    ]


def test_main_wires_rescoring_and_calibration(monkeypatch, tmp_path):
    """Rescoring: its train-step wrapper, its batch recorder, its finalize hook, the checkpoint
    keys it may find missing; calibration: the datasets provider it keeps the training set of,
    its train-step wrapper outermost (it runs before a rescored first step)."""
    from megatron_latentmoe.convert.names import TRAINING_STATE_SUFFIXES
    from megatron_latentmoe.training import balance_logging
    from megatron_latentmoe.training.rerun_balance import RerunBalance

    flags = dict(moe_qb_rescore_iters=3, moe_qb_rescore_solves=2, moe_qb_calibrate_batches=2)
    run = _Run(monkeypatch, tmp_path, decoder_seq_length=16, **flags)
    assert run() == 0
    # inside out: rescoring, the rerun hooks (they write the rescored step end's record), and
    # calibration outermost
    (rescore_wrap,), (rerun_wrap,), (calibration_wrap,) = run.named("wrap_train_step")
    rescore, calibration = rescore_wrap.__self__, calibration_wrap.__self__
    assert isinstance(rerun_wrap.__self__, RerunBalance)
    assert rescore_wrap == rescore.wrap_train_step
    assert calibration_wrap == calibration.wrap_train_step
    assert (rescore.iters, rescore.solves) == (3, 2)
    assert rescore.schedule == dict(seq_length=8, micro_batch_size=1, decoder_seq_length=16)
    assert calibration.schedule == rescore.schedule
    assert (calibration.num_batches, calibration.first_sample) == (2, 32)
    assert run.named("load_optional_checkpoint_keys") == [(TRAINING_STATE_SUFFIXES,)]
    assert run.named("set_batch_recorder") == [(rescore,)]
    assert run.named("install_finalize_hook") == [(("finalize", run.logger, rescore),)]
    ((_, provider, _, _),) = run.named("pretrain")
    assert provider.__wrapped__.__wrapped__ is run.fstep.train_valid_test_datasets_provider
    assert rescore.step_end.func is balance_logging.balance_step_end  # with this run's logger
    assert rescore.step_end.keywords == dict(balance_logger=run.logger)


@pytest.mark.parametrize(
    "flags, saved_layout, planned",
    [
        ({}, dict(tensor_model_parallel_size=2), True),
        ({}, dict(tensor_model_parallel_size=1), False),  # the same layout
        ({}, dict(tensor_model_parallel_size=None), False),  # not in the checkpoint's args
        ({}, None, False),  # nothing to resume from
        (dict(finetune=True), dict(tensor_model_parallel_size=2), False),
        (dict(no_load_optim=True, no_load_rng=True), dict(context_parallel_size=2), False),
        (dict(no_load_optim=True), dict(context_parallel_size=2), True),
        (dict(no_load_rng=True), dict(expert_tensor_parallel_size=2), True),
        # more or fewer data-parallel ranks alone: Megatron loads the optimizer and RNG state
        ({}, dict(data_parallel_size=4), False),
        (dict(data_parallel_random_init=True), dict(data_parallel_size=4), True),  # RNG per rank
        ({}, dict(data_parallel_size=4, pipeline_model_parallel_size=2), True),
    ],
)
def test_main_plans_a_layout_change_when_it_resumes_from_another_layout(
    monkeypatch, tmp_path, flags, saved_layout, planned
):
    root = tmp_path / "ckpt"
    root.mkdir()
    _tree(root, [4], "4")
    run = _Run(monkeypatch, tmp_path, load=str(root), ckpt_format="torch_dcp", **flags)
    if saved_layout is not None:
        run.saved = SimpleNamespace(**{**dict.fromkeys(resume.LAYOUT_FIELDS, 1), **saved_layout})
    assert run() == 0
    assert run.named("repair_checkpoint_tracker") == [(str(root), "torch_dcp")]
    assert run.named("saved_args") == [(f"{root}/iter_0000004",)]  # read for the shape check too
    assert run.named("plan_layout_change") == ([(run.args, run.saved)] if planned else [])


@pytest.mark.parametrize(
    "flags, loads",
    [
        (dict(override_opt_param_scheduler=True), True),
        (dict(override_opt_param_scheduler=True, no_load_optim=True), False),
        (dict(override_opt_param_scheduler=True, finetune=True), False),
        (dict(override_opt_param_scheduler=False, no_load_optim=True), False),
    ],
)
def test_main_loads_the_optimizer_of_another_lr_with_the_schedule_override(
    monkeypatch, tmp_path, flags, loads
):
    """Another --lr than the checkpoint's, the optimizer restored: the saved param groups are
    rewritten to this run's LR (compat.training.load_optimizer_with_new_lr, given the
    checkpoint's args and this run's) where --override-opt_param-scheduler is given; not where
    the optimizer is not loaded (--no-load-optim, --finetune)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    _tree(root, [4], "4")
    lrs = dict(lr=5e-4, min_lr=1e-4, decoupled_lr=None, decoupled_min_lr=None)
    run = _Run(monkeypatch, tmp_path, load=str(root), ckpt_format="torch_dcp", **lrs, **flags)
    run.saved = SimpleNamespace(**{**dict.fromkeys(resume.LAYOUT_FIELDS, 1), **lrs, "lr": 1e-3})
    assert run() == 0
    assert run.named("load_optimizer_with_new_lr") == ([(run.saved, run.args)] if loads else [])


def test_main_refuses_another_lr_without_the_schedule_override(monkeypatch, tmp_path, capsys):
    root = tmp_path / "ckpt"
    root.mkdir()
    _tree(root, [4], "4")
    lrs = dict(lr=5e-4, min_lr=1e-4, decoupled_lr=None, decoupled_min_lr=None)
    run = _Run(monkeypatch, tmp_path, load=str(root), ckpt_format="torch_dcp", **lrs)
    run.args.override_opt_param_scheduler = False
    run.saved = SimpleNamespace(**{**dict.fromkeys(resume.LAYOUT_FIELDS, 1), **lrs, "lr": 1e-3})
    assert run() == 2
    assert run.named("pretrain") == run.named("load_optimizer_with_new_lr") == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add --override-opt_param-scheduler to train on" in err


@pytest.mark.parametrize("no_load_optim", [False, True])
def test_main_trains_on_with_the_checkpoints_lr_under_its_schedule_flag(
    monkeypatch, tmp_path, capsys, no_load_optim
):
    """Another --lr / --min-lr with --use-checkpoint-opt_param-scheduler, the optimizer restored:
    this run's LR args become the checkpoint's before Megatron builds the optimizer
    (resume.take_checkpoint_lr), so load_optimizer_with_new_lr has nothing to rename, and one
    warning on stdout names them; with --no-load-optim (Megatron loads no schedule) the run keeps
    its own values, and one warning says the flag does nothing."""
    root = tmp_path / "ckpt"
    root.mkdir()
    _tree(root, [4], "4")
    lrs = dict(lr=5e-4, min_lr=1e-4, decoupled_lr=None, decoupled_min_lr=None)
    run = _Run(
        monkeypatch,
        tmp_path,
        load=str(root),
        ckpt_format="torch_dcp",
        override_opt_param_scheduler=False,
        use_checkpoint_opt_param_scheduler=True,
        no_load_optim=no_load_optim,
        **lrs,
    )
    run.saved = SimpleNamespace(
        **{**dict.fromkeys(resume.LAYOUT_FIELDS, 1), **lrs, "lr": 1e-3, "min_lr": 2e-5}
    )
    assert run() == 0
    out = capsys.readouterr().out
    taken = "this run's learning rates are not used, the checkpoint's schedule goes on with its"
    if no_load_optim:
        assert (run.args.lr, run.args.min_lr) == (5e-4, 1e-4) and taken not in out
        assert out.count("--use-checkpoint-opt_param-scheduler does nothing here: --no-load") == 1
        assert run.named("load_optimizer_with_new_lr") == []
        return
    assert (run.args.lr, run.args.min_lr) == (1e-3, 2e-5)
    assert run.named("load_optimizer_with_new_lr") == [(run.saved, run.args)]
    assert out.count(taken) == 1


def test_main_warns_once_that_use_flash_attn_does_nothing(monkeypatch, tmp_path, capsys):
    """--use-flash-attn, parsed by megatron-core 0.19.2 and read nowhere: the run goes on (older
    launch scripts carry it) with one warning naming the attention it runs instead."""
    from megatron.core.transformer.enums import AttnBackend

    run = _Run(
        monkeypatch,
        tmp_path,
        use_flash_attn=True,
        attention_backend=AttnBackend.auto,
        transformer_impl="local",
    )
    assert run() == 0
    out = capsys.readouterr().out
    assert out.count("WARNING: --use-flash-attn does nothing") == 1, out
    assert (
        "[pretrain_stable_latentmoe] WARNING: --use-flash-attn does nothing: megatron-core 0.19.2 "
        "parses it but no code reads it; the attention is --attention-backend auto with "
        "--transformer-impl local (FlashAttention: --attention-backend flash or auto with "
        "--transformer-impl transformer_engine on a GPU)"
    ) in out.splitlines()


def test_main_plans_no_layout_change_for_a_release_checkpoint(monkeypatch, tmp_path):
    """megatron-core 0.19.2 loads a release checkpoint's model alone, from iteration 0, from
    --load too (no optimizer, scheduler or RNG state): nothing to plan. Before, a release
    checkpoint of another layout on --load was planned for (its args were not read then; now they
    are, for the shape check) and announced Adam moments that start over."""
    _tree(tmp_path, ["release"], "release")
    run = _Run(monkeypatch, tmp_path, load=str(tmp_path))
    run.saved = SimpleNamespace(
        **{**dict.fromkeys(resume.LAYOUT_FIELDS, 1), "tensor_model_parallel_size": 2}
    )
    assert run() == 0
    assert run.named("saved_args") == [(f"{tmp_path}/release",)]
    assert run.named("plan_layout_change") == []


def test_main_refuses_a_checkpoint_of_another_model_shape(monkeypatch, tmp_path, capsys):
    """Before: megatron-core's load failed on every rank with a CheckpointException traceback
    ("Global shape mismatch ..."); now one line naming the flags, exit 2, before the loop."""
    run = _Run(monkeypatch, tmp_path, load="ckpt", hidden_size=128)
    run.saved = SimpleNamespace(hidden_size=64)
    assert run() == 2
    assert run.named("pretrain") == []
    assert capsys.readouterr().err == (
        "pretrain_stable_latentmoe: error: --load ckpt: the checkpoint is of another model shape: "
        "--hidden-size 64 (this run: 128). Give the checkpoint's model flags, or "
        "--use-checkpoint-args to take them from it\n"
    )


@pytest.mark.parametrize(
    "flags, refused",
    [({}, True), (dict(no_load_optim=True), False), (dict(finetune=True), False)],
)
def test_main_refuses_to_restore_the_optimizer_a_checkpoint_has_not(
    monkeypatch, tmp_path, capsys, flags, refused
):
    """A checkpoint saved with --no-save-optim, resumed without --no-load-optim: megatron-core
    0.19.2's load read ``state_dict['optimizer']``, a KeyError traceback on every rank; now one
    line, exit 2, before the loop. With --no-load-optim, or --finetune (the weights alone), the
    run goes on."""
    run = _Run(monkeypatch, tmp_path, load="ckpt", **flags)
    run.saved = SimpleNamespace(no_save_optim=True)
    assert run() == (2 if refused else 0)
    assert bool(run.named("pretrain")) is not refused
    err = capsys.readouterr().err
    assert err == (
        "pretrain_stable_latentmoe: error: --load ckpt: the checkpoint was saved with "
        "--no-save-optim (it holds no optimizer state), which megatron-core 0.19.2 fails to "
        "load; add --no-load-optim (the optimizer and its learning-rate schedule start anew, "
        "the iteration number goes on) or --finetune (the weights alone, from iteration 0)\n"
        if refused
        else ""
    )


def test_main_checks_the_pretrained_checkpoint_megatron_falls_back_to(
    monkeypatch, tmp_path, capsys
):
    """--pretrained-checkpoint where --load holds none: its args (a release checkpoint's too)
    are the ones the shape check reads, its flag names it; Megatron fine-tunes from it (the
    model alone), so no layout change is planned. Before: --load's (none) were read, and the
    load failed on every rank with a "Global shape mismatch" CheckpointException traceback."""
    layout = dict.fromkeys(resume.LAYOUT_FIELDS, 1)
    pre = tmp_path / "pre"
    pre.mkdir()
    _tree(pre, ["release"], "release")
    run = _Run(
        monkeypatch,
        tmp_path,
        load=str(tmp_path / "new"),
        pretrained_checkpoint=str(pre),
        hidden_size=8,
    )
    run.saved = SimpleNamespace(**{**layout, "tensor_model_parallel_size": 2}, hidden_size=8)
    assert run() == 0
    assert run.named("saved_args") == [(f"{pre}/release",)]
    assert run.named("plan_layout_change") == []
    run.saved.hidden_size = 16
    assert run() == 2
    assert capsys.readouterr().err == (
        f"pretrain_stable_latentmoe: error: --pretrained-checkpoint {pre}: the checkpoint is of "
        "another model shape: --hidden-size 16 (this run: 8). Give the checkpoint's model flags, "
        "or --use-checkpoint-args to take them from it\n"
    )


def test_main_warns_on_rank_0_that_a_release_checkpoint_ignores_ckpt_step(
    monkeypatch, tmp_path, capsys
):
    """megatron-core 0.19.2 loads ``release`` whatever --ckpt-step says, silently; now a
    warning line names both (rank 0 only)."""
    (tmp_path / TRACKER_FILE).write_text("release")
    (tmp_path / RELEASE).mkdir()
    warning = (
        f"[pretrain_stable_latentmoe] WARNING: --ckpt-step 5 is ignored: --load {tmp_path} holds "
        f"a release checkpoint ({TRACKER_FILE}: release), which megatron-core 0.19.2 "
        f"loads whatever --ckpt-step says: {tmp_path}/release"
    )
    for rank, printed in (("0", [warning]), ("1", [])):
        run = _Run(monkeypatch, tmp_path, load=str(tmp_path), ckpt_step=5)
        monkeypatch.setenv("RANK", rank)
        assert run() == 0
        out = capsys.readouterr().out.splitlines()
        assert [line for line in out if "WARNING" in line] == printed


def test_main_repairs_the_tracker_on_rank_0_only(monkeypatch, tmp_path):
    _tree(tmp_path, [4], "4")
    run = _Run(monkeypatch, tmp_path, load=str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert run() == 0
    assert run.named("repair_checkpoint_tracker") == run.named("repair_non_persistent_checkpoints")
    assert run.named("repair_checkpoint_tracker") == []
    assert run.named("saved_args") == [(f"{tmp_path}/iter_0000004",)]
    monkeypatch.setenv("RANK", "0")
    run = _Run(monkeypatch, tmp_path, load=str(tmp_path))
    assert run() == 0
    assert [e[0] for e in run.events if e[0].startswith("repair_") or e[0] == "saved_args"] == [
        "repair_checkpoint_tracker",
        "repair_non_persistent_checkpoints",  # the global non-persistent ones, before the load too
        "saved_args",
    ]
    assert run.named("repair_non_persistent_checkpoints") == [(run.args,)]
    run = _Run(monkeypatch, tmp_path)  # no --load
    assert run() == 0
    assert run.named("repair_checkpoint_tracker") == run.named("saved_args") == []
    assert run.named("repair_non_persistent_checkpoints") == []
    run = _Run(monkeypatch, tmp_path, load=str(tmp_path), auto_detect_ckpt_format=True)
    assert run() == 0
    assert run.named("repair_checkpoint_tracker") == [
        (str(tmp_path), checkpoint_repair.AUTO_FORMAT)
    ]


def test_main_explains_megatrons_schedule_mismatch_on_load(monkeypatch, tmp_path, capsys):
    run = _Run(monkeypatch, tmp_path)
    run.raises = AssertionError("OptimizerParamScheduler: class input value 10 and checkpoint 5")
    assert run() == 2
    err = capsys.readouterr().err
    assert err == (
        "pretrain_stable_latentmoe: error: the checkpoint's LR / weight-decay schedule differs "
        "from this run's flags (OptimizerParamScheduler: class input value 10 and checkpoint 5). "
        "Pass --override-opt_param-scheduler to continue with this run's schedule (e.g. a longer "
        "--train-iters), or --use-checkpoint-opt_param-scheduler to keep the checkpoint's.\n"
    )
    run.raises = AssertionError("another check")
    with pytest.raises(AssertionError, match="another check"):
        run()


def test_main_stops_at_a_batch_outside_the_vocabulary_in_one_line(monkeypatch, tmp_path, capsys):
    """A micro-batch's refusal (``forward_step.get_batch``) inside Megatron's loop: its line,
    exit 2, where the embedding's IndexError was a traceback."""
    run = _Run(monkeypatch, tmp_path)
    run.raises = run.fstep.OutOfVocabularyError("a micro-batch of --data-path /d holds token id 9")
    assert run() == 2
    assert capsys.readouterr().err == (
        "pretrain_stable_latentmoe: error: a micro-batch of --data-path /d holds token id 9\n"
    )


def test_main_refuses_a_loaded_non_finite_router_bias_in_one_line(monkeypatch, tmp_path, capsys):
    """A router's NaN / inf ``expert_bias`` (``moe/router.py`` refuses it at load): its line with
    the checkpoint folder, exit 2, where it was a traceback at the first step end (QB) or no error
    at all (Megatron's sign update)."""
    from megatron_latentmoe.moe.router import NonFiniteBiasError

    _tree(tmp_path, [4], "4")
    run = _Run(monkeypatch, tmp_path, load=str(tmp_path))
    run.raises = NonFiniteBiasError("decoder.layers.1.mlp.router.expert_bias (layer 2's router)")
    assert run() == 2
    assert capsys.readouterr().err == (
        f"pretrain_stable_latentmoe: error: --load {tmp_path}/iter_0000004: "
        "decoder.layers.1.mlp.router.expert_bias (layer 2's router)\n"
    )


@pytest.mark.parametrize("rank", ["0", "1"])
def test_main_stops_at_a_data_offset_its_datasets_cannot_serve_in_one_line(
    monkeypatch, tmp_path, capsys, rank
):
    """The loaded checkpoint's data offset past this run's datasets
    (``data_left.data_left_refusal``, decided alike on every rank where Megatron builds them):
    exit 2 on each rank, the line once (rank 0), where Megatron's sampler asserted on every
    rank."""
    from megatron_latentmoe.training.data_left import DataLeftError

    run = _Run(monkeypatch, tmp_path)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setattr(error_file, "_ended_by_torchrun", lambda: True)  # torchrun's SIGTERM
    run.raises = DataLeftError("--load /c: a release checkpoint without --finetune continues")
    assert run() == 2
    assert capsys.readouterr().err == (
        "pretrain_stable_latentmoe: error: --load /c: a release checkpoint without --finetune "
        "continues\n"
        if rank == "0"
        else ""
    )


def test_main_with_cuda_skips_the_cpu_world(monkeypatch, tmp_path, capsys):
    """With CUDA: Megatron-Core's compat only (no CPU shims, no gloo world, no QB gloo
    all-reduce), and the flag check is told CUDA is there."""
    import torch

    run = _Run(monkeypatch, tmp_path)
    run.cpu_notes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run() == 0
    assert [e[0] for e in run.events] == [e for e in MAIN_STEPS if e not in CPU_ONLY_STEPS]
    assert run.named("checked_args") == [(True,)]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("[pretrain_stable_latentmoe] done in ")


@pytest.mark.parametrize("initialized", [True, False])
def test_main_ends_with_a_barrier_and_destroys_the_process_group(
    monkeypatch, tmp_path, initialized
):
    """After Megatron's loop the ranks meet at a barrier and the process group is destroyed
    (a rank that exits first leaves gloo / NCCL peers waiting); without a group, nothing."""
    import torch

    run = _Run(monkeypatch, tmp_path)
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    assert run() == 0
    assert calls == (["barrier", "destroy"] if initialized else [])


@pytest.mark.parametrize(
    "logging_rank, history, printed", [(True, [1], True), (False, [1], False), (True, [], False)]
)
def test_main_prints_the_balance_summary_on_the_logging_rank(
    monkeypatch, tmp_path, capsys, logging_rank, history, printed
):
    run = _Run(monkeypatch, tmp_path)
    run.logger.is_logging_rank, run.logger.history = logging_rank, history
    assert run() == 0
    out = capsys.readouterr().out.splitlines()
    summary = ["[pretrain_stable_latentmoe] summary: ('summary', 1)", "second line"]
    assert (out[1:3] == summary) is printed and len(out) == (4 if printed else 2)


def test_main_prints_the_balance_summary_before_megatrons_early_exit(monkeypatch, tmp_path, capsys):
    """--exit-interval / --exit-duration-in-mins / the signal handler: megatron-core 0.19.2 saves
    and calls sys.exit inside pretrain; the summary of the iterations trained is printed before
    the exit goes on with its status (it was not printed)."""
    run = _Run(monkeypatch, tmp_path)
    run.logger.history, run.raises = [1], SystemExit(0)
    with pytest.raises(SystemExit) as exit_info:
        run()
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["[pretrain_stable_latentmoe] summary: ('summary', 1)", "second line"]


@pytest.mark.parametrize("rank, made", [("1", True), ("0", False)])
def test_the_balance_logger_follows_the_flags(monkeypatch, tmp_path, rank, made):
    """The last rank (it writes the JSONL records) makes the file's folder; the logger counts
    the step's global batch x sequence tokens (Megatron's current batch: a
    --step-batch-size-schedule changes it) and numbers steps from Megatron's iteration + 1."""
    from megatron.core import num_microbatches_calculator, parallel_state

    writers = SimpleNamespace(
        get_args=lambda: SimpleNamespace(curr_iteration=6),
        get_tensorboard_writer=lambda: "tensorboard",
        get_wandb_writer=lambda: "wandb",
    )
    monkeypatch.setitem(sys.modules, "megatron.training", writers)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = SimpleNamespace(
        num_layers=3,
        num_experts=8,
        global_batch_size=4,
        seq_length=16,
        log_interval=5,
        tensorboard_log_interval=7,
        balance_log_loads_interval=9,
        moe_per_layer_logging=True,
    )
    batch = [4]
    monkeypatch.setattr(
        num_microbatches_calculator, "get_current_global_batch_size", lambda: batch[0]
    )
    path = tmp_path / "logs" / "balance.jsonl"
    logger = pretrain._make_balance_logger(args, str(path))
    assert path.parent.is_dir() is made and not path.exists()
    assert (logger.num_layers, logger.num_experts, logger.tokens_per_step()) == (3, 8, 64)
    batch[0] = 8
    assert logger.tokens_per_step() == 128
    assert (logger.log_interval, logger.tensorboard_log_interval, logger.loads_interval) == (
        5,
        7,
        9,
    )
    assert (logger.jsonl_path, logger.iteration_fn(), logger.per_layer_tensorboard) == (
        str(path),
        7,
        True,
    )
    assert (logger.writer_fn(), logger.wandb_writer_fn()) == ("tensorboard", "wandb")
    assert logger._pp_group is parallel_state.get_pipeline_model_parallel_group
    assert logger._is_last_stage is parallel_state.is_pipeline_last_stage
    dp_groups = []
    monkeypatch.setattr(
        parallel_state,
        "get_data_parallel_group",
        lambda with_context_parallel: dp_groups.append(with_context_parallel) or "dp-cp",
    )
    assert logger._dp_group() == "dp-cp" and dp_groups == [True]
    assert pretrain._make_balance_logger(args, None).jsonl_path is None


class _Checked:
    """``pretrain.checked_args`` with the flag parser, our checks, Megatron's ``validate_args``
    and the config builder faked: the calls it makes, in order, in ``events``."""

    def __init__(self, monkeypatch, **flags):
        from megatron_latentmoe import files
        from megatron_latentmoe.compat import training as compat_training
        from megatron_latentmoe.data import corpus
        from megatron_latentmoe.training import arguments, data_args, megatron_refusals

        self.events = []
        event = self.events.append
        self.args = SimpleNamespace(
            use_checkpoint_args=False,
            load=None,
            save=None,
            ckpt_format="torch_dist",
            data_cache_path=None,
            split=None,
            tokenizer_model=None,
            trust_remote_code=False,
            data_path=None,
        )
        vars(self.args).update(flags)
        self.default_data, self.default_tokenizer = True, True
        self.layout_refusal = self.interleaved_refusal = self.megatron_assert = None
        self.vocabulary_refusal = None

        def validate_args(args, defaults):
            event(("validate_args", args, defaults))
            if self.megatron_assert:
                raise AssertionError(self.megatron_assert)

        def apply_default_tokenizer(args, tokenizer_dir):
            event(("apply_default_tokenizer", tokenizer_dir))
            args.tokenizer_model = tokenizer_dir if self.default_tokenizer else "mine"
            return self.default_tokenizer

        fakes = {
            (compat_training, "parse_with_our_flags"): lambda add: (
                event(("parse", add)) or self.args
            ),
            (compat_training, "cpu_training_defaults"): lambda args: ["fused kernels"],
            (compat_training, "apply_cpu_training_compat"): lambda: event(("cpu compat",)),
            (corpus, "default_cache_dir"): lambda: "/home/cache",
            (corpus, "default_tokenizer_dir"): lambda: "/shipped/tokenizer",
            (arguments, "validate_stable_latentmoe_args"): lambda args, has_cuda: event(
                ("validate ours", has_cuda)
            ),
            (data_args, "uses_default_data"): lambda args: self.default_data,
            (data_args, "apply_default_tokenizer"): apply_default_tokenizer,
            (megatron_refusals, "expert_layout_refusal"): lambda args: self.layout_refusal,
            (data_args, "data_vocabulary_refusal"): lambda args: (
                event(("data vocabulary",)) or self.vocabulary_refusal
            ),
            (megatron_refusals, "interleaved_schedule_refusal"): lambda args, group: (
                event(("interleaved", group)) or self.interleaved_refusal
            ),
            (megatron_refusals, "megatron_refusal"): lambda args, err: f"refused: {err}",
            (files, "folder_refusal"): lambda flag, path: None,  # tests/training/
            (resume, "load_checkpoint_args"): lambda args: (
                event(("checkpoint args",)) or {"expert_model_parallel_size"}
            ),  # what the checkpoint changed
        }
        for (module, name), fake in fakes.items():
            monkeypatch.setattr(module, name, fake)
        monkeypatch.setitem(
            sys.modules,
            "megatron.training.arguments",
            SimpleNamespace(validate_args=validate_args),
        )
        config = SimpleNamespace(microbatch_group_size_per_vp_stage=3, moe_layer_freq=[0, 1, 1])
        monkeypatch.setitem(
            sys.modules,
            "megatron_latentmoe.training.model_provider",
            SimpleNamespace(transformer_config_from_args=lambda args: config),
        )
        self.config = config
        monkeypatch.setenv("RANK", "0")

    def __call__(self, has_cuda=False):
        return pretrain.checked_args(has_cuda)


def test_checked_args_complete_a_cpu_run_with_the_shipped_corpus_and_tokenizer(monkeypatch, capsys):
    from megatron_latentmoe.training.arguments import add_stable_latentmoe_args

    checked = _Checked(monkeypatch)
    args, config, cpu_notes, default_data_dir = checked()
    assert (args, config, cpu_notes) == (checked.args, checked.config, ["fused kernels"])
    assert default_data_dir == "/home/cache"
    assert args.data_path == ["/home/cache/default_corpus"] and args.split == "98,2,0"
    assert args.moe_layer_freq == [0, 1, 1]  # the model's layers, for Megatron's FLOPs count
    assert checked.events == [
        ("parse", add_stable_latentmoe_args),
        ("validate ours", False),
        ("apply_default_tokenizer", "/shipped/tokenizer"),
        ("cpu compat",),
        ("validate_args", args, {}),
        ("interleaved", 3),
    ]
    assert capsys.readouterr().out == (
        "[pretrain_stable_latentmoe] tokenizer: the shipped one (HuggingFaceTokenizer "
        "/shipped/tokenizer)\n"
    )


def test_checked_args_name_the_shipped_corpus_dataset_after_the_runs_tokenizer(
    monkeypatch, tmp_path
):
    """--tokenizer-model DIR without --data-path: Megatron reads the shipped corpus tokenized
    with DIR, a dataset of its own name (was the shipped tokenizer's default_corpus)."""
    from megatron_latentmoe.data.corpus import default_dataset_name

    (tmp_path / "tokenizer.json").write_text("{}")
    checked = _Checked(monkeypatch, tokenizer_model=str(tmp_path))
    checked.default_tokenizer = False
    args, _, _, default_data_dir = checked()
    name = default_dataset_name(tmp_path)
    assert name.startswith("default_corpus_") and args.data_path == [f"/home/cache/{name}"]


def test_checked_args_keep_the_users_choices(monkeypatch, capsys):
    """A --data-cache-path holds the shipped corpus's tokens; a given --split is kept; a given
    tokenizer is not announced; on CUDA nothing of the CPU compat; --use-checkpoint-args first."""
    from megatron_latentmoe.cli_errors import FlagError

    checked = _Checked(monkeypatch, data_cache_path="/scratch", split="90,10,0")
    checked.default_tokenizer = False
    args, _, cpu_notes, default_data_dir = checked(has_cuda=True)
    assert default_data_dir == "/scratch/default_data" and cpu_notes == []
    assert args.data_path == ["/scratch/default_data/default_corpus"] and args.split == "90,10,0"
    assert [e[0] for e in checked.events] == [
        "parse",
        "validate ours",
        "apply_default_tokenizer",
        "validate_args",
        "interleaved",
    ]
    assert checked.events[1] == ("validate ours", True)
    assert capsys.readouterr().out == ""
    checked = _Checked(monkeypatch, use_checkpoint_args=True, data_path=["mine"])
    checked.default_data = False
    args, _, _, default_data_dir = checked()
    assert [e[0] for e in checked.events[:3]] == ["parse", "checkpoint args", "validate ours"]
    assert default_data_dir is None and args.data_path == ["mine"] and args.split is None
    # the given dataset's ids against the tokenizer, once its flags are final (not the shipped
    # corpus's: the shipped tokenizer made it)
    assert [e[0] for e in checked.events[-3:]] == [
        "validate_args",
        "data vocabulary",
        "interleaved",
    ]
    checked.vocabulary_refusal = "--data-path mine: mine.bin, in its first 1 MiB, holds token id 9"
    with pytest.raises(FlagError) as err:
        checked()
    assert str(err.value) == checked.vocabulary_refusal


def test_checked_args_refuse_a_pretrained_checkpoint_megatron_fails_to_load(monkeypatch, tmp_path):
    """--pretrained-checkpoint where --load holds none: the start-up checks of --load judge it
    (here a torch_dist checkpoint with --ckpt-format torch; before, Megatron's RuntimeError
    traceback on every rank after building the model)."""
    from megatron_latentmoe.cli_errors import FlagError
    from tests.training import dcp_checkpoint

    pre = tmp_path / "pre"
    pre.mkdir()
    dcp_checkpoint(pre, 2)
    checked = _Checked(monkeypatch, pretrained_checkpoint=str(pre), ckpt_format="torch")
    with pytest.raises(FlagError) as err:
        checked()
    assert str(err.value).startswith(
        f"--pretrained-checkpoint {pre}: {pre}/iter_0000002 is a torch_dist checkpoint"
    )
    checked = _Checked(monkeypatch, pretrained_checkpoint=str(pre), ckpt_format="torch_dist")
    assert checked()[0] is checked.args


@pytest.mark.parametrize("refusal", ["layout", "megatron", "interleaved"])
def test_checked_args_refusals_are_flag_errors(monkeypatch, refusal):
    from megatron_latentmoe.cli_errors import FlagError

    checked = _Checked(monkeypatch)
    checked.layout_refusal = "--expert-model-parallel-size 3" if refusal == "layout" else None
    checked.megatron_assert = "num_layers % pp" if refusal == "megatron" else None
    checked.interleaved_refusal = "--micro-batch-size 2" if refusal == "interleaved" else None
    message = {
        "layout": "--expert-model-parallel-size 3",
        "megatron": "refused: num_layers % pp",
        "interleaved": "--micro-batch-size 2",
    }[refusal]
    with pytest.raises(FlagError) as err:
        checked()
    assert str(err.value) == message and err.value.__cause__ is None
    called = [e[0] for e in checked.events]
    assert ("validate_args" in called) is (refusal != "layout")
    assert ("interleaved" in called) is (refusal == "interleaved")


def test_checked_args_name_a_refused_flag_the_checkpoint_gave(monkeypatch):
    from megatron_latentmoe.cli_errors import FlagError

    checked = _Checked(monkeypatch, use_checkpoint_args=True)
    checked.layout_refusal = "--expert-model-parallel-size 3 is not allowed"
    with pytest.raises(FlagError) as err:
        checked()
    assert str(err.value) == (
        "--expert-model-parallel-size 3 is not allowed (--expert-model-parallel-size: from the "
        "checkpoint's args, --use-checkpoint-args)"
    )
    assert err.value.__cause__ is None


def test_main_ends_a_full_disk_outside_a_save_in_one_line(monkeypatch, tmp_path, capsys):
    """An ``OSError`` ENOSPC out of Megatron's ``pretrain`` (the balance JSONL, TensorBoard, the
    dataset cache: a traceback before): this rank's line (``files.write_disk_failure_error``),
    exit 2; another ``OSError`` is re-raised."""
    import errno
    import shutil

    run = _Run(monkeypatch, tmp_path)
    jsonl = str(tmp_path / "balance.jsonl")
    run.raises = OSError(errno.ENOSPC, "No space left on device", jsonl)
    assert run() == 2
    free = f"{shutil.disk_usage(tmp_path).free / 1e6:.1f} MB"
    assert capsys.readouterr().err == (
        f"pretrain_stable_latentmoe: error: the disk filled up writing {jsonl} ({free} free); "
        "free space there\n"
    )
    # megatron-core's dataset cache: a bare Exception raised from numpy's nameless OSError
    run.raises = Exception("Failed to write dataset materials to the data cache directory.")
    run.raises.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    run.args.data_cache_path = str(tmp_path)
    full = lambda path: SimpleNamespace(free=0 if str(path) == str(tmp_path) else 10**9)  # noqa: E731
    monkeypatch.setattr(shutil, "disk_usage", full)
    assert run() == 2
    assert capsys.readouterr().err == (
        f"pretrain_stable_latentmoe: error: the disk filled up writing in --data-cache-path "
        f"{tmp_path} (0.0 MB free); free space there or give --data-cache-path a folder on a "
        "larger disk\n"
    )
    run.raises = OSError(errno.EACCES, "Permission denied", jsonl)
    with pytest.raises(PermissionError):
        run()


def test_main_ends_a_full_disk_under_the_shipped_corpus_in_one_line(monkeypatch, tmp_path, capsys):
    """Tokenizing the shipped corpus into a full disk: ``preprocess_jsonl``'s write raised a bare
    ``OSError: [Errno 28] No space left on device`` (measured on a 64 KiB tmpfs), a traceback;
    now one line naming the folder and --data-cache-path, exit 2 (the disk has room again once
    the cut files are removed: the folder is named all the same)."""
    import errno
    import shutil

    from megatron_latentmoe.data import corpus

    run = _Run(monkeypatch, tmp_path, tokenizer_model="/shipped", trust_remote_code=False)
    run.default_data_dir, run.cpu_notes = str(tmp_path / "default_data"), []

    def full(d, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(corpus, "prepare_default_dataset", full)
    assert run() == 2  # the cut files removed: free space again (measured), the folder named
    free = f"{shutil.disk_usage(tmp_path).free / 1e6:.1f} MB"
    assert capsys.readouterr().err == (
        "pretrain_stable_latentmoe: error: the shipped corpus's dataset: the disk filled up "
        f"writing in --data-cache-path {tmp_path / 'default_data'} ({free} free); free space "
        "there or give --data-cache-path a folder on a larger disk\n"
    )
    assert "pretrain" not in [e[0] for e in run.events]


def _tree(root, persistent, tracker, non_persistent=None):
    """Complete torch_dist folders ``root/<name>`` for each name in ``persistent`` (``release``
    or an iteration), ``root``'s tracker holding ``tracker``; a global non-persistent tracker
    and checkpoint at ``root/np`` of iteration ``non_persistent``."""
    from megatron_latentmoe.checkpoint_layout import iteration_dir_name

    folders = [(root, iteration_dir_name(None if p == "release" else p)) for p in persistent]
    if non_persistent is not None:
        folders.append((root / "np", iteration_dir_name(non_persistent)))
        (root / "np").mkdir()
        (root / "np" / TRACKER_FILE).write_text(str(non_persistent))
    for folder, name in folders:
        (folder / name).mkdir()
        for file in (".metadata", "metadata.json"):
            (folder / name / file).write_text("{}")
    (root / TRACKER_FILE).write_text(tracker)


# (flag, persistent folders, tracker, non-persistent iteration, --ckpt-step, the folder loaded)
LOADED_FOLDERS = {
    "persistent": ("load", [2, 4], "4", None, None, "iter_0000004"),
    "release on --load": ("load", ["release"], "release", None, None, "release"),
    "release on --pretrained-checkpoint": (
        "pretrained_checkpoint",
        ["release"],
        "release",
        None,
        None,
        "release",
    ),
    "newer non-persistent": ("load", [4], "4", 5, None, "np/iter_0000005"),
    "as new non-persistent": ("load", [4], "4", 4, None, "np/iter_0000004"),
    "older non-persistent": ("load", [4], "4", 3, None, "iter_0000004"),
    "release and a non-persistent": ("load", ["release"], "release", 3, None, "np/iter_0000003"),
    "--ckpt-step": ("load", [2, 4], "4", None, 2, "iter_0000002"),
    "--ckpt-step and a non-persistent": ("load", [2, 4], "4", 3, 2, "np/iter_0000003"),
    "--ckpt-step with release": ("load", [2, "release"], "release", None, 2, "release"),
    # Megatron compares the non-persistent iteration with --ckpt-step's, release or not
    "--ckpt-step with release and an older non-persistent": (
        "load",
        ["release"],
        "release",
        3,
        5,
        "release",
    ),
}


@pytest.mark.parametrize("case", LOADED_FOLDERS)
def test_every_check_reads_the_folder_megatron_loads(monkeypatch, tmp_path, capsys, case):
    """One folder per case, the one megatron-core 0.19.2's ``_load_base_checkpoint`` loads (a
    ``release`` tracker: ``release`` from --load too, iteration 0; --ckpt-step's iteration, but a
    release tracker's release flag kept; a global non-persistent checkpoint as new or newer
    wins): the folder the file and format checks judge (``resumed_by_args``), the one whose args
    the entry point's shape check reads, and the one ``--use-checkpoint-args`` reads. Before, the
    shape check read nothing for a release checkpoint on --load: one of another hidden size
    failed in Megatron's load with a "Global shape mismatch" traceback (measured, CPU, 1 rank)."""
    from megatron.core import dist_checkpointing

    load_arg, persistent, tracker, non_persistent, step, loaded = LOADED_FOLDERS[case]
    root = tmp_path / "ckpt"
    root.mkdir()
    _tree(root, persistent, tracker, non_persistent)
    read = []

    def load_common_state_dict(path):
        read.append(os.path.relpath(path, root))
        return {"args": SimpleNamespace(hidden_size=64)}

    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", load_common_state_dict)
    flags = dict(
        load=str(root) if load_arg == "load" else None,
        pretrained_checkpoint=str(root) if load_arg == "pretrained_checkpoint" else None,
        non_persistent_ckpt_type="global" if non_persistent else None,
        non_persistent_global_ckpt_dir=str(root / "np") if non_persistent else None,
        ckpt_step=step,
        hidden_size=128,
    )
    real = [
        (module, name, getattr(module, name))
        for module, name in (
            (resume, "saved_args"),
            (resume, "repair_checkpoint_tracker"),
            (checkpoint_repair, "repair_checkpoint_tracker"),
        )
    ]
    run = _Run(monkeypatch, tmp_path, **flags)
    for module, name, function in real:  # _Run fakes them
        monkeypatch.setattr(module, name, function)
    assert os.path.relpath(resume.resumed_by_args(run.args, load_arg), root) == loaded
    assert run() == 2  # the shape check read that folder's args
    assert read == [loaded]
    assert "the checkpoint is of another model shape: --hidden-size 64" in capsys.readouterr().err
    checkpointing = SimpleNamespace(load_args_from_checkpoint=lambda args, load_arg: None)
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", checkpointing)
    read.clear()
    resume.load_checkpoint_args(run.args)
    assert read == [loaded]
