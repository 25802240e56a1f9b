"""Whether this run's datasets can serve the data offset of the checkpoint it loaded: this
module's one job. Megatron knows the offset after its load and the datasets' lengths once it builds
them, after the model; :func:`checks_data_left` wraps the datasets provider that the entry point,
:mod:`.pretrain`, gives Megatron, and raises :class:`DataLeftError` with
:func:`data_left_refusal`'s line. A release loaded without ``--finetune``, which gets there:
:func:`.resume.release_data_warning`.
"""

from __future__ import annotations


class DataLeftError(ValueError):
    """The data offset a loaded checkpoint gives this run does not fit its datasets
    (:func:`data_left_refusal`): every rank builds the same datasets and raises it alike."""


def data_left_refusal(args, train_len: int | None, valid_len: int | None) -> str | None:
    """One line when the samples the loaded checkpoint's run consumed (``args``, after Megatron's
    load) do not fit this run's datasets (their lengths; None: not built). megatron-core 0.19.2
    continues the data after them but sizes each dataset for this run's own samples, in whole
    epochs of the data: ``MegatronPretrainingSampler`` asserted "no samples left to consume" on
    every rank after the model was built, and where the offset fits but not the samples this run
    reads after it, training stopped with a bare ``StopIteration``. Measured (CPU, 1 rank,
    tiny.sh, global batch 8; a run of 16 iterations with ``--split 1,1,98``, 64 evaluated samples
    every 4): its checkpoint of 16 made a release, loaded with ``--split 1,0,99``: "128, 99"
    (``--train-iters 1``), a StopIteration (``20``: 128 + 160 of 198); of 8, with ``--eval-iters
    0``: "128, 113" for the validation data; a plain resume of 16 with ``--train-iters 8`` (and
    ``--override-opt_param-scheduler``): "128, 99". A release gets there without ``--finetune``
    (:func:`.resume.release_data_warning`; a longer run sizes its data for its longer self: no
    way out).
    Where the validation data holds the offset but not this run's evaluations after it
    (:func:`_evaluations`; e.g. a release of a run that evaluated more often), the evaluation
    that reaches its end stops with a ``StopIteration`` on every rank. Measured (same set-up,
    ``--split 98,1,1``): a run of 16 iterations evaluating 32 samples every 2 (256 evaluated)
    made a release, loaded with ``--train-iters 16 --eval-interval 4 --eval-iters 8``: "256, 320
    more (5 evaluations ...), 354" (3 epochs of 118); without the check, a traceback ending in
    ``StopIteration`` in the evaluation at iteration 8 (256 + 64 read at 4, 64 more past 354).

    ``--skip-train``: megatron-core 0.19.2 builds no training loader and starts the validation one
    at sample 0 (sized for one evaluation): nothing to check. ``--phase-transition-iterations``:
    the training loader starts at this phase's samples (``(iteration - last transition) x global
    batch``, sized for the phase and read to its end at most): not checked; the validation one
    continues the checkpoint's evaluated samples as any (checked). ``--full-validation`` starts
    the validation data at 0 (``--rampup-batch-size`` is refused by the flag check).
    ``--dataloader-type cyclic``: ``MegatronPretrainingRandomSampler`` wraps around the data
    (epochs), never runs out; ``external``: the user's loaders: not checked."""
    if args.skip_train or getattr(args, "dataloader_type", None) in ("cyclic", "external"):
        return None
    release = args.iteration == 0
    head = f"--load {args.load}: " + (
        "a release checkpoint without --finetune continues the"
        if release
        else f"the checkpoint of iteration {args.iteration} continues the"
    )
    ways = (
        "pass --finetune to start the data from sample 0 (a larger --train-iters or "
        "--train-samples sizes the data for that many samples alone)"
        if release
        else f"resume with a --train-iters above {args.iteration} and the data the checkpoint's "
        "run trained on, or pass --finetune to load its model alone and start the data over"
    )
    consumed = args.consumed_train_samples
    end, exits = _last_iteration(args)
    reads = max(0, end - args.iteration) * args.global_batch_size
    phases = getattr(args, "phase_transition_iterations", None)
    if train_len is not None and not phases and consumed + max(reads, 1) > train_len:
        return (
            f"{head} training data after the {consumed} samples its run consumed, and this run "
            f"reads {reads} more, but this run's training data holds {train_len} samples (sized "
            "for this run's samples in whole epochs of the data): megatron-core 0.19.2 fails on "
            "every rank with 'no samples left to consume' at start or with a StopIteration; "
            f"{ways}"
        )
    consumed = args.consumed_valid_samples
    if valid_len is None or args.full_validation:
        return None
    if consumed >= valid_len:
        return (
            f"{head} validation data after the {consumed} samples its run evaluated, but this "
            f"run's validation data holds {valid_len} samples (sized for this run's evaluations "
            "in whole epochs of the data, --eval-iters 0 included): megatron-core 0.19.2 fails "
            f"on every rank at start with 'no samples left to consume'; {ways}"
        )
    evaluations = _evaluations(args, end, exits)
    batch = getattr(args, "eval_global_batch_size", args.global_batch_size)
    evaluates = evaluations * args.eval_iters * batch
    if consumed + evaluates > valid_len:
        plural = "" if evaluations == 1 else "s"
        return (
            f"{head} validation data after the {consumed} samples its run evaluated, and this "
            f"run evaluates {evaluates} more ({evaluations} evaluation{plural} of --eval-iters "
            f"{args.eval_iters} x {batch} samples), but this run's validation data holds "
            f"{valid_len} samples (sized for this run's evaluations in whole epochs of the data): "
            "megatron-core 0.19.2 fails on every rank with a StopIteration in the evaluation "
            f"that reaches its end; {ways}"
        )
    return None


def _last_iteration(args) -> tuple[int, bool]:
    """(the iteration this run trains to, whether it exits there): megatron-core 0.19.2 trains
    to ``--train-iters`` unless an ``--exit-interval`` multiple or a phase transition after the
    loaded iteration comes first, where it saves and exits (``sys.exit``, no final evaluation).
    ``--exit-duration-in-mins`` and signals may stop it sooner: not foreseen."""
    start, last = args.iteration, args.train_iters
    stops = [i for i in getattr(args, "phase_transition_iterations", None) or () if i > start]
    if getattr(args, "exit_interval", None):
        stops.append((start // args.exit_interval + 1) * args.exit_interval)
    stop = min(stops, default=None)
    if stop is not None and stop <= last:
        return stop, True
    return max(last, start), False


def _evaluations(args, end: int, exits: bool) -> int:
    """The evaluations of the validation data this run makes after the loaded iteration, as
    megatron-core 0.19.2's train loop makes them: one at each multiple of ``--eval-interval``
    after it up to ``end`` (from ``--start-eval-at-iter``), and one after the loop unless the run
    exits at ``end`` (:func:`_last_iteration`); none with ``--eval-iters 0``."""
    if not args.eval_iters:
        return 0
    first, interval = max(args.iteration + 1, args.start_eval_at_iter or 0), args.eval_interval
    loop = end // interval - (first - 1) // interval if interval and end >= first else 0
    return loop + (0 if exits else 1)


def checks_data_left(provider):
    """Megatron's datasets provider, raising :class:`DataLeftError` where the datasets it builds
    cannot serve the loaded checkpoint's data offset (:func:`data_left_refusal`): their lengths
    are known only once built (Megatron's loaders are built right after, from the same
    lengths). ``functools.wraps`` copies the ``is_distributed`` that Megatron reads."""
    import functools

    @functools.wraps(provider)
    def provider_checking_data_left(*a, **kw):
        from megatron.training import get_args

        train_ds, valid_ds, test_ds = provider(*a, **kw)
        refusal = data_left_refusal(
            get_args(), _length(train_ds), None if isinstance(valid_ds, list) else _length(valid_ds)
        )
        if refusal:
            raise DataLeftError(refusal)
        return train_ds, valid_ds, test_ds

    return provider_checking_data_left


def _length(dataset) -> int | None:
    return None if dataset is None else len(dataset)
