"""EncoderBlock / EncoderStack on the GPU (native core) in fp16 and bf16.

Every numeric check uses the tolerance rule of ``helpers.assert_close_rule``:
the output may differ from the fp32 reference (the written-out formula, or
the torch module in fp32) by at most twice what plain PyTorch in the block's
dtype differs by, plus atol.  Fresh random inputs per test (seed in messages).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from encoder_helpers import (
    block_config,
    block_formula,
    block_params,
    padding_mask,
    randomize,
    stack_formula,
    torch_slow_path,
)
from helpers import assert_close_rule, randn

import fusedenc.encoder.blocks as encoder_module
import fusedenc.encoder.executors as executors_module
from fusedenc import EncoderBlock, EncoderStack

pytestmark = pytest.mark.gpu

DEV = "cuda"
F32 = torch.float32
HALF = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def _block(d, h, f, act, dtype, gen, **kw):
    return randomize(EncoderBlock(d, h, f, act, dtype=dtype, device=DEV, **kw), gen)


def _check_block(block, x, bias=None, mask=None, *, what=""):
    with torch.inference_mode():
        out = block(x, bias, mask)
    p, cfg = block_params(block), block_config(block)
    ref = block_formula(p, x, cfg, bias, mask, dtype=F32)
    same = block_formula(p, x, cfg, bias, mask, dtype=x.dtype)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close_rule(out, ref, same, x.dtype, what=what)
    return out


# ------------------------------------------------- vs nn.TransformerEncoderLayer ----


@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("dtype", HALF)
def test_matches_transformer_encoder_layer(dtype, norm_first, activation, with_mask, gen):
    torch.manual_seed(gen.seed_value)
    layer = nn.TransformerEncoderLayer(
        256, 8, 512, dropout=0.0, activation=activation, norm_first=norm_first, batch_first=True, device=DEV
    ).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen).to(DEV))
    block = EncoderBlock.from_torch(copy.deepcopy(layer).to(dtype))
    x = randn((4, 64, 256), dtype, device=DEV, gen=gen)
    mask = padding_mask(4, 64, gen, device=DEV) if with_mask else None
    with torch.inference_mode():
        out = block(x, key_padding_mask=mask)
    ref = torch_slow_path(layer, x, F32, src_key_padding_mask=mask)
    same = torch_slow_path(layer, x, dtype, src_key_padding_mask=mask)
    assert_close_rule(out, ref, same, dtype, what=f"seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", HALF)
def test_stack_from_torch_matches_transformer_encoder(dtype, gen):
    torch.manual_seed(gen.seed_value)
    layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, activation="gelu", batch_first=True, device=DEV)
    encoder = nn.TransformerEncoder(layer, 4, norm=nn.LayerNorm(128, device=DEV), enable_nested_tensor=False).eval()
    stack = EncoderStack.from_torch(copy.deepcopy(encoder).to(dtype))
    x = randn((8, 32, 128), dtype, device=DEV, gen=gen)
    mask = padding_mask(8, 32, gen, device=DEV)
    with torch.inference_mode():
        out = stack(x, key_padding_mask=mask)
    ref = torch_slow_path(encoder, x, F32, src_key_padding_mask=mask)
    same = torch_slow_path(encoder, x, dtype, src_key_padding_mask=mask)
    assert_close_rule(out, ref, same, dtype, what=f"seed={gen.seed_value}")


# ------------------------------------------------------------ Lc0 and BERT forms ----


@pytest.mark.parametrize("activation", ["mish", "swish", "relu2"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("dtype", HALF)
def test_lc0_form_with_smolgen_bias(dtype, norm_first, activation, gen):
    alpha = (2 * 15) ** -0.25
    block = _block(768, 24, 2304, activation, dtype, gen, norm_first=norm_first, residual_alpha=alpha)
    x = randn((16, 64, 768), dtype, device=DEV, gen=gen)
    bias = randn((16, 24, 64, 64), dtype, device=DEV, gen=gen)
    _check_block(block, x, bias, what=f"{activation} seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", HALF)
def test_bert_form_exact_gelu_with_padding(dtype, gen):
    block = _block(768, 12, 3072, "gelu", dtype, gen, layer_norm_eps=1e-12)
    x = randn((6, 128, 768), dtype, device=DEV, gen=gen)
    mask = padding_mask(6, 128, gen, device=DEV)
    _check_block(block, x, mask=mask, what=f"seed={gen.seed_value}")


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seq", [1, 64, 128, 512, 2048])
@pytest.mark.parametrize("dtype", HALF)
def test_sequence_lengths_and_head_dims_with_bias_and_mask(dtype, seq, head_dim, gen):
    heads = 4
    d = heads * head_dim
    batch = max(1, 4096 // seq)
    batch = min(batch, 8)
    block = _block(d, heads, 2 * d, "swish", dtype, gen, residual_alpha=0.6)
    x = randn((batch, seq, d), dtype, device=DEV, gen=gen)
    bias = randn((1, heads, seq, seq), dtype, device=DEV, gen=gen)
    mask = padding_mask(batch, seq, gen, device=DEV)
    _check_block(block, x, bias, mask, what=f"S={seq} Dh={head_dim} seed={gen.seed_value}")


def test_t82_stack_at_depth(gen):
    """15 Lc0 layers in fp16: the rule holds at depth too."""
    dtype = torch.float16
    alpha = (2 * 15) ** -0.25
    stack = EncoderStack(
        [_block(768, 24, 2304, "swish", dtype, gen, residual_alpha=alpha) for _ in range(15)]
    )
    x = randn((8, 64, 768), dtype, device=DEV, gen=gen)
    with torch.inference_mode():
        out = stack(x)
    ref = stack_formula(stack.blocks, x, dtype=F32)
    same = stack_formula(stack.blocks, x, dtype=dtype)
    assert_close_rule(out, ref, same, dtype, what=f"seed={gen.seed_value}")


# ------------------------------------------------------------ paths ----


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("dtype", HALF)
def test_native_path_is_bitwise_the_ops_path(dtype, norm_first, gen, monkeypatch):
    """The direct-to-core path computes exactly what the public ops compute."""
    block = _block(256, 8, 512, "mish", dtype, gen, norm_first=norm_first, residual_alpha=0.7)
    x = randn((4, 64, 256), dtype, device=DEV, gen=gen)
    bias = randn((4, 8, 64, 64), dtype, device=DEV, gen=gen)
    mask = padding_mask(4, 64, gen, device=DEV)
    with torch.inference_mode():
        native = block(x, bias, mask)
        monkeypatch.setattr(encoder_module, "_native_active", lambda device: False)
        ops = block(x, bias, mask)
    assert torch.equal(native, ops)


def test_native_path_does_not_call_the_public_ops(gen, monkeypatch):
    block = _block(128, 4, 256, "gelu", torch.float16, gen)
    x = randn((2, 16, 128), torch.float16, device=DEV, gen=gen)

    def refuse(*args, **kwargs):
        raise AssertionError("the eager GPU path went through the public ops")

    monkeypatch.setattr(executors_module, "linear", refuse)
    monkeypatch.setattr(executors_module, "layer_norm", refuse)
    monkeypatch.setattr(executors_module, "attention", refuse)
    with torch.inference_mode():
        _check_block(block, x)


def test_rows_input_and_empty_batch(gen):
    block = _block(128, 4, 256, "relu", torch.float16, gen)
    x = randn((3, 16, 128), torch.float16, device=DEV, gen=gen)
    with torch.inference_mode():
        assert torch.equal(block(x.view(48, 128), seq_len=16).view(3, 16, 128), block(x))
        assert block(x[:0]).shape == (0, 16, 128)
    torch.cuda.synchronize()


def test_compile_fullgraph_matches_eager(gen):
    block = _block(256, 8, 512, "swish", torch.float16, gen, residual_alpha=0.7)
    x = randn((4, 32, 256), torch.float16, device=DEV, gen=gen)
    mask = padding_mask(4, 32, gen, device=DEV)
    compiled = torch.compile(block, fullgraph=True)
    with torch.inference_mode():
        eager = block(x, key_padding_mask=mask)
        got = compiled(x, key_padding_mask=mask)
    assert torch.equal(got, eager)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_stack_matches_eager(mode, gen):
    """The compiled stack is one op running the eager (native) forward: bit-identical, also
    replayed from torch.compile's CUDA graphs."""
    stack = EncoderStack.build(
        3, 256, 8, 512, activation="mish", residual_alpha=0.7, dtype=torch.float16, device=DEV
    ).eval()
    x = randn((8, 64, 256), torch.float16, device=DEV, gen=gen)
    compiled = torch.compile(stack, fullgraph=True, mode=None if mode == "default" else mode)
    with torch.inference_mode():
        eager = stack(x)
        for _ in range(3):  # reduce-overhead records its graph on a later call
            assert torch.equal(compiled(x), eager)


def test_bad_input_on_gpu_raises_before_launch(gen):
    block = _block(128, 4, 256, "relu", torch.float16, gen)
    x = randn((2, 16, 128), torch.float16, device=DEV, gen=gen)
    with pytest.raises(TypeError, match="dtype"):
        block(x.float())
    with pytest.raises(ValueError, match="cpu"):
        block(x.cpu().half())
    with pytest.raises(ValueError, match="attn_bias"):
        block(x, torch.zeros((2, 4, 16, 15), dtype=torch.float16, device=DEV))
    with torch.inference_mode():
        _check_block(block, x)  # the block still works


# ------------------------------------------------------------ CUDA graphs ----


@pytest.mark.parametrize("extras", ["none", "bias+mask"])
def test_graph_runner_matches_eager(extras, gen):
    dtype = torch.float16
    alpha = 0.5
    stack = EncoderStack([_block(256, 8, 512, "mish", dtype, gen, residual_alpha=alpha) for _ in range(3)])
    with_bias = "bias" in extras
    with_mask = "mask" in extras
    runner = stack.graph_runner(seq_len=32, batch_sizes=(1, 4, 16), attn_bias=with_bias, key_padding_mask=with_mask)
    assert runner.capture_all() > 0
    for b in (1, 3, 4, 16, 21):  # exact buckets, padded buckets, and chunks of the largest
        x = randn((b, 32, 256), dtype, device=DEV, gen=gen)
        bias = randn((b, 8, 32, 32), dtype, device=DEV, gen=gen) if with_bias else None
        mask = padding_mask(b, 32, gen, device=DEV) if with_mask else None
        with torch.inference_mode():
            got = runner(x, bias, mask).clone()
            eager = stack(x, bias, mask)
        assert got.shape == x.shape
        if b in runner.batch_sizes:
            assert torch.equal(got, eager), f"B={b}: replay differs from eager"
        ref = stack_formula(stack.blocks, x, bias, mask, dtype=F32)
        same = stack_formula(stack.blocks, x, bias, mask, dtype=dtype)
        assert_close_rule(got, ref, same, dtype, what=f"B={b} seed={gen.seed_value}")


def test_graph_runner_reads_each_calls_inputs(gen):
    dtype = torch.bfloat16
    stack = EncoderStack([_block(128, 4, 256, "gelu", dtype, gen) for _ in range(2)])
    runner = stack.graph_runner(seq_len=16, batch_sizes=(8,))
    x1 = randn((8, 16, 128), dtype, device=DEV, gen=gen)
    x2 = randn((8, 16, 128), dtype, device=DEV, gen=gen)
    with torch.inference_mode():
        out1 = runner(x1).clone()
        out2 = runner(x2).clone()
        assert torch.equal(out1, stack(x1)) and torch.equal(out2, stack(x2))
    assert not torch.equal(out1, out2)


def test_graph_runner_checks_its_inputs(gen):
    stack = EncoderStack([_block(128, 4, 256, "relu", torch.float16, gen)])
    runner = stack.graph_runner(seq_len=16, batch_sizes=(4,))
    x = randn((2, 16, 128), torch.float16, device=DEV, gen=gen)
    with pytest.raises(ValueError, match=r"\[B, 16, 128\]"):
        runner(randn((2, 8, 128), torch.float16, device=DEV, gen=gen))
    with pytest.raises(ValueError, match="attn_bias"):
        runner(x, torch.zeros((2, 4, 16, 16), dtype=torch.float16, device=DEV))
    with pytest.raises(TypeError, match="float32"):
        runner(x.float())
    assert runner(x[:0]).shape == (0, 16, 128)


def test_graph_runner_at_bt4_shapes(gen):
    """Regression: during capture the GEMM workspace must outlive the block's GEMMs (a freed
    workspace was carved into the block's own outputs and replay hung at these shapes)."""
    dtype = torch.float16
    alpha = (2 * 15) ** -0.25
    stack = EncoderStack([_block(1024, 32, 1536, "mish", dtype, gen, residual_alpha=alpha) for _ in range(2)])
    runner = stack.graph_runner(seq_len=64, batch_sizes=(256,))
    x = randn((256, 64, 1024), dtype, device=DEV, gen=gen)
    with torch.inference_mode():
        got = runner(x).clone()
        torch.cuda.synchronize()
        assert torch.equal(got, stack(x))
