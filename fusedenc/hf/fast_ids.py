"""Token ids straight from a fast tokenizer's Rust backend, where a sample shows them equal to
what the caller's own tokenizing gives.

A Hugging Face fast tokenizer's call (``tokenizer(texts)["input_ids"]``) runs the Rust
backend's ``encode_batch`` outside the GIL, then builds a Python dict of lists per text and
merges them, holding the GIL: on a GPU machine's host that second part costs as much as the
tokenizing (20,000 sentences: 0.18 s in the backend, 0.29-0.65 s through the call; H200 host,
16 cores), and a corpus loop feeding a GPU is bound by it.  ``backend_ids`` asks the backend
for the ids alone (``encode_batch_fast`` where tokenizers has it: no character offsets).

It runs on a private copy of the backend with padding off and truncation as asked: the
tokenizer's own backend keeps whatever truncation and padding its last call set, and threads
must not race on it.  A tokenizer may do more in Python than the backend (a subclass's own
``_batch_encode_plus``, texts it rewrites first), so ``checked`` compares the two on a sample
of the caller's texts (``sample``) and the caller keeps its own path where they differ.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np

__all__ = ["SAMPLE_EACH", "backend_ids", "checked", "sample", "same_ids"]

#: Texts of a call compared from each end of its length order and from between (a few ms).
SAMPLE_EACH = 8

IdsFn = Callable[[list], list]  # texts -> each text's token ids (a list of ints each)

# A backend copy costs ~20 ms (a 30k-word vocabulary through JSON): one per tokenizer and
# max_length, made again if tokens were added since (the sample check catches other edits).
_copies: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def backend_ids(tokenizer: Any, max_length: Optional[int] = None) -> Optional[IdsFn]:
    """``ids(texts)``: each text's token ids with the special tokens, truncated to ``max_length``
    on the tokenizer's truncation side (None: not truncated), from a private copy of
    ``tokenizer``'s Rust backend; None where ``tokenizer`` is not a fast one (or its backend
    cannot be copied)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or not hasattr(backend, "to_str"):
        return None
    try:
        cached = _copies.setdefault(tokenizer, {})
    except TypeError:  # not weakly referable: a copy each call
        cached = {}
    size = len(tokenizer)
    made = cached.get(max_length)
    if made is None or made[0] != size:
        made = cached[max_length] = (size, _copy(tokenizer, backend, max_length))
    return made[1]


def _copy(tokenizer: Any, backend: Any, max_length: Optional[int]) -> Optional[IdsFn]:
    try:
        own = type(backend).from_str(backend.to_str())
        own.no_padding()
        if max_length is None:
            own.no_truncation()
        else:
            own.enable_truncation(int(max_length), direction=getattr(tokenizer, "truncation_side", "right"))
    except Exception:  # noqa: BLE001 - a backend that cannot be copied: the caller's own path
        return None
    encode = getattr(own, "encode_batch_fast", None) or own.encode_batch  # _fast: tokenizers >= 0.20

    def ids(texts: list) -> list:
        return [e.ids for e in encode(list(texts), add_special_tokens=True)]

    return ids


def sample(texts: Sequence[str], ids: IdsFn, max_length: int) -> list:
    """The ``SAMPLE_EACH`` longest and shortest texts (by characters), as many spread
    between, the longest repeated past ``max_length`` tokens (truncation compared too), and one
    text upper-cased with spaces around it (stripping and lower-casing compared too)."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    between = order[np.linspace(0, len(order) - 1, SAMPLE_EACH + 2).astype(np.int64)[1:-1]]
    picked = np.concatenate([order[:SAMPLE_EACH], between, order[-SAMPLE_EACH:]])
    out = [texts[i] for i in picked]
    # A truncating ``ids`` gives at most max_length tokens, so repeating the text
    # (max_length / its tokens + 2) times passes max_length whatever its own count was.
    longest = texts[order[0]]
    tokens = len(ids([longest])[0]) - 2  # without the special tokens
    if tokens < 1:  # an empty or blank longest text
        longest, tokens = "a", 1
    out.append(" ".join([longest] * (max_length // tokens + 2)))
    # sentence-transformers before 6 stripped and (do_lower_case) lower-cased texts itself: a
    # text with spaces around it in upper case differs there for a tokenizer that minds either.
    out.append(f"  {texts[between[0]].upper()} ")
    return out


def same_ids(want: Sequence, got: Sequence) -> bool:
    """Whether two tokenizings of the same texts give the same ids, text by text."""
    if len(want) != len(got):
        return False
    return all(len(w) == len(g) and np.array_equal(np.asarray(w), np.asarray(g)) for w, g in zip(want, got))


def checked(texts: Sequence[str], fast: Optional[IdsFn], reference: IdsFn, max_length: int) -> IdsFn:
    """``fast`` where it gives ``reference``'s ids on a ``sample`` of ``texts``, else
    ``reference``; ``reference`` for a call of a few texts (the sample would be the call)."""
    if fast is None or len(texts) <= 3 * SAMPLE_EACH:
        return reference
    try:
        probe = sample(texts, fast, max_length)
        return fast if same_ids(reference(probe), fast(probe)) else reference
    except Exception:  # noqa: BLE001 - a check that cannot run (a probe the tokenizer refuses): its own path
        return reference
