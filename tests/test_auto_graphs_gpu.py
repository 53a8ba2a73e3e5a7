"""Automatic CUDA graphs behind the plain call, on the GPU (``fusedenc.graphs.auto``).

Every result is checked against the eager path (``auto_graphs.disabled()``) and, where the
math allows, the fp32 reference by the project's rule (``helpers.assert_close_rule``);
``out=`` buffers are poisoned with NaN first.  A batch that fills its bucket replays the
eager path's kernels on the same shapes, so those results must be bit-identical; a padded
batch runs the bucket's GEMM shapes, held to the rule.
"""

from __future__ import annotations

import threading

import pytest
import torch
from encoder_helpers import padding_mask, randomize, stack_formula
from helpers import assert_close_rule, poisoned, randn
from lc0_writer import random_planes, write_preset

from fusedenc import EncoderBlock, EncoderStack
from fusedenc.common.dtypes import ATOL
from fusedenc.graphs import auto as auto_graphs
from fusedenc.lc0 import load_network, read_net
from fusedenc.lc0.reference import reference_forward

pytestmark = pytest.mark.gpu

DEV = "cuda"
F16 = torch.float16


@pytest.fixture(autouse=True)
def _fresh_graphs():
    was = auto_graphs.set_enabled(True)
    yield
    auto_graphs.clear()
    auto_graphs.set_enabled(was)


def _stack(gen, layers=3, d=256, heads=8, f=512, dtype=F16, **kw):
    blocks = [randomize(EncoderBlock(d, heads, f, "mish", residual_alpha=0.6, dtype=dtype, device=DEV, **kw), gen)
              for _ in range(layers)]  # fmt: skip
    return EncoderStack(blocks)


def _eager(module, *args, **kwargs):
    with auto_graphs.disabled():
        return module(*args, **kwargs)


def _counts(module):
    return module.auto_graphs.stats()["counts"]


@pytest.mark.parametrize("extras", ["none", "shared bias", "bias+mask"])
@pytest.mark.parametrize("batch", [4, 5, 16])
def test_plain_stack_calls_replay_graphs_that_match_eager_and_the_reference(extras, batch, gen):
    stack = _stack(gen)
    s, h = 32, 8
    for call in range(4):  # eager, capture + replay, replay, replay (fresh inputs each time)
        x = randn((batch, s, 256), F16, device=DEV, gen=gen)
        bias = None if extras == "none" else randn((1 if extras == "shared bias" else batch, h, s, s), F16,
                                                      device=DEV, gen=gen)  # fmt: skip
        mask = padding_mask(batch, s, gen, device=DEV) if extras == "bias+mask" else None
        with torch.inference_mode():
            out = poisoned(x.shape, F16, DEV)
            got = stack(x, bias, mask, out=out)
            eager = _eager(stack, x, bias, mask)
        assert got is out
        if batch in auto_graphs.BUCKETS:
            assert torch.equal(got, eager), f"call {call}: differs from eager"
        ref = stack_formula(stack.blocks, x, bias, mask, dtype=torch.float32)
        same = stack_formula(stack.blocks, x, bias, mask, dtype=F16)
        assert_close_rule(got, ref, same, F16, what=f"call {call} B={batch} seed={gen.seed_value}")
    c = _counts(stack)
    assert c["captures"] == 1 and c["replays"] == 3, c


def test_a_block_and_batch_second_layouts(gen):
    block = _stack(gen, layers=1).blocks[0]
    x = randn((6, 16, 256), F16, device=DEV, gen=gen)
    rows = x.reshape(96, 256)
    for _ in range(3):
        torch.testing.assert_close(block(x), _eager(block, x), rtol=0, atol=0)
        torch.testing.assert_close(block(rows, seq_len=16), _eager(block, rows, seq_len=16), rtol=0, atol=0)
    seq_first = EncoderBlock(256, 8, 512, "relu", batch_first=False, dtype=F16, device=DEV)
    xs = x.transpose(0, 1)
    for _ in range(3):
        out = poisoned(xs.shape, F16, DEV)
        assert seq_first(xs, out=out) is out
        torch.testing.assert_close(out, _eager(seq_first, xs), rtol=0, atol=0)
    assert _counts(block)["replays"] >= 2 and _counts(seq_first)["replays"] >= 1


def test_weights_changed_in_place_are_seen(gen):
    """In-place copies keep the parameters' addresses, but the folded and FP8 weight copies
    the graphs read are made from them: a new version re-captures."""
    stack = _stack(gen)
    x = randn((8, 32, 256), F16, device=DEV, gen=gen)
    stack(x)
    stack(x)
    other = _stack(gen)
    stack.load_state_dict(other.state_dict())  # in place
    torch.testing.assert_close(stack(x), _eager(other, x), rtol=0, atol=0)
    held = stack.auto_graphs.stats()["graphs"]
    assert held >= 1
    stack.half()  # already half: _apply replaces no tensor, the graphs stay valid and kept
    assert stack.auto_graphs.stats()["graphs"] == held
    stack.float()  # through _apply, replacing every weight: graphs dropped
    assert stack.auto_graphs.stats()["graphs"] == 0


def test_alternating_batch_sizes_keep_memory_bounded(gen):
    """More buckets than graphs allowed: evictions recycle the shared pool's memory."""
    stack = _stack(gen, layers=2)
    stack.auto_graphs.max_graphs = 3
    sizes = [1, 3, 7, 12, 20, 33, 48]
    xs = {b: randn((b, 32, 256), F16, device=DEV, gen=gen) for b in sizes}
    want = {b: _eager(stack, xs[b]) for b in sizes}
    reserved = []
    with torch.inference_mode():
        for _ in range(6):
            for b in sizes:
                for _ in range(3):
                    torch.testing.assert_close(stack(xs[b]), want[b], rtol=1e-2, atol=1e-2)
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    assert stack.auto_graphs.stats()["graphs"] <= 3
    assert _counts(stack)["evictions"] > 0
    # After the first round the pool has its working size; later rounds must not grow it.
    assert max(reserved[2:]) <= reserved[1] + (64 << 20), [r >> 20 for r in reserved]
    mem = auto_graphs.memory()[str(torch.device(DEV, torch.cuda.current_device()))]
    assert mem["graphs"] <= 3 and mem["static_bytes"] > 0


def test_several_threads_and_streams(gen):
    stack = _stack(gen)
    xs = [randn((b, 32, 256), F16, device=DEV, gen=gen) for b in (4, 8, 4, 16, 8, 4)]
    want = [_eager(stack, x) for x in xs]
    torch.cuda.synchronize()
    errors = []

    def work(i):
        try:
            stream = torch.cuda.Stream() if i % 2 else torch.cuda.current_stream()
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(10):
                    got = stack(xs[i])
                    stream.synchronize()
                    if not torch.equal(got, want[i]):
                        errors.append(f"thread {i}: wrong result")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_inside_a_users_capture_the_call_runs_eagerly(gen):
    stack = _stack(gen)
    x = randn((8, 32, 256), F16, device=DEV, gen=gen)
    for _ in range(3):
        stack(x)  # an automatic graph exists for this shape
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stack(x)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        static_out = stack(x)
    assert _counts(stack)["eager: caller capturing"] == 1
    x.copy_(randn(x.shape, F16, device=DEV, gen=gen))
    g.replay()
    torch.testing.assert_close(static_out, _eager(stack, x), rtol=0, atol=0)


def test_inference_mode_and_plain_calls_share_graphs(gen):
    stack = _stack(gen)
    x = randn((8, 32, 256), F16, device=DEV, gen=gen)
    want = _eager(stack, x)
    for i in range(4):
        if i % 2:
            with torch.inference_mode():
                got = stack(x)
            assert got.is_inference()
        else:
            got = stack(x)
            assert not got.is_inference() and got.grad_fn is None
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _counts(stack)["captures"] == 1


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_stack_replays_its_graphs(mode, gen):
    stack = _stack(gen)
    x = randn((8, 64, 256), F16, device=DEV, gen=gen)
    compiled = torch.compile(stack, fullgraph=True, mode=None if mode == "default" else mode)
    with torch.inference_mode():
        want = _eager(stack, x)
        for _ in range(4):
            torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)
    if mode == "default":
        assert _counts(stack).get("replays", 0) >= 2


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("lc0") / "tiny.pb.gz"
    write_preset(path, "tiny", seed=13)
    return path


@pytest.mark.parametrize("batch", [8, 5])
def test_a_plain_lc0_call_replays_a_graph_held_to_the_reference(tiny_path, batch, gen):
    net = load_network(str(tiny_path), dtype=F16, device=DEV)
    file = read_net(str(tiny_path))
    for call in range(3):
        planes = random_planes(batch, gen)
        ref64 = reference_forward(file, planes.double())
        same = reference_forward(file, planes.to(DEV, F16))
        x = planes.to(DEV, F16)
        with torch.inference_mode():
            heads = net(x)
            out = {k: poisoned(v.shape, v.dtype, DEV) for k, v in heads.items()}
            assert net(x, out=out) is out
        for name, ref in ref64.items():
            for got in (heads[name], out[name]):
                err = (got.double().cpu() - ref).abs().max().item()
                bound = 2 * (same[name].double().cpu() - ref).abs().max().item() + ATOL[F16]
                assert err <= bound, f"call {call} {name}: {err:.3g} > {bound:.3g} (seed {gen.seed_value})"
    assert _counts(net)["replays"] >= 3


def test_lc0_evaluate_and_compile_use_the_graphs(tiny_path, gen):
    net = load_network(str(tiny_path), dtype=F16, device=DEV)
    fens = ["rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1"] * 4
    first = net.evaluate(fens)
    for _ in range(2):
        again = net.evaluate(fens)
    assert [e.best_move for e in again] == [e.best_move for e in first]
    assert _counts(net)["replays"] >= 1
    x = random_planes(16, gen).to(DEV, F16)
    compiled = torch.compile(net)
    want = _eager(net, x)
    for _ in range(3):  # the graph runs smolgen beside QKV on fewer SMs: close, not bitwise
        got = compiled(x)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=2e-2, atol=2e-2)


def test_offsets_reach_the_statics_through_pinned_memory(gen):
    """``graph_feeds.copy_offsets``: back-to-back copies from the one pinned buffer (each
    waits for the last to leave) and a larger one (a new buffer), all landing as written,
    with empty sequences ending at T after the call's."""
    import numpy as np

    from fusedenc.graphs import feeds as graph_feeds

    copies = []
    for sequences, size in [(3, 8), (5, 8), (7, 12), (2, 3000)]:
        lengths = torch.randint(1, 9, (sequences,), generator=gen).numpy()
        offsets = np.zeros(sequences + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        static = torch.full((size + 1,), -1, dtype=torch.int32, device=DEV)
        graph_feeds.copy_offsets(static, offsets, int(offsets[-1]))
        copies.append((static, offsets.tolist()))
    torch.cuda.synchronize()
    for static, offsets in copies:
        assert static.tolist() == offsets + [offsets[-1]] * (static.shape[0] - len(offsets))


@pytest.mark.parametrize("layout", ["dense", "wide rows", "one row", "columns apart"])
def test_padded_ids_feed_fills_its_statics_in_one_native_call(layout, gen, monkeypatch):
    """``PaddedIdsFeed.fill``: the offsets (from pinned memory), ids and token types reach the
    poisoned statics' ``[:B, :S]`` corners exactly, everything else untouched; rows that are
    dense (alone, or rows of a wider tensor) go by one ``core.copy_blocks`` call, ids whose
    columns are apart by the framework's copies."""
    import numpy as np

    from fusedenc import core
    from fusedenc.graphs import feeds as graph_feeds

    calls = []
    native = core.copy_blocks
    monkeypatch.setattr(core, "copy_blocks", lambda *a: (calls.append(a), native(*a)))
    batch = 1 if layout == "one row" else 13
    wide = torch.randint(0, 30000, (batch, 80), generator=gen).cuda()
    ids = {"dense": wide[:, :37].contiguous(), "wide rows": wide[:, :37], "one row": wide[:, :37],
           "columns apart": wide[:, :74:2]}[layout]  # fmt: skip
    types = torch.randint(0, 2, ids.shape, generator=gen).cuda()
    lengths = torch.randint(1, 38, (batch,), generator=gen).numpy()
    offsets = np.zeros(batch + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    tokens = int(offsets[-1])
    inputs = (ids, types, offsets, tokens, int(lengths.max()))
    feed = graph_feeds.PaddedIdsFeed.of(inputs)
    statics, _ = feed.statics(inputs)
    for t in statics:
        t.fill_(-7)
    feed.fill(statics, inputs)
    torch.cuda.synchronize()
    static_ids, static_types, static_cu = statics
    b, s = ids.shape
    assert torch.equal(static_ids[:b, :s], ids) and torch.equal(static_types[:b, :s], types)
    for static in (static_ids, static_types):
        rest = torch.ones_like(static, dtype=torch.bool)
        rest[:b, :s] = False
        assert (static[rest] == -7).all()
    assert static_cu.tolist() == offsets.tolist() + [tokens] * (static_cu.shape[0] - batch - 1)
    assert len(calls) == (0 if layout == "columns apart" else 1), calls


def test_copy_blocks_refuses_a_block_it_cannot_copy():
    """``core.copy_blocks``: a null address or a pitch narrower than the row is refused before
    anything is copied; empty blocks copy nothing."""
    from fusedenc import core

    dst = torch.full((4, 8), -1, dtype=torch.int32, device=DEV)
    src = torch.arange(32, dtype=torch.int32, device=DEV).view(4, 8)
    stream = torch.cuda.current_stream().cuda_stream
    good = (dst.data_ptr(), 32, src.data_ptr(), 32, 32, 4)
    for bad in [(0, 32, src.data_ptr(), 32, 32, 4), (dst.data_ptr(), 16, src.data_ptr(), 32, 32, 4),
                (dst.data_ptr(), 32, src.data_ptr(), 32, -4, 4)]:  # fmt: skip
        with pytest.raises(ValueError, match="copy_blocks"):
            core.copy_blocks(dst.device, stream, [good, bad])
    torch.cuda.synchronize()
    assert (dst == -1).all()  # the good block before the bad one was not copied either
    core.copy_blocks(dst.device, stream, [(dst.data_ptr(), 32, src.data_ptr(), 32, 0, 4), good])
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
