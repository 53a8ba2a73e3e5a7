"""Inputs for the attention GPU tests, shared by the generic and the per-backend modules."""

from __future__ import annotations

import torch

import fusedenc

#: Ops that would mean the attention result was copied on its way to [B*S, H*Dh].
COPY_OPS = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to"}


def record_kernel_outputs(backend, monkeypatch) -> list:
    """Wraps ``backend.kernel`` for this test; returns the list each tensor it returns is appended to."""
    outputs = []
    original = backend.kernel

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        outputs.append(out)
        return out

    monkeypatch.setattr(backend, "kernel", spy)
    return outputs


def packed_inputs(b, s, h, d, dtype, gen, variant="none", device="cuda"):
    """q, k, v as strided views of one packed [B, S, 3, H, Dh] buffer (what fused_qkv returns),
    plus the bias and mask of ``variant``; masked variants make sequence 1 all padding (its rows
    must come out as zeros)."""
    qkv = torch.randn((b, s, 3 * h * d), generator=gen).to(device, dtype)
    q, k, v = fusedenc.ops.gemm.split_qkv(qkv, h)
    bias = mask = None
    if variant in ("bias", "bias+mask"):
        bias = torch.randn((b, h, s, s), generator=gen).to(device, dtype)
    elif variant == "bias_broadcast":
        bias = torch.randn((1, h, s, s), generator=gen).to(device, dtype)
    elif variant == "bias_expanded":  # [B, H, S, S] with batch stride 0
        bias = torch.randn((1, h, s, s), generator=gen).to(device, dtype).expand(b, h, s, s)
    elif variant == "bias_float32":  # float32 bias with half q, k, v
        bias = torch.randn((b, h, s, s), generator=gen).to(device)
    elif variant == "bias_strided":  # a transposed view: unit stride in the wrong dimension
        bias = torch.randn((b, h, s, s), generator=gen).to(device, dtype).transpose(-1, -2)
    if variant in ("mask", "bias+mask", "bias_float32"):
        lengths = torch.randint(1, s + 1, (b,), generator=gen)
        mask = torch.arange(s)[None, :] >= lengths[:, None]
        if b > 1:
            mask[1] = True
        mask = mask.to(device)
    return qkv, q, k, v, bias, mask


def replays_match_eager(b, s, h, d, variant, gen, backend=None, device="cuda"):
    """Captures ``attention`` on packed inputs in a CUDA graph (planned, and compiled, on a side
    stream first), then twice: new data into the same buffers, replay, and assert the replay is
    bitwise what an eager call gives.  Yields ``(out, q, k, v, bias, mask)`` after each replay."""
    from fusedenc.attention import attention

    qkv, q, k, v, bias, mask = packed_inputs(b, s, h, d, torch.float16, gen, variant, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention(q, k, v, bias, mask, backend=backend)  # plan (and Triton compile) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, bias, mask, backend=backend)
    for _ in range(2):
        _, _, _, _, bias2, mask2 = packed_inputs(b, s, h, d, torch.float16, gen, variant, device)
        qkv.copy_(torch.randn(qkv.shape, generator=gen).to(device, qkv.dtype))
        if bias is not None:
            bias.copy_(bias2)
        if mask is not None:
            mask.copy_(mask2)
        graph.replay()
        torch.cuda.synchronize()
        expected = attention(q, k, v, bias, mask, backend=backend)
        torch.testing.assert_close(out, expected, atol=0, rtol=0, msg=lambda m: f"{variant}: {m} seed={gen.seed_value}")
        yield out, q, k, v, bias, mask
