"""EncoderBlock / EncoderStack on CPU (the reference ops): conversions, the Lc0 form, state dicts, bad input.

Numeric checks use the tolerance rule of ``helpers.assert_close_rule``: fp32
outputs against an fp64 reference, with twice what plain fp32 PyTorch
deviates plus atol.
"""

from __future__ import annotations

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

import fusedenc
from fusedenc import EncoderBlock, EncoderStack

F32 = torch.float32


def _torch_layer(d, h, f, act, norm_first, batch_first, gen, bias=True):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = nn.TransformerEncoderLayer(
        d, h, f, dropout=0.0, activation=act, norm_first=norm_first, batch_first=batch_first, bias=bias
    )
    with torch.no_grad():  # non-trivial biases and LayerNorm affine
        for name, p in layer.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return layer.eval()


# ------------------------------------------------- vs nn.TransformerEncoderLayer ----


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
def test_matches_transformer_encoder_layer(norm_first, activation, batch_first, with_mask, gen):
    layer = _torch_layer(64, 4, 96, activation, norm_first, batch_first, gen)
    block = EncoderBlock.from_torch(layer)
    b, s = 3, 11
    x = randn((b, s, 64) if batch_first else (s, b, 64), F32, gen=gen)
    mask = padding_mask(b, s, gen) if with_mask else None
    with torch.no_grad():
        out = block(x, key_padding_mask=mask)
    ref = torch_slow_path(layer, x, torch.float64, src_key_padding_mask=mask)
    same = torch_slow_path(layer, x, F32, src_key_padding_mask=mask)
    assert out.shape == x.shape and out.dtype == F32
    assert_close_rule(out, ref, same, F32, what=f"seed={gen.seed_value}")


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_stack_matches_transformer_encoder_with_final_norm(norm_first, gen):
    layer = _torch_layer(32, 2, 64, "gelu", norm_first, True, gen)
    encoder = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(32), enable_nested_tensor=False).eval()
    with torch.no_grad():  # independent layers, non-trivial final norm
        for lay in encoder.layers:
            for p in lay.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        encoder.norm.weight.copy_(1 + 0.2 * torch.randn(32, generator=gen))
        encoder.norm.bias.copy_(0.2 * torch.randn(32, generator=gen))
    stack = EncoderStack.from_torch(encoder)
    assert len(stack.blocks) == 3 and stack.final_norm is not None
    x = randn((2, 9, 32), F32, gen=gen)
    mask = padding_mask(2, 9, gen)
    with torch.no_grad():
        out = stack(x, key_padding_mask=mask)
    ref = torch_slow_path(encoder, x, torch.float64, src_key_padding_mask=mask)
    same = torch_slow_path(encoder, x, F32, src_key_padding_mask=mask)
    assert_close_rule(out, ref, same, F32, what=f"seed={gen.seed_value}")


def test_from_torch_without_bias(gen):
    layer = _torch_layer(32, 4, 64, "relu", False, True, gen, bias=False)
    block = EncoderBlock.from_torch(layer)
    assert block.qkv_bias is None and block.norm1_bias is None
    x = randn((2, 5, 32), F32, gen=gen)
    with torch.no_grad():
        out = block(x)
    assert_close_rule(out, torch_slow_path(layer, x, torch.float64), torch_slow_path(layer, x, F32), F32)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: nn.TransformerEncoderLayer(32, 4, 64, activation=nn.LeakyReLU()), "no fusedenc equivalent"),
        (lambda: nn.TransformerEncoderLayer(36, 4, 64), "multiple of 8"),
        (lambda: nn.Linear(4, 4), "nn.TransformerEncoderLayer"),
    ],
    ids=["activation", "width", "type"],
)
def test_from_torch_refuses_what_it_cannot_convert(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        EncoderBlock.from_torch(make())


# ------------------------------------------------------------ the Lc0 form ----


@pytest.mark.parametrize("activation", ["mish", "swish", "relu2", "selu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_lc0_form_with_alpha(activation, norm_first, gen):
    """LN(x + alpha * f(x)) (and pre-LN's x + alpha * f(LN(x))) against the written-out formula."""
    alpha = (2 * 15) ** -0.25
    block = randomize(EncoderBlock(64, 8, 96, activation, norm_first=norm_first, residual_alpha=alpha), gen)
    x = randn((4, 16, 64), F32, gen=gen)
    bias = randn((4, 8, 16, 16), F32, gen=gen)  # smolgen-like per-sequence, per-head bias
    with torch.no_grad():
        out = block(x, attn_bias=bias)
    p, cfg = block_params(block), block_config(block)
    ref = block_formula(p, x, cfg, bias, dtype=torch.float64)
    same = block_formula(p, x, cfg, bias, dtype=F32)
    assert_close_rule(out, ref, same, F32, what=f"{activation} seed={gen.seed_value}")


@pytest.mark.parametrize("bias_batch", [1, 3])
def test_attention_bias_broadcast_and_mask(bias_batch, gen):
    block = randomize(EncoderBlock(32, 4, 64, "gelu"), gen)
    x = randn((3, 7, 32), F32, gen=gen)
    bias = randn((bias_batch, 4, 7, 7), F32, gen=gen)
    mask = padding_mask(3, 7, gen)
    with torch.no_grad():
        out = block(x, bias, mask)
    p, cfg = block_params(block), block_config(block)
    assert_close_rule(
        out, block_formula(p, x, cfg, bias, mask, torch.float64), block_formula(p, x, cfg, bias, mask, F32), F32
    )


def test_fully_padded_sequence_is_finite_and_others_unaffected(gen):
    block = randomize(EncoderBlock(32, 4, 64), gen)
    x = randn((3, 6, 32), F32, gen=gen)
    mask = padding_mask(3, 6, gen, full_row=True)
    with torch.no_grad():
        out = block(x, key_padding_mask=mask)
        alone = block(x[:2], key_padding_mask=mask[:2])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:2], alone, rtol=0, atol=1e-6)


def test_rows_input_with_seq_len_matches_batched(gen):
    block = randomize(EncoderBlock(32, 4, 64, "swish", residual_alpha=0.7), gen)
    x = randn((3, 5, 32), F32, gen=gen)
    with torch.no_grad():
        batched = block(x)
        rows = block(x.reshape(15, 32), seq_len=5)
    assert rows.shape == (15, 32)
    torch.testing.assert_close(rows.view(3, 5, 32), batched, rtol=0, atol=0)


def test_stack_build_and_inference_mode(gen):
    stack = EncoderStack.build(2, 32, 4, 64, activation="mish", residual_alpha=0.5, final_norm=True)
    for b in stack.blocks:
        randomize(b, gen)
    x = randn((2, 4, 32), F32, gen=gen)
    with torch.inference_mode():
        out = stack(x)
    ref = stack_formula(stack.blocks, x, dtype=torch.float64, final_norm=stack.final_norm)
    same = stack_formula(stack.blocks, x, dtype=F32, final_norm=stack.final_norm)
    assert_close_rule(out, ref, same, F32)


def test_empty_batch(gen):
    block = randomize(EncoderBlock(32, 4, 64), gen)
    out = block(torch.empty((0, 5, 32)))
    assert out.shape == (0, 5, 32)
    assert block(torch.empty((0, 32)), seq_len=4).shape == (0, 32)


def test_compile_fullgraph_traces(gen):
    """The block is traceable with fullgraph=True (the aot_eager backend keeps this fast on CPU)."""
    block = randomize(EncoderBlock(32, 4, 64, "mish", residual_alpha=0.8), gen)
    x = randn((2, 4, 32), F32, gen=gen)
    mask = padding_mask(2, 4, gen)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, key_padding_mask=mask), block(x, key_padding_mask=mask), rtol=0, atol=0)


def test_compiled_stack_is_one_op_and_matches_eager(gen):
    """Under torch.compile a stack (or a lone block) is one fusedenc::encoder_rows call whose
    implementation is the eager forward: bit-identical, and no per-op dispatch to pay."""
    stack = EncoderStack.build(3, 32, 4, 64, activation="swish", residual_alpha=0.7, final_norm=True)
    for block in stack.blocks:
        randomize(block, gen)
    x = randn((2, 6, 32), F32, gen=gen)
    with torch.inference_mode():
        explained = torch._dynamo.explain(stack)(x)
        calls = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert explained.graph_break_count == 0 and calls == [torch.ops.fusedenc.encoder_rows], calls
        compiled = torch.compile(stack, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), stack(x))
        assert torch.equal(compiled(x[:0]), stack(x[:0]))  # an empty batch, through the op
        block = stack.blocks[1]
        calls = [n.target for g in torch._dynamo.explain(block)(x).graphs for n in g.graph.nodes if n.op == "call_function"]
        assert calls == [torch.ops.fusedenc.encoder_rows], calls


def test_copies_are_modules_of_their_own(gen):
    """deepcopy and pickle work (the plan lock is not copied), and a compiled copy runs its own weights."""
    import copy
    import pickle

    stack = EncoderStack.build(2, 32, 4, 64, activation="gelu")
    for block in stack.blocks:
        randomize(block, gen)
    twin = copy.deepcopy(stack)
    with torch.no_grad():
        twin.blocks[0].ffn1_weight.mul_(2.0)
    x = randn((2, 5, 32), F32, gen=gen)
    with torch.inference_mode():
        compiled_twin = torch.compile(twin, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled_twin(x), twin(x))
        assert not torch.equal(twin(x), stack(x))
        restored = pickle.loads(pickle.dumps(stack))
        assert torch.equal(restored(x), stack(x))


def test_a_graph_that_outlives_its_module_says_so():
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.fusedenc.encoder_rows(torch.zeros(4, 32), 10**9, 1, 4, None, None)
    # A real handle: it runs while its module lives, and says so once the module is gone.
    import gc

    block = EncoderBlock(32, 4, 64).eval()
    handle, x = block._handle, torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(torch.ops.fusedenc.encoder_rows(x, handle, 1, 4, None, None), block(x, seq_len=4))
    del block
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.fusedenc.encoder_rows(x, handle, 1, 4, None, None)


def test_graph_runner_needs_a_gpu():
    stack = EncoderStack.build(1, 32, 4, 64)
    with pytest.raises(ValueError, match="GPU"):
        stack.graph_runner(seq_len=8)


# ------------------------------------------------------------ state dicts ----


def test_state_dict_round_trip(gen):
    block = randomize(EncoderBlock(32, 4, 64, "gelu", norm_first=True, residual_alpha=0.5), gen)
    other = EncoderBlock(32, 4, 64, "gelu", norm_first=True, residual_alpha=0.5)
    other.load_state_dict(block.state_dict())
    x = randn((2, 3, 32), F32, gen=gen)
    with torch.no_grad():
        torch.testing.assert_close(other(x), block(x), rtol=0, atol=0)
    assert set(block.state_dict()) == {n for n in EncoderBlock._PARAM_NAMES}


def test_state_dict_with_separate_qkv(gen):
    block = randomize(EncoderBlock(32, 4, 64), gen)
    sd = block.state_dict()
    wq, wk, wv = sd.pop("qkv_weight").chunk(3)
    bq, bk, bv = sd.pop("qkv_bias").chunk(3)
    sd.update(q_weight=wq, k_weight=wk, v_weight=wv, q_bias=bq, k_bias=bk, v_bias=bv)
    other = EncoderBlock(32, 4, 64)
    result = other.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(other.qkv_weight, block.qkv_weight) and torch.equal(other.qkv_bias, block.qkv_bias)
    # ... and the same through a parent module's prefix
    stack = EncoderStack.build(1, 32, 4, 64)
    stack.load_state_dict({f"blocks.0.{k}": v for k, v in sd.items()})
    assert torch.equal(stack.blocks[0].qkv_weight, block.qkv_weight)


def test_state_dict_missing_key_is_an_error(gen):
    sd = EncoderBlock(32, 4, 64).state_dict()
    del sd["ffn1_weight"]
    with pytest.raises(RuntimeError, match="ffn1_weight"):
        EncoderBlock(32, 4, 64).load_state_dict(sd)


def test_no_bias_has_no_bias_parameters():
    block = EncoderBlock(32, 4, 64, bias=False)
    assert all(not n.endswith("bias") for n in block.state_dict())
    assert block.norm1_bias is None


# ------------------------------------------------------------ bad input ----


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(d_model=30, n_heads=4, d_ff=64), ValueError, "does not divide d_model"),
        (dict(d_model=36, n_heads=4, d_ff=64), ValueError, "multiple of 8"),
        (dict(d_model=32, n_heads=4, d_ff=60), ValueError, "d_ff=60"),
        (dict(d_model=32, n_heads=0, d_ff=64), ValueError, "n_heads"),
        (dict(d_model=32, n_heads=4, d_ff=64, activation="swishy"), ValueError, "swishy"),
        (dict(d_model=32, n_heads=4, d_ff=64, residual_alpha=float("nan")), ValueError, "residual_alpha"),
        (dict(d_model=32, n_heads=4, d_ff=64, layer_norm_eps=-1.0), ValueError, "layer_norm_eps"),
    ],
    ids=["heads", "width", "ffn", "zero_heads", "activation", "alpha", "eps"],
)
def test_bad_constructor_arguments(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        EncoderBlock(**kwargs)


def _bad_calls():
    x = torch.randn(2, 5, 32)
    return [
        ("wrong D", lambda b: b(torch.randn(2, 5, 16)), ValueError, "d_model=32"),
        ("rank", lambda b: b(torch.randn(2, 5, 32, 1)), ValueError, r"\[B, S, D\]"),
        ("rows without seq_len", lambda b: b(torch.randn(10, 32)), ValueError, "seq_len"),
        ("rows not divisible", lambda b: b(torch.randn(10, 32), seq_len=3), ValueError, "multiple of seq_len"),
        ("seq_len mismatch", lambda b: b(x, seq_len=4), ValueError, "seq_len=4"),
        ("dtype", lambda b: b(x.double()), TypeError, "dtype"),
        ("not a tensor", lambda b: b([1.0]), TypeError, "x must be a torch.Tensor"),
        ("bias shape", lambda b: b(x, torch.randn(2, 4, 5, 4)), ValueError, "attn_bias must have shape"),
        ("bias heads", lambda b: b(x, torch.randn(1, 2, 5, 5)), ValueError, "attn_bias"),
        ("bias batch", lambda b: b(x, torch.randn(3, 4, 5, 5)), ValueError, "attn_bias"),
        ("mask shape", lambda b: b(x, None, torch.zeros(2, 4, dtype=torch.bool)), ValueError, "key_padding_mask"),
        ("mask dtype", lambda b: b(x, None, torch.zeros(2, 5)), TypeError, "key_padding_mask"),
    ]


@pytest.mark.parametrize("what, call, exc, message", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_forward_arguments(what, call, exc, message):
    block = EncoderBlock(32, 4, 64)
    with pytest.raises(exc, match=message):
        call(block)
    # and the block still works afterwards
    assert block(torch.randn(2, 5, 32)).shape == (2, 5, 32)


def test_stack_rejects_mismatched_blocks():
    with pytest.raises(ValueError, match="blocks\\[1\\]"):
        EncoderStack([EncoderBlock(32, 4, 64), EncoderBlock(32, 8, 64)])
    with pytest.raises(TypeError, match="EncoderBlock"):
        EncoderStack([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="at least one"):
        EncoderStack([])


def test_exports():
    assert fusedenc.EncoderBlock is EncoderBlock and fusedenc.EncoderStack is EncoderStack
