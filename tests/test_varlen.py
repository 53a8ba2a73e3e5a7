"""The padding-free path on CPU: packing, varlen attention, blocks and stacks on packed rows,
patch_hf's packed encoder, bad input, and the embeddings benchmark's smoke run.

The oracle is the padded computation in fp32 (``forward`` with a key padding mask, or the
unpatched HF model): on real tokens the packed path must give the same numbers; padding
positions come out zero.  Masks are drawn fresh per test, never only prefix masks.
"""

from __future__ import annotations

import json

import pytest
import torch
from bench_helpers import run_bench
from hf_helpers import SMALL, small_models

import fusedenc
from fusedenc.attention import VarlenPlan, reference_varlen_attention, varlen_attention
from fusedenc.attention import varlen as attention_varlen
from fusedenc.graphs import auto as auto_graphs
from fusedenc.graphs.varlen import VarlenGraphRunner, default_token_buckets
from fusedenc.hf import varlen as hf_varlen
from fusedenc.varlen import calls as packed_calls
from fusedenc.varlen import packing as varlen

#: fp32 on the CPU: the packed and padded paths differ only in summation order.
TOL = dict(rtol=2e-5, atol=2e-5)


def _mask(gen, batch, seq, kind):
    """bool [B, S], True = padding: right padding with varied lengths (one full, one of a
    single token), left padding, or holes (position 0 kept real)."""
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    lengths[0], lengths[-1] = seq, 1
    pad = torch.arange(seq)[None, :] >= lengths[:, None]
    if kind == "left":
        pad = pad.flip(1)
    elif kind == "holes":
        pad = torch.rand(batch, seq, generator=gen) < 0.4
        pad[:, 0] = False
    return pad


# ------------------------------------------------------------ packing ----


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_pack_unpack_round_trip(kind, gen):
    b, s, d = 5, 13, 8
    x = torch.randn(b, s, d, generator=gen)
    pad = _mask(gen, b, s, kind)
    pad[2] = True  # an all-padding sequence: no rows
    p = varlen.packing_from_mask(pad)
    assert p.total == int((~pad).sum()) and p.lengths[2] == 0
    if kind != "holes":  # random holes may happen to form a prefix mask
        assert p.prefix == (kind == "right")
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist()[-1] == p.total
    rows = varlen.pack(x, p)
    assert rows.shape == (p.total, d) and rows.is_contiguous()
    torch.testing.assert_close(rows, x[~pad])  # sequence by sequence, in position order
    back = varlen.unpack(rows, p)
    torch.testing.assert_close(back, x.masked_fill(pad[..., None], 0.0), rtol=0, atol=0)
    out = torch.full_like(x, float("nan"))  # poisoned: padding must be overwritten with zeros
    varlen.unpack(rows, p, out=out)
    torch.testing.assert_close(out, back, rtol=0, atol=0)
    keep = (~pad)[..., None].float()
    want = (x * keep).sum(1) / keep.sum(1).clamp(min=1e-9)
    torch.testing.assert_close(varlen.mean_pool(rows, p), want)
    torch.testing.assert_close(varlen.masked_mean_pool(x, (~pad).long()), want)  # HF's mask: 1 = real
    assert varlen.masked_mean_pool(x, (~pad).long())[2].abs().max() == 0  # the all-padding sequence: zeros
    assert varlen.masked_mean_pool(x.double(), None, torch.float64).dtype == torch.float64
    torch.testing.assert_close(varlen.masked_mean_pool(x, None), x.mean(1))  # no mask: every position


def test_packing_flags_and_lengths(gen):
    pad = torch.tensor([[False, False, True], [True, False, False], [False, True, False]])
    p = varlen.packing_from_mask(pad)
    assert not p.prefix and not p.first_real and p.lengths == (2, 2, 2) and p.max_seqlen == 2
    q = varlen.packing_from_lengths([3, 0, 1], 3)
    assert q.prefix and not q.first_real and q.indices.tolist() == [0, 1, 2, 6]
    assert q.cu_seqlens.tolist() == [0, 3, 3, 4]
    r = varlen.packing_from_lengths(torch.tensor([2, 1]), 2)
    assert r.first_real and r.has_padding


def _reference_packing(pad):
    """What a packing of bool ``pad`` (True = padding) must hold, computed plainly in torch."""
    real = ~pad
    lengths = real.sum(1).tolist()
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    prefix = all(bool(r[:n].all()) for r, n in zip(real, lengths))
    first_real = bool(real[:, :1].all()) and real.shape[1] > 0
    return lengths, real.reshape(-1).nonzero().flatten().tolist(), cu, prefix, first_real


@pytest.mark.parametrize("kind", ["right", "left", "holes", "empty rows", "no rows", "no positions", "one"])
def test_packing_from_mask_and_host_match_a_plain_reference(kind, gen):
    """The numpy path (one read of the mask, one buffer holding indices and offsets) against
    a plain torch computation: lengths, indices, offsets, flags, dtypes, layout."""
    b, s = {"no rows": (0, 7), "no positions": (3, 0), "one": (1, 1)}.get(kind, (6, 11))
    pad = torch.zeros(b, s, dtype=torch.bool)
    if b and s > 1:
        pad = _mask(gen, b, s, kind if kind in ("left", "holes") else "right")
    if kind == "empty rows":
        pad[1], pad[4] = True, True
    want_lengths, want_indices, want_cu, want_prefix, want_first = _reference_packing(pad)
    if b == 0:
        want_first = True  # no sequence: none whose position 0 is padding
    strided = pad.t().numpy().T  # a host array that is not contiguous
    for p in (varlen.packing_from_mask(pad), varlen.packing_from_host(pad.numpy()), varlen.packing_from_host(strided)):
        assert (p.batch, p.seq, p.lengths) == (b, s, tuple(want_lengths)), kind
        assert p.total == sum(want_lengths) and p.max_seqlen == max(want_lengths, default=0)
        assert p.indices.dtype == torch.int64 and p.indices.is_contiguous() and p.indices.tolist() == want_indices
        assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.is_contiguous() and p.cu_seqlens.tolist() == want_cu
        assert p.cu_seqlens.shape == (b + 1,) and p.indices.shape == (p.total,)
        assert (p.prefix, p.first_real) == (want_prefix, want_first), kind
        assert p.has_padding == (p.total < b * s)
    if b and s:
        x = torch.randn(b, s, 4, generator=gen)
        torch.testing.assert_close(varlen.unpack(varlen.pack(x, p), p), x.masked_fill(pad[..., None], 0.0))


def test_packing_from_host_bad_input():
    import numpy as np

    for bad in (np.zeros((2, 3)), np.zeros((2, 3, 1), dtype=bool), [[True]], torch.zeros(2, 3, dtype=torch.bool)):
        with pytest.raises(TypeError, match="numpy bool"):
            varlen.packing_from_host(bad)


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: varlen.packing_from_mask(torch.zeros(2, 3)), TypeError, "bool"),
        (lambda: varlen.packing_from_mask(torch.zeros(2, 3, 1, dtype=torch.bool)), ValueError, r"\[B, S\]"),
        (lambda: varlen.packing_from_mask([[True]]), TypeError, "torch.Tensor"),
        (lambda: varlen.packing_from_lengths([2, 5], 4), ValueError, r"lengths\[1\]=5 is outside \[0, seq_len=4\]"),
        (lambda: varlen.packing_from_lengths([-1], 4), ValueError, r"lengths\[0\]=-1"),
        (lambda: varlen.packing_from_lengths([1.5], 4), TypeError, r"lengths\[0\]"),
        (lambda: varlen.packing_from_lengths(torch.tensor([1.0]), 4), ValueError, "integer"),
        (lambda: varlen.pack(torch.zeros(2, 4, 3), varlen.packing_from_lengths([1, 1], 3)), ValueError, r"\[2, 3, D\]"),
        (lambda: varlen.unpack(torch.zeros(5, 3), varlen.packing_from_lengths([1, 1], 3)), ValueError, "T = 2"),
    ],
)
def test_packing_bad_input(call, err, match):
    with pytest.raises(err, match=match):
        call()


# ------------------------------------------------------------ attention ----


def _qkv(gen, t, h, d, dtype=torch.float32):
    qkv = torch.randn(t, 3 * h * d, generator=gen).to(dtype)
    return qkv, qkv.view(t, 3, h, d).unbind(1)  # strided views of one buffer, as the block passes them


def test_varlen_attention_matches_reference(gen):
    lengths = [5, 0, 1, 9, 3]  # an empty sequence among them
    cu = varlen.cu_seqlens_from_lengths(lengths)
    t = sum(lengths)
    _, (q, k, v) = _qkv(gen, t + 4, 3, 8)  # 4 rows past the last sequence: a graph bucket's slack
    out = varlen_attention(q, k, v, cu, max(lengths))
    ref = reference_varlen_attention(q, k, v, cu)
    assert out.shape == (t + 4, 24)
    torch.testing.assert_close(out[:t], ref[:t], **TOL)
    # Against fusedenc's padded attention on the same sequences.
    qp = torch.zeros(len(lengths), 9, 3, 8)
    kp, vp = qp.clone(), qp.clone()
    for i, (a, n) in enumerate(zip(cu.tolist(), lengths)):
        qp[i, :n], kp[i, :n], vp[i, :n] = q[a:a + n], k[a:a + n], v[a:a + n]
    mask = torch.arange(9)[None] >= torch.tensor(lengths)[:, None]
    padded = fusedenc.attention.attention(qp, kp, vp, None, mask).view(len(lengths), 9, 24)
    for i, (a, n) in enumerate(zip(cu.tolist(), lengths)):
        torch.testing.assert_close(out[a:a + n], padded[i, :n], **TOL)


def test_varlen_attention_bad_input(gen):
    _, (q, k, v) = _qkv(gen, 6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, v, cu.long(), 4)
    with pytest.raises(ValueError, match="more than max_seqlen=3"):
        varlen_attention(q, k, v, cu, 3)
    with pytest.raises(ValueError, match="must not decrease"):
        varlen_attention(q, k, v, torch.tensor([0, 4, 2], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be 0"):
        varlen_attention(q, k, v, torch.tensor([1, 4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="exceeds the 6 rows"):
        varlen_attention(q, k, v, torch.tensor([0, 7], dtype=torch.int32), 8)
    with pytest.raises(ValueError, match=r"\[T, H, Dh\]"):
        varlen_attention(q[None], k[None], v[None], cu, 4)
    with pytest.raises(ValueError, match="flash_varlen.*cannot serve"):
        varlen_attention(q, k, v, cu, 4, backend="flash_varlen")  # CPU
    with pytest.raises(ValueError, match="triton_short.*cannot serve.*needs a GPU"):
        varlen_attention(q, k, v, cu, 4, backend="triton_short")
    with pytest.raises(ValueError, match="not one of"):
        varlen_attention(q, k, v, cu, 4, backend="nested")
    assert attention_varlen.choose(torch.float32, 8, torch.device("cpu")) == "padded"


def test_default_backend_by_sequence_bound(monkeypatch):
    """Short sequences default to triton_short where Triton serves, longer (or unknown) ones
    to flash_varlen where it runs, else padded; a forced backend still wins."""
    monkeypatch.delenv(attention_varlen.BACKEND_ENV, raising=False)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(attention_varlen, "triton_unusable", lambda d, h, dev, m: None if m <= 128 else "too long")
    monkeypatch.setattr(attention_varlen, "flash_unusable", lambda d, h, dev: None)
    short = attention_varlen.SHORT_DEFAULT_MAX
    assert attention_varlen.choose(torch.float16, 32, gpu, None, short) == "triton_short"
    assert attention_varlen.choose(torch.float16, 32, gpu, None, 17) == "triton_short"
    assert attention_varlen.choose(torch.float16, 32, gpu, None, short + 1) == "flash_varlen"
    assert attention_varlen.choose(torch.float16, 32, gpu) == "flash_varlen"  # bound unknown
    assert attention_varlen.choose(torch.float16, 32, gpu, "flash_varlen", 17) == "flash_varlen"
    monkeypatch.setattr(attention_varlen, "flash_unusable", lambda d, h, dev: "ROCm")
    assert attention_varlen.choose(torch.float16, 32, gpu, None, 64) == "triton_short"
    assert attention_varlen.choose(torch.float16, 32, gpu, None, 256) == "padded"
    monkeypatch.setattr(attention_varlen, "triton_unusable", lambda d, h, dev, m: "no triton")
    assert attention_varlen.choose(torch.float16, 32, gpu, None, 64) == "padded"


def test_backend_env_forces(monkeypatch):
    monkeypatch.setenv(attention_varlen.BACKEND_ENV, "flash_varlen")
    with pytest.raises(ValueError, match="cannot serve"):
        attention_varlen.choose(torch.float32, 8, torch.device("cpu"))


# ------------------------------------------------------------ blocks and stacks ----


def _stack(norm_first=False, final_norm=False, batch_first=True):
    torch.manual_seed(0)
    stack = fusedenc.EncoderStack.build(2, 32, 4, 64, activation="gelu", norm_first=norm_first, final_norm=final_norm,
                                        batch_first=batch_first, dtype=torch.float32, device="cpu")  # fmt: skip
    with torch.no_grad():  # visible biases and LayerNorm affine terms
        for name, p in stack.named_parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    return stack


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_stack_unpadded_equals_padded_on_real_tokens(kind, norm_first, gen):
    stack = _stack(norm_first=norm_first, final_norm=True)
    b, s = 6, 11
    x = torch.randn(b, s, 32, generator=gen)
    pad = _mask(gen, b, s, kind)
    want = stack(x, key_padding_mask=pad)
    got = stack.forward_unpadded(x, pad)
    assert torch.equal(got[pad], torch.zeros_like(got[pad])), "padding positions must be zero"
    torch.testing.assert_close(got[~pad], want[~pad], **TOL, msg=lambda m: f"seed={gen.seed_value}: {m}")
    # The block alone, and packed rows in, packed rows out.
    p = varlen.packing_from_mask(pad)
    rows = varlen.pack(x, p)
    block = stack.blocks[0]
    torch.testing.assert_close(block.forward_packed(rows, p), block(x, key_padding_mask=pad)[~pad], **TOL)
    torch.testing.assert_close(block.forward_packed(rows, p.cu_seqlens), block.forward_packed(rows, p), rtol=0, atol=0)
    torch.testing.assert_close(stack.forward_packed(rows, p.cu_seqlens), got[~pad], rtol=0, atol=0)


def test_stack_lengths_sequence_first_and_empty(gen):
    stack = _stack(batch_first=False)
    s, b = 7, 4
    x = torch.randn(s, b, 32, generator=gen)
    lengths = [7, 2, 0, 5]
    pad = torch.arange(s)[None] >= torch.tensor(lengths)[:, None]
    got = stack.forward_unpadded(x, lengths=lengths)
    assert got.shape == x.shape
    want = stack(x, key_padding_mask=pad)
    real = (~pad).t()
    torch.testing.assert_close(got[real], want[real], **TOL)
    assert torch.equal(got[:, 2], torch.zeros_like(got[:, 2])), "an empty sequence gives zeros"
    nothing = stack.forward_unpadded(x, lengths=[0, 0, 0, 0])  # no real token at all
    assert torch.equal(nothing, torch.zeros_like(x))


def test_stack_varlen_bad_input(gen):
    stack = _stack()
    x = torch.randn(2, 5, 32, generator=gen)
    with pytest.raises(ValueError, match="exactly one"):
        stack.forward_unpadded(x)
    with pytest.raises(ValueError, match="exactly one"):
        stack.forward_unpadded(x, torch.zeros(2, 5, dtype=torch.bool), lengths=[1, 1])
    with pytest.raises(ValueError, match=r"lengths\[0\]=6 is outside"):  # beyond the padded length
        stack.forward_unpadded(x, lengths=[6, 1])
    with pytest.raises(ValueError, match=r"bool \[B, S\]"):
        stack.forward_unpadded(x, torch.zeros(2, 4, dtype=torch.bool))
    rows = torch.randn(6, 32, generator=gen)
    with pytest.raises(ValueError, match="must equal the number of rows"):
        stack.forward_packed(rows, torch.tensor([0, 2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="more than max_seqlen"):
        stack.forward_packed(rows, torch.tensor([0, 2, 6], dtype=torch.int32), 3)
    with pytest.raises(ValueError, match=r"\[T, 32\]"):
        stack.forward_packed(torch.randn(6, 16), torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(TypeError, match="float64"):
        stack.forward_packed(rows.double(), torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="packing 3 tokens"):
        stack.forward_packed(rows, varlen.packing_from_lengths([2, 1], 5))
    with pytest.raises(ValueError, match="not supported on packed rows"):
        VarlenPlan(torch.tensor([0, 6], dtype=torch.int32), 6).run(rows, rows, rows, attn_bias=rows)
    stack.train()
    with pytest.raises(RuntimeError, match="inference-only"):
        stack.forward_unpadded(x, lengths=[1, 1])


def test_graph_runner_refuses_cpu_and_buckets():
    with pytest.raises(ValueError, match="GPU"):
        VarlenGraphRunner(_stack(), max_sequences=4, max_seqlen=8)
    b = default_token_buckets(5000)
    assert b[0] == 64 and b[-1] >= 5000 and all(x % 64 == 0 for x in b) and list(b) == sorted(set(b))
    assert all(b2 / b1 <= 1.5 for b1, b2 in zip(b[3:], b[4:]))


# ------------------------------------------------------------ patch_hf ----

transformers = pytest.importorskip("transformers")

PAD = 1  # the pad id of these tests' models (RoBERTa's; the embeddings tests use 0)


def _hf(gen, impl="sdpa", model_type="bert", padding_free=True):
    return small_models(gen, model_type, impl=impl, pad_token_id=PAD, padding_free=padding_free)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_patched_model_packs(impl, model_type, gen):
    model, ref = _hf(gen, impl, model_type)
    b, s = 5, 12
    ids = torch.randint(2, SMALL["vocab_size"], (b, s), generator=gen)
    mask = (~_mask(gen, b, s, "holes")).long()  # holes: not a prefix mask
    calls = []
    hook = model.encoder.layer[0].register_forward_pre_hook(lambda m, a: calls.append(tuple(a[0].shape)))
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask), ref(ids, attention_mask=mask)
    hook.remove()
    real = mask.bool()
    assert calls == [(1, int(real.sum()), SMALL["hidden_size"])], "the layers must see the packed rows"
    torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], **TOL)
    assert torch.equal(got.last_hidden_state[~real], torch.zeros_like(got.last_hidden_state[~real]))
    torch.testing.assert_close(got.pooler_output, want.pooler_output, **TOL)


@pytest.mark.parametrize("case", ["left-padding", "no-padding", "hidden-states", "padding_free=False", "all-padding"])
def test_patched_model_keeps_hf_padding_outputs(case, gen):
    """Where the packed path would not give HF's outputs, the padded path runs: HF's values
    at every position, padding included."""
    model, ref = _hf(gen, "eager", padding_free=case != "padding_free=False")
    b, s = 4, 9
    ids = torch.randint(2, SMALL["vocab_size"], (b, s), generator=gen)
    mask = (~_mask(gen, b, s, "left" if case == "left-padding" else "right")).long()
    if case == "no-padding":
        mask[:] = 1
    if case == "all-padding":
        mask[1] = 0
    kw = {"output_hidden_states": True} if case == "hidden-states" else {}
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask, **kw), ref(ids, attention_mask=mask, **kw)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **TOL)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, **TOL)
    if kw:
        assert [h.shape for h in got.hidden_states] == [h.shape for h in want.hidden_states]
        for g, w in zip(got.hidden_states, want.hidden_states):
            torch.testing.assert_close(g, w, **TOL)


def test_patched_model_lengths_beyond_positions(gen):
    """Longer than the position embeddings: refused by HF's embeddings, as unpatched."""
    model, ref = _hf(gen)
    ids = torch.randint(2, SMALL["vocab_size"], (2, SMALL["max_position_embeddings"] + 1), generator=gen)
    for m in (ref, model):
        with pytest.raises((IndexError, RuntimeError, ValueError)):
            m(ids, attention_mask=torch.ones_like(ids))


def test_patched_model_deepcopy_and_repatch(gen):
    import copy

    model, ref = _hf(gen)
    again = fusedenc.patch_hf(model)
    assert again is model
    clone = copy.deepcopy(model)
    ids = torch.randint(2, SMALL["vocab_size"], (3, 8), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    real = mask.bool()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).last_hidden_state[real]
        for m in (model, clone):
            torch.testing.assert_close(m(ids, attention_mask=mask).last_hidden_state[real], want, **TOL)


# ------------------------------------------------------------ patch_hf: one stack ----


def _stack_calls(model) -> int:
    """Calls of the stack the padding-free encoder runs its blocks as (0: none made)."""
    stack = hf_varlen.stack_of(model.encoder)
    return 0 if stack is None else sum(stack.auto_graphs.stats()["counts"].values())


def _run(model, ids, mask, **kw):
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kw)


def _per_layer(model, ids, mask):
    """The layers one by one: a hook on a layer watches its calls (the fallback path)."""
    handle = model.encoder.layer[0].register_forward_pre_hook(lambda m, a: None)
    try:
        return _run(model, ids, mask)
    finally:
        handle.remove()


def _ids_mask(gen, b=5, s=12):
    ids = torch.randint(2, SMALL["vocab_size"], (b, s), generator=gen)
    return ids, (~_mask(gen, b, s, "holes")).long()


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_patched_encoder_runs_its_blocks_as_one_stack(model_type, gen):
    model, ref = _hf(gen, "sdpa", model_type)
    ids, mask = _ids_mask(gen)
    modules, keys = len(list(model.modules())), list(model.state_dict())
    got = _run(model, ids, mask)
    stack = hf_varlen.stack_of(model.encoder)
    assert stack is not None and _stack_calls(model) == 1
    assert all(b is layer.block for b, layer in zip(stack.blocks, model.encoder.layer)), "the layers' own blocks"
    assert len(list(model.modules())) == modules and list(model.state_dict()) == keys, "no submodule added"
    assert not any(m.training for m in model.modules())
    per_layer = _per_layer(model, ids, mask)
    assert _stack_calls(model) == 1, "a hooked layer: the layers run one by one"
    assert torch.equal(got.last_hidden_state, per_layer.last_hidden_state)
    assert torch.equal(got.pooler_output, per_layer.pooler_output)
    real = mask.bool()
    want = ref(ids, attention_mask=mask)
    torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], **TOL)
    assert torch.equal(got.last_hidden_state[~real], torch.zeros_like(got.last_hidden_state[~real]))
    _run(model, ids, mask)
    assert hf_varlen.stack_of(model.encoder) is stack and _stack_calls(model) == 2


@pytest.mark.parametrize("watch", ["forward hook", "pre-hook", "hook with kwargs", "global hook", "instance forward"])
def test_patched_encoder_runs_layers_one_by_one_when_watched(watch, gen):
    model, _ = _hf(gen)
    ids, mask = _ids_mask(gen)
    plain = _run(model, ids, mask)
    layer = model.encoder.layer[1]
    seen = []
    if watch == "forward hook":
        handle = layer.register_forward_hook(lambda m, a, o: seen.append(m))
    elif watch == "pre-hook":
        handle = layer.register_forward_pre_hook(lambda m, a: seen.append(m))
    elif watch == "hook with kwargs":
        handle = layer.register_forward_hook(lambda m, a, k, o: seen.append(m), with_kwargs=True)
    elif watch == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: seen.append(m) if m is layer else None)
    else:
        hf_forward = layer.forward

        def forward(*args, **kwargs):
            seen.append(layer)
            return hf_forward(*args, **kwargs)

        layer.forward = forward
    try:
        watched = _run(model, ids, mask)
    finally:
        if watch == "instance forward":
            del layer.forward
        else:
            handle.remove()
    assert seen == [layer] and _stack_calls(model) == 1, "the watched call ran the layers one by one"
    assert torch.equal(watched.last_hidden_state, plain.last_hidden_state)
    _run(model, ids, mask)
    assert _stack_calls(model) == 2, "unwatched again: the stack"


def test_transformers_idle_output_hooks_keep_the_stack(gen):
    """transformers 5 leaves its output-recording hooks on the layers once hidden states were
    asked for; they do nothing while nothing is collected, so the stack runs."""
    model, ref = _hf(gen)
    ids, mask = _ids_mask(gen)
    hidden = _run(model, ids, mask, output_hidden_states=True)  # padded path: HF's shapes
    assert _stack_calls(model) == 0 and len(hidden.hidden_states) == SMALL["num_hidden_layers"] + 1
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert model.encoder.layer[0]._forward_hooks, "transformers 5 recording hooks installed"
    got = _run(model, ids, mask)
    assert _stack_calls(model) == 1
    real = mask.bool()
    torch.testing.assert_close(got.last_hidden_state[real], hidden.last_hidden_state[real], **TOL)


def test_the_stack_follows_replaced_blocks_moves_and_copies(gen):
    import copy

    model, _ = _hf(gen)
    ids, mask = _ids_mask(gen)
    _run(model, ids, mask)
    first = hf_varlen.stack_of(model.encoder)
    block = copy.deepcopy(model.encoder.layer[1].block)
    with torch.no_grad():
        block.ffn2_bias.add_(0.5)
    model.encoder.layer[1].block = block
    got = _run(model, ids, mask)
    stack = hf_varlen.stack_of(model.encoder)
    assert stack is not first and stack.blocks[1] is block, "rebuilt on the new block"
    assert torch.equal(got.last_hidden_state, _per_layer(model, ids, mask).last_hidden_state)
    clone = copy.deepcopy(model)
    clone_out = _run(clone, ids, mask)
    assert torch.equal(clone_out.last_hidden_state, got.last_hidden_state)
    assert all(b is layer.block for b, layer in zip(hf_varlen.stack_of(clone.encoder).blocks, clone.encoder.layer))
    model.float().to("cpu")  # already there: no tensor replaced, the stack stays
    assert hf_varlen.stack_of(model.encoder) is stack
    model.double().float()  # through _apply: the cached stack (and any graphs of it) goes
    assert hf_varlen.stack_of(model.encoder) is None
    torch.testing.assert_close(_run(model, ids, mask).last_hidden_state, got.last_hidden_state, rtol=0, atol=0)


def _fake_capture(run, device, pool):
    """A "graph" that recomputes its run into the static output when replayed (as
    tests/test_auto_graphs.py's): what a real graph does to its buffers."""

    class Replay:
        def replay(self):
            out.copy_(run())

    out = run()
    return Replay(), out


def test_patched_encoder_replays_one_graph_per_forward(gen, monkeypatch):
    """The automatic graphs' logic on the CPU (native core claimed, fake capture): one graph
    of the whole encoder per forward, the blocks' own caches unused."""
    monkeypatch.setattr(packed_calls, "_native_active", lambda device: True)
    monkeypatch.setattr(auto_graphs, "cuda_capture", _fake_capture)
    model, ref = _hf(gen)
    ids, mask = _ids_mask(gen)
    real = mask.bool()
    with auto_graphs.disabled():
        want = _per_layer(model, ids, mask).last_hidden_state
    blocks = [layer.block.auto_graphs.stats()["counts"] for layer in model.encoder.layer]
    for _ in range(3):
        got = _run(model, ids, mask).last_hidden_state
        torch.testing.assert_close(got, want, **TOL)
    counts = hf_varlen.stack_of(model.encoder).auto_graphs.stats()["counts"]
    assert counts == {"eager: first calls": 1, "captures": 1, "replays": 2}, counts
    assert [layer.block.auto_graphs.stats()["counts"] for layer in model.encoder.layer] == blocks
    torch.testing.assert_close(got[real], ref(ids, attention_mask=mask).last_hidden_state[real], **TOL)


# ------------------------------------------------------------ patch_hf: HF's layer loop skipped ----

TF_MAJOR = int(transformers.__version__.split(".")[0])


def _layer_calls(monkeypatch) -> list:
    """Every patched layer call (each one checks its arguments first)."""
    from fusedenc.hf.patch import HFEncoderLayer

    calls, refuse = [], HFEncoderLayer._refuse
    monkeypatch.setattr(HFEncoderLayer, "_refuse", lambda self, kw: (calls.append(self), refuse(self, kw))[1])
    return calls


def _encoder_inputs(ref, ids, mask) -> tuple:
    """The (args, kwargs) HF's model hands its encoder for this batch."""
    seen = {}
    hook = ref.encoder.register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        ref(ids, attention_mask=mask)
    hook.remove()
    return seen["a"], seen["k"]


@pytest.mark.parametrize("return_dict", [True, False])
def test_skipped_layer_loop_gives_hf_output_types(return_dict, gen, monkeypatch):
    """The first padding-free call of a kind runs HF's loop (the layers hand the stack's rows
    on) and records HF's output type; later ones make it without the loop: the same types,
    fields and values as HF's model and encoder, on transformers' own BertModel."""
    model, ref = _hf(gen)
    ids, mask = _ids_mask(gen)
    calls = _layer_calls(monkeypatch)
    real = mask.bool()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, return_dict=return_dict)
        outs = []
        for _ in range(3):
            calls.clear()
            outs.append(model(ids, attention_mask=mask, return_dict=return_dict))
            outs[-1] = (outs[-1], len(calls))
    assert [n for _, n in outs] == [SMALL["num_hidden_layers"], 0, 0], "HF's loop runs once, then is skipped"
    assert _stack_calls(model) == 3
    for got, _ in outs:
        assert type(got) is type(want) and len(got) == len(want)
        if return_dict:
            assert list(got.keys()) == list(want.keys())
        torch.testing.assert_close(got[0][real], want[0][real], **TOL)
        assert torch.equal(got[0][~real], torch.zeros_like(got[0][~real]))
        torch.testing.assert_close(got[1], want[1], **TOL)
        assert torch.equal(got[0], outs[0][0][0])
    # The encoder alone, as HF's model calls it, and (4.x) its tuple form.
    args, kwargs = _encoder_inputs(ref, ids, mask)
    kinds = [dict(kwargs)] + ([dict(kwargs, return_dict=False)] if TF_MAJOR < 5 else [])
    with torch.no_grad():
        for kw in kinds:
            hf_out = ref.encoder(*args, **kw)
            for _ in range(2):
                got = model.encoder(*args, **kw)
                assert type(got) is type(hf_out) and len(got) == len(hf_out)
                if hasattr(hf_out, "keys"):
                    assert list(got.keys()) == list(hf_out.keys())
                torch.testing.assert_close(got[0][real], hf_out[0][real], **TOL)


@pytest.mark.parametrize("refused", ["head_mask", "output_attentions"])
def test_a_refused_call_runs_no_block_before_the_error(gen, monkeypatch, refused):
    """A call a patched layer refuses raises before any block runs: the padding-free encoder
    does not run its stack first (it did, for head_mask, before the refusal was checked here)."""
    model, _ = _hf(gen, "eager")
    ids, mask = _ids_mask(gen)
    _run(model, ids, mask)  # the stack built and its output kind recorded: the fast path is warm
    ran = []
    for name in ("forward_packed", "forward"):
        real = getattr(fusedenc.EncoderBlock, name)
        monkeypatch.setattr(fusedenc.EncoderBlock, name, lambda self, *a, _real=real, **k: (ran.append(self), _real(self, *a, **k))[1])
    real_stack = fusedenc.EncoderStack.forward_packed
    monkeypatch.setattr(fusedenc.EncoderStack, "forward_packed",
                        lambda self, *a, **k: (ran.append(self), real_stack(self, *a, **k))[1])  # fmt: skip
    _run(model, ids, mask)
    assert ran, "the spies see a normal call"
    ran.clear()
    kw = {"head_mask": torch.ones(SMALL["num_hidden_layers"], SMALL["num_attention_heads"])} if refused == "head_mask" \
        else {"output_attentions": True}
    with pytest.raises(ValueError, match=refused):
        _run(model, ids, mask, **kw)
    assert not ran, f"{len(ran)} block or stack calls before the refusal"


def test_skipped_layer_loop_still_refuses(gen, monkeypatch):
    """Once HF's loop is skipped, what a patched layer refuses is still refused, as before."""
    model, ref = _hf(gen, "eager")  # transformers 5 itself refuses config.output_attentions with sdpa
    ids, mask = _ids_mask(gen)
    calls = _layer_calls(monkeypatch)
    first = _run(model, ids, mask).last_hidden_state
    calls.clear()
    assert torch.equal(_run(model, ids, mask).last_hidden_state, first) and not calls, "the loop is skipped"
    args, kwargs = _encoder_inputs(ref, ids, mask)
    with torch.no_grad():
        model.encoder(*args, **kwargs)  # the encoder called as the model calls it: recorded, then skipped
        calls.clear()
        model.encoder(*args, **kwargs)
        assert not calls
        model.config.output_attentions = True
        if "output_attentions" not in kwargs:  # transformers 5: the layers read it from the config
            with pytest.raises(ValueError, match="output_attentions"):
                model.encoder(*args, **kwargs)
        model.config.output_attentions = False
    with pytest.raises(ValueError, match="output_attentions"):
        _run(model, ids, mask, output_attentions=True)
    head_mask = torch.ones(SMALL["num_hidden_layers"], SMALL["num_attention_heads"])
    with pytest.raises(ValueError, match="head_mask"):
        _run(model, ids, mask, head_mask=head_mask)
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions"):
        _run(model, ids, mask)
    model.config.output_attentions = False
    model.encoder.layer[1].train()
    with pytest.raises(RuntimeError, match="inference-only"):
        _run(model, ids, mask)
    model.encoder.layer[1].eval()
    model.train()
    with pytest.raises(RuntimeError, match="inference-only"):
        _run(model, ids, mask)
    model.eval()
    calls.clear()
    assert torch.equal(_run(model, ids, mask).last_hidden_state, first) and not calls


def test_layer_loop_kept_where_hf_does_more(gen, monkeypatch):
    """Where HF's encoder does more than hand the last layer's output on (here: a forward
    that changes it), no output type is recorded: its loop runs every call."""
    model, _ = _hf(gen)
    ids, mask = _ids_mask(gen)
    calls = _layer_calls(monkeypatch)
    plain = _run(model, ids, mask).last_hidden_state
    hf_cls = next(c for c in type(model.encoder).__mro__[2:] if "forward" in vars(c))
    hf_forward = hf_cls.forward

    def forward(self, *args, **kwargs):
        out = hf_forward(self, *args, **kwargs)
        out.last_hidden_state = out.last_hidden_state + 1.0
        return out

    monkeypatch.setattr(hf_cls, "forward", forward)
    model.encoder.__dict__.pop("_fusedenc_outputs", None)  # as on an encoder never run before
    real = mask.bool()
    for _ in range(2):
        calls.clear()
        got = _run(model, ids, mask).last_hidden_state
        assert len(calls) == SMALL["num_hidden_layers"]
        torch.testing.assert_close(got[real], plain[real] + 1.0, **TOL)
    assert not model.encoder.__dict__.get("_fusedenc_outputs")


def test_output_maker():
    from transformers.modeling_outputs import BaseModelOutput

    t = torch.zeros(1, 2, 3)
    assert hf_varlen._output_maker((t,)) is tuple and hf_varlen._output_maker((t, t)) is None
    assert hf_varlen._output_maker(BaseModelOutput(last_hidden_state=t)) is BaseModelOutput
    assert hf_varlen._output_maker(BaseModelOutput(last_hidden_state=t, hidden_states=(t,))) is None
    assert hf_varlen._output_maker(t) is None and hf_varlen._output_maker({"last_hidden_state": t}) is None


# ------------------------------------------------------------ benchmark ----


@pytest.mark.slow
def test_embeddings_bench_smoke(tmp_path):
    run_bench("embeddings.py", ["--device", "cpu", "--model", "tiny", "--batch-sizes", "8", "--sentences", "16",
                                "--reps", "2", "--out-dir", str(tmp_path), "--tag", "smoke"], timeout=300)  # fmt: skip
    result = json.loads((tmp_path / "embeddings_smoke.json").read_text())
    assert result["environment"]["torch"] and "transformers" in result["environment"]
    [record] = result["records"]
    assert record["lengths"]["sentences"] == 16 and 0 < record["lengths"]["padding_fraction"] < 1
    impls = {r["impl"]: r for r in record["results"]}
    assert set(impls) == {"hf-eager", "hf-sdpa", "fusedenc-padded", "fusedenc", "fusedenc-pooled"}
    for name, r in impls.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["min_cosine"] > 0.99999 and r["sentences_per_s"] > 0, name
    assert (tmp_path / "embeddings_smoke.txt").read_text().strip()


@pytest.mark.slow
def test_embeddings_bench_full_length_has_no_padding(tmp_path):
    run_bench("embeddings.py", ["--device", "cpu", "--model", "tiny", "--batch-sizes", "4", "--sentences", "8",
                                "--reps", "1", "--full-length", "12", "--impl", "hf-sdpa,fusedenc",
                                "--out-dir", str(tmp_path), "--tag", "full"], timeout=300)  # fmt: skip
    [record] = json.loads((tmp_path / "embeddings_full.json").read_text())["records"]
    h = record["lengths"]
    assert record["full_length"] == 12 and h["min"] == h["max"] == 12 and h["padding_fraction"] == 0
    for r in record["results"]:
        assert "error" not in r and r["min_cosine"] > 0.99999, r
    assert "every sequence 12 tokens (no padding)" in (tmp_path / "embeddings_full.txt").read_text()
