"""The checks and defaults of the entry point's data flags: this module's one job (the other
flags and their checks are :mod:`.arguments`', whose ``validate_stable_latentmoe_args`` runs the
dataset checks here; the entry point, :mod:`.pretrain`, applies the defaults and the vocabulary
check; whether the data a resumed run still has fits is :mod:`.data_left`'s).

No dataset flag (``--data-path``, ``--train-data-path`` ..., ``--data-args-path``,
``--per-split-data-args-path``, ``--mock-data``): the run trains on the shipped corpus
(:func:`uses_default_data`); no tokenizer flag: with the shipped tokenizer
(:func:`apply_default_tokenizer`). A given dataset is checked before any rank starts: its
``.bin``/``.idx`` pair (:func:`check_data_paths`), ``--split`` against its sequences
(:func:`check_split`), the token ids at its head against the run's vocabulary
(:func:`data_vocabulary_refusal`; :func:`run_vocabulary` and :func:`data_description` serve the
batches' check too, ``forward_step.get_batch``). Each check raises the entry point's
:class:`~megatron_latentmoe.cli_errors.FlagError`, as :mod:`.arguments`' do.
"""

from __future__ import annotations

import argparse
import math
import os
import warnings
from collections.abc import Iterable

from megatron_latentmoe.cli_errors import FlagError
from megatron_latentmoe.data.errors import PreprocessError
from megatron_latentmoe.data.index_file import (
    HEAD_BYTES,
    Vocabulary,
    check_indexed_dataset,
    max_token_id_in_head,
    read_index_header,
    stopped_write_leftover,
)


def data_prefixes(paths: list[str] | None) -> Iterable[str]:
    """The file prefixes of a Megatron blend list ``[w1] p1 [w2] p2 ...`` (weights skipped)."""
    for item in paths or []:
        for token in str(item).split():
            try:
                float(token)
            except ValueError:
                yield token


_DATA_PATHS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
_DATA_ARGS_FILES = ("data_args_path", "per_split_data_args_path")


def check_data_paths(args) -> None:
    for dest in _DATA_PATHS:
        flag, paths = "--" + dest.replace("_", "-"), getattr(args, dest)
        if paths is not None and not list(data_prefixes(paths)):
            raise FlagError(
                f"{flag} {' '.join(map(str, paths))!r} has no dataset prefix: allowed are "
                "PREFIX or WEIGHT PREFIX [WEIGHT PREFIX ...] (Megatron .bin/.idx prefixes)"
            )
        for prefix in data_prefixes(paths):
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            leftover = stopped_write_leftover(prefix) if ".idx" in missing else None
            if leftover:
                raise FlagError(
                    f"{flag} {prefix}: no Megatron indexed dataset there (missing "
                    f"{' and '.join(prefix + e for e in missing)}, but {leftover} is there): a "
                    "tools/preprocess_data.py run stopped before it finished leaves that (it "
                    "renames the .idx into place last). Rerun it to write the dataset."
                )
            if missing:
                raise FlagError(
                    f"{flag} {prefix}: no Megatron indexed dataset there (missing "
                    f"{' and '.join(prefix + e for e in missing)}). Give the path prefix of a "
                    ".bin/.idx pair (tools/preprocess_data.py writes one), or leave --data-path "
                    "out to train on the shipped corpus."
                )
            try:
                check_indexed_dataset(prefix)
            except PreprocessError as err:
                raise FlagError(f"{flag} {prefix}: {err}") from None
    for dest in _DATA_ARGS_FILES:
        path = getattr(args, dest)
        if path is not None and not os.path.isfile(path):
            raise FlagError(f"--{dest.replace('_', '-')} {path}: no such file")


def run_vocabulary(args, tokenizer=None) -> Vocabulary | None:
    """The token ids this run's data may hold: the vocabulary of the tokenizer Megatron builds
    from these args (``tokenizer``: the one it built; else one is built here, on a copy of the
    args: 15 ms for the shipped tokenizer, after 2.7 s to import ``transformers`` the first time,
    which the run's own build of the tokenizer imports anyway), and the embedding's padded size.
    None when the tokenizer cannot be built here: the run then fails where it did before,
    building it."""
    from megatron.core.tokenizers.utils.build_tokenizer import (
        build_tokenizer,
        vocab_size_with_padding,
    )

    if tokenizer is None:
        try:
            # on a copy, not padding: no padded_vocab_size set, no "padded vocab" log line
            tokenizer = build_tokenizer(argparse.Namespace(**{**vars(args), "pad_vocab_size": 0}))
        except Exception:  # noqa: BLE001 - the run's own build reports it
            return None
    size = int(tokenizer.vocab_size)
    padded = getattr(args, "padded_vocab_size", None) or vocab_size_with_padding(
        size, args, logging_enabled=False
    )
    kind, model = args.tokenizer_type, args.tokenizer_model
    if kind == "HuggingFaceTokenizer":
        remake = (
            f"Remake it with tools/preprocess_data.py --tokenizer {model} (this run's "
            "tokenizer), or train with the tokenizer that made it (--tokenizer-model)"
        )
    else:
        remake = "Remake it with this run's tokenizer, or train with the tokenizer that made it"
    named = (
        model or args.vocab_file or (f"--vocab-size {args.vocab_size}" if args.vocab_size else "")
    )
    return Vocabulary(size, padded, f"{kind} {named}".strip(), remake)


def data_vocabulary_refusal(args) -> str | None:
    """One line when the head of a ``--data-path`` (``--train-data-path`` ...) dataset holds a
    token id outside this run's vocabulary (:func:`run_vocabulary`): a dataset made with another
    tokenizer, which megatron-core 0.19.2 trains on until the embedding raises ``IndexError:
    index out of range in self`` on every rank (an id past the padded embedding), or trains on
    silently (an id in its padding rows). Reads the first ``HEAD_BYTES`` of each ``.bin``
    (:func:`~megatron_latentmoe.data.index_file.max_token_id_in_head`); the batches check the rest
    (``forward_step.get_batch``). None: no refusal, or no dataset flag, or a tokenizer that
    cannot be built here."""
    datasets = [
        ("--" + dest.replace("_", "-"), prefix)
        for dest in _DATA_PATHS
        for prefix in dict.fromkeys(data_prefixes(getattr(args, dest)))
    ]
    vocabulary = run_vocabulary(args) if datasets else None
    if vocabulary is None:
        return None
    for flag, prefix in datasets:
        where = f"{flag} {prefix}: {prefix}.bin, in its first {HEAD_BYTES >> 20} MiB,"
        refusal = vocabulary.refusal(where, max_token_id_in_head(prefix))
        if refusal:
            return refusal
    return None


def data_description(args) -> str:
    """The dataset flags of this run with their values, as a message names them."""
    given = [
        f"--{dest.replace('_', '-')} {' '.join(map(str, getattr(args, dest)))}"
        for dest in _DATA_PATHS
        if getattr(args, dest)
    ]
    return ", ".join(given) or "the data"


MEGATRON_DEFAULT_SPLIT = "969, 30, 1"
"""``--split`` that megatron.training 0.19.2 uses with ``--data-path`` when none is given."""


def _sequence_count(prefix: str) -> int:
    """Sequences in the Megatron indexed dataset ``prefix`` (what Megatron's GPT datasets split),
    from its ``.idx`` header."""
    try:
        return read_index_header(prefix)[2]
    except PreprocessError as err:
        raise FlagError(f"--data-path {prefix}: {err}") from None


def check_split(args, datasets: list[tuple[str, int]] | None = None) -> None:
    """Every non-zero part of ``--split`` must get at least one sequence of every ``--data-path``
    dataset: megatron-core 0.19.2 builds a part with none by asking an epoch of 0 tokens for 1
    token, forever (``GPTDataset._get_num_epochs``), a hang without a message. Megatron's own
    default split, 969,30,1, gives the test part 0.1 %: no sequence in a dataset of under 500.
    ``datasets``: (name, sequences) pairs to check instead of ``--data-path``'s."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    split = MEGATRON_DEFAULT_SPLIT if args.split is None else args.split
    try:
        with warnings.catch_warnings():  # numpy's divide-by-zero of a zero sum: refused below
            warnings.simplefilter("ignore")
            vector = parse_and_normalize_split(split)
        if not all(math.isfinite(w) for w in vector):
            raise ValueError(split)
        matrix = convert_split_vector_to_split_matrix(vector)
    except (AssertionError, ValueError, ZeroDivisionError):
        raise FlagError(
            f"--split {split!r}: allowed: up to three non-negative weights (train, validation, "
            "test) with a positive sum, e.g. 98,2,0"
        ) from None
    given = (
        f"--split {split}"
        if args.split is not None
        else f"--split, not given, is Megatron's default {MEGATRON_DEFAULT_SPLIT.replace(' ', '')},"
        " which"
    )
    if datasets is None:
        datasets = [(f"--data-path {p}", _sequence_count(p)) for p in data_prefixes(args.data_path)]
        evaluated = [
            part for part, bounds in zip(("validation", "test"), matrix[1:], strict=True) if bounds
        ]
        if len(datasets) > 1 and evaluated and not args.eval_iters and not args.full_validation:
            # megatron-core 0.19.2 sizes each blend part by its samples: --eval-iters 0 asks
            # the validation / test blend for 0, and its data loader asserts 'no sample to
            # consume: 0' on every rank (one dataset is sized by the split instead and passes)
            raise FlagError(
                f"--data-path with {len(datasets)} datasets (a blend), --eval-iters 0 and a "
                f"{evaluated[0]} part in --split {split.replace(' ', '')}: megatron-core 0.19.2 "
                "builds that part's blend with 0 samples and fails at start; allowed: "
                "--eval-iters N > 0, or a --split with no validation or test part (e.g. 100,0,0)"
            )
    for name, n in datasets:
        for part, bounds in zip(("train", "validation", "test"), matrix, strict=True):
            if bounds is not None and round(bounds[1] * n) <= round(bounds[0] * n):
                raise FlagError(
                    f"{given} gives the {part} part none of the {n} sequences of "
                    f"{name} (Megatron would hang building it); allowed: a --split whose every "
                    "non-zero part gets at least one sequence, e.g. 98,2,0 (0 for a part you do "
                    "not need)"
                )


def uses_default_data(args) -> bool:
    """True when no dataset flag is given: train on the shipped corpus."""
    return not (args.mock_data or any(getattr(args, d) for d in _DATA_PATHS + _DATA_ARGS_FILES))


def apply_default_tokenizer(args, tokenizer_dir: str) -> bool:
    """Use the shipped tokenizer when no tokenizer flag is given, or ``--tokenizer-type
    HuggingFaceTokenizer`` without ``--tokenizer-model`` (megatron-core 0.19.2 would build a
    Hugging Face tokenizer from no path, after the flag check). Returns True if it did."""
    if args.tokenizer_type in (None, "HuggingFaceTokenizer") and args.tokenizer_model is None:
        args.tokenizer_type = "HuggingFaceTokenizer"
        args.tokenizer_model = tokenizer_dir
        return True
    if args.tokenizer_type is None:
        args.tokenizer_type = "HuggingFaceTokenizer"
    return False
