"""Embedded default corpus + tokenizer, and JSONL -> Megatron indexed dataset preprocessing.

The shipped corpus's dataset is :mod:`.corpus`'s, the preprocessing :mod:`.indexed`'s; what it
uses: reading the JSONL (:mod:`.jsonl`), the tokenizer (:mod:`.hf_tokenizer`), reading and
checking a written ``.bin``/``.idx`` pair (:mod:`.index_file`, which the entry point's flag checks
use too), Ctrl-C and SIGTERM around a write (:mod:`.signals`), and the error bad input raises
(:mod:`.errors`).

The shipped assets' locations live here, so that :mod:`.corpus` (the default dataset) and
:mod:`.hf_tokenizer` (the preprocessing's tokenizer, the shipped one by default) both import them
from the package, not from each other."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_CORPUS_PATH = ASSETS_DIR / "default_corpus.jsonl.gz"
DEFAULT_TOKENIZER_DIR = ASSETS_DIR / "tokenizer"


def is_shipped_tokenizer(path: str) -> bool:
    """``path`` is the shipped tokenizer of some install of this package (its package-relative
    path), e.g. the ``--tokenizer-model`` a checkpoint recorded in a clone since moved or
    deleted: this install's :data:`DEFAULT_TOKENIZER_DIR` holds the same files."""
    return Path(path).parts[-4:] == DEFAULT_TOKENIZER_DIR.parts[-4:]
