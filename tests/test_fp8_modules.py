"""``EncoderBlock.quantize("fp8")`` / ``EncoderStack.quantize``: the FP8 mode of the modules
(issue 21).  CPU tests run the reference math of ``fusedenc.fp8.rowwise``; the GPU test at the end
runs the kernels.  Accuracy is checked against the fp32 run of the same weights with the
FP8 error this math measured (bench/NOTES.md), and against the fp16 run (FP8 must be doing
something)."""

from __future__ import annotations

import copy

import pytest
import torch
from encoder_helpers import randomize, stack_formula
from fp8_helpers import random_stack, rel_err
from helpers import randn

import fusedenc.testing
from fusedenc import EncoderBlock
from fusedenc.encoder import executors
from fusedenc.fp8 import rowwise as fp8

D, H, F_ = 128, 4, 256


def _stack(layers, gen, **kw):
    return random_stack(layers, D, H, F_, gen, **kw)


def _count_fp8_gemms(monkeypatch):
    calls = []
    real = fp8.linear

    def spy(x, w, *args, **kw):
        calls.append(tuple(w.q.shape))
        return real(x, w, *args, **kw)

    monkeypatch.setattr(executors.fp8, "linear", spy)
    return calls


def test_a_quantized_stack_runs_its_gemms_in_fp8_within_the_measured_error(gen, monkeypatch):
    s = _stack(4, gen)
    x = randn((8, 64, D), torch.float16, gen=gen)
    ref = stack_formula(s.blocks, x.float(), dtype=torch.float32)
    y16 = s(x)
    calls = _count_fp8_gemms(monkeypatch)
    assert s.quantize("fp8") is s and all(b.quantized == "fp8" for b in s.blocks)
    y8 = s(x)
    assert calls == [(3 * D, D), (D, D), (F_, D), (D, F_)] * 4  # QKV, out, FFN1, FFN2 per layer
    e16, e8 = rel_err(y16, ref), rel_err(y8, ref)
    # fp16: ~0.06% here; row-wise FP8 on this 4-layer, 128-wide random stack: 4.0% (narrow K
    # averages less of each row's rounding away than t82's 768: 1.7% after 15 layers there).
    assert e16 < 0.005 and 10 * e16 < e8 < 0.06, (e16, e8)
    s.quantize(None)
    assert all(b.quantized is None for b in s.blocks) and torch.equal(s(x), y16)


def test_one_quantized_block_is_its_data_path_with_fp8_gemms(gen):
    """The post-LN data path written out with ``fp8.linear`` on row-quantized inputs and the
    weights' per-channel copies: the quantized block computes exactly that."""
    from fusedenc import layer_norm
    from fusedenc.attention import attention

    b = randomize(EncoderBlock(D, H, F_, activation="mish", residual_alpha=0.6, dtype=torch.float16), gen).eval()
    x2 = randn((2 * 64, D), torch.float16, gen=gen)

    def lin(t, w, bias, act="none"):
        return fp8.linear(fp8.quantize_rows(t), fp8.quantize_rows(w), bias, act, out_dtype=torch.float16)

    with torch.no_grad():
        qkv = lin(x2, b.qkv_weight, b.qkv_bias)
        q, k, v = qkv.view(2, 64, 3, H, -1).unbind(2)
        a = attention(q, k, v)
        h = layer_norm(lin(a, b.out_weight, b.out_bias), b.norm1_weight, b.norm1_bias, b.layer_norm_eps,
                       residual=x2, alpha=0.6)  # fmt: skip
        f = lin(h, b.ffn1_weight, b.ffn1_bias, "mish")
        want = layer_norm(lin(f, b.ffn2_weight, b.ffn2_bias), b.norm2_weight, b.norm2_bias, b.layer_norm_eps,
                          residual=h, alpha=0.6)  # fmt: skip
        got = b.quantize("fp8")(x2, seq_len=64)
    assert torch.equal(got, want)


def test_keep_and_layers_choose_what_stays_in_fp16(gen, monkeypatch):
    s = _stack(3, gen)
    x = randn((4, 64, D), torch.float16, gen=gen)
    y16 = s(x)
    calls = _count_fp8_gemms(monkeypatch)
    s.quantize("fp8", keep=("ffn2",), layers=[0, -1])
    assert [b.quantized for b in s.blocks] == ["fp8", None, "fp8"]
    y = s(x)
    assert calls == [(3 * D, D), (D, D), (F_, D)] * 2
    assert not torch.equal(y, y16)
    s.quantize("fp8", keep=fp8.BLOCK_GEMMS)  # every GEMM kept: the fp16 numbers exactly
    assert torch.equal(s(x), y16)


def test_weights_changed_after_quantize_are_quantized_again(gen):
    s = _stack(2, gen).quantize("fp8")
    x = randn((4, 64, D), torch.float16, gen=gen)
    with torch.no_grad():
        for b in s.blocks:
            b.ffn1_weight.mul_(0.5)
    fresh = copy.deepcopy(s).quantize(None).quantize("fp8")
    assert torch.equal(s(x), fresh(x))


def test_a_copy_of_a_quantized_block_is_quantized_too(gen):
    b = randomize(EncoderBlock(D, H, F_, activation="swish", dtype=torch.float16), gen).eval()
    x = randn((4, 64, D), torch.float16, gen=gen)
    y16 = b(x)
    b.quantize("fp8")
    c = copy.deepcopy(b)
    assert c.quantized == "fp8" and torch.equal(c(x), b(x)) and not torch.equal(c(x), y16)


def test_layer_norm_folding_is_off_while_quantized(gen):
    s = _stack(2, gen).quantize("fp8")
    x = randn((4, 64, D), torch.float16, gen=gen)
    y = s(x)
    with fusedenc.testing.layer_norm_folding("force"):
        assert torch.equal(s(x), y)


def test_bad_quantize_arguments(gen):
    s = _stack(2, gen)
    with pytest.raises(ValueError, match="mode must be 'fp8' or None"):
        s.quantize("int8")
    with pytest.raises(ValueError, match=r"keep names GEMMs \['ffn3'\]"):
        s.quantize("fp8", keep=("ffn3",))
    with pytest.raises(ValueError, match="not a layer of this 2-layer body"):
        s.quantize("fp8", layers=[2])
    with pytest.raises(TypeError, match="float16 or bfloat16 block"):
        EncoderBlock(D, H, F_, dtype=torch.float32).quantize("fp8")
    with pytest.raises(ValueError, match="multiples of 16"):
        EncoderBlock(40, 4, 80, dtype=torch.float16).quantize("fp8")
    assert all(b.quantized is None for b in s.blocks)  # nothing half-done


@pytest.mark.gpu
def test_a_quantized_stack_on_the_gpu_matches_the_reference_math(gen):
    """The kernels (quantization bit-identical, cuBLASLt's FP8 GEMM) against the CPU's FP8
    reference on the same weights.  The GEMMs' fp32 sums differ in order, and a rounding that
    flips one e4m3 code moves an element by up to 1/16 of its row's scale, so the two runs
    drift apart layer by layer (2.7% after four layers, measured on the H100, each ~4% from
    fp32).  One block has no time to drift: there the two must agree closely.  After four
    layers the GPU must be as accurate as the reference math, not equal to it."""
    from fusedenc import core

    if not torch.cuda.is_available() or not core.fp8_status(torch.device("cuda", 0))[0]:
        pytest.skip("no FP8 GPU")
    x = randn((16, 64, D), torch.float16, gen=gen)
    one = _stack(1, gen)
    cpu1 = copy.deepcopy(one).quantize("fp8")(x)
    gpu1 = copy.deepcopy(one).cuda().quantize("fp8")(x.cuda()).cpu()
    assert torch.isfinite(gpu1).all() and rel_err(gpu1, cpu1) < 0.01, rel_err(gpu1, cpu1)
    s = _stack(4, gen)
    ref = stack_formula(s.blocks, x.float(), dtype=torch.float32)
    cpu = copy.deepcopy(s).quantize("fp8")(x)
    gpu = copy.deepcopy(s).cuda().quantize("fp8")(x.cuda()).cpu()
    assert torch.isfinite(gpu).all()
    assert rel_err(gpu, ref) < 1.25 * rel_err(cpu, ref), (rel_err(gpu, ref), rel_err(cpu, ref), rel_err(gpu, cpu))


def test_an_lc0_net_quantizes_its_body(tmp_path, monkeypatch):
    """``Lc0Network.quantize``: the body's four GEMMs a layer in FP8, heads and embedding not;
    policy logits move, the WDL stays a distribution, and ``quantize(None)`` restores the net."""
    from lc0_writer import random_planes, write_preset

    from fusedenc.lc0 import load_network

    path = tmp_path / "tiny.pb.gz"
    write_preset(path, "tiny", seed=3)
    net = load_network(str(path), dtype=torch.float16, device="cpu")
    planes = random_planes(6, torch.Generator().manual_seed(1)).to(torch.float16)
    base = net(planes)
    calls = _count_fp8_gemms(monkeypatch)
    out = net.quantize("fp8")(planes)
    d, f = net.d_model, net.blocks[0].d_ff
    assert calls == [(3 * d, d), (d, d), (f, d), (d, f)] * len(net.blocks)
    assert not torch.equal(out["policy"], base["policy"]) and torch.isfinite(out["policy"]).all()
    assert torch.allclose(out["wdl"].float().sum(-1), torch.ones(6), atol=1e-2)
    net.quantize(None)
    assert torch.equal(net(planes)["policy"], base["policy"])


def test_a_stack_made_under_inference_mode_quantizes(gen):
    """Inference tensors have no version counter: the weight copies still work (and follow
    a move), as for a stack built inside ``torch.inference_mode``."""
    with torch.inference_mode():
        s = _stack(2, gen)
        x = randn((2, 64, D), torch.float16, gen=gen)
        y16 = s(x)
        y8 = s.quantize("fp8")(x)
    assert torch.isfinite(y8).all() and not torch.equal(y8, y16)
    assert rel_err(y8, y16) < 0.06
