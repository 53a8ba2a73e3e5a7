"""``fusedenc.graphs.auto``, the CUDA graphs behind a plain call, on the CPU.

The cache logic (keys, buckets, capture on the second call, LRU eviction and its back-off,
fallbacks, switches, invalidation when weights change, ``out=``, copies, threads; the packed
rows' feed of ``forward_packed``) runs here
with a fake capture: a "graph" recomputes its run from the static inputs into the static
output when replayed, which is what a real graph does to its buffers.  The GPU tests
(``test_auto_graphs_gpu.py``) check real graphs against the eager path.
"""

from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

import fusedenc
from fusedenc.graphs import auto as auto_graphs
from fusedenc.graphs import feeds as graph_feeds
from fusedenc.graphs import runner as graphs
from fusedenc.graphs.runner import eager_calls
from fusedenc.varlen import calls as packed_calls
from fusedenc.varlen import packing as varlen

#: fp32 on the CPU: a graph's bucket pads the attention's layout (more masked keys), which
#: changes only the summation order.
TOL_FP32 = dict(rtol=2e-5, atol=2e-5)


class _FakeGraph:
    def __init__(self, run, out):
        self.run, self.out, self.replays = run, out, 0

    def replay(self):
        self.replays += 1
        new = self.run()
        if isinstance(new, dict):
            for k, v in new.items():
                self.out[k].copy_(v)
        else:
            self.out.copy_(new)


def _fake_capture(run, device, pool):
    out = run()
    return _FakeGraph(run, out), out


class _Net(auto_graphs.GraphedModule):
    """Row-independent work with two outputs, like a network's heads."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 5), requires_grad=False)
        self.auto_graphs.capture = _fake_capture
        self.calls = 0

    def heads(self, x, shift=None):
        self.calls += 1
        y = x @ self.weight
        return {"y": y if shift is None else y + shift, "sum": y.sum(-1, keepdim=True)}

    def forward(self, x, shift=None, *, out=None, native=True):
        return auto_graphs.call(self, self.heads, (x, shift), key="heads", native=native, out=out)


def _want(net, x, shift=None):
    y = x @ net.weight
    return {"y": y if shift is None else y + shift, "sum": y.sum(-1, keepdim=True)}


def _same(got, want):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


@pytest.fixture(autouse=True)
def _on():
    was = auto_graphs.set_enabled(True)
    yield
    auto_graphs.set_enabled(was)


def _counts(net):
    return net.auto_graphs.stats()["counts"]


def test_first_call_is_eager_the_second_captures_later_ones_replay(gen):
    net = _Net()
    x = torch.randn(4, 3, generator=gen)
    _same(net(x), _want(net, x))
    assert _counts(net) == {"eager: first calls": 1} and net.auto_graphs.stats()["graphs"] == 0
    _same(net(x), _want(net, x))
    x2 = torch.randn(4, 3, generator=gen)
    _same(net(x2), _want(net, x2))
    c = _counts(net)
    assert c["captures"] == 1 and c["replays"] == 2
    assert net.auto_graphs.stats()["buckets"] == [4]


def test_outputs_belong_to_the_caller(gen):
    net = _Net()
    x, x2 = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    net(x)
    first = net(x)
    second = net(x2)  # a replay must not change what an earlier call returned
    _same(first, _want(net, x))
    _same(second, _want(net, x2))
    static = net.auto_graphs.entries()[0].out
    assert all(first[k].data_ptr() != static[k].data_ptr() for k in first)


@pytest.mark.parametrize("batch, bucket", [(1, 1), (3, 3), (5, 6), (7, 8), (100, 128), (257, 384), (1024, 1024)])
def test_batches_pad_up_to_a_bucket(batch, bucket):
    assert auto_graphs.bucket_for(batch) == bucket


def test_no_bucket_for_empty_huge_or_too_many_rows():
    assert auto_graphs.bucket_for(0) is None
    assert auto_graphs.bucket_for(auto_graphs.BUCKETS[-1] + 1) is None
    assert auto_graphs.bucket_for(1024, rows_per_item=128) is None  # 131072 rows > MAX_ROWS
    assert auto_graphs.bucket_for(512, rows_per_item=128) == 512


def test_batches_of_one_bucket_share_a_graph_and_padding_stays_out(gen):
    net = _Net()
    for b in (5, 6, 5, 6):  # both in bucket 6
        x = torch.randn(b, 3, generator=gen)
        got = net(x)
        assert got["y"].shape == (b, 5)
        _same(got, _want(net, x))
    assert net.auto_graphs.stats()["buckets"] == [6] and _counts(net)["captures"] == 1


def test_lru_bounds_the_graphs_and_backs_off_a_thrashing_key(gen):
    net = _Net()
    net.auto_graphs.max_graphs = 2
    sizes = [1, 2, 3]  # three buckets, room for two
    for _ in range(6):
        for b in sizes:
            x = torch.randn(b, 3, generator=gen)
            _same(net(x), _want(net, x))
            assert net.auto_graphs.stats()["graphs"] <= 2
    c = _counts(net)
    assert c["evictions"] >= 1
    # Cycling three keys through two slots would capture on every miss; the back-off keeps
    # captures well below the 18 calls.
    assert c["captures"] <= 6


def test_shared_and_broadcast_inputs_are_copied_compactly(gen):
    net = _Net()
    x = torch.randn(4, 3, generator=gen)
    shift = torch.randn(1, 5, generator=gen).expand(4, 5)  # stride 0 over the batch
    for _ in range(3):
        _same(net(x, shift), _want(net, x, shift))
    entry = net.auto_graphs.entries()[0]
    assert tuple(entry.inputs[1].shape) == (1, 5)  # one row, not one per item
    per_row = torch.randn(4, 5, generator=gen)
    for _ in range(3):
        _same(net(x, per_row), _want(net, x, per_row))
    assert net.auto_graphs.stats()["graphs"] == 2  # another layout, another graph


def test_an_input_it_cannot_copy_runs_eagerly(gen):
    net = _Net()
    x = torch.randn(4, 3, generator=gen)
    for _ in range(3):
        with pytest.raises(RuntimeError):  # the eager path's own error for a [3, 5] shift
            net(x, torch.randn(3, 5, generator=gen))
    assert _counts(net) == {"eager: inputs": 3}


@pytest.mark.parametrize("how", ["process", "module", "context", "native", "nested", "empty", "huge", "no-caching"])
def test_fallbacks_run_eagerly(gen, how, monkeypatch):
    net = _Net()
    if how == "no-caching":  # PYTORCH_NO_CUDA_MEMORY_CACHING=1: PyTorch cannot capture
        monkeypatch.setattr(graphs, "_caching_allocator_off", True)
    b = {"empty": 0, "huge": 2000}.get(how, 4)
    x = torch.randn(b, 3, generator=gen)
    kw = {"native": False} if how == "native" else {}
    if how == "process":
        auto_graphs.set_enabled(False)
    if how == "module":
        net.auto_graphs.enabled = False
    for _ in range(3):
        if how == "context":
            with auto_graphs.disabled():
                got = net(x)
        elif how == "nested":
            with eager_calls():
                got = net(x)
        else:
            got = net(x, **kw)
        _same(got, _want(net, x))
    assert net.auto_graphs.stats()["graphs"] == 0 and "captures" not in _counts(net)


def test_a_capture_without_the_caching_allocator_is_refused_before_it_starts(monkeypatch):
    """PyTorch captures only through its caching allocator: with it off, a half-made capture would
    leave the device unusable, so ``capture`` says why first and launches nothing."""
    monkeypatch.setattr(graphs, "_caching_allocator_off", True)
    ran = []
    with pytest.raises(graphs.CaptureUnavailable, match="PYTORCH_NO_CUDA_MEMORY_CACHING=1"):
        graphs.capture(lambda: ran.append(1), torch.device("cuda"))
    assert ran == [] and not graphs.capture_possible()


def test_weights_changed_in_place_or_replaced_are_recaptured(gen):
    net = _Net()
    x = torch.randn(4, 3, generator=gen)
    net(x)
    net(x)
    with torch.no_grad():
        net.weight.mul_(2)  # in place: a new version
    _same(net(x), _want(net, x))
    assert _counts(net)["weights changed"] == 1 and _counts(net)["captures"] == 2
    net.weight = nn.Parameter(torch.randn(3, 5, generator=gen), requires_grad=False)  # a new parameter
    _same(net(x), _want(net, x))
    assert _counts(net)["weights changed"] == 2
    with torch.no_grad():
        net.weight.data = torch.randn(3, 5, generator=gen)  # new storage, same parameter
    _same(net(x), _want(net, x))
    assert _counts(net)["weights changed"] == 3


def test_invalidate_and_apply_drop_graphs(gen):
    net = _Net()
    x = torch.randn(4, 3, generator=gen)
    net(x)
    net(x)
    assert net.auto_graphs.stats()["graphs"] == 1
    auto_graphs.invalidate()
    assert net.auto_graphs.stats()["graphs"] == 0
    net(x)
    net(x)
    net.to(torch.float32).to("cpu")  # replaces no tensor (sentence-transformers does it every encode())
    assert net.auto_graphs.stats()["graphs"] == 1, "a .to() that changes nothing dropped the graphs"
    net.to(torch.float64).to(torch.float32)  # .to/.half/.cuda go through _apply
    assert net.auto_graphs.stats()["graphs"] == 0


def test_out_receives_the_result(gen):
    net = _Net()
    x = torch.randn(4, 3, generator=gen)
    for _ in range(3):
        out = {"y": torch.full((4, 5), float("nan")), "sum": torch.full((4, 1), float("nan"))}
        got = net(x, out=out)
        assert got is out
        _same(out, _want(net, x))
    with pytest.raises(ValueError, match="out"):
        net(x, out={"y": torch.empty(4, 5)})
    with pytest.raises(ValueError, match="out"):
        net(x, out={"y": torch.empty(3, 5), "sum": torch.empty(4, 1)})


def test_stats_and_memory_report_what_is_held(gen):
    net = _Net()
    x = torch.randn(8, 3, generator=gen)
    net(x)
    net(x)
    s = net.auto_graphs.stats()
    want = 8 * 3 * 4 + 8 * 5 * 4 + 8 * 1 * 4  # static input, two static outputs (float32)
    assert s["graphs"] == 1 and s["static_bytes"] == want and s["capture_seconds"] >= 0
    assert auto_graphs.memory()["cpu"]["static_bytes"] >= want
    net.auto_graphs.clear()
    assert net.auto_graphs.stats()["graphs"] == 0


def test_copies_and_pickles_start_with_no_graphs(gen):
    net = _Net()
    x = torch.randn(4, 3, generator=gen)
    net(x)
    net(x)
    net.auto_graphs.max_graphs = 3
    for other in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert other.auto_graphs is not net.auto_graphs
        assert other.auto_graphs.stats()["graphs"] == 0 and other.auto_graphs.max_graphs == 3


def test_threads_get_their_own_results(gen):
    net = _Net()
    xs = [torch.randn(b, 3, generator=gen) for b in (2, 4, 3, 4) * 4]
    errors = []

    def work(x):
        try:
            for _ in range(5):
                _same(net(x), _want(net, x))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_fusedenc_modules_run_eagerly_on_the_cpu(gen):
    stack = fusedenc.EncoderStack.build(2, 16, 2, 32, dtype=torch.float32)
    x = torch.randn(3, 4, 16, generator=gen)
    want = stack(x)
    out = torch.full_like(x, float("nan"))
    assert stack(x, out=out) is out and torch.equal(out, want)
    assert stack.blocks[0](x).shape == x.shape
    assert stack.auto_graphs.stats()["counts"] == {"eager: no native core": 2}
    with pytest.raises(ValueError, match="out"):
        stack(x, out=torch.empty(3, 4, 15))


# ------------------------------------------------------------ packed rows ----


@pytest.mark.parametrize("tokens, sequences, max_seqlen, want", [
    (1, 1, 1, (64, 1, 64)),  # the smallest buckets
    (64, 2, 64, (64, 2, 64)),  # exact fits pad nothing
    (65, 3, 65, (128, 3, 128)),
    (300, 5, 300, (320, 6, 320)),  # max_seqlen's power of two capped by the token bucket
    (1000, 32, 100, (1024, 32, 128)),
    (800, 33, 9, (896, 48, 64)),
    (auto_graphs.MAX_ROWS, 1024, 128, (auto_graphs.MAX_ROWS, 1024, 128)),
])  # fmt: skip
def test_packed_calls_pad_up_to_token_sequence_and_length_buckets(tokens, sequences, max_seqlen, want):
    bucket = graph_feeds.packed_bucket(tokens, sequences, max_seqlen)
    assert bucket == want and bucket.tokens in graph_feeds.TOKEN_BUCKETS


def test_packed_calls_past_the_buckets_run_eagerly():
    assert graph_feeds.packed_bucket(0, 1, 0) == "eager: tokens"
    assert graph_feeds.packed_bucket(auto_graphs.MAX_ROWS + 1, 4, 64) == "eager: tokens"
    assert graph_feeds.packed_bucket(2000, auto_graphs.BUCKETS[-1] + 1, 8) == "eager: sequences"
    b = graph_feeds.TOKEN_BUCKETS
    assert b[-1] == auto_graphs.MAX_ROWS and list(b) == sorted(set(b)) and all(t % 64 == 0 for t in b)


def test_padded_ids_feed_buckets_and_eager_reasons(gen):
    """A padded batch of ids: the packed bucket of (T, B, longest), the padded length up to a
    power of two (at least 64); too many padded rows, tokens or sequences run eagerly; the
    call's part of the output is ``[:B, :S]``."""
    ids = torch.randint(0, 100, (20, 70), generator=gen)
    offsets = np.arange(21, dtype=np.int32) * 10  # 20 sequences of 10 tokens
    feed = graph_feeds.PaddedIdsFeed.of((ids, None, offsets, 200, 10))
    assert (feed.bucket, feed.seq_bucket) == ((256, 24, 64), 128)
    assert feed.key == ("padded ids", feed.bucket, 128, torch.int64, True)
    assert graph_feeds.PaddedIdsFeed.of((ids, ids, offsets, 200, 10)).key[-1] is False
    assert [graph_feeds.length_bucket(s) for s in (1, 64, 65, 129, 512)] == [64, 64, 128, 256, 512]
    out = torch.randn(24, 128, 4, generator=gen)
    assert torch.equal(feed.take(out), out[:20, :70])
    wide = torch.zeros((512, 200), dtype=torch.int64)  # 768 x 256 padded rows > MAX_ROWS
    assert graph_feeds.PaddedIdsFeed.of((wide, None, None, 5000, 200)) == "eager: rows"
    assert graph_feeds.PaddedIdsFeed.of((ids, None, offsets, 0, 0)) == "eager: tokens"
    many = torch.zeros((auto_graphs.BUCKETS[-1] + 1, 4), dtype=torch.int64)
    assert graph_feeds.PaddedIdsFeed.of((many, None, None, 100, 1)) == "eager: sequences"


def test_padded_ids_native_copy_blocks_are_the_rows_in_bytes():
    """What ``PaddedIdsFeed.fill`` hands the native copy: rows of a wider tensor keep their
    pitch, one row any; ids of another dtype than the statics, or whose columns are apart or
    rows overlap, take the framework's copy."""
    static = torch.zeros((24, 128), dtype=torch.int32)
    wide = torch.zeros((13, 80), dtype=torch.int32)
    block = graph_feeds._rows_block(static, wide[:, :37])
    assert block == (static.data_ptr(), 128 * 4, wide.data_ptr(), 80 * 4, 37 * 4, 13)
    copyable = graph_feeds._rows_copyable
    assert all(copyable(static, t) for t in (wide[:, :37], wide[:1, :37], wide[:, :1]))
    assert not copyable(static, wide[:1, ::2]) and not copyable(static, wide[:, ::2])
    assert not copyable(static, wide[:, :1].expand(13, 5))  # stride 0 across columns
    assert not copyable(static, wide[:1, :37].expand(13, 37))  # every row the same memory
    assert not copyable(static, wide[:, :37].long())  # another dtype: converted by the framework


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("with_types", [True, False])
def test_host_ids_feed_lays_ids_types_and_offsets_in_one_buffer(dtype, with_types, gen):
    """``HostIdsFeed``: the statics are views of one buffer (ids, token types, int32 offsets)
    on the feed's device; a fill writes each call's host ids (a strided view too) into the
    ``[:B, :S]`` corners and its offsets then empty sequences, zeros everywhere else whatever
    the staging buffer held, in one copy; the key tells it from a device-input feed's."""
    ids = torch.randint(1, 30000, (20, 40), generator=gen, dtype=torch.int64).to(dtype)
    types = torch.randint(0, 2, (20, 40), generator=gen).to(dtype) if with_types else None
    offsets = np.arange(21, dtype=np.int32) * 7  # 20 sequences of 7 tokens
    inputs = (ids, types, offsets, 140, 7)
    feed = graph_feeds.HostIdsFeed.on(torch.device("cpu"))(inputs)
    assert feed.key == ("host ids",) + graph_feeds.PaddedIdsFeed.of(inputs).key[1:]
    (buffer,), views = feed.statics(inputs)
    static_ids, static_types, static_cu = views[:3]
    assert buffer.dtype == dtype and static_ids.shape == (24, 64) and static_cu.dtype == torch.int32
    assert static_ids.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert (static_types is None) != with_types and static_cu.shape == (25,)
    buffer.fill_(-5)
    feed.fill([buffer], inputs)
    assert torch.equal(static_ids[:20, :40], ids) and not static_ids[20:].any() and not static_ids[:, 40:].any()
    if with_types:
        assert torch.equal(static_types[:20, :40], types)
    assert static_cu.tolist() == offsets.tolist() + [140] * 4, "unused offsets: empty sequences ending at T"
    wide = torch.randint(1, 30000, (17, 80), generator=gen, dtype=torch.int64).to(dtype)
    small_offsets = np.arange(18, dtype=np.int32) * 8  # 17 sequences of 8 tokens: the same graph
    small = (wide[:, ::2], None if types is None else types[:17, :40], small_offsets, 136, 8)
    small_feed = graph_feeds.HostIdsFeed.on(torch.device("cpu"))(small)
    assert small_feed.key == feed.key
    buffer.fill_(-5)
    for stage in graph_feeds._staging.values():
        stage.host.fill_(255)  # any bytes: another layout's, another dtype's
    small_feed.fill([buffer], small)
    assert torch.equal(static_ids[:17, :40], wide[:, ::2]) and not static_ids[17:].any() and not static_ids[:, 40:].any()
    if with_types:
        assert torch.equal(static_types[:17, :40], types[:17, :40]) and not static_types[17:].any()
    assert static_cu.tolist() == small_offsets.tolist() + [136] * 7


def test_a_packed_feed_fills_offsets_with_empty_sequences(gen):
    rows = torch.randn(70, 8, generator=gen)
    cu = torch.tensor([0, 30, 30, 70], dtype=torch.int32)  # an empty sequence inside
    feed = graph_feeds.PackedFeed.of((rows, cu, 40))
    assert feed.bucket == (128, 3, 64) and feed.rows == 70
    statics, views = feed.statics((rows, cu, 40))
    assert [tuple(s.shape) for s in statics] == [(128, 8), (4,)] and views[2] == 64
    assert graph_feeds.PackedFeed.of((rows, cu[:2], 30)).bucket.sequences == 1
    cu5 = torch.tensor([0, 10, 20, 30, 40, 70], dtype=torch.int32)  # 5 sequences: bucket 6, one unused offset
    feed = graph_feeds.PackedFeed.of((rows, cu5, 30))
    statics, _ = feed.statics((rows, cu5, 30))
    statics[0].fill_(float("nan"))
    statics[1].fill_(-7)
    feed.fill(statics, (rows, cu5, 30))
    assert statics[1].tolist() == [0, 10, 20, 30, 40, 70, 70], "unused offsets: empty sequences ending at T"
    assert torch.equal(statics[0][:70], rows) and torch.isnan(statics[0][70:]).all()
    assert graph_feeds.PackedFeed.of((rows, cu.tolist(), 40)) == "eager: inputs"


class _RowNet(auto_graphs.GraphedModule):
    """Row-wise work on packed rows that also reads the offsets on the device (each row plus
    its sequence's length), as the varlen attention does."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.auto_graphs.capture = _fake_capture

    def rows(self, rows, cu, max_seqlen):
        seq = torch.searchsorted(cu[1:].long(), torch.arange(rows.shape[0]), right=True).clamp(max=cu.numel() - 2)
        return rows @ self.weight + (cu[1:] - cu[:-1]).float()[seq, None]

    def forward(self, rows, cu, max_seqlen):
        return auto_graphs.call(self, self.rows, (rows, cu, max_seqlen), key="packed", native=True,
                                feed=graph_feeds.PackedFeed.of)  # fmt: skip


def test_packed_calls_share_bucketed_graphs_and_slack_stays_out(gen):
    net = _RowNet()
    for t, cu in ((70, [0, 30, 50, 70]), (100, [0, 50, 60, 100]), (70, [0, 10, 10, 70])):  # one bucket
        rows = torch.randn(t, 4, generator=gen)
        cu = torch.tensor(cu, dtype=torch.int32)
        with auto_graphs.disabled():
            want = net(rows, cu, 64)
        torch.testing.assert_close(net(rows, cu, 64), want, rtol=0, atol=0)
        for entry in net.auto_graphs.entries():  # poisoned between calls: every offset is rewritten
            entry.inputs[0].fill_(float("nan"))
            entry.inputs[1].fill_(-1)
    c = _counts(net)
    assert c["captures"] == 1 and c["replays"] == 2, c
    assert net.auto_graphs.stats()["buckets"] == [(128, 3, 64)]
    net(torch.randn(5, 4, generator=gen), torch.tensor([0, 5], dtype=torch.int32), 5)  # another bucket
    assert net.auto_graphs.stats()["buckets"] == [(128, 3, 64)]  # its first call runs eagerly


def test_batch_and_packed_buckets_are_reported_together(gen):
    net = _Net()
    x = torch.randn(4, 3, generator=gen)
    net(x)
    net(x)
    rows, cu = torch.randn(10, 3, generator=gen), torch.tensor([0, 4, 10], dtype=torch.int32)
    for _ in range(2):
        auto_graphs.call(net, lambda r, c, m: net.heads(r), (rows, cu, 6), key="p", native=True,
                         feed=graph_feeds.PackedFeed.of)  # fmt: skip
    assert net.auto_graphs.stats()["buckets"] == [4, (64, 2, 64)]


def _cpu_stack(gen):
    with torch.random.fork_rng():
        torch.manual_seed(gen.seed_value)
        stack = fusedenc.EncoderStack.build(2, 32, 4, 64, activation="gelu", dtype=torch.float32)
        with torch.no_grad():
            for p in stack.parameters():
                p.add_(torch.randn(p.shape) * 0.1)
    return stack


@pytest.fixture
def packed_graphs_on_cpu(monkeypatch):
    """forward_packed through automatic graphs on the CPU: native core claimed, fake capture."""
    monkeypatch.setattr(packed_calls, "_native_active", lambda device: True)
    monkeypatch.setattr(auto_graphs, "cuda_capture", _fake_capture)


def _packing(gen, lengths, d=32):
    p = varlen.packing_from_lengths(lengths, max(lengths))
    x = torch.randn(len(lengths), max(lengths), d, generator=gen)
    return varlen.pack(x, p), p


def test_forward_packed_replays_graphs_that_match_eager(gen, packed_graphs_on_cpu):
    stack = _cpu_stack(gen)
    block = stack.blocks[0]
    for call, lengths in enumerate(([5, 9, 1], [7, 2, 3], [9, 9, 1], [3, 3, 3])):  # one bucket: (64, 3, 64)
        rows, p = _packing(gen, lengths)
        for cache in (stack.auto_graphs, block.auto_graphs):
            for entry in cache.entries():  # poisoned statics: slack rows and stale offsets must not matter
                entry.inputs[0].fill_(float("nan"))
                entry.inputs[1].fill_(1 << 20)
        with auto_graphs.disabled():
            want, want_block = stack.forward_packed(rows, p), block.forward_packed(rows, p)
        got = stack.forward_packed(rows, p if call % 2 else p.cu_seqlens)  # a Packing or the offsets: one graph
        torch.testing.assert_close(got, want, **TOL_FP32, msg=lambda m: f"call {call} seed={gen.seed_value}: {m}")
        torch.testing.assert_close(block.forward_packed(rows, p), want_block, **TOL_FP32)
    for module in (stack, block):
        c = _counts(module)
        assert c["captures"] == 1 and c["replays"] == 3 and c["eager: switched off"] == 4, c
    assert stack.auto_graphs.stats()["buckets"] == [(64, 3, 64)]


def test_forward_packed_recaptures_changed_weights_and_stays_bounded(gen, packed_graphs_on_cpu):
    stack = _cpu_stack(gen)
    rows, p = _packing(gen, [20, 4])
    stack.forward_packed(rows, p)
    stack.forward_packed(rows, p)
    with torch.no_grad():
        stack.blocks[1].ffn2_weight.mul_(2)  # in place: a new version
    with auto_graphs.disabled():
        want = stack.forward_packed(rows, p)
    torch.testing.assert_close(stack.forward_packed(rows, p), want, **TOL_FP32)
    assert _counts(stack)["weights changed"] == 1
    stack.auto_graphs.max_graphs = 2
    batches = [_packing(gen, lengths) for lengths in ([40, 30], [70, 60], [120, 130], [3])]  # four buckets
    for _ in range(4):
        for rows, p in batches:
            stack.forward_packed(rows, p)
            assert stack.auto_graphs.stats()["graphs"] <= 2
    assert _counts(stack)["evictions"] >= 1


def test_forward_packed_runs_eagerly_where_graphs_do_not_apply(gen, packed_graphs_on_cpu):
    stack = _cpu_stack(gen)
    rows, p = _packing(gen, [3] * 1100)  # more sequences than the largest bucket
    stack.forward_packed(rows, p)
    assert _counts(stack) == {"eager: sequences": 1}
    stack.auto_graphs.enabled = False
    stack.forward_packed(*_packing(gen, [4, 2]))
    assert _counts(stack)["eager: switched off"] == 1
