"""Tokenized texts cut into batches by a budget of padded tokens, longest first.

A batch of the same number of texts costs very different work at 8 and at 256 tokens a
text; a budget of padded tokens (batch size x its longest sequence, what text-embeddings-
inference calls ``max_batch_tokens``) keeps each batch's work and memory bounded whatever the
lengths, and sorting longest first keeps the padding inside each batch small.  Shared by
``fusedenc.embed.encode`` (a corpus) and a patched ``SentenceTransformer.encode()``, which
also share ``tokenized_chunks`` (tokenizing on threads while the GPU runs what is ready) and
``stream_batches`` (the budget's batches across those chunks).  A chunk's token ids travel
packed (``PackedIds``: one array and each text's place in it), not as a list a text.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

__all__ = ["MAX_BATCH_SEQUENCES", "TOKENIZE_CHUNK", "PackedIds", "batches_by_tokens", "padded_batch", "stream_batches",
           "tokenized_chunks", "tokenizer_threads"]

#: Texts a batch may hold: the graphs' largest batch bucket (``graphs.feeds.BUCKETS``).
MAX_BATCH_SEQUENCES = 1024


@dataclass
class PackedIds:
    """Many texts' token ids in one int64 array: text ``j``'s are
    ``flat[starts[j]:starts[j] + lengths[j]]``.

    Why not a list of ids a text: a pass holds its texts' ids from the tokenizer to their
    batch, long enough for each list (a tracked container) to outlive CPython's young garbage
    collections and reach the oldest generation; 20,000 of them a pass set off a full
    collection of every object in the process every ~5 passes (0.26 s on a 2-core CPU, ~1 pass'
    time on a GPU).  Packed as the tokenizer returns them, the lists die young; and a batch is
    padded by one gather instead of a Python step a text."""

    flat: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def pack(cls, seqs: Sequence[Sequence[int]]) -> "PackedIds":
        """Each of ``seqs`` (lists or arrays of ids) one after the other."""
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
        return cls(flat, _starts(lengths), lengths)

    @classmethod
    def from_padded(cls, ids: np.ndarray, real: np.ndarray) -> "PackedIds":
        """The real tokens (``real`` true) of a padded ``[texts, length]`` batch, row by row."""
        real = np.asarray(real, dtype=bool)
        lengths = real.sum(axis=1, dtype=np.int64)
        return cls(np.asarray(ids)[real].astype(np.int64), _starts(lengths), lengths)

    def take(self, index: np.ndarray) -> "PackedIds":
        """The texts at ``index``, in that order (the same ``flat``)."""
        return PackedIds(self.flat, self.starts[index], self.lengths[index])

    def row(self, j: int) -> np.ndarray:
        return self.flat[self.starts[j]:self.starts[j] + self.lengths[j]]

    def __iter__(self) -> Iterator[np.ndarray]:  # each text's ids (for checks, not a hot path)
        return (self.row(j) for j in range(len(self)))

    def positions(self) -> np.ndarray:
        """Where in ``flat`` each text's ids are, text after text (one index a token)."""
        if not len(self):
            return np.zeros(0, dtype=np.int64)
        ends = np.cumsum(self.lengths)
        return np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(self.starts - (ends - self.lengths), self.lengths)

    @staticmethod
    def join(parts: Sequence["PackedIds"]) -> "PackedIds":
        """The texts of ``parts``, one after the other, in a new ``flat`` of their ids only."""
        lengths = np.concatenate([p.lengths for p in parts])
        return PackedIds(np.concatenate([p.flat[p.positions()] for p in parts]), _starts(lengths), lengths)


def _starts(lengths: np.ndarray) -> np.ndarray:
    return np.cumsum(lengths) - lengths


def batches_by_tokens(lengths: np.ndarray, max_batch_tokens: int,
                      max_sequences: int = MAX_BATCH_SEQUENCES) -> list[np.ndarray]:  # fmt: skip
    """Indices of ``lengths`` sorted longest first (stable), cut into batches whose padded
    size (count x longest) stays within ``max_batch_tokens`` (a text longer than the budget is
    a batch of its own) and that hold at most ``max_sequences``."""
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    order = np.argsort(-np.asarray(lengths), kind="stable")
    out, start = [], 0
    while start < len(order):
        longest = int(lengths[order[start]])
        count = max(1, min(max_sequences, max_batch_tokens // max(longest, 1)))
        out.append(order[start:start + count])
        start += count
    return out


def _full(lengths: np.ndarray, batch: np.ndarray, max_batch_tokens: int, max_sequences: int) -> bool:
    """Whether ``batch`` (indices into ``lengths``, longest first) holds as many texts as its
    longest allows: no later text could join it."""
    longest = int(lengths[batch[0]])
    return len(batch) >= max(1, min(max_sequences, max_batch_tokens // max(longest, 1)))


def stream_batches(chunks: Iterable[tuple[np.ndarray, PackedIds, Optional[PackedIds]]], max_batch_tokens: int,
                   max_sequences: int = MAX_BATCH_SEQUENCES) -> Iterator[tuple[np.ndarray, PackedIds, Optional[PackedIds], np.ndarray]]:  # fmt: skip
    """``batches_by_tokens`` over a stream of tokenized chunks ``(rows, ids, types)`` (the
    texts' indices, their token ids, their token types or None in every chunk), as
    ``(rows, ids, types, lengths)`` of each batch.

    A chunk's texts join those the chunks before left over; every full batch goes out at
    once, and a short last one waits for the next chunk's texts.  The chunks come longest
    first (``tokenized_chunks``), so the texts held back are about as long as the next
    chunk's longest: the batches stay full whatever the chunk size, and a pass over a corpus
    makes a few distinct batch shapes (graph keys), not one short tail per chunk."""
    left: Optional[tuple[np.ndarray, PackedIds, Optional[PackedIds]]] = None
    for rows, ids, types in chunks:
        rows = np.asarray(rows, dtype=np.int64)
        if left is not None and len(left[0]):
            rows = np.concatenate([left[0], rows])
            ids = PackedIds.join([left[1], ids])
            types = None if types is None or left[2] is None else PackedIds.join([left[2], types])
        lengths = ids.lengths
        cut = batches_by_tokens(lengths, max_batch_tokens, max_sequences)
        if cut and not _full(lengths, cut[-1], max_batch_tokens, max_sequences):
            held = cut.pop()
        else:
            held = np.empty(0, dtype=np.int64)
        for batch in cut:
            yield rows[batch], ids.take(batch), None if types is None else types.take(batch), lengths[batch]
        left = (rows[held], ids.take(held), None if types is None else types.take(held))
    if left is not None and len(left[0]):
        yield left[0], left[1], left[2], left[1].lengths


def padded_batch(ids: PackedIds, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(ids, mask)`` ``[len(ids), longest]`` of a batch's token ids, padded on the right
    with ``pad``."""
    longest = int(ids.lengths.max()) if len(ids) else 0
    real = np.arange(longest) < ids.lengths[:, None]
    out = np.full((len(ids), longest), pad, dtype=np.int64)
    out[real] = ids.flat[ids.positions()]  # row-major: each text's ids in turn, as positions() lists them
    return out, real.astype(np.int64)


def tokenizer_threads() -> int:
    """Threads that tokenize chunks ahead of the caller, by default.  A fast tokenizer's batch
    call already spreads one chunk over every core (Rust's rayon pool, unless
    ``TOKENIZERS_PARALLELISM`` says no, as the tokenizers library reads it): more threads then
    only make the chunks finish together in groups (on a 2-core CPU two threads handed out
    chunks in pairs at the same total time), and the GPU waits for a group's first chunk
    as long as for the whole group, which ends a pass with a group's GPU work left to do.
    One thread hands them out one by one.  Where the tokenizer runs on one core, up to 4
    threads (one a core) share the chunks instead."""
    setting = os.environ.get("TOKENIZERS_PARALLELISM")
    if setting is None or setting.lower() not in ("", "off", "false", "f", "no", "n", "0"):
        return 1
    return min(4, os.cpu_count() or 1)


#: Texts a tokenizer call takes at most (the first ones are smaller: ``chunk_sizes``): large
#: enough to amortize its Python.  On an H200, with the small first chunk, 1,024 and 2,048 were
#: level within the runs' noise (~5%) in the corpus command.
TOKENIZE_CHUNK = 1024
#: The first chunk's texts at most: the GPU waits for it (measured on an H200, bert-base and 20k
#: sentences: a first chunk of 2,048 texts left the GPU idle ~40 ms of a 330 ms pass).
FIRST_CHUNK = 256


def chunk_sizes(total: int, chunk: int) -> list[int]:
    """Texts a chunk: ``FIRST_CHUNK`` (or ``chunk`` if smaller) first, doubling up to ``chunk``,
    the last what is left: a small first chunk starts the GPU early, the later ones keep the
    tokenizer's per-call cost low."""
    sizes, size, left = [], min(max(1, chunk), FIRST_CHUNK), total
    while left > 0:
        sizes.append(min(size, left))
        left -= sizes[-1]
        size = min(2 * size, max(1, chunk))
    return sizes


def tokenized_chunks(texts: Sequence[str], tokenize: Callable[[list], Any], chunk: int,
                     workers: Optional[int] = None) -> Iterator[tuple[np.ndarray, Any]]:  # fmt: skip
    """``(rows, tokenize(their texts))`` for chunks of up to ``chunk`` texts (``chunk_sizes``), in the order
    sentence-transformers sorts texts (longest by characters first, so each chunk's token
    counts are close), as each is ready: the first on the calling thread (a fast tokenizer
    sets its truncation and padding state on its first call, which threads must not race),
    every other one submitted to ``workers`` threads (default ``tokenizer_threads()``) before
    the first is handed out, so the tokenizer works while the caller runs the chunks before (a
    fast tokenizer's batch call runs outside the GIL)."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    sizes = chunk_sizes(len(order), chunk)
    chunks = [order[end - size:end] for end, size in zip(np.cumsum(sizes), sizes)]
    if not chunks:
        return

    def run(rows: np.ndarray) -> Any:
        return tokenize([texts[r] for r in rows])

    first = run(chunks[0])
    with ThreadPoolExecutor(max_workers=max(1, workers or tokenizer_threads())) as pool:
        rest = pool.map(run, chunks[1:])
        yield chunks[0], first
        yield from zip(chunks[1:], rest)
