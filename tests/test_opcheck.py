"""The custom ops pass torch.library.opcheck and trace under torch.compile (CPU reference path)."""

from __future__ import annotations

import pytest
import torch

import fusedenc


def _args(gen, residual=False):
    x = torch.randn(6, 16, generator=gen)
    w = torch.randn(8, 16, generator=gen)
    b = torch.randn(8, generator=gen)
    if residual:
        return (x, w, b, "none", torch.randn(6, 8, generator=gen), 1.0, 0.5)
    return (x, w, b, "gelu", None, 0.5, 1.0)


@pytest.mark.parametrize("residual", [False, True])
def test_opcheck_linear(residual, gen):
    torch.library.opcheck(torch.ops.fusedenc.linear.default, _args(gen, residual))


def test_opcheck_linear_out(gen):
    args = _args(gen)
    out = torch.full((6, 8), float("nan"))
    torch.library.opcheck(torch.ops.fusedenc.linear_out.default, (out,) + args)


def test_compile_fullgraph_matches_eager(gen):
    torch._dynamo.reset()
    x = torch.randn(2, 4, 16, generator=gen)
    w_qkv = torch.randn(48, 16, generator=gen) * 0.25
    w1 = torch.randn(32, 16, generator=gen) * 0.25

    def block(t):
        q, k, v = fusedenc.fused_qkv(t, w_qkv, None, 4)
        return fusedenc.linear(q.reshape(2, 4, 16), w1, None, "mish") + v.sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), block(x))
