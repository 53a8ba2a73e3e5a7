"""Bad input raises TypeError/ValueError naming the argument, before any work."""

from __future__ import annotations

import pytest
import torch

import fusedenc

H = torch.float16


def _ok():
    return dict(
        x=torch.randn(4, 16).to(H),
        weight=torch.randn(24, 16).to(H),
        bias=torch.randn(24).to(H),
    )


def _misaligned(shape, dtype=H):
    """A tensor whose data pointer is 2 bytes past a 16-byte boundary."""
    base = torch.randn(int(torch.tensor(shape).prod()) + 8).to(dtype)
    return base[1 : 1 + int(torch.tensor(shape).prod())].view(shape)


CASES = [
    # (description, overrides, exception, message fragment)
    ("x not a tensor", dict(x=[[1.0] * 16]), TypeError, "x must be a torch.Tensor"),
    ("weight not a tensor", dict(weight=3), TypeError, "weight must be a torch.Tensor"),
    ("integer x", dict(x=torch.ones(4, 16, dtype=torch.int32)), TypeError, "x.dtype"),
    ("float64 x", dict(x=torch.ones(4, 16, dtype=torch.float64)), TypeError, "x.dtype"),
    ("weight dtype differs", dict(weight=torch.randn(24, 16)), TypeError, "weight.dtype"),
    ("bias dtype differs", dict(bias=torch.randn(24)), TypeError, "bias.dtype"),
    ("scalar x", dict(x=torch.tensor(1.0).to(H)), ValueError, "x must have at least one dimension"),
    ("1-D weight", dict(weight=torch.randn(16).to(H)), ValueError, "weight must be 2-D"),
    ("K mismatch", dict(x=torch.randn(4, 24).to(H)), ValueError, "x.shape[-1]=24"),
    ("K not a multiple of 8", dict(x=torch.randn(4, 12).to(H), weight=torch.randn(24, 12).to(H)), ValueError, "K=x.shape[-1]=12"),
    ("N not a multiple of 8", dict(weight=torch.randn(20, 16).to(H), bias=torch.randn(20).to(H)), ValueError, "N=weight.shape[0]=20"),
    ("bias wrong length", dict(bias=torch.randn(16).to(H)), ValueError, "bias must have shape (24,)"),
    ("bias 2-D", dict(bias=torch.randn(1, 24).to(H)), ValueError, "bias must have shape"),
    ("bias strided", dict(bias=torch.randn(48).to(H)[::2]), ValueError, "bias must be contiguous"),
    ("weight transposed", dict(weight=torch.randn(16, 24).to(H).t()), ValueError, "weight must be row-major"),
    ("x column-strided", dict(x=torch.randn(4, 32).to(H)[:, ::2]), ValueError, "x must have unit stride"),
    ("x rows overlap", dict(x=torch.randn(16).to(H).expand(4, 16)), ValueError, "overlapping rows"),
    ("x not viewable as rows", dict(x=torch.randn(2, 3, 16).to(H).transpose(0, 1)), ValueError, "cannot be viewed as rows"),
    ("x misaligned", dict(x=_misaligned((4, 16))), ValueError, "x data pointer is not 16-byte aligned"),
    ("x row stride not 16 bytes", dict(x=torch.randn(4, 20).to(H)[:, :16]), ValueError, "x row stride 20"),
    ("weight misaligned", dict(weight=_misaligned((24, 16))), ValueError, "weight data pointer"),
    ("bias misaligned", dict(bias=_misaligned((24,))), ValueError, "bias data pointer"),
    ("unknown activation", dict(activation="swiglu"), ValueError, "activation='swiglu'"),
    ("activation not a str", dict(activation=None), TypeError, "activation must be a str"),
    ("alpha NaN", dict(alpha=float("nan")), ValueError, "alpha=nan"),
    ("alpha inf", dict(alpha=float("inf")), ValueError, "alpha=inf"),
    ("alpha a tensor", dict(alpha=torch.tensor(1.0)), TypeError, "alpha must be a real number"),
    ("beta NaN", dict(beta=float("nan"), residual=torch.randn(4, 24).to(H)), ValueError, "beta=nan"),
    ("beta without residual", dict(beta=0.5), ValueError, "beta=0.5 has no effect"),
    ("residual with activation", dict(activation="relu", residual=torch.randn(4, 24).to(H)), ValueError, "cannot be combined with residual"),
    ("residual wrong shape", dict(residual=torch.randn(4, 16).to(H)), ValueError, "residual must have shape (4, 24)"),
    ("residual dtype", dict(residual=torch.randn(4, 24)), TypeError, "residual.dtype"),
    ("out wrong shape", dict(out=torch.empty(4, 16, dtype=H)), ValueError, "out must have shape (4, 24)"),
    ("out dtype", dict(out=torch.empty(4, 24)), TypeError, "out.dtype"),
    ("out misaligned", dict(out=_misaligned((4, 24))), ValueError, "out data pointer"),
]


@pytest.mark.parametrize("desc,overrides,exc,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_linear_arguments(desc, overrides, exc, fragment):
    args = _ok()
    args.update(overrides)
    out = args.pop("out", None)
    with pytest.raises(exc) as info:
        fusedenc.linear(
            args["x"], args["weight"], args.get("bias"), args.get("activation", "none"),
            args.get("residual"), args.get("beta", 1.0), alpha=args.get("alpha", 1.0), out=out,
        )  # fmt: skip
    assert fragment in str(info.value), f"{desc}: message {str(info.value)!r} lacks {fragment!r}"
    # A valid call afterwards still gives the right answer.
    good = _ok()
    y = fusedenc.linear(good["x"], good["weight"], good["bias"], "relu")
    assert torch.equal(y, fusedenc.reference_linear(good["x"], good["weight"], good["bias"], "relu"))


def test_out_overlapping_inputs_is_rejected():
    buf = torch.randn(4, 24).to(H)
    x = buf[:, :16]
    with pytest.raises(ValueError, match="out overlaps x"):
        fusedenc.linear(x, torch.randn(24, 16).to(H), out=buf)
    r = torch.randn(5, 24).to(H)
    with pytest.raises(ValueError, match="partially overlaps residual"):
        fusedenc.linear(torch.randn(4, 16).to(H), torch.randn(24, 16).to(H), residual=r[:4], out=r[1:])


def test_fused_qkv_arguments():
    x = torch.randn(2, 3, 16)
    w = torch.randn(48, 16)
    with pytest.raises(ValueError, match="num_heads=3 does not divide D=16"):
        fusedenc.fused_qkv(x, w, None, 3)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        fusedenc.fused_qkv(x, w, None, 0)
    with pytest.raises(ValueError, match=r"w_qkv must have shape \(48, 16\)"):
        fusedenc.fused_qkv(x, torch.randn(16, 16), None, 4)
    with pytest.raises(ValueError, match=r"x must be \[B, S, D\]"):
        fusedenc.fused_qkv(x[0], w, None, 4)


def test_pack_qkv_arguments():
    w = torch.randn(8, 8)
    with pytest.raises(ValueError, match="k_weight must be square"):
        fusedenc.pack_qkv(w, torch.randn(8, 4), w)
    with pytest.raises(ValueError, match="missing k_bias, v_bias"):
        fusedenc.pack_qkv(w, w, w, torch.randn(8))
    with pytest.raises(TypeError, match="v_weight is torch.float16"):
        fusedenc.pack_qkv(w, w, w.half())
    with pytest.raises(ValueError, match=r"q_bias must have shape \(8,\)"):
        fusedenc.pack_qkv(w, w, w, torch.randn(4), torch.randn(8), torch.randn(8))


def test_plan_cache_limit_argument():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="limit must be a positive int"):
            fusedenc.set_plan_cache_limit(bad)
