"""FP8 written by its producers (issue 21): the LayerNorm kernel's e4m3 copy of its output
against ``fusedenc.fp8.rowwise.quantize_rows`` of that output, bit for bit, into poisoned buffers;
its argument checks; and a quantized stack whose LayerNorms hand their FP8 copies to the
GEMMs, against the same stack quantizing every GEMM input by its own pass (bit-identical:
the copies are the same codes, so only speed may change)."""

from __future__ import annotations

import copy

import pytest
import torch
from fp8_helpers import count_quantize_passes, random_stack, require_fp8_gpu
from helpers import randn

import fusedenc.testing
from fusedenc import core
from fusedenc.common.device import current_stream
from fusedenc.fp8 import rowwise as fp8

DEV = "cuda"


def _layer_norm_fp8(x, w, b, *, residual=None, sum_out=None, alpha=1.0, eps=1e-5, q_out=None, q_scale=None):
    rows, cols = x.shape
    out = torch.full_like(x, float("nan"))
    q = torch.full((rows, cols), 0x7F, dtype=torch.uint8, device=x.device) if q_out is None else q_out  # 0x7F: NaN
    scale = torch.full((rows,), float("nan"), device=x.device) if q_scale is None else q_scale
    core.layer_norm(
        x=x, ldx=cols, rows=rows, cols=cols, out=out, ldo=cols, weight=w, bias=b, residual=residual, ldr=cols,
        sum_out=sum_out, lds=cols, eps=eps, alpha=alpha, q_out=q, q_scale=scale, stream=current_stream(x.device),
    )  # fmt: skip
    return out, q, scale


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("rows, cols", [(1, 64), (37, 128), (300, 768), (129, 1024), (7, 4096), (3, 16384)])
def test_layer_norm_writes_the_codes_quantize_rows_makes_of_its_output(dtype, rows, cols, gen):
    """Every kernel shape: several rows a warp (64, 128), a warp a row (768, 1024), a block a
    row (4096, 16384).  Rows at scales 1e-3 .. 1e3 through weight, a large residual mean."""
    require_fp8_gpu()
    x = randn((rows, cols), dtype, gen=gen).to(DEV)
    res = (randn((rows, cols), torch.float32, gen=gen) + 100.0).to(dtype).to(DEV)
    w = (randn((cols,), torch.float32, gen=gen) * torch.logspace(-3, 3, cols)).to(dtype).to(DEV)
    b = randn((cols,), dtype, gen=gen).to(DEV)
    out, q, scale = _layer_norm_fp8(x, w, b, residual=res, alpha=0.7)
    plain = torch.full_like(x, float("nan"))
    core.layer_norm(x=x, ldx=cols, rows=rows, cols=cols, out=plain, ldo=cols, weight=w, bias=b, residual=res,
                    ldr=cols, eps=1e-5, alpha=0.7, stream=current_stream(x.device))  # fmt: skip
    assert torch.equal(out, plain)  # the FP8 copy changes nothing else
    want = fp8.quantize_rows(out)
    assert torch.equal(scale, want.scale), (scale - want.scale).abs().max()
    assert torch.equal(q, want.q.view(torch.uint8))


@pytest.mark.gpu
def test_layer_norm_fp8_with_the_residual_sum_and_special_rows():
    require_fp8_gpu()
    rows, cols = 6, 256
    x = torch.randn(rows, cols, dtype=torch.float16, device=DEV)
    w = torch.ones(cols, dtype=torch.float16, device=DEV)
    b = torch.zeros(cols, dtype=torch.float16, device=DEV)
    x[0] = 3.0  # constant row: output 0, scale 1, codes 0
    x[1, 5] = float("nan")  # NaN spoils its row: scale NaN
    res = torch.randn(rows, cols, dtype=torch.float16, device=DEV)
    h = torch.full_like(x, float("nan"))
    out, q, scale = _layer_norm_fp8(x, w, b * 0, residual=res * 0, sum_out=h)
    want = fp8.quantize_rows(out)
    assert scale[0].item() == 1.0 and torch.all(q[0] == 0)
    assert torch.isnan(scale[1]) and torch.isnan(want.scale[1])
    good = [0, 2, 3, 4, 5]
    assert torch.equal(scale[good], want.scale[good]) and torch.equal(q[good], want.q.view(torch.uint8)[good])
    assert torch.equal(h[2:], x[2:])  # sum_out still written


@pytest.mark.gpu
def test_layer_norm_fp8_refuses_bad_buffers():
    require_fp8_gpu()
    rows, cols = 8, 128
    x = torch.randn(rows, cols, dtype=torch.float16, device=DEV)
    q = torch.empty(rows, cols, dtype=torch.uint8, device=DEV)
    s = torch.empty(rows, device=DEV)
    with pytest.raises(ValueError, match="together"):  # codes without their scales
        core.layer_norm(x=x, ldx=cols, rows=rows, cols=cols, out=torch.empty_like(x), ldo=cols, eps=1e-5, q_out=q,
                        stream=current_stream(x.device))  # fmt: skip
    with pytest.raises(ValueError, match="aligned"):
        _layer_norm_fp8(x, None, None, q_out=torch.empty(rows * cols + 1, dtype=torch.uint8, device=DEV)[1:].view(rows, cols), q_scale=s)
    with pytest.raises(ValueError, match="overlaps"):  # codes written over the input
        _layer_norm_fp8(x, None, None, q_out=x.view(torch.uint8)[:, :cols], q_scale=s)
    with pytest.raises(ValueError, match="overlaps"):
        _layer_norm_fp8(x, None, None, q_out=q, q_scale=x.view(torch.float32)[0, :rows])


@pytest.mark.gpu
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-ln", "pre-ln"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["accurate", "fast"])
def test_a_quantized_stack_takes_the_layer_norms_fp8_copies(norm_first, fast_accum, gen, monkeypatch):
    """Same output bit for bit with and without the producers' copies, and fewer
    quantization passes with them: post-LN, only the out-projection's and FFN2's inputs and
    the stack's first input; pre-LN, the out-projection's (its FFN2 carries the residual and
    stays in fp16)."""
    require_fp8_gpu()
    layers = 3
    s = random_stack(layers, 256, 4, 512, gen, norm_first=norm_first, device=DEV).quantize("fp8", fast_accum=fast_accum)
    x = randn((32, 64, 256), torch.float16, gen=gen).to(DEV)
    with torch.no_grad():
        s(x)  # the first call makes the weights' e4m3 copies (quantize_rows too): not counted
    passes = count_quantize_passes(monkeypatch)
    with torch.no_grad():
        with fusedenc.testing.fp8_producers_disabled():
            base = s(x)
        n_base = len(passes)
        passes.clear()
        got = s(x)
    assert n_base == (3 if norm_first else 4) * layers
    assert len(passes) == (layers if norm_first else 2 * layers + 1), passes
    assert torch.isfinite(got).all() and torch.equal(got, base)
    # A copy of the stack quantizes its own weights: same result again.
    assert torch.equal(copy.deepcopy(s)(x), got)


def test_the_producers_switch_is_off_on_the_cpu_and_restores():
    assert not fp8.producers_write_fp8(torch.device("cpu"))
    was = fp8.producers_write_fp8(torch.device(DEV)) if torch.cuda.is_available() else False
    with fusedenc.testing.fp8_producers_disabled():
        assert not fp8.producers_write_fp8(torch.device(DEV))
    if torch.cuda.is_available():
        assert fp8.producers_write_fp8(torch.device(DEV)) == was
