"""Loading the Hugging Face tokenizer that the preprocessing tokenizes with, and what of it the
preprocessing cannot honour (Megatron's flags that change its ids) or needs (its EOS id as EOD).

``transformers`` is imported only when a tokenizer is loaded: the entry point's flag checks
import :data:`TOKENIZER_FLAGS_NOT_HONOURED` without it.
"""

from __future__ import annotations

import os
from typing import Any

from . import DEFAULT_TOKENIZER_DIR
from .errors import PreprocessError


class NoEosError(PreprocessError):
    """``append_eod`` with a tokenizer that has no eos token: callers that cannot turn
    ``append_eod`` off (the shipped corpus's dataset) say what the user can do instead."""


_HF_FOLDER = "the tokenizer is the Hugging Face folder given by --tokenizer-model"
TOKENIZER_FLAGS_NOT_HONOURED: dict[str, tuple[str, str]] = {
    "--vocab-file": ("vocab_file", _HF_FOLDER),
    "--merge-file": ("merge_file", _HF_FOLDER),
    "--tokenizer-metadata": ("metadata_path", _HF_FOLDER),
    "--tokenizer-special-tokens": (
        "special_tokens",
        "it adds tokens to the vocabulary; add them to the tokenizer folder instead "
        "(add_special_tokens, save_pretrained)",
    ),
    "--tokenizer-hf-no-use-fast": (
        "tokenizer_hf_no_use_fast",
        "the folder's fast tokenizer is used",
    ),
    "--tokenizer-hf-no-include-special-tokens": (
        "tokenizer_hf_no_include_special_tokens",
        "tokenizer(text).input_ids is written, special tokens included",
    ),
}
"""Megatron's flags that change the ids of its ``HuggingFaceTokenizer`` and that the preprocessing
here cannot honour (:func:`load_tokenizer` loads the ``--tokenizer-model`` folder as it is): each
flag's args attribute, and why. tools/preprocess_data.py refuses them; so does a training run on
the shipped corpus, which it tokenizes with the run's tokenizer (:mod:`.corpus`)."""


def load_tokenizer(
    tokenizer: str | os.PathLike | Any | None = None, trust_remote_code: bool = False
):
    """A Hugging Face tokenizer from a folder (the shipped one when ``None``) or an object as is.

    ``trust_remote_code``: let a tokenizer whose ``tokenizer_config.json`` names its own Python
    class (``auto_map``) run that code, as Megatron's ``--trust-remote-code``; without it such a
    tokenizer is refused (never the interactive prompt of ``transformers``)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is None:
        tokenizer = DEFAULT_TOKENIZER_DIR
    path = os.fspath(tokenizer)
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is in the [hf] extra
        raise PreprocessError(
            "preprocessing needs `transformers` (pip install 'megatron-latentmoe[hf]')"
        ) from e
    if not os.path.isdir(path):
        # A hub name works only if it is already in the local HF cache: nothing is downloaded here.
        try:
            tok = AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=trust_remote_code
            )
        except Exception as e:
            _refuse_remote_code(path, e, trust_remote_code)
            raise PreprocessError(
                f"tokenizer not found: {path!r} is not a folder (nor a cached HF name): "
                f"{one_line(e)}"
            ) from e
    else:
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as e:
            _refuse_remote_code(path, e, trust_remote_code)
            why = one_line(e)
            if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
                why = f"no {' nor '.join(TOKENIZER_FILES)} there ({why})"
            raise PreprocessError(f"cannot load the tokenizer in {path}: {why}") from e
    # Documents are longer than any model context; silence "sequence length is longer than"
    # warnings.
    tok.model_max_length = 1 << 62
    return tok


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A Hugging Face tokenizer folder holds one of them (an older one may load without: vocab files
and a config.json; named only when loading failed)."""


def one_line(error: Exception) -> str:
    """``transformers``' message on one line: an empty folder's ran over five (measured,
    transformers 5.25: "Couldn't instantiate the backend tokenizer from one of: ...")."""
    return " ".join(str(error).split())


def _refuse_remote_code(path: str, error: Exception, trust_remote_code: bool) -> None:
    if not trust_remote_code and "trust_remote_code" in str(error):
        raise PreprocessError(
            f"the tokenizer {path!r} runs its own Python code (auto_map in its "
            "tokenizer_config.json): allow it with --trust-remote-code (trust_remote_code=True)"
        ) from None


def eod_id(tok) -> int:
    """The id the preprocessing appends as Megatron's EOD: the tokenizer's eos token's;
    :class:`NoEosError` when it has none."""
    eod = getattr(tok, "eos_token_id", None)
    if eod is None:
        raise NoEosError(
            "the tokenizer has no eos_token, so no EOD can be appended: turn it off with "
            "--no-append-eod (append_eod=False)"
        )
    return int(eod)
