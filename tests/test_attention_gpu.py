"""fusedenc.attention on a GPU: every available backend against the fp32 formula and sdpa_math,
no-copy outputs, CUDA graphs, torch.compile, the table's choices and the tune command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from attention_helpers import COPY_OPS, packed_inputs, record_kernel_outputs, replays_match_eager
from helpers import assert_close_rule, attention_formula

import fusedenc
import fusedenc.attention as A
from fusedenc.attention import attention, explain
from fusedenc.common import table_files
from fusedenc.common.device import device_arch, device_metadata

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_attention_tables")]

DEV = "cuda"
DTYPES = [torch.float16, torch.bfloat16]
SEQS = [1, 64, 128, 512, 2048]
HEAD_DIMS = [32, 64, 128]
VARIANTS = ["none", "bias", "bias_broadcast", "bias_float32", "bias_strided", "mask", "bias+mask"]
#: Every variant at head dim 64; the others run the two that matter most (cuDNN builds
#: a graph per new shape, which is what makes this test slow).
SHORT_VARIANTS = ["none", "bias+mask"]


def _shape(s):
    """Small batches for long sequences: the whole module stays well under two minutes."""
    if s >= 2048:
        return 2, 2
    if s >= 512:
        return 2, 2
    return 3, 4


def _available_or_skip(name):
    if not A.BACKENDS[name].available():
        pytest.skip(f"{name} is not available here")


# ------------------------------------------------------------ accuracy ----


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(A.BACKENDS))
@pytest.mark.sweep
def test_backend_matches_reference_and_math(name, dtype, seq, head_dim, gen):
    _available_or_skip(name)
    backend = A.BACKENDS[name]
    b, h = _shape(seq)
    served = 0
    for variant in VARIANTS if head_dim == 64 else SHORT_VARIANTS:
        what = f"{name} {dtype} S={seq} Dh={head_dim} {variant} seed={gen.seed_value}"
        qkv, q, k, v, bias, mask = packed_inputs(b, seq, h, head_dim, dtype, gen, variant)
        call = A.describe_call(q, k, v, bias, mask)
        ok, why = backend.supports(call)
        if not ok:
            assert why, what
            assert explain(q, k, v, bias, mask).backend != name, what
            with pytest.raises(ValueError, match=name):
                attention(q, k, v, bias, mask, backend=name)
            continue
        served += 1
        out = attention(q, k, v, bias, mask, backend=name)
        torch.cuda.synchronize()
        ref = attention_formula(q, k, v, bias, mask, dtype=torch.float32)
        same = attention_formula(q, k, v, bias, mask, dtype=dtype)
        math_out = attention(q, k, v, bias, mask, backend="sdpa_math")
        assert out.shape == (b * seq, h * head_dim) and out.dtype == dtype and out.is_contiguous(), what
        assert_close_rule(out, ref, same, dtype, what + " (vs fp32 formula)")
        assert_close_rule(out, ref, math_out, dtype, what + " (vs sdpa_math)")
        if mask is not None and b > 1:
            rows = out.view(b, seq, -1)[1]
            assert torch.equal(rows, torch.zeros_like(rows)), what + ": all-padding rows are not zeros"
    if served == 0:
        pytest.skip(f"{name} serves none of the variants for {dtype}, Dh={head_dim}")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [36, 256])
def test_unusual_head_dims_pick_a_backend_that_works(head_dim, gen):
    """Dh=36 breaks 16-byte alignment (math serves it); Dh=256 is past cuDNN's limit on most GPUs."""
    for variant in ("none", "bias+mask"):
        qkv, q, k, v, bias, mask = packed_inputs(2, 64, 2, head_dim, torch.float16, gen, variant)
        ex = explain(q, k, v, bias, mask)
        assert A.BACKENDS[ex.backend].supports(ex.call)[0]
        out = attention(q, k, v, bias, mask)
        what = f"Dh={head_dim} {variant} via {ex.backend} seed={gen.seed_value}"
        assert_close_rule(out, attention_formula(q, k, v, bias, mask, dtype=torch.float32), attention_formula(q, k, v, bias, mask, dtype=torch.float16), torch.float16, what)


# ------------------------------------------------------------ no copy ----


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn"])
def test_output_is_the_kernel_output_without_copy(name, gen, monkeypatch):
    _available_or_skip(name)
    backend = A.BACKENDS[name]
    kernel_outputs = record_kernel_outputs(backend, monkeypatch)
    A.clear_cache()
    variant = "none" if name in ("sdpa_flash", "flash_attn") else "bias"
    qkv, q, k, v, bias, mask = packed_inputs(4, 64, 4, 64, torch.float16, gen, variant)
    attention(q, k, v, bias, mask, backend=name)  # plan
    kernel_outputs.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = attention(q, k, v, bias, mask, backend=name)
    assert len(kernel_outputs) == 1
    kout = kernel_outputs[0]
    assert out.untyped_storage().data_ptr() == kout.untyped_storage().data_ptr(), f"{name}: output was copied"
    assert out.data_ptr() == kout.data_ptr() and out.stride() == (256, 1)
    copies = [e.key for e in prof.key_averages() if e.key in COPY_OPS]
    assert copies == [], f"{name}: copy ops in the call: {copies}"


@pytest.mark.gpu
def test_math_output_is_a_copy(gen):
    """The math kernel writes [B, H, S, Dh]; reaching [B*S, H*Dh] costs one copy (documented)."""
    qkv, q, k, v, bias, mask = packed_inputs(2, 64, 4, 64, torch.float16, gen)
    out = attention(q, k, v, backend="sdpa_math")
    assert out.is_contiguous() and out.shape == (128, 256)


# ------------------------------------------------------------ graphs, compile ----


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["none", "bias+mask", "bias_float32"])
def test_cuda_graph_capture_and_replay(variant, gen):
    for _ in replays_match_eager(3, 64, 4, 64, variant, gen):
        pass  # each replay is compared with an eager call inside


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["mask", "bias_strided"])
def test_cuda_graph_capture_of_a_first_call(variant, gen):
    """Plan, tables and mask constants made inside the capture itself: nothing may touch the host."""
    b, s, h, d = 2, 80, 2, 32  # S not a multiple of 16: the padded-bias path
    qkv, q, k, v, bias, mask = packed_inputs(b, s, h, d, torch.float16, gen, variant)
    A.clear_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, bias, mask)
    assert A.cache_info()["constants"] == 0  # made in the graph's pool, not kept for eager use
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, attention(q, k, v, bias, mask), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "triton_short"], ids=["table", "triton_short"])
def test_compile_fullgraph(backend, gen):
    """Through the custom op under torch.compile(fullgraph=True): the table's choice, and the
    Triton kernel forced (the one backend whose launcher is ours)."""
    if backend is not None:
        _available_or_skip(backend)
    torch._dynamo.reset()
    b, s, h, d = 4, 64, 4, 32
    e = h * d
    x = torch.randn((b, s, e), generator=gen).to(DEV, torch.float16)
    w_qkv = (torch.randn((3 * e, e), generator=gen) * e**-0.5).to(DEV, torch.float16)
    w_o = (torch.randn((e, e), generator=gen) * e**-0.5).to(DEV, torch.float16)
    bias = torch.randn((1, h, s, s), generator=gen).to(DEV, torch.float16)
    lengths = torch.randint(1, s + 1, (b,), generator=gen)
    mask = (torch.arange(s)[None, :] >= lengths[:, None]).to(DEV)

    def block(t, with_bias):
        q, k, v = fusedenc.ops.gemm.split_qkv(torch.nn.functional.linear(t, w_qkv), h)
        a = attention(q, k, v, bias if with_bias else None, mask if with_bias else None, backend=backend)
        return torch.nn.functional.linear(a, w_o)

    for with_bias in (False, True):
        compiled = torch.compile(block, fullgraph=True)
        torch.testing.assert_close(compiled(x, with_bias), block(x, with_bias), atol=2e-3, rtol=2e-3)


# ------------------------------------------------------------ table ----


@pytest.mark.gpu
def test_table_choice_always_supports_the_call(gen):
    seen = set()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (32, 40, 64, 128, 256):
            for s in (1, 64, 300, 2048):
                for variant in ("none", "bias", "mask", "bias+mask"):
                    b, h = (1, 2) if s >= 2048 else (2, 2)
                    qkv, q, k, v, bias, mask = packed_inputs(b, s, h, d, dtype, gen, variant)
                    ex = explain(q, k, v, bias, mask)
                    backend = A.BACKENDS[ex.backend]
                    assert backend.available() and backend.supports(ex.call)[0], str(ex)
                    for c in ex.candidates:  # everything listed before the winner was unusable
                        if c.name == ex.backend:
                            break
                        assert not (c.available and c.supported), str(ex)
                    seen.add(ex.backend)
    assert "sdpa_math" in seen or len(seen) >= 1


@pytest.mark.gpu
def test_tune_quick_writes_a_table_that_loads_without_warnings(tmp_path, monkeypatch):
    env = dict(os.environ, FUSEDENC_CONFIG_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "-m", "fusedenc.tune", "attention", "--quick"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "crossover" in r.stdout and "winner" in r.stdout
    path = tmp_path / f"attention_{device_arch(DEV)}.json"
    table = json.loads(path.read_text())
    assert table["measured_with"] == device_metadata(DEV)
    assert table["rules"] and all(rule["backends"] for rule in table["rules"])

    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    A.clear_cache()
    gen = torch.Generator().manual_seed(0)
    qkv, q, k, v, bias, mask = packed_inputs(32, 256, 8, 64, torch.float16, gen)  # a key --quick measures
    with warnings.catch_warnings():
        warnings.simplefilter("error", A.AttentionTableWarning)
        ex = explain(q, k, v)
        out = attention(q, k, v)
    assert ex.user_table == str(path) and ex.user_rule is not None, str(ex)
    assert ex.user_rule["match"]["seq"] == "<=256" and ex.user_rule["match"]["extras"] == "none"
    assert ex.backend == next(c.name for c in ex.candidates if c.available and c.supported)
    assert out.shape == (32 * 256, 8 * 64)
