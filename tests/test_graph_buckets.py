"""``graphs.BucketedGraphs``, the machinery of ``GraphRunner`` and ``Lc0GraphRunner``, on CPU.

CUDA graphs need a GPU, so these tests stand in a fake for ``torch.cuda``'s graph API: a
"graph" records, while it is being captured, how to recompute the run's outputs into the
same tensors, and ``replay()`` does that.  That is what a real graph does to its static
buffers, so the bucket choice, the copies into the static inputs, padding, chunking, dict
outputs and the empty batch are all checked here; the GPU tests (``test_encoder_gpu``,
``test_lc0_network``) check the same runners with real graphs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fusedenc.graphs import runner as graphs
from fusedenc.graphs.runner import BucketedGraphs


class _FakeGraph:
    capturing = None  # the graph being captured, if any

    def __init__(self):
        self.steps = []
        self.replays = 0

    def replay(self):
        self.replays += 1
        for step in self.steps:
            step()


class _FakeStream:
    def wait_stream(self, other):
        pass


@contextlib.contextmanager
def _fake_capture(graph, pool=None, stream=None, capture_error_mode="global"):
    _FakeGraph.capturing = graph
    try:
        yield
    finally:
        _FakeGraph.capturing = None


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(graphs, "_free_streams", {})  # no fake stream outlives the test


def _math(x, shift):
    """Row-independent work with two outputs (like a network's heads)."""
    s = x.sum(dim=1, keepdim=True)
    return {"sum": s if shift is None else s + shift, "double": x * 2}


def _run(x, shift=None):
    out = _math(x, shift)
    graph = _FakeGraph.capturing
    if graph is not None:  # what replaying the captured kernels does: recompute in place
        def step():
            for name, t in _math(x, shift).items():
                out[name].copy_(t)

        graph.steps.append(step)
    return out


class _Runner(BucketedGraphs):
    def __init__(self, batch_sizes, with_shift=False):
        super().__init__(_run, batch_sizes, torch.device("cpu"))
        self.with_shift = with_shift
        self.captures = []

    def _static_inputs(self, bucket):
        self.captures.append(bucket)
        return torch.zeros(bucket, 3), (torch.zeros(bucket, 1) if self.with_shift else None)

    def __call__(self, x, shift=None):
        return self._dispatch((x, shift))


def _expect(out, x, shift=None):
    want = _math(x, shift)
    assert set(out) == set(want)
    for name in want:
        torch.testing.assert_close(out[name], want[name], rtol=0, atol=0)


@pytest.mark.parametrize("batch, bucket", [(1, 1), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_a_batch_runs_in_the_smallest_bucket_that_holds_it(fake_cuda, batch, bucket):
    runner = _Runner((1, 4, 8))
    x = torch.randn(batch, 3)
    out = runner(x)
    _expect(out, x)
    assert runner.captures == [bucket]
    g = runner._graphs[bucket]
    assert out["sum"].data_ptr() == g.out["sum"].data_ptr()  # a view of the static output
    assert torch.equal(g.inputs[0][:batch], x) and (bucket == batch or not g.inputs[0][batch:].any())


def test_each_call_replays_with_its_own_inputs(fake_cuda):
    runner = _Runner((4,))
    a, b = torch.randn(4, 3), torch.randn(2, 3)
    first = {k: v.clone() for k, v in runner(a).items()}
    second = runner(b)
    _expect(first, a)
    _expect(second, b)
    assert runner.captures == [4] and runner._graphs[4].graph.replays == 2


def test_a_batch_above_the_largest_bucket_runs_in_chunks(fake_cuda):
    runner = _Runner((2, 4), with_shift=True)
    x = torch.randn(9, 3)
    shift = torch.randn(9, 1)
    out = runner(x, shift)
    _expect(out, x, shift)
    assert sorted(set(runner.captures)) == [2, 4]  # chunks of 4, 4 and 1 (bucket 2)
    assert out["sum"].data_ptr() not in {g.out["sum"].data_ptr() for g in runner._graphs.values()}


def test_an_input_with_a_leading_one_is_the_same_for_every_row(fake_cuda):
    runner = _Runner((4,), with_shift=True)
    x, shift = torch.randn(7, 3), torch.randn(1, 1)
    _expect(runner(x, shift), x, shift)  # chunks 4 + 3, each given the whole [1, 1] shift
    _expect(runner(x[:3], shift), x[:3], shift)


def test_an_empty_batch_captures_nothing(fake_cuda):
    runner = _Runner((4,))
    out = runner(torch.zeros(0, 3))
    assert out["double"].shape == (0, 3) and runner.captures == []


def test_capture_all_captures_every_bucket_once(fake_cuda):
    runner = _Runner((1, 2, 4))
    runner.capture_all()
    runner.capture_all()
    assert runner.captures == [4, 2, 1]
    assert runner.capture_seconds >= 0


@pytest.mark.parametrize("sizes", [(), (0,), (2, -1), (True,), (1.5,)])
def test_bad_batch_sizes(sizes):
    with pytest.raises(ValueError, match="^batch_sizes must be positive ints"):
        _Runner(sizes)


def _run_tensor(x, shift=None):
    out = x * 3
    graph = _FakeGraph.capturing
    if graph is not None:
        graph.steps.append(lambda: out.copy_(x * 3))
    return out


class _TensorRunner(_Runner):
    def __init__(self, batch_sizes):
        super().__init__(batch_sizes)
        self._run = _run_tensor


@pytest.mark.parametrize("batch", [3, 4, 10])
def test_a_single_tensor_output(fake_cuda, batch):
    """GraphRunner's case: one output tensor, sliced or concatenated like the dict's."""
    runner = _TensorRunner((4,))
    x = torch.randn(batch, 3)
    torch.testing.assert_close(runner(x), x * 3, rtol=0, atol=0)


def test_a_capture_owns_its_cublas_workspace(fake_cuda, monkeypatch):
    """torch's cached cuBLAS workspaces are dropped before and after every capture (and after
    a failed one), so a graph's torch matmuls use a workspace inside its own pool:
    ``own_cublas_workspace`` says why."""
    from fusedenc.graphs import runner as graphs

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)

    def run(x, shift=None):
        calls.append("capture" if _FakeGraph.capturing is not None else "warm-up")
        return _run(x, shift)

    runner = _Runner((4,))
    runner._run = run
    _expect(runner(torch.ones(3, 3)), torch.ones(3, 3))
    assert calls == ["warm-up", "clear", "capture", "clear"]
    calls.clear()
    with graphs.own_cublas_workspace():
        calls.append("capture")
    assert calls == ["clear", "capture", "clear"]
    calls.clear()
    with pytest.raises(RuntimeError, match="capture failed"):
        with graphs.own_cublas_workspace():
            raise RuntimeError("capture failed")
    assert calls == ["clear", "clear"]


def test_a_capture_pauses_the_cycle_collector(fake_cuda):
    """No cycle collection inside a capture (freeing a CUDA graph or pinned memory there
    breaks it: ``no_cycle_collection`` says why); the collector's state comes back after it,
    also after a failed capture, and with nested or overlapping captures."""
    import gc

    seen = []

    def run(x, shift=None):
        if _FakeGraph.capturing is not None:
            seen.append(gc.isenabled())
        return _run(x, shift)

    was = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            runner = _Runner((4,))
            runner._run = run
            _expect(runner(torch.ones(3, 3)), torch.ones(3, 3))
            assert seen.pop() is False and gc.isenabled() is state
            with graphs.no_cycle_collection():
                with graphs.no_cycle_collection():
                    assert not gc.isenabled()
                assert not gc.isenabled()
            assert gc.isenabled() is state
            with pytest.raises(RuntimeError, match="capture failed"):
                with graphs.no_cycle_collection():
                    raise RuntimeError("capture failed")
            assert gc.isenabled() is state
    finally:
        (gc.enable if was else gc.disable)()
