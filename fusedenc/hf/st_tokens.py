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
sentence-transformers 6 on), but a module may do more (a processor, a chat template, other
processing settings, a query expansion), so each call checks: the fast ids must equal
``preprocess``'s real tokens, with token types all zero, on a sample of its texts (the
longest, the shortest, some between, one made longer than ``max_seq_length`` so that
truncation is compared too, and one upper-cased with spaces around it for the stripping and
lower-casing older releases did themselves), else every chunk goes through ``preprocess``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

__all__ = ["chunk_tokenizer"]

#: Texts of a call compared between the fast tokenizer and ``preprocess`` from each end of
#: its length order and from between (about 2 ms of ``preprocess``).
_SAMPLE_EACH = 8

Tokenized = tuple[list, Optional[list]]  # each text's token ids, each one's token types (None: zeros)


def chunk_tokenizer(model: Any, texts: list) -> Callable[[list], Tokenized]:
    """``tokenize(chunk) -> (ids, types)`` for ``texts``' chunks: the fast tokenizer's ids
    where a sample of ``texts`` shows them equal to ``preprocess``'s, else ``preprocess``'s
    real tokens (read off its attention mask)."""
    preprocess = getattr(model, "preprocess", None) or model.tokenize  # tokenize() before 6.0

    def from_preprocess(chunk: list) -> Tokenized:
        features = preprocess(chunk)
        real = features["attention_mask"].numpy() != 0
        ids = [row[keep] for row, keep in zip(features["input_ids"].numpy(), real)]
        types = features.get("token_type_ids")
        return ids, None if types is None else [row[keep] for row, keep in zip(types.numpy(), real)]

    fast = _fast_ids(model)
    if fast is None or len(texts) <= 3 * _SAMPLE_EACH:  # a short call: the sample would be the call
        return from_preprocess
    try:
        sample = _sample(texts, fast, int(model.max_seq_length))
        same = _same_tokens(from_preprocess(sample), fast(sample))
    except Exception:  # noqa: BLE001 - a check that cannot run (a probe the module refuses): its own path
        same = False
    return fast if same else from_preprocess


def _fast_ids(model: Any) -> Optional[Callable[[list], Tokenized]]:
    tokenizer = getattr(model, "tokenizer", None)
    max_length = getattr(model, "max_seq_length", None)
    if not getattr(tokenizer, "is_fast", False) or not isinstance(max_length, int) or max_length < 2:
        return None

    def fast(chunk: list) -> Tokenized:
        out = tokenizer(chunk, truncation=True, max_length=max_length, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)  # fmt: skip
        return out["input_ids"], None

    return fast


def _sample(texts: list, fast: Callable[[list], Tokenized], max_length: int) -> list:
    """The ``_SAMPLE_EACH`` longest and shortest texts (by characters), as many spread
    between, the longest repeated past ``max_length`` tokens, and one text upper-cased with
    spaces around it."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    between = order[np.linspace(0, len(order) - 1, _SAMPLE_EACH + 2).astype(np.int64)[1:-1]]
    picked = np.concatenate([order[:_SAMPLE_EACH], between, order[-_SAMPLE_EACH:]])
    sample = [texts[i] for i in picked]
    # The fast path truncates to max_length, so a text's count is at most that: repeating it
    # (max_length / its tokens + 2) times passes max_length whatever its own count was.
    longest = texts[order[0]]
    tokens = len(fast([longest])[0][0]) - 2  # without the special tokens
    if tokens < 1:  # an empty or blank longest text
        longest, tokens = "a", 1
    sample.append(" ".join([longest] * (max_length // tokens + 2)))
    # sentence-transformers before 6 stripped and (do_lower_case) lower-cased texts itself: a
    # text with spaces around it in upper case differs there for a tokenizer that minds either.
    sample.append(f"  {texts[between[0]].upper()} ")
    return sample


def _same_tokens(want: Tokenized, got: Tokenized) -> bool:
    (want_ids, want_types), (got_ids, _) = want, got
    if len(want_ids) != len(got_ids):
        return False
    if any(len(w) != len(g) or not np.array_equal(np.asarray(w), np.asarray(g)) for w, g in zip(want_ids, got_ids)):
        return False
    return want_types is None or all(not np.any(t) for t in want_types)
