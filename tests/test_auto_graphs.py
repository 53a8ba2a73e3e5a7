"""``fusedenc.auto_graphs``, the CUDA graphs behind a plain call, on the CPU.

The cache logic (keys, buckets, capture on the second call, LRU eviction and its back-off,
fallbacks, switches, invalidation when weights change, ``out=``, copies, threads) runs here
with a fake capture: a "graph" recomputes its run from the static inputs into the static
output when replayed, which is what a real graph does to its buffers.  The GPU tests
(``test_auto_graphs_gpu.py``) check real graphs against the eager path.
"""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
import torch.nn as nn

import fusedenc
from fusedenc import auto_graphs
from fusedenc.graphs import eager_calls


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


@pytest.mark.parametrize("how", ["process", "module", "context", "native", "nested", "empty", "huge"])
def test_fallbacks_run_eagerly(gen, how):
    net = _Net()
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
