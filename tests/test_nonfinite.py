"""Non-finite values propagate as in the reference: a NaN in an input is a NaN in the output.

Every op gets a NaN (and, where the limit is well defined, an inf) in each of
its operands; the output must match the written-out formula under
``helpers.assert_close_rule``, which demands NaN at exactly the formula's NaN
positions, and the test also names the positions it expects (a row, a
column, a sequence) so that a NaN turned into a finite value by a max() or a
clamp cannot pass by accident.  CPU always; CUDA (native core) under the
``gpu`` marker.

Not covered on purpose: inf through activations whose limit torch itself
computes inconsistently (torch's CPU ``F.gelu(inf)`` is NaN, the math says
inf), and NaN in a key that the padding mask removes (PyTorch's SDPA adds
``-inf`` to the NaN score and gets NaN; a masked_fill formula gets a finite
value: the two references disagree, fusedenc follows SDPA).
"""

from __future__ import annotations

import pytest
import torch
from encoder_helpers import attention_formula, block_config, block_formula, block_params, randomize
from helpers import assert_close_rule, linear_formula, poisoned, randn, ref_dtype, same_dtype_torch
from layer_norm_helpers import ln_formula, ln_same_dtype

import fusedenc
from fusedenc import EncoderBlock
from fusedenc.common.activations import ACTIVATIONS

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
NAN, INF = float("nan"), float("inf")
#: Activations whose value at +-inf is defined the same way by torch and by the math.
INF_ACTIVATIONS = ("none", "relu", "selu", "tanh", "sigmoid")


def _activation_sites(activations, sites):
    """(activation, where) pairs, leaving out a residual with an activation (the API has no such call)."""
    return [pytest.param(a, w, id=f"{a}-{w}") for a in activations for w in sites if w != "residual" or a == "none"]


def _set(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# ------------------------------------------------------------------ linear ----

M, K, N = 7, 32, 24


def _linear_case(dev, dtype, gen, where, value, activation, alpha=1.0):
    x = randn((M, K), dtype, dev, gen)
    w = randn((N, K), dtype, dev, gen, K**-0.5)
    b = randn((N,), dtype, dev, gen)
    r = randn((M, N), dtype, dev, gen) if where == "residual" else None
    row, col, kk = 3, 5, 11
    expect = torch.zeros((M, N), dtype=torch.bool)
    if where == "x":
        x = _set(x, (row, kk), value)
        expect[row, :] = True
    elif where == "weight":
        w = _set(w, (col, kk), value)
        expect[:, col] = True
    elif where == "bias":
        b = _set(b, col, value)
        expect[:, col] = True
    else:
        r = _set(r, (row, col), value)
        expect[row, col] = True
    out = fusedenc.linear(x, w, b, activation, r, alpha=alpha, out=poisoned((M, N), dtype, dev))
    ref = linear_formula(x, w, b, activation, r, alpha=alpha, dtype=ref_dtype(dtype))
    same = same_dtype_torch(x, w, b, activation, r, alpha=alpha)
    return out, ref, same, expect


@pytest.mark.parametrize(("activation", "where"), _activation_sites(ACTIVATIONS, ("x", "weight", "bias", "residual")))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.sweep
def test_linear_nan(dev, dtype, activation, where, gen):
    out, ref, same, expect = _linear_case(dev, dtype, gen, where, NAN, activation, alpha=0.75)
    what = f"NaN in {where}, {activation} {dtype} on {dev}, seed={gen.seed_value}"
    got = torch.isnan(out).cpu()
    assert torch.equal(got, expect), f"{what}: NaN at {got.nonzero().tolist()[:8]}, expected the {where}'s row/column"
    assert_close_rule(out, ref, same, dtype, what=what)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["+inf", "-inf"])
@pytest.mark.parametrize(("activation", "where"), _activation_sites(INF_ACTIVATIONS, ("x", "bias", "residual")))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.sweep
def test_linear_inf(dev, dtype, activation, where, sign, gen):
    out, ref, same, _ = _linear_case(dev, dtype, gen, where, sign * INF, activation)
    assert_close_rule(out, ref, same, dtype, what=f"{sign * INF} in {where}, {activation} {dtype} on {dev}, seed={gen.seed_value}")


# -------------------------------------------------------------- layer_norm ----

T, D = 6, 64


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where", ["x", "residual", "x_bias", "weight", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.sweep
def test_layer_norm_nonfinite(dev, dtype, where, value, gen):
    x, r = randn((T, D), dtype, dev, gen), randn((T, D), dtype, dev, gen)
    w, b = 1 + randn((D,), dtype, dev, gen, 0.2), randn((D,), dtype, dev, gen, 0.2)
    xb = randn((D,), dtype, dev, gen, 0.2)
    row, col = 2, 9
    expect = torch.zeros((T, D), dtype=torch.bool)
    if where == "x":
        x = _set(x, (row, col), value)
        expect[row] = True  # the row's mean is NaN/inf: every element of it is NaN
    elif where == "residual":
        r = _set(r, (row, col), value)
        expect[row] = True
    elif where == "x_bias":
        xb = _set(xb, col, value)
        expect[:] = True
    elif where == "weight":
        w = _set(w, col, value)
        expect[:, col] = value != value  # NaN weight: NaN column; inf weight: +-inf column
    else:
        b = _set(b, col, value)
        expect[:, col] = value != value
    kw = dict(residual=r, alpha=0.5, x_bias=xb)
    sum_out = poisoned((T, D), dtype, dev)
    out = fusedenc.layer_norm(x, w, b, 1e-5, **kw, out=poisoned((T, D), dtype, dev), sum_out=sum_out)
    ref, h_ref = ln_formula(x, w, b, 1e-5, **kw, dtype=ref_dtype(dtype))
    same, h_same = ln_same_dtype(x, w, b, 1e-5, **kw)
    what = f"{value} in {where}, {dtype} on {dev}, seed={gen.seed_value}"
    got = torch.isnan(out).cpu()
    assert torch.equal(got, expect), f"{what}: NaN at {got.nonzero().tolist()[:8]}"
    assert_close_rule(out, ref, same, dtype, what=what)
    assert_close_rule(sum_out, h_ref, h_same, dtype, what=f"{what} (sum_out)")


# --------------------------------------------------------------- attention ----

B, S, NH, DH = 2, 9, 2, 16


def _attn_check(q_qkv, bias, mask, dtype, what):
    q, k, v = fusedenc.ops.gemm.split_qkv(q_qkv, NH)
    out = fusedenc.attention.attention(q, k, v, bias, mask)
    ref = attention_formula(q_qkv.to(ref_dtype(dtype)), B, S, NH, bias, mask).reshape(B * S, NH * DH)
    same = attention_formula(q_qkv, B, S, NH, bias, mask).reshape(B * S, NH * DH)
    assert_close_rule(out, ref, same, dtype, what=what)
    return out.view(B, S, NH, DH)


@pytest.mark.parametrize("where", ["q", "k", "v", "attn_bias", "attn_bias_fp32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dev", DEVICES)
def test_attention_nan(dev, dtype, where, gen):
    qkv = randn((B, S, 3 * NH * DH), dtype, dev, gen)
    bias_dtype = torch.float32 if where == "attn_bias_fp32" else dtype
    bias = randn((B, NH, S, S), bias_dtype, dev, gen)
    b, s, h = 1, 4, 1
    part = {"q": 0, "k": 1, "v": 2}
    expect = torch.zeros((B, S, NH), dtype=torch.bool)
    if where in part:
        col = part[where] * NH * DH + h * DH + 3
        qkv = _set(qkv, (b, s, col), NAN)
        if where == "q":
            expect[b, s, h] = True  # one query row of one head
        else:
            expect[b, :, h] = True  # a key or value is read by every query of its sequence and head
    else:
        bias = _set(bias, (b, h, s, 6), NAN)
        expect[b, s, h] = True
    out = _attn_check(qkv, bias, None, dtype, f"NaN in {where}, {dtype} on {dev}, seed={gen.seed_value}")
    if where == "v":  # a value's NaN lands in its own channel of every query of its sequence and head
        out = out[..., 3:4]
    got = torch.isnan(out).any(-1).cpu()
    assert torch.equal(got, expect), f"NaN in {where}: NaN rows at {got.nonzero().tolist()}"
    assert torch.isnan(out[expect.to(out.device)]).all(), f"NaN in {where}: a row is only partly NaN"


@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dev", DEVICES)
def test_attention_neg_inf_bias(dev, dtype, with_mask, gen):
    """-inf in attn_bias removes a key like the mask; a query row whose keys are all -inf gives zeros."""
    qkv = randn((B, S, 3 * NH * DH), dtype, dev, gen)
    bias = randn((B, NH, S, S), dtype, dev, gen)
    bias[0, 1, 2, :5] = -INF  # part of a row
    bias[1, 0, 7, :] = -INF  # a whole row: no key left
    mask = None
    if with_mask:
        mask = torch.zeros((B, S), dtype=torch.bool, device=dev)
        mask[0, 6:] = True
    out = _attn_check(qkv, bias, mask, dtype, f"-inf bias mask={with_mask}, {dtype} on {dev}, seed={gen.seed_value}")
    assert not torch.isnan(out).any()
    assert torch.equal(out[1, 7, 0], torch.zeros_like(out[1, 7, 0]))


# ------------------------------------------------------------------- block ----


@pytest.mark.parametrize("where", ["x", "attn_bias", "ffn1_bias"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("dev", DEVICES)
def test_block_nan(dev, dtype, norm_first, where, gen):
    """A NaN in one token reaches every token of its sequence (attention) and no other
    sequence; one in attn_bias poisons one query token; one in a parameter, everything."""
    d, nh, f, b, s = 32, 2, 64, 3, 5
    block = randomize(EncoderBlock(d, nh, f, "gelu", norm_first=norm_first, residual_alpha=0.7, dtype=dtype, device=dev), gen)
    x = randn((b, s, d), dtype, dev, gen)
    bias = randn((1, nh, s, s), dtype, dev, gen) if where == "attn_bias" else None
    expect = torch.zeros((b, s), dtype=torch.bool)
    if where == "x":
        x = _set(x, (1, 2, 7), NAN)
        expect[1] = True
    elif where == "attn_bias":
        bias = _set(bias, (0, 1, 3, 0), NAN)  # broadcast over the batch: query 3 of every sequence
        expect[:, 3] = True
    else:
        with torch.no_grad():
            block.ffn1_bias[5] = NAN
        expect[:] = True
    with torch.inference_mode():
        out = block(x, bias)
    p, cfg = block_params(block), block_config(block)
    ref = block_formula(p, x, cfg, bias, dtype=ref_dtype(dtype))
    same = block_formula(p, x, cfg, bias, dtype=dtype)
    what = f"NaN in {where}, norm_first={norm_first} {dtype} on {dev}, seed={gen.seed_value}"
    got_rows = torch.isnan(out).any(-1).cpu()
    assert torch.equal(got_rows, expect), f"{what}: NaN tokens {got_rows.nonzero().tolist()}"
    assert torch.isnan(out[expect.to(out.device)]).all(), f"{what}: a token is only partly NaN"
    assert_close_rule(out, ref, same, dtype, what=what)
