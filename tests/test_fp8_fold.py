"""The FP8 mode with LayerNorms folded into the GEMMs (``fusedenc.encoder.fp8_fold``, issue 21).

CPU tests run the torch math (``norm_fold.mode("force")``) against formulas written the
other way round (normalize, then multiply) and the whole stack against fp32; the GPU tests
at the end run the Hopper kernels (the FP8 GEMM with a folded LayerNorm, the FP8 residual
GEMM writing z, its statistics and its e4m3 codes) against the same math."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from encoder_helpers import stack_formula
from fp8_helpers import random_stack, rel_err, require_fp8_gpu, synthetic_lc0
from helpers import randn

from fusedenc import core
from fusedenc.common.activations import apply_activation
from fusedenc.encoder import fp8_fold
from fusedenc.fp8 import rowwise as fp8
from fusedenc.ops import norm_fold
from fusedenc.testing import layer_norm_folding

D, H, F_ = 128, 4, 256


def _pending(gen, rows, d, device="cpu", mean=0.3):
    """Rows pending a LayerNorm, with their codes (static power-of-two column scales)."""
    z = (randn((rows, d), torch.float16, device, gen=gen) * 2 + mean).to(torch.float16)
    rstd, shift = norm_fold.stats(z.float(), 1e-5)
    gamma = (torch.rand(d, generator=gen) + 0.5).to(torch.float16).to(device)
    beta = randn((d,), torch.float16, device, gen=gen, scale=0.1)
    scale = fp8.static_scales(z.float().abs().amax(0), power_of_two=True)
    codes = fp8.e4m3_columns(z.float(), 1.0 / scale)
    return fp8_fold.CodedRows(norm_fold.NormedRows(z, rstd, shift, gamma, beta), codes, scale)


def _normalize_then_multiply(rows, weight, bias, act):
    """``act(LN'(z) W_eff^T + W beta + b)``: the row's statistics applied to the dequantized
    codes, then the GEMM with the weight the folded codes stand for (``W * gamma`` as coded)."""
    p = rows.rows
    zq = rows.codes.float() * rows.scale
    normed = zq * p.rstd[:, None] + p.shift[:, None]
    q = fp8.quantize_rows(weight.float() * (p.gamma.float() * rows.scale)[None, :])
    w_eff = fp8.dequantize(q) / rows.scale[None, :]
    return apply_activation(normed @ w_eff.t() + (weight.float() @ p.beta.float() + bias.float()), act)


def test_static_scales_rounded_to_powers_of_two(gen):
    amax = torch.rand(64, generator=gen) * 100
    amax[0] = 0.0
    plain, pow2 = fp8.static_scales(amax), fp8.static_scales(amax, power_of_two=True)
    mantissa, _ = torch.frexp(pow2)
    assert torch.all(mantissa == 0.5)  # powers of two
    assert torch.all(pow2 >= plain) and torch.all(pow2 < 2 * plain) and pow2[0] == 1.0


@pytest.mark.parametrize("activation", ["none", "swish"])
def test_norm_linear_is_the_layer_norm_of_the_codes_times_the_coded_weight(activation, gen):
    rows = _pending(gen, 96, 128)
    w, b = randn((80, 128), torch.float16, gen=gen, scale=0.1), randn((80,), torch.float16, gen=gen)
    folded = fp8_fold.fold_weight(w, b, rows.rows.gamma, rows.rows.beta, rows.scale)
    got = fp8_fold.norm_linear(rows, folded, activation, out_dtype=torch.float16)
    want = _normalize_then_multiply(rows, w, b, activation)
    assert got.dtype == torch.float16 and got.shape == (96, 80)
    # fp32 sums in two orders, one rounding to fp16 (plus the folded bias's to fp16)
    assert torch.allclose(got.float(), want, atol=3e-3, rtol=2e-3), (got.float() - want).abs().max()
    scale = torch.rand(80, generator=gen) + 0.5
    codes = fp8_fold.norm_linear(rows, folded, activation, out_dtype=torch.float16, out_scale=scale)
    assert codes.dtype == fp8.E4M3
    step = (want * scale).abs().clamp(min=2**-6) / 8  # one e4m3 step (3 mantissa bits)
    assert torch.all((codes.float() - (want * scale).clamp(-448, 448)).abs() <= step + 1e-6)


@pytest.mark.parametrize("pending", [False, True], ids=["plain-residual", "pending-residual"])
def test_residual_linear_writes_z_its_statistics_and_its_codes(pending, gen):
    x = fp8.quantize_rows(randn((96, 256), torch.float16, gen=gen))
    codes = fp8.e4m3_columns(x.q.float() * x.scale[:, None], torch.full((256,), 1.0))
    w = fp8.quantize_rows(randn((128, 256), torch.float16, gen=gen, scale=0.05))
    bias = randn((128,), torch.float16, gen=gen)
    prev = _pending(gen, 96, 128)
    residual = prev.rows if pending else prev.rows.z
    gamma, beta = prev.rows.gamma, prev.rows.beta
    scale = fp8.static_scales(torch.full((128,), 6.0), power_of_two=True)
    out = fp8_fold.residual_linear(codes, w, bias, residual, 0.7, gamma, beta, 1e-5, (scale, 1.0 / scale))
    r = norm_fold.normalized(prev.rows) if pending else prev.rows.z.float()
    z = r + 0.7 * (codes.float() @ fp8.dequantize(w).t() + bias.float())
    assert torch.allclose(out.rows.z.float(), z, atol=2e-3, rtol=1e-3)
    var, mean = torch.var_mean(z, dim=1, unbiased=False)
    assert torch.allclose(out.rows.rstd, torch.rsqrt(var + 1e-5), rtol=1e-4)
    assert torch.allclose(out.rows.shift, -mean * out.rows.rstd, atol=1e-4)
    assert out.rows.gamma is gamma and out.rows.beta is beta and torch.equal(out.scale, scale)
    assert torch.all((out.codes.float() * scale - z).abs() <= z.abs() / 8 + 2**-9 * scale)
    bare = fp8_fold.residual_linear(codes, w, bias, residual, 0.7, gamma, beta, 1e-5, None)
    assert bare.codes is None and torch.equal(bare.rows.z, out.rows.z)


def _calibrated(gen, layers=3, **kw):
    s = random_stack(layers, D, H, F_, gen)
    sample = randn((8, 64, D), torch.float16, gen=gen)
    return s, s.quantize("fp8", calibration=sample, **kw)


def test_calibration_sees_the_layer_norm_inputs(gen):
    s = random_stack(1, D, H, F_, gen)
    b = s.blocks[0]
    sample = randn((4, 64, D), torch.float16, gen=gen)
    seen = []
    real = fp8.Calibration.observe
    cal = None
    try:
        fp8.Calibration.observe = lambda self, block, out, what="ffn1": (seen.append((what, out)), real(self, block, out, what))
        cal = fp8.calibrate(s.blocks, s, sample)
    finally:
        fp8.Calibration.observe = real
    whats = [w for w, _ in seen]
    assert whats == ["attention", "norm1", "ffn1", "norm2"], whats
    # the first LayerNorm's input: x + alpha * (a Wo^T + bo), a the attention output
    a = seen[0][1]
    z1 = sample.reshape(-1, D).float() + b.residual_alpha * (a.float() @ b.out_weight.float().t() + b.out_bias.float())
    assert torch.allclose(seen[1][1], z1, atol=2e-2, rtol=1e-2)
    want = fp8.static_scales(z1.abs().amax(0), power_of_two=True)
    assert torch.equal(cal.column_scales(b, "norm1", power_of_two=True), fp8.static_scales(seen[1][1].abs().amax(0), True))
    assert torch.allclose(cal.column_scales(b, "norm1", power_of_two=True), want, rtol=1.0)  # same binade or one off


def test_a_folded_stack_is_as_accurate_as_the_layer_norm_passes(gen):
    s, _ = _calibrated(gen, 4)
    x = randn((8, 64, D), torch.float16, gen=gen)  # not the calibration sample
    ref = stack_formula(s.blocks, x.float(), dtype=torch.float32)
    assert all(b._fp8.folds_norms for b in s.blocks)
    assert not fp8_fold.applies(s.blocks, x.view(-1, D))  # CPU, auto: no kernels, the passes run
    passes = s(x)
    with layer_norm_folding("force"):
        assert fp8_fold.applies(s.blocks, x.view(-1, D))
        folded = s(x)
    assert torch.isfinite(folded).all() and not torch.equal(folded, passes)
    e_pass, e_fold = rel_err(passes, ref), rel_err(folded, ref)
    assert e_fold < 1.25 * e_pass and e_fold < 0.08, (e_fold, e_pass)


def test_a_folded_stack_survives_copy_pickle_and_weight_changes(gen):
    s, _ = _calibrated(gen, 2)
    x = randn((2, 64, D), torch.float16, gen=gen)
    with layer_norm_folding("force"):
        y = s(x)
        assert torch.equal(copy.deepcopy(s)(x), y)
        assert torch.equal(pickle.loads(pickle.dumps(s))(x), y)
        with torch.no_grad():
            s.blocks[1].norm1_weight.mul_(1.5)  # FFN1's folded copy is made again
        assert not torch.equal(s(x), y)


def test_what_turns_the_fold_off(gen):
    x = randn((2, 64, D), torch.float16, gen=gen).view(-1, D)
    s, _ = _calibrated(gen, 2, fold_norms=False)
    assert not any(b._fp8.folds_norms for b in s.blocks)
    s2, _ = _calibrated(gen, 2)
    with layer_norm_folding("force"):
        assert not fp8_fold.applies(s.blocks, x)  # fold_norms=False
        assert fp8_fold.applies(s2.blocks, x)
        assert not fp8_fold.applies(s2.blocks, x[:0])  # empty
        s2.blocks[1].quantize("fp8")  # dynamic scales: no LayerNorm input scales
        assert not fp8_fold.applies(s2.blocks, x)
    with layer_norm_folding("off"):
        assert not fp8_fold.applies(_calibrated(gen, 2)[0].blocks, x)
    s3 = random_stack(2, D, H, F_, gen)
    s3.quantize("fp8", keep=("qkv",), calibration=randn((2, 64, D), torch.float16, gen=gen))
    assert not any(b._fp8.folds_norms for b in s3.blocks)  # a kept GEMM: the passes


# ------------------------------------------------------------ GPU ----


def _require_fold_kernels(activation: str = "swish") -> None:
    """Skip, with the reason, where ``fp8_fold.applies`` is False by build or device: the fold
    runs on the Hopper FP8 residual GEMM and the epilogue GEMM for ``activation``, compute
    capability 9.0 and a build with CUTLASS only (as tests/test_sm90_gemm_gpu.py detects its
    kernels).  Where they are there, the tests below must run them."""
    require_fp8_gpu()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 LayerNorm fold's kernels run on compute capability 9.0 only")
    if not core.fp8.sm90_fp8_residual_compiled(torch.float16):
        pytest.skip("this build has no Hopper FP8 residual GEMM (built without CUTLASS?)")
    if activation not in fp8_fold._epilogue_activations():
        pytest.skip(f"this build has no sm90 FP8 epilogue GEMM for float16 {activation} (built without CUTLASS?)")


def _gpu_pending(gen, rows, d):
    cpu = _pending(gen, rows, d)
    p = cpu.rows
    return fp8_fold.CodedRows(norm_fold.NormedRows(*(None if t is None else t.cuda() for t in p)),
                              cpu.codes.cuda(), cpu.scale.cuda())  # fmt: skip


def _fast_accumulation_error(codes, w):
    """The largest error of the plain FP8 GEMM with fast accumulation (``fp8.linear``, no fold,
    no residual) on these operands against fp32 sums: the kernels under test accumulate the
    same way, so their tolerance is measured, not guessed."""
    ones = torch.ones(codes.shape[0], device=codes.device)
    plain = fp8.linear(fp8.Quantized(codes, ones), w, None, fast_accum=True, out_dtype=torch.float16)
    exact = codes.float() @ fp8.dequantize(w).t()
    return 2 * (plain.float() - exact).abs().max().item()  # its own fp16 rounding included


@pytest.mark.gpu
@pytest.mark.parametrize("activation,e4m3_out",
                         [("none", False), ("swish", False), ("swish", True), ("mish", True), ("gelu", True)])
def test_gpu_norm_kernel_matches_the_math(activation, e4m3_out, gen):
    require_fp8_gpu()
    rows = _gpu_pending(gen, 16384, 768)
    w = randn((1024, 768), torch.float16, "cuda", gen=gen, scale=0.05)
    b = randn((1024,), torch.float16, "cuda", gen=gen)
    folded = fp8_fold.fold_weight(w, b, rows.rows.gamma, rows.rows.beta, rows.scale)
    out_scale = (torch.rand(1024, generator=gen) + 0.5).cuda() if e4m3_out else None
    if e4m3_out and torch.cuda.get_device_capability() == (9, 0) and activation in fp8_fold._epilogue_activations():
        # Where the kernel is built it must be the one that runs (the torch math below also passes).
        probe = torch.empty((16384, 1024), dtype=torch.uint8, device="cuda")
        ok, why = core.sm90_fp8_gemm_applies(rows.codes.view(torch.uint8), rows.rows.rstd, folded.weight.q.view(torch.uint8),
                                             folded.weight.scale, folded.bias, probe, activation, True, out_scale,
                                             rows.rows.shift, folded.colsum)  # fmt: skip
        assert ok, why
    got = fp8_fold.norm_linear(rows, folded, activation, out_dtype=torch.float16, out_scale=out_scale)
    # the same math in torch (fast_accum=False: the kernels accumulate fast only)
    ref = fp8_fold.norm_linear(rows, folded, activation, out_dtype=torch.float16, out_scale=out_scale, fast_accum=False)
    want = _normalize_then_multiply(rows, w, b, activation)
    # swish and mish have slopes below 1.1, GELU below 1.13: the sums' error, times rstd and
    # that slope, bounds the output's
    slope = 1.13 if activation == "gelu" else 1.1
    acc_err = slope * rows.rows.rstd.max().item() * _fast_accumulation_error(rows.codes, folded.weight)
    if e4m3_out:
        want = want * out_scale
        assert got.dtype == fp8.E4M3
        step = want.abs().clamp(min=2**-6) / 8  # one e4m3 step (3 mantissa bits)
        err = (got.float() - want.clamp(-448, 448)).abs()
        assert torch.all(err <= step + acc_err * out_scale), err.max()
        assert (got.view(torch.uint8) == ref.view(torch.uint8)).float().mean() > 0.98
    else:
        same = want.to(torch.float16).float()
        err = (got.float() - want).abs()
        assert torch.all(err <= 2 * (same - want).abs() + acc_err), (err.max(), acc_err)
        assert rel_err(got, ref) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("pending,codes_out", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("rows", [16384, 1000])
def test_gpu_residual_kernel_matches_the_math(pending, codes_out, rows, gen):
    require_fp8_gpu()
    k, n = 2304, 768
    x = randn((rows, k), torch.float16, "cuda", gen=gen)
    codes = x.to(fp8.E4M3)
    w = fp8.quantize_rows(randn((n, k), torch.float16, "cuda", gen=gen, scale=0.03))
    bias = randn((n,), torch.float16, "cuda", gen=gen)
    prev = _gpu_pending(gen, rows, n)
    residual = prev.rows if pending else prev.rows.z
    scale = fp8.static_scales(torch.full((n,), 8.0, device="cuda"), power_of_two=True)
    code_scale = (scale, 1.0 / scale) if codes_out else None
    args = (codes, w, bias, residual, 0.6, prev.rows.gamma, prev.rows.beta, 1e-5, code_scale)
    torch.cuda.synchronize()
    got = fp8_fold.residual_linear(*args)
    ref = fp8_fold.residual_linear(*args, fast_accum=False)
    r = norm_fold.normalized(prev.rows) if pending else prev.rows.z.float()
    z = r + 0.6 * (codes.float() @ fp8.dequantize(w).t() + bias.float())
    same = z.to(torch.float16).float()
    acc_err = 0.6 * _fast_accumulation_error(codes, w)
    err = (got.rows.z.float() - z).abs()
    assert torch.all(err <= 2 * (same - z).abs() + acc_err), (err.max(), acc_err)
    assert torch.allclose(got.rows.rstd, ref.rows.rstd, rtol=1e-3)
    assert torch.allclose(got.rows.shift, ref.rows.shift, atol=1e-3, rtol=1e-3)
    if codes_out:
        assert got.codes.dtype == fp8.E4M3 and torch.equal(got.scale, scale)
        assert torch.all((got.codes.float() * scale - z).abs() <= z.abs() / 8 + 2**-9 * scale + acc_err)
        assert (got.codes.view(torch.uint8) == ref.codes.view(torch.uint8)).float().mean() > 0.98
    else:
        assert got.codes is None


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swish", "gelu"])
def test_gpu_folded_stack_runs_the_kernels_and_is_as_accurate_as_the_passes(activation, gen):
    _require_fold_kernels(activation)
    s = random_stack(4, 768, 24, 2304, gen, device="cuda")
    for b in s.blocks:
        b.activation = activation
    sample = randn((256, 64, 768), torch.float16, "cuda", gen=gen)
    x = randn((256, 64, 768), torch.float16, "cuda", gen=gen)
    ref = stack_formula(s.blocks, x.float(), dtype=torch.float32)
    s.quantize("fp8", calibration=sample, fast_accum=True)
    assert fp8_fold.applies(s.blocks, x.view(-1, 768))
    folded = s(x)
    with layer_norm_folding("off"):
        passes = s(x)
    with layer_norm_folding("force"):
        for b in s.blocks:
            b._fp8.fast_accum = False  # the torch math of the same fold
        math = s(x)
        for b in s.blocks:
            b._fp8.fast_accum = True
    e_fold, e_pass = rel_err(folded, ref), rel_err(passes, ref)
    assert torch.isfinite(folded).all() and e_fold < 1.25 * e_pass, (e_fold, e_pass)
    # Fast accumulation moves some e4m3 codes by one step against the fp32 sums of the torch
    # math, and layers carry such flips on: two FP8 runs differ by less than FP8's own error,
    # where a wrong fold (a missing colsum, a lost bias or scale) is many times that.
    assert rel_err(folded, math) < e_fold, (rel_err(folded, math), e_fold)
    runner = s.graph_runner(64, (256,))
    assert torch.equal(runner(x), folded)  # the graph replays the same kernels


@pytest.mark.gpu
def test_gpu_fold_stays_off_where_a_kernel_would_not_run(gen):
    """tanh-GELU is not in the FP8 epilogue, slow accumulation not in the kernels, 64 positions
    too few tiles: each keeps the LayerNorm passes (no GEMM may fall back to torch math).
    Exact GELU folds where its e4m3-output unit is built."""
    _require_fold_kernels()
    x = randn((256, 64, 768), torch.float16, "cuda", gen=gen)
    sample = randn((64, 64, 768), torch.float16, "cuda", gen=gen)
    swish = random_stack(2, 768, 12, 1536, gen, device="cuda").quantize("fp8", calibration=sample, fast_accum=True)
    assert fp8_fold.applies(swish.blocks, x.view(-1, 768))
    assert not fp8_fold.applies(swish.blocks, x[:64].reshape(-1, 768))  # 64 positions: too few tiles
    for act, folds in (("gelu_tanh", False), ("gelu", "float16" in core.fp8.sm90_fp8_e4m3_gelu_kernels())):
        other = random_stack(2, 768, 12, 1536, gen, device="cuda")
        for b in other.blocks:
            b.activation = act
        other.quantize("fp8", calibration=sample, fast_accum=True)
        assert fp8_fold.applies(other.blocks, x.view(-1, 768)) == folds, act
    slow = random_stack(2, 768, 12, 1536, gen, device="cuda").quantize("fp8", calibration=sample)
    assert not fp8_fold.applies(slow.blocks, x.view(-1, 768))


def test_an_lc0_net_folds_its_calibrated_fp8_body(tmp_path, monkeypatch):
    """A calibrated Lc0 net runs its body through ``fp8_fold.block_rows`` (smolgen reading each
    layer's pending input through its 16-bit fold), as close to fp16 as the LayerNorm passes."""
    net, sample, planes = synthetic_lc0(tmp_path, "tiny", seed=3, planes_seed=4, sample=16, positions=6)
    base = net(planes)
    net.quantize("fp8", calibration=sample)
    passes = net(planes)
    calls = []
    real = fp8_fold.block_rows
    monkeypatch.setattr(fp8_fold, "block_rows", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    with layer_norm_folding("force"):
        folded = net(planes)
    assert calls == [True] * (len(net.blocks) - 1) + [False]  # the last block writes no codes
    assert torch.isfinite(folded["policy"]).all() and not torch.equal(folded["policy"], passes["policy"])
    e_pass = rel_err(passes["policy"], base["policy"])
    assert rel_err(folded["policy"], base["policy"]) < 1.5 * e_pass + 1e-3
    assert torch.allclose(folded["wdl"].float().sum(-1), torch.ones(6), atol=1e-2)
    net.quantize("fp8", calibration=sample, fold_norms=False)
    with layer_norm_folding("force"):
        assert torch.equal(net(planes)["policy"], passes["policy"])


@pytest.mark.gpu
def test_gpu_lc0_net_folds_its_fp8_body_on_the_kernels(tmp_path, monkeypatch):
    _require_fold_kernels()  # t82's FFN activation: swish
    net, sample, planes = synthetic_lc0(tmp_path, "t82", seed=1, planes_seed=5, sample=256, positions=256, device="cuda")
    base = net(planes)
    net.quantize("fp8", calibration=sample, fast_accum=True, fold_norms=False)
    passes = net(planes)
    net.quantize("fp8", calibration=sample, fast_accum=True)
    calls = []
    real = fp8_fold.block_rows
    monkeypatch.setattr(fp8_fold, "block_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    folded = net(planes)
    assert len(calls) == len(net.blocks)  # auto: the kernels ran the fold
    e_pass, e_fold = rel_err(passes["policy"], base["policy"]), rel_err(folded["policy"], base["policy"])
    assert torch.isfinite(folded["policy"]).all() and e_fold < 1.5 * e_pass + 1e-3, (e_fold, e_pass)
    assert (folded["wdl"].float() - base["wdl"].float()).abs().max() < 0.2
    # As a graph, smolgen runs beside each FP8 QKV GEMM (a side stream): the same net within
    # FP8's error (smolgen's small GEMMs run on other kernels there, and codes may flip).
    beside = []
    real_beside = type(net)._folded_layer_beside
    monkeypatch.setattr(type(net), "_folded_layer_beside", lambda self, *a: beside.append(1) or real_beside(self, *a))
    graphed = net.graph_runner((256,))(planes)
    assert beside and len(calls) > len(net.blocks)  # captured through the fold, smolgen beside QKV
    assert rel_err(graphed["policy"], folded["policy"]) < e_fold, (rel_err(graphed["policy"], folded["policy"]), e_fold)
