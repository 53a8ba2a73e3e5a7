"""The encoder block's math written out in plain PyTorch, for the block tests.

``block_formula`` is the oracle: every step in one dtype (fp64/fp32 for the
reference, the block's own dtype for "what plain PyTorch gets"), attention as
an explicit softmax, so it shares no code with fusedenc.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from helpers import attention_formula as views_attention_formula
from helpers import randn

from fusedenc import EncoderBlock
from fusedenc.common.activations import apply_activation


def torch_slow_path(module, x, dtype, **kwargs):
    """``module`` (an nn.TransformerEncoder[Layer]) run in ``dtype`` on its slow path: train mode
    with dropout 0 is the eval math without the fast path (which zeroes padded rows instead of
    computing them)."""
    m = copy.deepcopy(module).to(dtype).train()
    with torch.no_grad():
        return m(x.to(dtype), **kwargs)


def block_params(block: EncoderBlock) -> dict:
    return {name: getattr(block, name) for name in EncoderBlock._PARAM_NAMES}


def block_config(block: EncoderBlock) -> dict:
    return dict(
        n_heads=block.n_heads,
        activation=block.activation,
        norm_first=block.norm_first,
        alpha=block.residual_alpha,
        eps=block.layer_norm_eps,
    )


def attention_formula(qkv, batch, seq, heads, attn_bias=None, mask=None):
    """Attention on a packed [T, 3D] QKV buffer, as [B, S, D], in qkv's dtype (see helpers)."""
    d = qkv.shape[-1] // 3
    q, k, v = qkv.view(batch, seq, 3, heads, d // heads).unbind(2)
    return views_attention_formula(q, k, v, attn_bias, mask, dtype=qkv.dtype).view(batch, seq, d)


def block_formula(params, x, cfg, attn_bias=None, mask=None, dtype=None):
    """One block on x [B, S, D], every step in ``dtype`` (default x.dtype)."""
    dtype = dtype or x.dtype
    p = {k: (None if t is None else t.detach().to(dtype)) for k, t in params.items()}
    x = x.to(dtype)
    batch, seq, d = x.shape
    alpha, eps = cfg["alpha"], cfg["eps"]

    def attn(z):
        qkv = F.linear(z, p["qkv_weight"], p["qkv_bias"])
        a = attention_formula(qkv, batch, seq, cfg["n_heads"], attn_bias, mask)
        return F.linear(a, p["out_weight"], p["out_bias"])

    def ffn(z):
        f = apply_activation(F.linear(z, p["ffn1_weight"], p["ffn1_bias"]), cfg["activation"])
        return F.linear(f, p["ffn2_weight"], p["ffn2_bias"])

    def ln(z, i):
        return F.layer_norm(z, (d,), p[f"norm{i}_weight"], p[f"norm{i}_bias"], eps)

    if not cfg["norm_first"]:
        h = ln(x + alpha * attn(x), 1)
        return ln(h + alpha * ffn(h), 2)
    h = x + alpha * attn(ln(x, 1))
    return h + alpha * ffn(ln(h, 2))


def stack_formula(blocks, x, attn_bias=None, mask=None, dtype=None, final_norm=None):
    for b in blocks:
        x = block_formula(block_params(b), x, block_config(b), attn_bias, mask, dtype)
    if final_norm is not None:
        dtype = dtype or x.dtype
        w = None if final_norm.weight is None else final_norm.weight.to(dtype)
        b = None if final_norm.bias is None else final_norm.bias.to(dtype)
        x = F.layer_norm(x.to(dtype), final_norm.normalized_shape, w, b, final_norm.eps)
    return x


def randomize(block: EncoderBlock, gen: torch.Generator) -> EncoderBlock:
    """Fresh random parameters of realistic scale (biases and LayerNorm affine non-trivial)."""
    with torch.no_grad():
        for name in EncoderBlock._PARAM_NAMES:
            t = getattr(block, name)
            if t is None:
                continue
            if name.startswith("norm") and name.endswith("weight"):
                new = 1.0 + randn(t.shape, torch.float32, gen=gen, scale=0.2)
            elif name.endswith("weight"):
                new = randn(t.shape, torch.float32, gen=gen, scale=t.shape[1] ** -0.5)
            else:
                new = randn(t.shape, torch.float32, gen=gen, scale=0.2)
            t.copy_(new.to(t.dtype))
    return block


def padding_mask(batch, seq, gen, *, device="cpu", full_row=False):
    """A bool [B, S] key padding mask with a random length per sequence (>= 1 real key each);
    with ``full_row`` the last sequence is all padding."""
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    mask = torch.arange(seq)[None, :] >= lengths[:, None]
    if full_row:
        mask[-1] = True
    return mask.to(device)
