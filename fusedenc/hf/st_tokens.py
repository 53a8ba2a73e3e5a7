"""A patched ``SentenceTransformer.encode()``'s tokenization: each text's token ids (and token
types) for the corpus loop (``sentences._encode_texts``), the same ids as the model's own
``preprocess`` gives, at a third of its host time where that can be shown.

``preprocess`` (``tokenize`` before sentence-transformers 6) pads every chunk and returns
``input_ids``, ``attention_mask`` and ``token_type_ids`` as tensors: turning the padded
lists into three tensors costs about twice the tokenizing itself (80 vs 29 us a sentence
on one CPU core, all-MiniLM-L6-v2's tokenizer), all of it holding the GIL, and a patched
``encode()`` that feeds a GPU is bound by exactly that.  The model's fast tokenizer asked
for the ids alone, truncated to ``max_seq_length``, gives the same ids wherever
``preprocess`` is plain tokenizing (its lower-casing is the tokenizer's own setting from
sentence-transformers 6 on), and its Rust backend asked directly (``fast_ids.backend_ids``)
gives them at a fraction of the call's host time again; but a module may do more (a processor, a chat template, other
processing settings, a query expansion), so each call checks: the fast ids must equal
``preprocess``'s real tokens, with token types all zero, on a sample of its texts (the
longest, the shortest, some between, one made longer than ``max_seq_length`` so that
truncation is compared too, and one upper-cased with spaces around it for the stripping and
lower-casing older releases did themselves), else every chunk goes through ``preprocess``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from . import fast_ids
from .token_batches import PackedIds

__all__ = ["chunk_tokenizer"]

Tokenized = tuple[PackedIds, Optional[PackedIds]]  # the texts' token ids, their token types (None: zeros)


def chunk_tokenizer(model: Any, texts: list) -> Callable[[list], Tokenized]:
    """``tokenize(chunk) -> (ids, types)`` for ``texts``' chunks: the fast tokenizer's ids
    where a sample of ``texts`` shows them equal to ``preprocess``'s, else ``preprocess``'s
    real tokens (read off its attention mask)."""
    preprocess = getattr(model, "preprocess", None) or model.tokenize  # tokenize() before 6.0

    def from_preprocess(chunk: list) -> Tokenized:
        features = preprocess(chunk)
        real = features["attention_mask"].numpy() != 0
        types = features.get("token_type_ids")
        return (PackedIds.from_padded(features["input_ids"].numpy(), real),
                None if types is None else PackedIds.from_padded(types.numpy(), real))  # fmt: skip

    fast = _fast_ids(model)
    if fast is None:
        return from_preprocess

    def preprocess_ids(chunk: list) -> list:  # each text's ids, as fast_ids.checked compares them
        ids, types = from_preprocess(chunk)
        if types is not None and np.any(types.flat):  # the fast path gives no token types
            raise ValueError("preprocess gives token types other than 0")
        return list(ids)

    # fast_ids.checked: preprocess itself for a short call, where the sample disagrees, or where
    # the check cannot run (a probe the module refuses, token types the fast path lacks).
    chosen = fast_ids.checked(texts, fast, preprocess_ids, int(model.max_seq_length))
    if chosen is preprocess_ids:
        return from_preprocess

    def packed(chunk: list) -> Tokenized:
        return PackedIds.pack(fast(chunk)), None

    packed.__name__ = fast.__name__  # which fast path: fast_backend or fast_call
    return packed


def _fast_ids(model: Any) -> Optional[Callable[[list], list]]:
    """Each text's ids from the module's fast tokenizer, truncated to ``max_seq_length``: from
    its backend (``fast_ids.backend_ids``), or its call where the backend cannot be copied."""
    tokenizer = getattr(model, "tokenizer", None)
    max_length = getattr(model, "max_seq_length", None)
    if not getattr(tokenizer, "is_fast", False) or not isinstance(max_length, int) or max_length < 2:
        return None
    backend = fast_ids.backend_ids(tokenizer, max_length)
    if backend is not None:

        def fast_backend(chunk: list) -> list:
            return backend(chunk)

        return fast_backend

    def fast_call(chunk: list) -> list:
        return tokenizer(chunk, truncation=True, max_length=max_length, return_attention_mask=False,
                         return_token_type_ids=False, verbose=False)["input_ids"]  # fmt: skip

    return fast_call
