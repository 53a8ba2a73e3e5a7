"""``fusedenc.fp8.rowwise``'s two e4m3 flavours: OCP (``float8_e4m3fn``, 448: NVIDIA, gfx95x, CPU) and
MI300's FNUZ (``float8_e4m3fnuz``, 240), picked per device from what the core reports."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from helpers import randn

from fusedenc import capabilities, core
from fusedenc.fp8 import rowwise as fp8
from fusedenc.fp8.rowwise import E4M3, E4M3_FNUZ, E4M3_MAX, dequantize, e4m3_columns, format_for, quantize_rows

FNUZ = torch.float8_e4m3fnuz


def _fnuz_codes(values: np.ndarray) -> torch.Tensor:
    """An independent FNUZ encoding: torch's own conversion of float32 values computed in numpy."""
    return torch.from_numpy(values.astype(np.float32)).to(FNUZ)


def test_fnuz_rows_match_torch_bit_for_bit(gen):
    x = randn((48, 272), torch.float32, gen=gen) * torch.logspace(-4, 4, 48)[:, None]
    t = quantize_rows(x, E4M3_FNUZ)
    assert t.q.dtype == FNUZ and t.scale.dtype == torch.float32
    xn = x.numpy()
    amax = np.abs(xn).max(axis=1)
    scale = (amax / np.float32(240.0)).astype(np.float32)  # IEEE fp32 division, as the kernel does
    assert np.array_equal(t.scale.numpy(), scale), gen.seed_value
    want = _fnuz_codes(xn / scale[:, None])
    assert torch.equal(t.q.view(torch.uint8), want.view(torch.uint8)), gen.seed_value
    assert t.q.float().abs().amax(dim=1).eq(240.0).all()  # each row's largest value maps onto 240
    back = dequantize(t)
    bound = torch.maximum(x.abs() * 2.0**-4, t.scale[:, None] * 2.0**-11)  # FNUZ subnormals: 2^-10 step
    assert ((back - x).abs() <= bound).all(), gen.seed_value


def test_fnuz_codes_are_not_the_ocp_codes(gen):
    # The two flavours share no scale: an OCP code read as FNUZ would be off by 2 and more.
    x = randn((8, 64), torch.float32, gen=gen)
    ocp, fnuz = quantize_rows(x), quantize_rows(x, E4M3_FNUZ)
    assert ocp.q.dtype == E4M3 and fnuz.q.dtype == FNUZ
    assert not torch.equal(ocp.q.view(torch.uint8), fnuz.q.view(torch.uint8))
    # ... but both stand for x within e4m3's precision.
    for t in (ocp, fnuz):
        assert torch.allclose(dequantize(t), x, rtol=2.0**-4, atol=float(t.scale.max()) * 2.0**-9)


def test_fnuz_zero_nan_and_inf_rows():
    x = torch.tensor([[0.0, -0.0, 0.0], [1.0, float("nan"), 2.0], [1.0, float("inf"), -1.0], [2.0, -4.0, 1.0]])
    t = quantize_rows(x, E4M3_FNUZ)
    assert t.scale[0] == 1.0 and t.q[0].view(torch.uint8).eq(0).all()  # FNUZ has no -0: 0x00, never 0x80
    assert torch.isnan(t.scale[1]) and torch.isnan(t.q[1].float()).all()
    assert torch.isinf(t.scale[2]) and torch.isnan(t.q[2, 1].float())  # inf / inf; finite / inf: +0 (no -0)
    assert t.q[2].view(torch.uint8)[[0, 2]].eq(0).all()
    assert t.scale[3] == 4.0 / 240.0 and t.q[3].float().tolist() == [120.0, -240.0, 60.0]


def test_fnuz_columns_saturate_at_240_and_keep_nan(gen):
    x = randn((16, 32), torch.float32, gen=gen) * 100.0
    x[0, 0], x[1, 1], x[2, 2], x[3, 3] = 1e6, -float("inf"), float("nan"), -1e-30
    s = torch.rand(32, generator=gen) * 4 + 0.25
    q = e4m3_columns(x, s, E4M3_FNUZ)
    assert q.dtype == FNUZ
    y = x * s
    assert q[0, 0].float() == 240.0 and q[1, 1].float() == -240.0
    assert q.view(torch.uint8)[2, 2] == 0x80 and torch.isnan(q[2, 2].float())  # 0x80: FNUZ's only NaN
    assert q.view(torch.uint8)[3, 3] == 0  # -tiny rounds to +0
    # torch's conversion (which turns overflow into NaN) of the clamped values, element by element
    want = _fnuz_codes(np.clip(y.numpy(), -240.0, 240.0))
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), gen.seed_value
    assert q.float().abs().nan_to_num(0).max() <= 240.0


def test_ocp_path_unchanged(gen):
    # The NVIDIA / CPU behaviour: e4m3fn codes, scales amax / 448, saturation at 448.
    x = randn((32, 128), torch.float32, gen=gen) * 3.0
    assert format_for(x) == (E4M3, E4M3_MAX) == (torch.float8_e4m3fn, 448.0)
    t = quantize_rows(x)
    scale = x.abs().amax(dim=1) / 448.0
    assert t.q.dtype == torch.float8_e4m3fn and torch.equal(t.scale, scale)
    assert torch.equal(t.q.view(torch.uint8), (x / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8))
    s = torch.full((128,), 500.0)
    q = e4m3_columns(x, s)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() == 448.0
    assert torch.equal(q.view(torch.uint8), (x * s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("reported, want", [("e4m3fn", (torch.float8_e4m3fn, 448.0)),
                                            ("e4m3fnuz", (torch.float8_e4m3fnuz, 240.0))])  # fmt: skip
def test_format_follows_what_the_core_reports(monkeypatch, reported, want):
    asked = []
    monkeypatch.setattr(core.fp8, "fp8_format", lambda device: asked.append(device) or reported)
    assert format_for(torch.device("cuda", 1)) == want
    assert asked == [torch.device("cuda", 1)]
    assert format_for(torch.device("cpu")) == (torch.float8_e4m3fn, 448.0)  # the CPU never asks the core
    assert len(asked) == 1
    # the attention kernels' e4m3 output (OCP codes) is allowed only where the device reads OCP
    from fusedenc.attention import plans

    call = types.SimpleNamespace(device_type="cuda", device_index=1)
    assert (plans._device_codes(call).dtype == torch.float8_e4m3fn) == (reported == "e4m3fn")


def test_core_format_without_an_active_core_is_ocp():
    # No GPU (CI) or no native core: the reference runs, in OCP codes.
    if torch.cuda.is_available() and core.backend().name != "reference":
        pytest.skip("a live core answers for itself (test_fp8_formats_on_rocm_gpu)")
    assert core.fp8.fp8_format(torch.device("cuda", 0)) == "e4m3fn"


def test_linear_reference_takes_fnuz_operands(gen):
    x = randn((24, 64), torch.float32, gen=gen)
    w = randn((40, 64), torch.float32, gen=gen)
    qx, qw = quantize_rows(x, E4M3_FNUZ), quantize_rows(w, E4M3_FNUZ)
    y = fp8.linear(qx, qw, out_dtype=torch.float16)
    ref = (dequantize(qx) @ dequantize(qw).t()).half()
    assert torch.equal(y, ref) or (y.float() - ref.float()).abs().max() <= 2.0**-10 * ref.float().abs().max()
    codes = fp8.linear(qx, qw, out_scale=torch.full((40,), 8.0))
    assert codes.dtype == FNUZ  # the flavour of the operands
    with pytest.raises(TypeError, match="one e4m3 flavour"):
        fp8.linear(qx, quantize_rows(w), out_dtype=torch.float16)


def test_capabilities_report_the_format():
    report = capabilities()["fp8"]
    assert {"gemm", "quantize", "runs_here", "reason", "format", "max"} <= set(report)
    assert (report["format"], report["max"]) in (("e4m3fn", 448.0), ("e4m3fnuz", 240.0))


@pytest.mark.gpu
def test_fp8_formats_on_rocm_gpu(gen):
    """On an AMD GPU: the core's FNUZ/OCP choice follows the arch, and the quantization kernel
    writes the reference's codes bit for bit.  Never run here: no AMD GPU was available."""
    if not torch.cuda.is_available() or torch.version.hip is None:
        pytest.skip("needs a ROCm GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    arch = torch.cuda.get_device_properties(device).gcnArchName
    fmt = format_for(device)
    if core.backend().name != "reference":
        assert fmt.dtype == (torch.float8_e4m3fnuz if arch.startswith("gfx94") else torch.float8_e4m3fn), arch
    ok, why = core.fp8_status(device)
    if not ok:
        pytest.skip(f"no FP8 here: {why}")
    x = randn((96, 768), torch.float16, device, gen=gen)
    got = quantize_rows(x)
    want = quantize_rows(x.cpu(), fmt)
    assert got.q.dtype == fmt.dtype
    assert torch.equal(got.scale.cpu(), want.scale)
    assert torch.equal(got.q.view(torch.uint8).cpu(), want.q.view(torch.uint8))
