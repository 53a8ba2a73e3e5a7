"""How a plain call's inputs reach an automatic graph's static buffers (``auto_graphs``' feeds).

An automatic graph is captured on static input buffers sized for a bucket; each call that
replays it copies its own inputs in and gets back the leading rows of the static output.
A *feed* says how for one kind of call, so that ``AutoGraphs`` (keys, LRU, stamps, lock,
pool, counts) stays one cache whatever the call:

``BatchFeed``
    batch-first inputs (the padded calls of blocks, stacks and Lc0 nets): the batch pads up
    to a bucket of ``BUCKETS``; rows past it are padding (the items of a batch are
    independent).  Another input is per item or shared; broadcast dimensions are copied
    compactly (an HF mask expanded over heads as ``[B, 1, S, S]``).
``PackedFeed``
    packed rows ``[T, D]``, their int32 ``cu_seqlens`` ``[N + 1]`` and ``max_seqlen``
    (``forward_packed``): T pads up to a token bucket (``TOKEN_BUCKETS``), N to a bucket of
    ``BUCKETS`` (offsets past N repeat T: empty sequences, as ``VarlenGraphRunner`` fills
    them), ``max_seqlen`` up to a power of two (the varlen attention takes an upper bound:
    ``flash_varlen`` sizes its grid by it and CTAs past a sequence's end exit; ``padded``
    lays the sequences out that long and masks the rest).  Rows past T belong to no
    sequence, and every op but attention is row-wise: they never reach the real rows.

``PaddedIdsFeed``
    a padded batch of token ids ``[B, S]`` (and token types) whose real tokens are each
    row's prefix, with their host offsets: the graph packs the real tokens itself and
    returns ``[B, S, D]`` (a patched BERT's short path, ``hf_embedded``).  Buckets: the
    packed bucket of (T, B, ``max_seqlen``) and S up to a power of two; the offsets (from
    pinned memory), ids and token types go in one native call of 2-D copies
    (``core.copy_blocks``; framework copies where the core is off or the ids' columns are
    apart).
``HostIdsFeed``
    ``PaddedIdsFeed``'s call with the ids (and token types) still on the host, as a tokenizer
    returns them (``sentence_embeddings``): the graph's static ids, token types and offsets
    are views of one device buffer, filled from one pinned buffer of the same layout by one
    host-to-device copy.  The caller neither copies the batch over nor reads its mask back.

``Feed.of(inputs)`` is the call's feed, or a string saying why it runs eagerly (counted in
``stats()``).  ``key`` goes into the graph's key and ``bucket`` into ``stats()``;
``statics(inputs)`` makes a graph's buffers at capture and the arguments its function is
captured with; ``fill(statics, inputs)`` copies a call's inputs in; ``take(out)`` is the
call's part of the static output (a view: the cache clones it or copies it out).
"""

from __future__ import annotations

import bisect
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from .. import core
from .varlen import default_token_buckets

__all__ = [
    "BUCKETS", "MAX_ROWS", "MIN_SEQLEN_BUCKET", "TOKEN_BUCKETS", "BatchFeed", "PackedBucket", "PackedFeed",
    "HostIdsFeed", "PaddedIdsFeed", "bucket_for", "copy_offsets", "length_bucket", "packed_bucket",
]  # fmt: skip

#: Batch-size buckets: powers of two and 1.5x powers of two up to 1024, so a batch pads by
#: at most 50% (33% above 3; ~20% on average over uniformly drawn sizes) for two graphs per
#: doubling, and the batch sizes engines use (powers of two) pad not at all.  Above 1024
#: positions an eager call is within a few percent of a graph (host time is amortized).
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
#: Rows (batch x tokens per item, or packed tokens) above which a call runs eagerly: 1024 Lc0
#: positions, 512 sequences of 128 tokens.  Bounds the memory one graph holds.
MAX_ROWS = 1 << 16
#: Token-count buckets of packed rows: multiples of 64, about 2**0.25 apart (at most ~19% of
#: a replay is slack rows, ~9% on average), up to ``MAX_ROWS``.
TOKEN_BUCKETS = default_token_buckets(MAX_ROWS)
#: The smallest ``max_seqlen`` bucket: shorter sequences share one graph (the flash kernel's
#: row blocks are 64 or 128 queries long, so its grid is the same below that).
MIN_SEQLEN_BUCKET = 64

Why = str  # the reason a call runs eagerly, counted as such in ``AutoGraphs.stats()``


def bucket_for(batch: int, rows_per_item: int = 1) -> Optional[int]:
    """The bucket a batch of ``batch`` items runs in (None: eagerly)."""
    if batch <= 0 or batch > BUCKETS[-1]:
        return None
    b = BUCKETS[bisect.bisect_left(BUCKETS, batch)]
    return b if b * rows_per_item <= MAX_ROWS else None


# ------------------------------------------------------------ batch-first inputs ----


def _layout(t: Optional[torch.Tensor], i: int, batch: int, device: torch.device):
    """(key, static shape, view shape) of input ``i``; None: not copyable (run eagerly).
    Input 0 holds the batch; another is per item (leading ``batch``) or shared (leading 1 or
    stride 0); dimensions broadcast by stride 0 stay broadcast."""
    if t is None:
        return (None, None, None)
    if not isinstance(t, torch.Tensor) or t.device != device or t.dim() == 0:
        return None
    shared = i > 0 and (t.shape[0] == 1 or t.stride(0) == 0)
    if not shared and t.shape[0] != batch:
        return None
    compact = tuple(1 if (d > 0 and t.stride(d) == 0) or (d == 0 and shared) else n for d, n in enumerate(t.shape))
    full = tuple(t.shape[1:])
    return ((shared, compact[1:], full, t.dtype), compact, full)


def _compact(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``t`` without its broadcast dimensions (``shape``'s 1s where ``t`` has more)."""
    for d in range(t.dim()):
        if shape[d] == 1 and t.shape[d] != 1:
            t = t.narrow(d, 0, 1)
    return t


class BatchFeed:
    """Batch-first inputs (tensors or None; the first holds the batch)."""

    __slots__ = ("rows", "bucket", "layouts", "key")

    def __init__(self, batch: int, bucket: int, layouts: list):
        self.rows, self.bucket, self.layouts = batch, bucket, layouts
        self.key = (bucket, tuple(lay[0] for lay in layouts))

    @classmethod
    def of(cls, inputs: Sequence[Optional[torch.Tensor]], rows_per_item: int = 1) -> Union["BatchFeed", Why]:
        x = inputs[0]
        batch = x.shape[0]
        bucket = bucket_for(batch, rows_per_item)
        if bucket is None:
            return "eager: batch size"
        layouts = [_layout(t, i, batch, x.device) for i, t in enumerate(inputs)]
        if any(lay is None for lay in layouts):
            return "eager: inputs"
        return cls(batch, bucket, layouts)

    def statics(self, inputs) -> tuple[list, list]:
        statics, views = [], []
        for t, lay in zip(inputs, self.layouts):
            if t is None:
                statics.append(None)
                views.append(None)
                continue
            key, compact, full = lay
            shape = (1 if key[0] else self.bucket,) + tuple(compact[1:])
            static = torch.zeros(shape, dtype=t.dtype, device=t.device)
            statics.append(static)
            views.append(static.expand((shape[0],) + full))
        return statics, views

    def fill(self, statics, inputs) -> None:
        for static, given, lay in zip(statics, inputs, self.layouts):
            if static is not None:
                src = _compact(given, lay[1])
                static[: src.shape[0]].copy_(src)

    def take(self, out):
        return _leading(out, self.rows)


# ------------------------------------------------------------ packed rows ----


class PackedBucket(NamedTuple):
    """The static sizes of a packed call's graph."""

    tokens: int  # rows of the static buffer (>= T)
    sequences: int  # sequences the static cu_seqlens holds (>= N; its length is this + 1)
    max_seqlen: int  # the attention's bound on a sequence's length (>= the call's max_seqlen)


def packed_bucket(tokens: int, sequences: int, max_seqlen: int) -> Union[PackedBucket, Why]:
    """The bucket of a packed call of ``tokens`` rows in ``sequences`` sequences none longer
    than ``max_seqlen``, or why it runs eagerly (no rows, or more than the largest bucket)."""
    if tokens <= 0 or tokens > TOKEN_BUCKETS[-1]:
        return "eager: tokens"
    t = TOKEN_BUCKETS[bisect.bisect_left(TOKEN_BUCKETS, tokens)]
    n = bucket_for(sequences)
    if n is None:
        return "eager: sequences"
    # At most the token bucket: no sequence is longer than T, so a larger bound only costs work.
    return PackedBucket(t, n, min(length_bucket(int(max_seqlen)), t))


def length_bucket(length: int) -> int:
    """A sequence length's bucket (``max_seqlen``'s, and ``PaddedIdsFeed``'s padded length): a
    power of two, at least ``MIN_SEQLEN_BUCKET`` (few graphs however the longest sentence of
    a batch, and so HF's padded length, varies)."""
    return max(MIN_SEQLEN_BUCKET, 1 << max(length - 1, 0).bit_length())


class PackedFeed:
    """``(rows [T, D], cu_seqlens int32 [N + 1], max_seqlen)``, offsets already checked (they
    end at T; the sequences are at most ``max_seqlen`` long).  The graph's function is
    captured with the bucket's ``max_seqlen``; an eager call gets the caller's."""

    __slots__ = ("rows", "sequences", "bucket", "key")

    def __init__(self, rows: int, sequences: int, bucket: PackedBucket, key):
        self.rows, self.sequences, self.bucket, self.key = rows, sequences, bucket, key

    @classmethod
    def of(cls, inputs) -> Union["PackedFeed", Why]:
        rows, cu, max_seqlen = inputs
        if not isinstance(cu, torch.Tensor) or cu.device != rows.device or cu.dim() != 1:
            return "eager: inputs"  # the eager path raises the right error
        n = cu.shape[0] - 1
        bucket = packed_bucket(rows.shape[0], n, max_seqlen)
        if isinstance(bucket, str):
            return bucket
        return cls(rows.shape[0], n, bucket, ("packed", bucket, rows.shape[1], rows.dtype))

    def statics(self, inputs) -> tuple[list, list]:
        rows = inputs[0]
        b = self.bucket
        static_rows = torch.zeros((b.tokens, rows.shape[1]), dtype=rows.dtype, device=rows.device)
        static_cu = torch.zeros(b.sequences + 1, dtype=torch.int32, device=rows.device)
        return [static_rows, static_cu], [static_rows, static_cu, b.max_seqlen]

    def fill(self, statics, inputs) -> None:
        static_rows, static_cu = statics
        rows, cu, _ = inputs
        t, n = self.rows, self.sequences
        static_rows[:t].copy_(rows)  # rows past T keep whatever they held: they are in no sequence
        static_cu[: n + 1].copy_(cu)
        if n < self.bucket.sequences:
            static_cu[n + 1 :].fill_(t)  # unused offsets: empty sequences ending at T

    def take(self, out):
        return _leading(out, self.rows)


def _leading(out, n: int):
    """The first ``n`` rows of a static output (a tensor or a dict of them)."""
    return {k: v[:n] for k, v in out.items()} if isinstance(out, dict) else out[:n]


# ------------------------------------------------------------ padded token ids ----


class PaddedIdsFeed:
    """``(ids [B, S], token types [B, S] or None, offsets, T, max_seqlen)``: int ids on the
    device, each sequence's real tokens the first ``offsets[i + 1] - offsets[i]`` of its row
    (checked by the caller); ``offsets`` int32 ``[B + 1]`` on the host (numpy), ending at T;
    ``max_seqlen`` the longest.  The graph's function is captured on ``[B', S']`` static ids
    (stale past the call's ``[B, S]``: only real positions are read), offsets padded with
    empty sequences ending at T, the token bucket and the bucket's ``max_seqlen``, and returns
    ``[B', S', D]`` (or a dict of such per-token results and ``[B', D]`` per-sequence ones);
    the call takes ``[:B, :S]`` of each per-token result (3-D) and ``[:B]`` of the others."""

    __slots__ = ("batch", "seq", "tokens", "bucket", "seq_bucket", "key")
    _KIND = "padded ids"  # the key's first entry: which feed's statics a graph holds

    def __init__(self, batch, seq, tokens, bucket, padded_seq, key):
        self.batch, self.seq, self.tokens, self.bucket, self.seq_bucket, self.key = (
            batch, seq, tokens, bucket, padded_seq, key)  # fmt: skip

    @classmethod
    def of(cls, inputs) -> Union["PaddedIdsFeed", Why]:
        ids, types, _, tokens, max_seqlen = inputs
        batch, seq = ids.shape
        bucket = packed_bucket(tokens, batch, max_seqlen)
        if isinstance(bucket, str):
            return bucket
        padded_seq = length_bucket(seq)
        if bucket.sequences * padded_seq > MAX_ROWS:
            return "eager: rows"
        key = (cls._KIND, bucket, padded_seq, ids.dtype, types is None)
        return cls(batch, seq, tokens, bucket, padded_seq, key)

    def statics(self, inputs) -> tuple[list, list]:
        ids, types = inputs[0], inputs[1]
        shape = (self.bucket.sequences, self.seq_bucket)
        static_ids = torch.zeros(shape, dtype=ids.dtype, device=ids.device)
        static_types = None if types is None else torch.zeros(shape, dtype=types.dtype, device=ids.device)
        static_cu = torch.zeros(self.bucket.sequences + 1, dtype=torch.int32, device=ids.device)
        statics = [static_ids, static_types, static_cu]
        return statics, statics + [self.bucket.tokens, self.bucket.max_seqlen]

    def fill(self, statics, inputs) -> None:
        static_ids, static_types, static_cu = statics
        ids, types, offsets = inputs[:3]
        b, s = self.batch, self.seq
        if (static_ids.is_cuda and core.active_on(static_ids.device) and _rows_copyable(static_ids, ids)
                and (types is None or _rows_copyable(static_types, types))):  # fmt: skip
            # The offsets, ids and token types in one native call: three framework copies cost
            # ~60-100 us of host time a call on the H200 hosts measured, before the launch.
            device = static_ids.device
            stream = torch.cuda.current_stream(device)
            stage = _staged(static_cu, offsets, self.tokens)
            n_bytes = static_cu.shape[0] * 4
            blocks = [(static_cu.data_ptr(), n_bytes, stage.host.data_ptr(), n_bytes, n_bytes, 1),
                      _rows_block(static_ids, ids)]  # fmt: skip
            if static_types is not None:
                blocks.append(_rows_block(static_types, types))
            core.copy_blocks(device, stream.cuda_stream, blocks)
            stage.copied.record(stream)
            return
        copy_offsets(static_cu, offsets, self.tokens)
        static_ids[:b, :s].copy_(ids)
        if static_types is not None:
            static_types[:b, :s].copy_(types)

    def take(self, out):
        if isinstance(out, dict):
            return {k: self.take(v) for k, v in out.items()}
        return out[: self.batch, : self.seq] if out.dim() == 3 else out[: self.batch]


class HostIdsFeed(PaddedIdsFeed):
    """``PaddedIdsFeed`` for ids and token types on the host (int tensors) and a graph on
    ``device``: the statics are views of one device buffer (ids ``[B', S']``, token types
    ``[B', S']``, then the int32 offsets), and a call writes its inputs into a pinned buffer
    of the same layout and copies it over in one go.  Everything outside the call's
    ``[:B, :S]`` corners is zeroed on the way: the staging buffer may hold any bytes (another
    layout's, another dtype's), and a bucket's slack rows read ids from the spare sequences'
    rows, which must be valid ids (``triton_embeddings``)."""

    __slots__ = ("device",)
    _KIND = "host ids"

    @classmethod
    def on(cls, device: torch.device):
        """The ``feed`` argument of ``auto_graphs.call`` for a graph on ``device``."""
        def of(inputs):
            feed = cls.of(inputs)
            if not isinstance(feed, str):
                feed.device = device
            return feed

        return of

    def _layout(self, ids, types) -> tuple[int, int, int]:
        """(elements of ids' dtype for the ids, for the token types, in all)."""
        n_ids = self.bucket.sequences * self.seq_bucket
        n_types = 0 if types is None else n_ids
        n_cu = -(-(self.bucket.sequences + 1) * 4 // ids.element_size())  # int32s, in ids' elements
        return n_ids, n_types, n_ids + n_types + n_cu

    def _views(self, buffer: torch.Tensor, ids, types):
        n_ids, n_types, _ = self._layout(ids, types)
        shape = (self.bucket.sequences, self.seq_bucket)
        static_ids = buffer[:n_ids].view(shape)
        static_types = None if types is None else buffer[n_ids:n_ids + n_types].view(shape)
        static_cu = buffer[n_ids + n_types:].view(torch.int32)[: self.bucket.sequences + 1]
        return static_ids, static_types, static_cu

    def statics(self, inputs) -> tuple[list, list]:
        ids, types = inputs[0], inputs[1]
        buffer = torch.zeros(self._layout(ids, types)[2], dtype=ids.dtype, device=self.device)
        return [buffer], [*self._views(buffer, ids, types), self.bucket.tokens, self.bucket.max_seqlen]

    def fill(self, statics, inputs) -> None:
        (buffer,) = statics
        ids, types, offsets = inputs[:3]
        b, s = self.batch, self.seq
        n_bytes = buffer.numel() * buffer.element_size()
        stage = _stage(buffer.device, n_bytes)
        host = stage.host[:n_bytes].view(buffer.dtype)
        host_ids, host_types, host_cu = self._views(host, ids, types)
        for static, given in ((host_ids, ids), (host_types, types)):
            if given is not None:
                rows = static.numpy()
                rows[:b, :s] = given.numpy()
                rows[:b, s:] = 0
                rows[b:] = 0
        _write_offsets(host_cu.numpy(), offsets, self.tokens)
        if buffer.is_cuda:
            buffer.copy_(host, non_blocking=True)  # on the device's current stream, as the replay
            stage.copied.record(torch.cuda.current_stream(buffer.device))
        else:
            buffer.copy_(host)


class _Staging:
    """A device's host buffer (pinned for a GPU) for inputs on their way to a graph's statics,
    and the event of its last copy out (rewritten only once that copy is done)."""

    __slots__ = ("host", "copied")

    def __init__(self, n_bytes: int, device: torch.device):
        pinned = device.type == "cuda"
        self.host = torch.zeros(n_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None


_staging: dict = {}  # device -> _Staging; used under the device's graph lane lock (auto_graphs)


def _stage(device: torch.device, n_bytes: int) -> _Staging:
    """``device``'s staging buffer, at least ``n_bytes`` long and free to rewrite."""
    stage = _staging.get(device)
    if stage is not None and stage.copied is not None:  # its last copy out done (long since:
        stage.copied.synchronize()  # the call before ended in a read); before reuse, or freeing
    if stage is None or stage.host.shape[0] < n_bytes:
        stage = _staging[device] = _Staging(max(n_bytes, 4096), device)
    return stage


def copy_offsets(static_cu: torch.Tensor, offsets: np.ndarray, tokens: int) -> None:
    """``static_cu`` (int32 ``[N' + 1]``) := host ``offsets`` (``[N + 1]``, ending at
    ``tokens``), then ``tokens`` repeated: empty sequences.  On a GPU the copy leaves from
    pinned memory without waiting (a pageable one costs ~20-40 us of host time a call)."""
    n = static_cu.shape[0]
    if not static_cu.is_cuda:
        padded = np.empty(n, dtype=np.int32)
        _write_offsets(padded, offsets, tokens)
        static_cu.copy_(torch.from_numpy(padded))
        return
    stage = _staged(static_cu, offsets, tokens)
    static_cu.copy_(stage.host[: 4 * n].view(torch.int32), non_blocking=True)  # on the current stream, as the replay
    stage.copied.record(torch.cuda.current_stream(static_cu.device))


def _staged(static_cu: torch.Tensor, offsets: np.ndarray, tokens: int) -> _Staging:
    """The device's pinned staging buffer holding ``static_cu``'s new value in its first
    ``N' + 1`` int32s (``copy_offsets``); the caller copies it out and records ``copied``."""
    n = static_cu.shape[0]
    stage = _stage(static_cu.device, 4 * n)
    _write_offsets(stage.host[: 4 * n].view(torch.int32).numpy(), offsets, tokens)
    return stage


def _write_offsets(values: np.ndarray, offsets: np.ndarray, tokens: int) -> None:
    """``values`` (int32, ``[N' + 1]``) := ``offsets`` (``[N + 1]``, ending at ``tokens``),
    then ``tokens`` repeated: the bucket's spare sequences, empty."""
    values[: offsets.shape[0]] = offsets
    values[offsets.shape[0]:] = tokens


def _rows_copyable(static: torch.Tensor, given: torch.Tensor) -> bool:
    """Whether ``static[:B, :S] = given`` may be a native 2-D copy of bytes: one dtype, and
    ``given`` ``[B, S]`` of dense rows that do not overlap (else the framework's copy)."""
    rows, width = given.shape
    return (given.dtype == static.dtype and (given.stride(1) == 1 or width <= 1)
            and (given.stride(0) >= width or rows <= 1))  # fmt: skip


def _rows_block(static: torch.Tensor, given: torch.Tensor) -> tuple:
    """``copy_blocks``' block for ``static[:B, :S] = given`` (``[B, S]``, rows dense, one dtype)."""
    size = given.element_size()
    rows, width = given.shape
    return (static.data_ptr(), static.stride(0) * size, given.data_ptr(), given.stride(0) * size, width * size, rows)
