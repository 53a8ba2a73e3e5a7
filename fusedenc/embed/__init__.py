"""Embedding a corpus: ``python -m fusedenc embed MODEL INPUT -o OUTPUT`` (cli.py), and the
same from Python, ``fusedenc.embed.encode(load_model(...), texts)`` (embedding.py): tokenized
in threads, sorted by length, batched by a token budget, on the patched model's fast path.
texts.py reads ``.txt``, ``.jsonl`` and ``.parquet`` corpora; st_folder.py reads what a
sentence-transformers folder computes."""

from .embedding import DEFAULT_MAX_BATCH_TOKENS, EncodeStats, Model, encode, load_model
from .texts import Corpus, InputError, read_corpus

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "Corpus", "EncodeStats", "InputError", "Model", "encode", "load_model",
           "read_corpus"]
