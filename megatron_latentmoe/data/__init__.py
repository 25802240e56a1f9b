"""Embedded default corpus + tokenizer, and JSONL -> Megatron indexed dataset preprocessing.

The shipped assets' locations live here, so that :mod:`.corpus` (the default dataset) and
:mod:`.indexed` (the preprocessing, which defaults to the shipped tokenizer) both import them
from the package, not from each other."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_CORPUS_PATH = ASSETS_DIR / "default_corpus.jsonl.gz"
DEFAULT_TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
