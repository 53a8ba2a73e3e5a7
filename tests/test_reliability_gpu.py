"""Reliability on the GPU: resources, out-of-memory, concurrency, determinism.

* 100k calls over mixed shapes under a small plan-cache limit keep device
  memory (``torch.cuda.memory_allocated``) and host memory (RSS from
  ``/proc/self/statm``) flat and the plan cache within its limit;
* an oversized batch raises a clear out-of-memory error, and the next normal
  call succeeds with the right answer;
* 8 threads on their own streams get bit for bit what the same calls give
  serially, and a CUDA-graph replay beside eager calls changes neither;
* concurrent first use of the plan cache and of the attention tables (with a
  corrupt user table: one warning) gives correct results and no duplicate plans;
* the same inputs give bitwise-identical outputs across calls and across two
  processes (with the same tuning tables).

All ``gpu``-marked; about a minute on an H100.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
from encoder_helpers import block_config, block_formula, block_params, padding_mask, randomize
from helpers import assert_close_rule, linear_formula, poisoned, randn, ref_dtype, same_dtype_torch

import fusedenc
import fusedenc.attention as A
from fusedenc import EncoderBlock, EncoderStack
from fusedenc.common import table_files
from fusedenc.common.device import device_arch

pytestmark = pytest.mark.gpu

DEV = "cuda"
H, BF = torch.float16, torch.bfloat16


@pytest.fixture
def isolated_tables(tmp_path, monkeypatch):
    """No user attention table (an empty config dir), no forced backend, fresh decisions."""
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path / "tables"))
    monkeypatch.delenv(A.BACKEND_ENV, raising=False)
    A.clear_cache()
    yield tmp_path / "tables"
    A.clear_cache()


@pytest.fixture
def plan_cache_limit():
    """Set a plan-cache limit for one test; the old limit comes back after."""
    saved = fusedenc.plan_cache_info()["limit"]
    yield fusedenc.set_plan_cache_limit
    fusedenc.set_plan_cache_limit(saved)


def _r(shape, dtype, gen, scale=1.0):
    return randn(shape, dtype, device=DEV, gen=gen, scale=scale)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _check_linear(out, x, w, b=None, act="none", residual=None, alpha=1.0, *, what):
    ref = linear_formula(x, w, b, act, residual, 1.0, alpha, dtype=ref_dtype(x.dtype))
    assert_close_rule(out, ref, same_dtype_torch(x, w, b, act, residual, 1.0, alpha), x.dtype, what=what)


def _check_block(out, block, x, bias=None, mask=None, *, what):
    p, cfg = block_params(block), block_config(block)
    ref = block_formula(p, x, cfg, bias, mask, dtype=ref_dtype(x.dtype))
    same = block_formula(p, x, cfg, bias, mask, dtype=x.dtype)
    assert_close_rule(out, ref, same, x.dtype, what=what)


def _run_in_threads(target, count: int, timeout: float = 300.0) -> None:
    """target(i) in ``count`` threads, each on its own stream, started together."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []
    streams = [torch.cuda.Stream() for _ in range(count)]

    def body(i):
        try:
            barrier.wait()
            with torch.cuda.stream(streams[i]):
                target(i)
            streams[i].synchronize()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)
            barrier.abort()

    torch.cuda.synchronize()  # inputs made on the default stream are ready for every stream
    threads = [threading.Thread(target=body, args=(i,), name=f"fusedenc-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    torch.cuda.synchronize()
    if errors:
        raise errors[0]


# ------------------------------------------------------------ 100k calls ----


def test_stress_100k_calls_memory_flat_and_plan_cache_bounded(gen, plan_cache_limit, isolated_tables):
    """100,000 calls of linear (every activation, residual), layer_norm, attention and the block
    over mixed tiny shapes: device memory returns to the same bytes at every checkpoint, RSS
    grows by less than 32 MiB after warm-up, and the plan cache never exceeds a limit of 16
    (with more than 16 GEMM shapes in play, so it evicts)."""
    limit = 16
    plan_cache_limit(limit)
    fusedenc.clear_plan_cache()
    acts = fusedenc.ACTIVATIONS
    ks, ns, ms = (16, 32, 64), (16, 48), (1, 3, 8, 17, 64)
    weights = {(n, k): (_r((n, k), H, gen, k**-0.5), _r((n,), H, gen)) for n in ns for k in ks}
    xs = {(m, k): _r((m, k), H, gen) for m in ms for k in ks}
    res = {(m, n): _r((m, n), H, gen) for m in ms for n in ns}
    ln_res = {m: _r((m, 64), H, gen) for m in ms}
    ln_w, ln_b = 1 + _r((64,), H, gen, 0.2), _r((64,), H, gen, 0.2)
    qkv = _r((4, 16, 3 * 64), H, gen)
    q, k, v = fusedenc.ops.gemm.split_qkv(qkv, 4)
    mask = padding_mask(4, 16, gen, device=DEV)
    block = randomize(EncoderBlock(64, 4, 128, "swish", dtype=H, device=DEV), gen)
    xb = _r((2, 16, 64), H, gen)
    mask_b = padding_mask(2, 16, gen, device=DEV)
    rng = torch.Generator().manual_seed(gen.seed_value)
    picks = torch.randint(0, 1 << 30, (100_000,), generator=rng).tolist()

    def call(i: int, p: int):
        kind = i % 50
        if kind == 0:
            return block(xb, key_padding_mask=mask_b if p % 2 else None)
        if kind < 5:
            return fusedenc.attention.attention(q, k, v, None, mask if p % 2 else None)
        if kind < 15:
            m = ms[p % len(ms)]
            r = ln_res[m] if (p >> 6) % 2 else None
            return fusedenc.layer_norm(xs[(m, 64)], ln_w, ln_b, residual=r, alpha=0.5)
        m, kk, n = ms[p % len(ms)], ks[(p >> 3) % len(ks)], ns[(p >> 6) % len(ns)]
        w, b = weights[(n, kk)]
        if (p >> 9) % 4 == 0:
            return fusedenc.linear(xs[(m, kk)], w, b, residual=res[(m, n)], alpha=0.5)
        return fusedenc.linear(xs[(m, kk)], w, b, acts[(p >> 11) % len(acts)])

    with torch.inference_mode():
        for i in range(5_000):  # warm-up: workspaces, constants, plans, allocator pools
            call(i, picks[i])
        torch.cuda.synchronize()
        mem0, rss0 = torch.cuda.memory_allocated(), _rss_bytes()
        seen = []
        for i in range(5_000, 100_000):
            call(i, picks[i])
            if i % 1000 == 999:
                info = fusedenc.plan_cache_info()
                assert info["size"] <= limit, f"call {i}: plan cache holds {info['size']} > limit {limit}"
            if i % 19_000 == 0:
                torch.cuda.synchronize()
                seen.append((i, torch.cuda.memory_allocated() - mem0, _rss_bytes() - rss0))
        torch.cuda.synchronize()
    mem1, rss1 = torch.cuda.memory_allocated(), _rss_bytes()
    info = fusedenc.plan_cache_info()
    assert mem1 == mem0, f"device memory grew by {mem1 - mem0} bytes over 95k calls (checkpoints {seen})"
    assert rss1 - rss0 < 32 << 20, f"host RSS grew by {(rss1 - rss0) >> 20} MiB (checkpoints {seen})"
    assert info["size"] <= limit and info["evictions"] > 0, info

    # Still right after all that.
    w, b = weights[(48, 64)]
    out = fusedenc.linear(xs[(17, 64)], w, b, "mish", out=poisoned((17, 48), H, DEV))
    _check_linear(out, xs[(17, 64)], w, b, "mish", what=f"after 100k calls seed={gen.seed_value}")
    with torch.inference_mode():
        _check_block(block(xb, key_padding_mask=mask_b), block, xb, None, mask_b, what=f"block after 100k seed={gen.seed_value}")


# ------------------------------------------------------------ out of memory ----


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def test_oversized_batch_raises_oom_then_normal_calls_succeed(gen, isolated_tables):
    """A linear whose output would take terabytes, and a block whose batch fills a third of the
    free memory (its QKV buffer alone needs the rest), raise an out-of-memory error that says
    so; afterwards device memory is back where it was and normal calls give the right answer."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()

    x = _r((1 << 20, 16), H, gen)
    w = _r((1 << 21, 16), H, gen, 0.25)  # out would be 2^41 halves = 4 TiB
    with pytest.raises((torch.OutOfMemoryError, RuntimeError)) as info:
        fusedenc.linear(x, w)
    assert _is_oom(info.value), f"not an out-of-memory error: {type(info.value).__name__}: {info.value}"
    del x, w

    block = randomize(EncoderBlock(1024, 16, 4096, "gelu", dtype=H, device=DEV), gen)
    free, _total = torch.cuda.mem_get_info()
    seq = 16
    batch = int(free // 3 // (seq * 1024 * 2))
    big = torch.empty((batch, seq, 1024), dtype=H, device=DEV)  # values irrelevant: it must not run
    with pytest.raises((torch.OutOfMemoryError, RuntimeError)) as info:
        with torch.inference_mode():
            block(big)
    assert _is_oom(info.value), f"not an out-of-memory error: {type(info.value).__name__}: {info.value}"
    del big, info
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    x = _r((6, 32), H, gen)
    w, b = _r((48, 32), H, gen, 32**-0.5), _r((48,), H, gen)
    out = fusedenc.linear(x, w, b, "relu", out=poisoned((6, 48), H, DEV))
    _check_linear(out, x, w, b, "relu", what=f"linear after OOM seed={gen.seed_value}")
    xb = _r((3, seq, 1024), H, gen)
    with torch.inference_mode():
        _check_block(block(xb), block, xb, what=f"block after OOM seed={gen.seed_value}")
    del out, x, w, b, xb, block
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base < 64 << 20, "memory held after the OOM (beyond workspaces)"


# ------------------------------------------------------------ concurrency ----


def _jobs(gen):
    """Eight mixed workloads, 12 calls each: the fp16 post-LN block with bias and mask (threads
    0 and 4, sharing one module), linear bf16 + mish (1), the bf16 pre-LN block (5), layer_norm
    with a residual (2, 6) and linear fp16 + gelu_tanh (3, 7)."""
    b1 = randomize(EncoderBlock(256, 8, 512, "swish", residual_alpha=0.6, dtype=H, device=DEV), gen)
    b2 = randomize(EncoderBlock(128, 4, 384, "gelu", norm_first=True, dtype=BF, device=DEV), gen)
    w1, bias1 = _r((768, 256), H, gen, 256**-0.5), _r((768,), H, gen)
    w2 = _r((512, 128), BF, gen, 128**-0.5)
    lw, lb = 1 + _r((1024,), H, gen, 0.2), _r((1024,), H, gen, 0.2)
    attn_bias = _r((1, 8, 64, 64), H, gen)
    mask = padding_mask(8, 64, gen, device=DEV)

    def make(i):
        kind = i % 4
        if kind == 0:
            x = _r((8, 64, 256), H, gen)
            return lambda: b1(x, attn_bias, mask)
        if kind == 1 and i < 4:
            x = _r((200, 128), BF, gen)
            return lambda: fusedenc.linear(x, w2, None, "mish")
        if kind == 1:
            x = _r((8, 25, 128), BF, gen)
            return lambda: b2(x)
        if kind == 2:
            x, r = _r((300, 1024), H, gen), _r((300, 1024), H, gen)
            return lambda: fusedenc.layer_norm(x, lw, lb, residual=r, alpha=0.7)
        x = _r((333, 256), H, gen)
        return lambda: fusedenc.linear(x, w1, bias1, "gelu_tanh")

    return [[make(i) for _ in range(12)] for i in range(8)]


def test_eight_threads_on_separate_streams_match_serial(gen, isolated_tables):
    jobs = _jobs(gen)
    with torch.inference_mode():
        expected = [[c().clone() for c in calls] for calls in jobs]
        torch.cuda.synchronize()
        got = [[] for _ in jobs]

        def work(i):
            for _ in range(3):  # several rounds, so the threads overlap for a while
                got[i] = [c().clone() for c in jobs[i]]

        _run_in_threads(work, len(jobs))
    for i, (g, e) in enumerate(zip(got, expected)):
        for j, (a, b) in enumerate(zip(g, e)):
            assert torch.equal(a, b), f"thread {i} call {j}: differs from serial (max diff {(a.float() - b.float()).abs().max().item():.3g})"


def test_graph_replay_beside_eager_calls(gen, isolated_tables):
    """One thread replays a captured stack while another runs the same stack eagerly on its own
    stream: both get bit for bit what they get alone."""
    stack = EncoderStack([randomize(EncoderBlock(128, 4, 256, "mish", residual_alpha=0.5, dtype=H, device=DEV), gen) for _ in range(2)])
    runner = stack.graph_runner(seq_len=32, batch_sizes=(4, 16), key_padding_mask=True)
    runner.capture_all()
    xs_graph = [_r((b, 32, 128), H, gen) for b in (3, 16, 4, 9) * 3]
    masks = [padding_mask(x.shape[0], 32, gen, device=DEV) for x in xs_graph]
    xs_eager = [_r((5, 32, 128), H, gen) for _ in range(12)]
    with torch.inference_mode():
        want_graph = [runner(x, None, m).clone() for x, m in zip(xs_graph, masks)]
        want_eager = [stack(x) for x in xs_eager]
        _check_block(want_eager[0], stack.blocks[1], stack.blocks[0](xs_eager[0]), what=f"eager seed={gen.seed_value}")
        got = {0: [], 1: []}

        def work(i):
            for _ in range(5):
                if i == 0:
                    got[0] = [runner(x, None, m).clone() for x, m in zip(xs_graph, masks)]
                else:
                    got[1] = [stack(x) for x in xs_eager]

        _run_in_threads(work, 2)
    for j, (a, b) in enumerate(zip(got[0], want_graph)):
        assert torch.equal(a, b), f"graph replay {j} differs when eager calls run beside it"
    for j, (a, b) in enumerate(zip(got[1], want_eager)):
        assert torch.equal(a, b), f"eager call {j} differs when a graph replays beside it"


def test_concurrent_first_use_of_plan_cache_and_attention_tables(gen, isolated_tables):
    """Eight threads make their first calls at once on an empty plan cache and unloaded attention
    tables (the user table is corrupt): every result is right and equals a serial rerun, the
    cache holds each plan once, and the corrupt table is reported exactly once."""
    isolated_tables.mkdir(parents=True, exist_ok=True)
    (isolated_tables / f"attention_{device_arch(DEV)}.json").write_text("{ not json")
    fusedenc.clear_plan_cache()
    A.clear_cache()
    x_shared = _r((777, 128), H, gen)
    w, b = _r((384, 128), H, gen, 128**-0.5), _r((384,), H, gen)
    xs = [_r((901 + 2 * i, 128), H, gen) for i in range(8)]
    qkvs = [_r((4, 48, 3 * 128), H, gen) for _ in range(8)]
    block = randomize(EncoderBlock(128, 4, 256, "relu", dtype=H, device=DEV), gen)
    # Eager calls: a block's automatic graphs would replay in the serial rerun and make no plans
    # there, which is not what this test counts (tests/test_auto_graphs_gpu.py covers threads).
    block.auto_graphs.enabled = False
    xbs = [_r((2, 48, 128), H, gen) for _ in range(8)]
    results: list = [None] * 8

    def calls(i):
        q, k, v = fusedenc.ops.gemm.split_qkv(qkvs[i], 4)
        return (
            fusedenc.linear(x_shared, w, b, "swish"),
            fusedenc.linear(xs[i], w, b, "relu"),
            fusedenc.attention.attention(q, k, v),
            block(xbs[i]),
        )

    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")

        def work(i):
            results[i] = calls(i)

        _run_in_threads(work, 8)
    table_warnings = [c for c in caught if issubclass(c.category, A.AttentionTableWarning)]
    assert len(table_warnings) == 1, [str(c.message) for c in table_warnings]
    size_concurrent = fusedenc.plan_cache_info()["size"]

    fusedenc.clear_plan_cache()
    with torch.inference_mode():
        serial = [calls(i) for i in range(8)]
    assert fusedenc.plan_cache_info()["size"] == size_concurrent, "a plan was cached twice or lost"
    for i in range(8):
        for j, (a, s) in enumerate(zip(results[i], serial[i])):
            assert torch.equal(a, s), f"thread {i} result {j} differs from the serial rerun"
        _check_linear(results[i][1], xs[i], w, b, "relu", what=f"thread {i} seed={gen.seed_value}")
        _check_block(results[i][3], block, xbs[i], what=f"thread {i} block seed={gen.seed_value}")
    _check_linear(results[0][0], x_shared, w, b, "swish", what=f"shared shape seed={gen.seed_value}")


# ------------------------------------------------------------ determinism ----

_DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import sys, torch, fusedenc
    from fusedenc import EncoderBlock, EncoderStack
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(20240611)
    def r(shape, dtype, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(dtype=dtype, device="cuda")
    H, BF = torch.float16, torch.bfloat16
    out = {}
    stack = EncoderStack.build(3, 768, 24, 2304, activation="mish", residual_alpha=0.43, dtype=H, device="cuda")
    with torch.no_grad():
        for blk in stack.blocks:
            for p in blk.parameters():
                p.copy_(r(p.shape, H, 0.05) + (1.0 if p.dim() == 1 and p.shape[0] == 768 else 0.0))
    with torch.inference_mode():
        for name, act, dtype in (("swish", "swish", H), ("relu", "relu", BF), ("gelu_tanh", "gelu_tanh", H), ("mish32", "mish", torch.float32)):
            x, w, b = r((513, 768), dtype), r((2304, 768), dtype, 768 ** -0.5), r((2304,), dtype)
            out["linear_" + name] = fusedenc.linear(x, w, b, act)
        x, w, res = r((4096, 768), H), r((768, 768), H, 768 ** -0.5), r((4096, 768), H)
        out["linear_residual"] = fusedenc.linear(x, w, None, residual=res, alpha=0.43)
        out["layer_norm"] = fusedenc.layer_norm(r((4096, 768), H), 1 + r((768,), H, 0.2), r((768,), H, 0.2), residual=res, alpha=0.43)
        q, k, v = fusedenc.ops.gemm.split_qkv(r((64, 64, 3 * 768), H), 24)
        mask = torch.arange(64, device="cuda")[None, :] >= torch.randint(1, 65, (64,), generator=g).cuda()[:, None]
        out["attention"] = fusedenc.attention.attention(q, k, v)
        out["attention_bias_mask"] = fusedenc.attention.attention(q, k, v, r((1, 24, 64, 64), H), mask)
        xs = r((64, 64, 768), H)
        out["stack"] = stack(xs, key_padding_mask=mask)
        runner = stack.graph_runner(seq_len=64, batch_sizes=(64,), key_padding_mask=True)
        out["stack_graph"] = runner(xs, None, mask).clone()
        out["attention_backend"] = torch.tensor([ord(c) for c in fusedenc.attention.explain(q, k, v).backend])
    torch.save({k: t.cpu() for k, t in out.items()}, sys.argv[1])
    """
)


def test_determinism_across_calls(gen, isolated_tables):
    """The same inputs give bit-identical outputs call after call (each op and the block)."""
    x, w, b = _r((513, 768), H, gen), _r((2304, 768), H, gen, 768**-0.5), _r((2304,), H, gen)
    res = _r((513, 2304), H, gen)
    q, k, v = fusedenc.ops.gemm.split_qkv(_r((16, 64, 3 * 256), H, gen), 8)
    bias, mask = _r((16, 8, 64, 64), H, gen), padding_mask(16, 64, gen, device=DEV)
    block = randomize(EncoderBlock(256, 8, 768, "gelu", dtype=H, device=DEV), gen)
    xb = _r((16, 64, 256), H, gen)
    ops = {
        "linear_swish": lambda: fusedenc.linear(x, w, b, "swish"),
        "linear_relu": lambda: fusedenc.linear(x, w, b, "relu"),
        "linear_residual": lambda: fusedenc.linear(x, w, b, residual=res, alpha=0.5),
        "layer_norm": lambda: fusedenc.layer_norm(res, None, None, residual=res, alpha=0.5),
        "attention": lambda: fusedenc.attention.attention(q, k, v, bias, mask),
        "block": lambda: block(xb, bias, mask),
    }
    with torch.inference_mode():
        for name, op in ops.items():
            first = op().clone()
            for i in range(5):
                again = op()
                assert torch.equal(first, again), f"{name}: call {i + 2} differs from call 1"


def test_determinism_across_processes(tmp_path, isolated_tables):
    """Two processes with the same inputs and tables (none: an empty config dir) save
    bit-identical outputs of every op, the block stack and its graph replay."""
    script = tmp_path / "run.py"
    script.write_text(_DETERMINISM_SCRIPT)
    env = dict(os.environ)
    env[table_files.CONFIG_DIR_ENV] = str(isolated_tables)
    env.pop(A.BACKEND_ENV, None)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / f"out{i}.pt")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"subprocess failed:\n{stdout}\n{stderr}"
    a, b = (torch.load(tmp_path / f"out{i}.pt") for i in range(2))
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.isnan(a[name].float()).any() or name.startswith("attention_backend"), f"{name}: NaN output"
        assert torch.equal(a[name], b[name]), f"{name}: differs between two processes"
