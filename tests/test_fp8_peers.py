"""bench/fp8_peers.py on the CPU: the torchao-style FP8 peer's math (its per-row quantization,
its layer, its whole net) against fusedenc.fp8.rowwise's reference math, and the FP8 check of
bench/nps.py, which must pass the peer and fail a wrong one.  The peer's GEMM,
``torch._scaled_mm``, runs where this torch takes row-wise scales on the CPU; elsewhere its
twin ``emulated_scaled_mm`` (fusedenc.fp8.rowwise.scaled_linear) stands in."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
from helpers import randn

from fusedenc.fp8 import rowwise as fp8
from fusedenc.tune.presets import expand

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import fp8_peers  # noqa: E402  (bench/fp8_peers.py)
import nps  # noqa: E402  (bench/nps.py: the check)
from peers import Impl, block_state_dicts, build_torch_model, reference_forward  # noqa: E402

CPU = torch.device("cpu")
SCALED_MM_OK, SCALED_MM_OUT, SCALED_MM_WHY = fp8_peers.scaled_mm_status(CPU)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_peer_quantization_is_fusedencs_bit_for_bit(dtype, gen):
    x = randn((40, 96), torch.float32, gen=gen) * torch.logspace(-4, 4, 40)[:, None]  # rows of every size
    x[3] = 0  # an all-zero row: scale 1, zero codes
    x[7, 5] = 1e-30  # a row that is all but zero
    x = x.to(dtype)
    q, scale = fp8_peers.quantize_rows(x)
    want = fp8.quantize_rows(x)
    assert q.dtype == fp8.E4M3 and scale.dtype == torch.float32 and scale.shape == (40, 1)
    assert torch.equal(scale[:, 0], want.scale) and scale[3, 0] == 1.0
    assert torch.equal(_bits(q), _bits(want.q))
    # And it is a quantization: each row's largest value lands on 448, the rest within e4m3's half ulp.
    nonzero = x.float().abs().amax(dim=1) > 0
    assert q.float().abs().amax(dim=1)[nonzero].eq(fp8.E4M3_MAX).all()
    back = q.float() * scale
    assert ((back - x.float()).abs() <= torch.maximum(x.float().abs() * 2.0**-4, scale * 2.0**-10)).all()


def _linear(k, n, gen, dtype=torch.float16) -> nn.Linear:
    lin = nn.Linear(k, n, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(randn((n, k), torch.float32, gen=gen, scale=k**-0.5))
        lin.bias.copy_(randn((n,), torch.float32, gen=gen, scale=0.5))
    return lin.to(dtype).requires_grad_(False)


def test_peer_layer_is_the_reference_fp8_gemm(gen):
    """Fp8Linear on [B, S, K] is fusedenc.fp8.rowwise's GEMM of the quantized rows and the per-channel
    weight, bit for bit (same math), and that is x W^T + b up to FP8's error."""
    lin = _linear(64, 48, gen)
    x = randn((3, 5, 64), torch.float16, gen=gen)
    layer = fp8_peers.Fp8Linear(lin, torch.float16, fp8_peers.emulated_scaled_mm)
    out = layer(x)
    assert out.shape == (3, 5, 48) and out.dtype == torch.float16
    rows = x.reshape(-1, 64)
    want = fp8.scaled_linear(fp8.quantize_rows(rows), fp8.quantize_rows(lin.weight), lin.bias, torch.float16)
    assert torch.equal(out.reshape(-1, 48), want)
    ref = rows.float() @ lin.weight.float().t() + lin.bias.float()
    rel = ((out.reshape(-1, 48).float() - ref).norm() / ref.norm()).item()
    assert 1e-3 < rel < 0.08, rel  # e4m3 keeps 3 mantissa bits: a few percent, never fp16's 1e-4


@pytest.mark.skipif(not SCALED_MM_OK, reason=f"torch._scaled_mm does not run here: {SCALED_MM_WHY}")
def test_peer_layer_with_torchs_scaled_mm_matches_the_emulation(gen):
    """Where this torch runs torch._scaled_mm with row-wise scales on the CPU, the real peer
    agrees with its emulated twin up to the order of fp32 sums (one fp16 rounding apart)."""
    lin = _linear(128, 64, gen)
    x = randn((4, 16, 128), torch.float16, gen=gen)
    real = fp8_peers.Fp8Linear(lin, SCALED_MM_OUT)(x).float()
    emulated = fp8_peers.Fp8Linear(lin, torch.float16, fp8_peers.emulated_scaled_mm)(x).float()
    assert ((real - emulated).abs() <= emulated.abs() * 2.0**-10 + 1e-4).all(), (real - emulated).abs().max()


def _net(dtype: torch.dtype, seed: int):
    run = expand(["tiny"], dtype)[0]
    return run, build_torch_model(run, CPU, seed)


def test_peer_net_is_the_emulated_reference_net(gen):
    """The peer on an fp32 model, its GEMM emulated, computes what the FP8 check's oracle does
    (peers.reference_forward with every GEMM in fusedenc.fp8.rowwise's math): the same codes meet the
    same GEMM; only attention's and LayerNorm's fp32 rounding differ.  That rounding can move a
    value across an e4m3 rounding boundary, and the flipped code (one e4m3 step) spreads to the
    layers after it: over 200 seeds the two nets' relative difference reached 0.029 of the FP8
    error (typically 1e-5 of it), while the median value agreed to 1e-7.  So: most values
    agree to fp32 rounding, and the whole stays far below what another FP8 scheme would give
    (the fp16 model against the oracle: 1.0x the FP8 error, median difference 1e-2)."""
    run, model = _net(torch.float32, seed=int(torch.randint(1 << 30, (1,), generator=gen)))
    x = randn((4, run.seq_len, run.preset.d_model), torch.float32, gen=gen)
    with torch.inference_mode():
        peer = fp8_peers.torch_fp8_model(model, torch.float32, fp8_peers.emulated_scaled_mm)
        out = peer(x)
        emulated = reference_forward(block_state_dicts(model), x, run, torch.float32, fp8_peers.emulated_linear)
        ref = reference_forward(block_state_dicts(model), x, run, torch.float64)
    fp8_err = nps.rel_err(emulated, ref)
    assert 1e-3 < fp8_err < 0.1, fp8_err
    median = ((out - emulated).abs() / emulated.abs().clamp_min(1e-6)).median().item()
    assert median < 1e-5, (median, gen.seed_value)
    assert nps.rel_err(out, emulated) < 0.1 * fp8_err, (nps.rel_err(out, emulated), fp8_err, gen.seed_value)
    # The original fp32 model is untouched (the peer is a copy).
    assert isinstance(model.blocks[0].in_proj, nn.Linear)
    assert nps.rel_err(model(x), ref) < 1e-5


def _check_setup(gen):
    run, model = _net(torch.float16, seed=int(torch.randint(1 << 30, (1,), generator=gen)))
    x = randn((4, run.seq_len, run.preset.d_model), torch.float16, gen=gen)
    ref = reference_forward(block_state_dicts(model), x, run, torch.float32)
    emulated = nps.rel_err(reference_forward(block_state_dicts(model), x, run, torch.float32,
                                             fp8_peers.emulated_linear), ref)  # fmt: skip
    return model, x, ref, emulated


def _e5m2_activations(a, b, scale_a, scale_b, bias, out_dtype):
    """A wrong peer: activation codes with e5m2's 2 mantissa bits instead of e4m3's 3."""
    coarse = a.float().to(torch.float8_e5m2).float().to(fp8.E4M3)
    return fp8_peers.emulated_scaled_mm(coarse, b, scale_a, scale_b, bias, out_dtype)


def _weight_scale_dropped(a, b, scale_a, scale_b, bias, out_dtype):
    """A wrong peer: forgets the per-channel weight scales."""
    return fp8_peers.emulated_scaled_mm(a, b, scale_a, torch.ones_like(scale_b), bias, out_dtype)


def test_the_fp8_check_passes_the_peer_and_fails_wrong_ones(gen):
    with torch.inference_mode():
        model, x, ref, emulated = _check_setup(gen)
        assert 1e-3 < emulated < 0.1, emulated

        def check(mm):
            return nps.check_fp8_impl(Impl("p", fp8_peers.torch_fp8_model(model, torch.float16, mm)), x, ref,
                                      emulated, slack=1.5)  # fmt: skip

        good = check(fp8_peers.emulated_scaled_mm)
        assert good["passed"] is True and good["rel_err"] <= good["bound"], good
        assert 0.8 < good["x_emulated"] < 1.2, good  # fp16 between the ops adds next to nothing to FP8's error
        if SCALED_MM_OK:
            real = check(fp8_peers.scaled_mm)
            assert real["passed"] is True and 0.8 < real["x_emulated"] < 1.2, real
        coarse = check(_e5m2_activations)
        assert coarse["passed"] is False and coarse["x_emulated"] > 1.5, coarse
        unscaled = check(_weight_scale_dropped)
        assert unscaled["passed"] is False, unscaled
        wrong_shape = nps.check_fp8_impl(Impl("p", lambda t: t[:, :-1]), x, ref, emulated, slack=1.5)
        assert wrong_shape["passed"] is False and "output shape" in wrong_shape["reason"]


def test_fusedenc_fp8_on_cpu_runs_the_reference_math_and_passes_the_check(gen):
    """fusedenc-fp8 as nps.py builds it (a quantized copy of the fusedenc stack, under
    inference mode) runs on the CPU and meets the FP8 rule; the fp16 stack it came from
    stays fp16."""
    run = expand(["tiny"], torch.float16)[0]
    with torch.inference_mode():
        model, x, ref, emulated = _check_setup(gen)
        impl = fp8_peers.make_fusedenc_fp8(model, run, CPU, [4], "fusedenc-fp8")
        assert all(b.quantized == "fp8" for b in impl.call.blocks)
        c = nps.check_fp8_impl(impl, x, ref, emulated, slack=1.5)
        assert c["passed"] is True and 0.8 < c["x_emulated"] < 1.2, c


def test_fp8_rows_are_named_and_refused_without_fp8():
    assert all(fp8_peers.is_fp8(n) for n in fp8_peers.FP8_IMPLS)
    assert fp8_peers.is_fp8("torch-fp8-compile:reduce-overhead") and not fp8_peers.is_fp8("torch-compile")
    assert not any(fp8_peers.is_fp8(n) for n in nps.IMPLS)
    args = nps.parse_args(["--dtype", "fp8", "--impl", "fusedenc,fusedenc-fp8"])
    assert args.fp8 and args.dtype == "float16" and args.impl == ["fusedenc", "fusedenc-fp8"]
    assert nps.parse_args([]).fp8 is False and nps.parse_args([]).dtype is None
    with pytest.raises(SystemExit):
        nps.parse_args(["--impl", "fusedenc-fp8"])  # an FP8 row without --dtype fp8
    with pytest.raises(SystemExit):
        nps.parse_args(["--dtype", "fp8", "--impl", "fusedenc-fp9"])


def test_fp8_ratios_take_the_fastest_fp16_fusedenc_and_torch_fp8_rows():
    def entry(ms, precision=None):
        e = {"points": {"8": {"ms": ms}}, "checked": True}
        return {**e, "precision": precision} if precision else e

    rec = {
        "batch_sizes": [8], "check": {"fp8": {}},
        "reference_lines": {"8": {"gemm_floor": {"ms": 1.0}, "roofline_ms": 0.5}},
        "impls": {"torch": entry(8.0), "fusedenc": entry(4.0), "fusedenc-graph": entry(2.0),
                  "torch-fp8": entry(5.0, "fp8"), "torch-fp8-compile": entry(3.0, "fp8"),
                  "fusedenc-fp8-graph": entry(1.0, "fp8")},
    }  # fmt: skip
    nps.derive(rec, expand(["tiny"], torch.float16)[0])
    lines = rec["reference_lines"]["8"]
    assert lines["best_fusedenc_fp16"] == {"impl": "fusedenc-graph", "ms": 2.0}
    assert lines["best_torch_fp8"] == {"impl": "torch-fp8-compile", "ms": 3.0}
    pt = rec["impls"]["fusedenc-fp8-graph"]["points"]["8"]
    assert pt["x_fusedenc_fp16"] == pytest.approx(2.0) and pt["x_torch_fp8"] == pytest.approx(3.0)
    assert pt["x_torch"] == pytest.approx(8.0)
    assert "x_torch_fp8" not in rec["impls"]["fusedenc"]["points"]["8"]  # fp16 rows get no FP8 ratios
