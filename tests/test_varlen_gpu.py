"""The padding-free path on the GPU: varlen attention backends, stacks (fp16, bf16, FP8) on
packed rows, the token-bucketed graph runner, the automatic graphs of a plain
``forward_packed`` and of a patched encoder, and patch_hf on real sentences.

Rule (DESIGN.md): ``|out - ref32| <= 2 * |same - ref32| + atol`` with ``ref32`` the padded
fp32 computation and ``same`` the padded computation in the test's dtype; compared on real
tokens only.  Graph static buffers are poisoned with NaN before replays: rows outside
every sequence must never reach the real ones.  An automatic graph whose call fills its
bucket (token count, sequence count and ``max_seqlen`` all bucket sizes) runs the eager
path's kernels on the same shapes: bit-identical; a padded bucket is held to the rule.
"""

from __future__ import annotations

import copy
import gzip
import pathlib

import pytest
import torch
from helpers import assert_close_rule

import fusedenc
from fusedenc.attention import reference_varlen_attention, varlen_attention
from fusedenc.attention import varlen as attention_varlen
from fusedenc.graphs import auto as auto_graphs
from fusedenc.graphs.feeds import PackedBucket
from fusedenc.hf import varlen as hf_varlen
from fusedenc.varlen import packing as varlen

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
SENTENCES = pathlib.Path(__file__).parent / "data" / "real_sentences" / "sentences.txt.gz"
FP16_COSINE = 0.9999


def _lengths(gen, n, longest):
    lengths = torch.randint(1, longest + 1, (n,), generator=gen).tolist()
    lengths[0], lengths[-1] = longest, 1
    lengths[n // 2] = 0  # an empty sequence
    return lengths


def _unusable(backend, dtype, head_dim, max_seqlen):
    """Why ``backend`` cannot serve these calls on this GPU (a skip reason), or None."""
    cuda = torch.device("cuda")
    if backend == "flash_varlen":
        return attention_varlen.flash_unusable(dtype, head_dim, cuda)
    if backend == "triton_short":
        return attention_varlen.triton_unusable(dtype, head_dim, cuda, max_seqlen)
    return None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("backend", ["flash_varlen", "triton_short", "padded"])
def test_varlen_attention_backends(backend, head_dim, dtype, gen):
    why = _unusable(backend, dtype, head_dim, 120)
    if why:
        pytest.skip(why)
    lengths = _lengths(gen, 37, 120)
    cu = varlen.cu_seqlens_from_lengths(lengths, "cuda")
    t, h = sum(lengths), 12
    qkv32 = torch.randn(t + 5, 3 * h * head_dim, generator=gen).cuda()
    qkv = qkv32.to(dtype)
    q, k, v = qkv.view(t + 5, 3, h, head_dim).unbind(1)  # strided views of the QKV buffer
    out = varlen_attention(q, k, v, cu, max(lengths), backend=backend)
    q32, k32, v32 = qkv32.view(t + 5, 3, h, head_dim).unbind(1)
    ref = reference_varlen_attention(q32, k32, v32, cu)
    same = reference_varlen_attention(q, k, v, cu).to(dtype)  # fp32 math on rounded inputs, rounded: dtype's error
    assert_close_rule(out[:t], ref[:t], same[:t], dtype, f"{backend} hd{head_dim} seed={gen.seed_value}")


def _compiled(kernel) -> int:
    """Kernels Triton has compiled of ``kernel`` in this process (every device)."""
    caches = getattr(kernel, "device_caches", None)
    assert caches is not None, "this Triton's JITFunction has no device_caches: update _compiled"
    return sum(len(cache[0]) for cache in caches.values())


def test_triton_kernels_compile_once_per_model_shape(gen):
    """A corpus pass meets many batch shapes (sequence count, padded length, token bucket); each
    Triton kernel compile costs a first run on a machine ~0.5 s.  The packed-embeddings kernel
    compiles once for a width and dtype across them all, the short varlen attention once per key
    block, and every call still holds the rule (rows) and the exact scatter index."""
    from fusedenc.attention import triton_short
    from fusedenc.hf import triton_embeddings

    d, vocab, positions = 200, 97, 130  # a width no other test uses: this test's compile is the first
    tables = [torch.randn(vocab, d, generator=gen), torch.randn(positions, d, generator=gen),
              torch.randn(2, d, generator=gen), 1 + 0.1 * torch.randn(d, generator=gen),
              0.1 * torch.randn(d, generator=gen)]  # word, position, token type, gamma, beta
    half, full = [t.half().cuda() for t in tables], [t.cuda() for t in tables]
    kernel = triton_embeddings._packed_embeddings_kernel
    before = _compiled(kernel)
    for n, s, slack in [(1, 8, 0), (2, 13, 3), (5, 16, 0), (16, 40, 16), (17, 127, 5), (33, 64, 0), (100, 9, 7),
                        (513, 24, 1), (1000, 31, 0)]:  # fmt: skip
        lengths = torch.randint(1, s + 1, (n,), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
        ids = torch.randint(0, vocab, (n, s), generator=gen).cuda()
        tokens = int(lengths.sum()) + slack
        got, target = triton_embeddings.packed_embeddings(ids, None, cu, tokens, *half, 1e-12)
        want, want_target = triton_embeddings.reference_packed_embeddings(ids, None, cu, tokens, *full, 1e-12)
        same, _ = triton_embeddings.reference_packed_embeddings(ids, None, cu, tokens, *half, 1e-12)
        assert torch.equal(target, want_target), (n, s, slack)
        assert_close_rule(got, want, same.half(), torch.float16, f"embeddings n={n} S={s} seed={gen.seed_value}")
    assert _compiled(kernel) - before == 1, f"{_compiled(kernel) - before} compiles of the embeddings kernel for one width"

    attention = triton_short._short_varlen_kernel
    before = _compiled(attention)
    blocks = set()
    for n, longest in [(1, 7), (3, 16), (40, 9), (7, 31), (33, 20), (200, 60), (17, 33), (90, 128), (5, 100)]:
        lengths = torch.randint(1, longest + 1, (n,), generator=gen).tolist()
        lengths[0] = longest
        cu = varlen.cu_seqlens_from_lengths(lengths, "cuda")
        qkv = torch.randn(sum(lengths), 3, 12, 32, generator=gen).half().cuda()
        q, k, v = qkv.unbind(1)
        out = triton_short.short_varlen_attention(q, k, v, cu, longest, 32**-0.5)
        ref = reference_varlen_attention(q.float(), k.float(), v.float(), cu)
        assert_close_rule(out, ref, reference_varlen_attention(q, k, v, cu).half(), torch.float16,
                          f"attention n={n} longest={longest} seed={gen.seed_value}")  # fmt: skip
        blocks.add(triton_short.key_block(longest))
    compiles = _compiled(attention) - before
    assert compiles <= len(blocks), f"{compiles} compiles of the varlen attention for {len(blocks)} key blocks"


def _stack(dtype, norm_first=False, layers=3):
    torch.manual_seed(0)
    stack = fusedenc.EncoderStack.build(layers, 768, 12, 3072, activation="gelu", norm_first=norm_first,
                                        layer_norm_eps=1e-12, dtype=torch.float32, device="cuda")  # fmt: skip
    with torch.no_grad():
        for p in stack.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return stack, copy.deepcopy(stack).to(dtype)


def _batch(gen, b, s, d, dtype):
    lengths = _lengths(gen, b, s)
    pad = torch.arange(s)[None] >= torch.tensor(lengths)[:, None]
    x32 = torch.randn(b, s, d, generator=gen).cuda()
    return x32, x32.to(dtype), pad.cuda()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_first", [False, True])
def test_stack_unpadded_rule(dtype, norm_first, gen):
    ref_stack, stack = _stack(dtype, norm_first)
    x32, x, pad = _batch(gen, 48, 96, 768, dtype)
    real = ~pad
    ref = ref_stack(x32, key_padding_mask=pad)
    same = stack(x, key_padding_mask=pad)  # fusedenc's padded path in dtype
    got = stack.forward_unpadded(x, pad)
    assert torch.equal(got[pad], torch.zeros_like(got[pad]))
    assert_close_rule(got[real], ref[real], same[real], dtype, f"{dtype} norm_first={norm_first} seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_runner_token_buckets(dtype, gen):
    ref_stack, stack = _stack(dtype)
    runner = stack.varlen_graph_runner((256, 1024, 4096), max_sequences=64, max_seqlen=128)
    for b in (64, 40, 7, 64):  # new buckets, fewer sequences than the capacity, a bucket reused
        x32, x, pad = _batch(gen, b, 128, 768, dtype)
        p = varlen.packing_from_mask(pad)
        rows = varlen.pack(x, p)
        for g in runner._graphs.values():  # poison every static buffer: slack rows must not matter
            g.inputs[0].fill_(float("nan"))  # the static rows (inputs: rows, cu_seqlens)
            g.out.fill_(float("nan"))
        got = runner(rows, p.cu_seqlens.cpu()).clone()
        eager = stack.forward_packed(rows, p)
        ref = varlen.pack(ref_stack(x32, key_padding_mask=pad), p)
        same = varlen.pack(stack(x, key_padding_mask=pad), p)
        assert torch.isfinite(got).all(), f"b={b}: NaN reached real rows"
        assert_close_rule(got, ref, same, dtype, f"graph b={b} seed={gen.seed_value}")
        assert_close_rule(eager, ref, same, dtype, f"eager b={b} seed={gen.seed_value}")
    assert len(runner._graphs) >= 2
    with pytest.raises(ValueError, match="max_seqlen"):
        runner(torch.zeros(200, 768, dtype=dtype, device="cuda"), [0, 200])


def test_fp8_stack_packed(gen):
    if not fusedenc.capabilities()["fp8"]["runs_here"]:
        pytest.skip("no FP8 on this GPU")
    ref_stack, stack = _stack(torch.float16)
    x32, x, pad = _batch(gen, 64, 96, 768, torch.float16)
    stack.quantize("fp8", fast_accum=True, calibration=x[:16])
    real = ~pad
    ref = ref_stack(x32, key_padding_mask=pad)[real].float()
    padded = stack(x, key_padding_mask=pad)[real].float()
    packed = stack.forward_unpadded(x, pad)[real].float()
    # Same FP8 math on the same rows, but the GEMMs pick other algorithms at another M: a
    # last-bit difference before a quantization moves an e4m3 code (~6%), so packed and padded
    # differ at FP8's own noise level (3.6% measured on an H100).  The rule is against fp32:
    # packed no worse than the padded FP8 path, within a quarter.
    err_padded = (padded - ref).norm() / ref.norm()
    err_packed = (packed - ref).norm() / ref.norm()
    assert torch.isfinite(packed).all()
    assert err_packed <= 1.25 * err_padded + 1e-3, f"FP8 packed {err_packed:.3e} vs padded {err_padded:.3e} against fp32"


# ------------------------------------------------------------ automatic graphs ----


@pytest.fixture
def graphs_on():
    was = auto_graphs.set_enabled(True)
    yield
    auto_graphs.clear()
    auto_graphs.set_enabled(was)


def _poison(*modules):
    """NaN in every static row buffer and output, nonsense offsets: a replay must rewrite
    every offset it reads, and slack rows must never reach the real ones."""
    with torch.inference_mode():  # a graph captured under inference mode has an inference-tensor output
        for module in modules:
            for entry in module.auto_graphs.entries():
                if not isinstance(entry.bucket, PackedBucket):
                    continue  # a padded call's graph
                rows, cu = entry.inputs
                rows.fill_(float("nan"))
                cu.fill_(1 << 30)
                entry.out.fill_(float("nan"))


def _packed(gen, lengths, dtype, d=768):
    """(x32, packed rows in dtype, padding mask, packing) of right-padded sequences."""
    s = max(lengths)
    pad = (torch.arange(s)[None] >= torch.tensor(lengths)[:, None]).cuda()
    x32 = torch.randn(len(lengths), s, d, generator=gen).cuda()
    p = varlen.packing_from_mask(pad)
    return x32, varlen.pack(x32.to(dtype), p), pad, p


#: 8 sequences, 448 tokens, the longest 64: exactly the packed bucket (448, 8, 64).
EXACT = [64, 64, 64, 64, 64, 64, 40, 24]


def _counts(module):
    return module.auto_graphs.stats()["counts"]


@pytest.mark.parametrize("backend", ["flash_varlen", "triton_short", "padded"])
def test_plain_forward_packed_replays_graphs_equal_to_eager(backend, gen, graphs_on, monkeypatch):
    dtype = torch.float16
    why = _unusable(backend, dtype, 64, max(EXACT))
    if why:
        pytest.skip(why)
    monkeypatch.setenv(attention_varlen.BACKEND_ENV, backend)
    ref_stack, stack = _stack(dtype)
    block = stack.blocks[0]
    for call in range(4):  # eager, capture + replay, replay, replay: fresh rows and sequence order each time
        lengths = [EXACT[i] for i in torch.randperm(len(EXACT), generator=gen).tolist()]
        x32, rows, pad, p = _packed(gen, lengths, dtype)
        _poison(stack, block)
        with torch.inference_mode():
            got = stack.forward_packed(rows, p if call % 2 else p.cu_seqlens)  # a Packing or offsets: one key
            got_block = block.forward_packed(rows, p)
            with auto_graphs.disabled():
                eager, eager_block = stack.forward_packed(rows, p), block.forward_packed(rows, p)
        assert torch.equal(got, eager), f"call {call}: differs from eager ({backend})"
        assert torch.equal(got_block, eager_block), f"call {call}: block differs from eager ({backend})"
        ref = varlen.pack(ref_stack(x32, key_padding_mask=pad), p)
        with auto_graphs.disabled():  # the stack's counts are its packed calls'
            same = varlen.pack(stack(x32.to(dtype), key_padding_mask=pad), p)
        assert_close_rule(got, ref, same, dtype, f"call {call} {backend} seed={gen.seed_value}")
    for module in (stack, block):
        c = _counts(module)
        assert c["captures"] == 1 and c["replays"] == 3, c
    assert stack.auto_graphs.stats()["buckets"] == [(448, 8, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_packed_graphs_of_padded_buckets_hold_the_rule(dtype, gen, graphs_on):
    """Fewer tokens, sequences and a shorter longest sequence than the bucket's: slack rows,
    empty trailing sequences, a larger attention bound."""
    ref_stack, stack = _stack(dtype)
    pad = None
    for call in range(3):
        x32, x, new_pad = _batch(gen, 37, 90, 768, dtype)  # one sequence empty
        pad = new_pad if pad is None else pad  # one mask (one bucket), fresh rows
        p = varlen.packing_from_mask(pad)
        rows = varlen.pack(x, p)
        _poison(stack)
        with torch.inference_mode():
            got = stack.forward_packed(rows, p)
            with auto_graphs.disabled():
                eager = stack.forward_packed(rows, p)
        ref = varlen.pack(ref_stack(x32, key_padding_mask=pad), p)
        with auto_graphs.disabled():
            same = varlen.pack(stack(x, key_padding_mask=pad), p)
        assert torch.isfinite(got).all(), f"call {call}: NaN from the poisoned statics reached real rows"
        assert_close_rule(got, ref, same, dtype, f"graph call {call} seed={gen.seed_value}")
        assert_close_rule(eager, ref, same, dtype, f"eager call {call} seed={gen.seed_value}")
    c = _counts(stack)
    assert c["captures"] == 1 and c["replays"] == 2, c
    [bucket] = stack.auto_graphs.stats()["buckets"]
    assert bucket.tokens >= p.total and bucket.sequences == 48 and bucket.max_seqlen == 128, bucket


def test_forward_packed_graphs_follow_weights_and_keep_memory_bounded(gen, graphs_on):
    dtype = torch.float16
    _, stack = _stack(dtype, layers=2)
    _, other = _stack(dtype, layers=2)
    with torch.no_grad():
        for q in other.parameters():
            q.mul_(0.9)
    _, rows, _, p = _packed(gen, EXACT, dtype)
    with torch.inference_mode():
        stack.forward_packed(rows, p)
        stack.forward_packed(rows, p)  # captured
        stack.load_state_dict(other.state_dict())  # in place: same addresses, new versions
        got = stack.forward_packed(rows, p)
        with auto_graphs.disabled():
            want = other.forward_packed(rows, p)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _counts(stack)["weights changed"] == 1

    stack.auto_graphs.max_graphs = 3
    lengths = ([20] * 3, [50] * 6, [64] * 12, [100] * 15, [128] * 24, [200] * 30)  # six buckets, three slots
    batches = [_packed(gen, n, dtype)[1:] for n in lengths]  # (rows, mask, packing)
    with torch.inference_mode(), auto_graphs.disabled():
        wants = [stack.forward_packed(r, q) for r, _, q in batches]
    reserved = []
    with torch.inference_mode():
        for _ in range(6):
            for (r, _, q), w in zip(batches, wants):
                for _ in range(3):
                    torch.testing.assert_close(stack.forward_packed(r, q), w, rtol=1e-2, atol=1e-2)
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    assert stack.auto_graphs.stats()["graphs"] <= 3 and _counts(stack)["evictions"] > 0
    # After the first rounds the shared pool has its working size; later rounds must not grow it
    # beyond one more working set (a key that comes back from its back-off is captured beside
    # the graphs still held: measured 468 -> 550 -> 468 MiB on an H100) and must come back down.
    assert max(reserved[2:]) <= reserved[1] + (128 << 20), [r >> 20 for r in reserved]
    assert reserved[-1] <= max(reserved[:-1]), [r >> 20 for r in reserved]
    mem = auto_graphs.memory()[str(torch.device("cuda", torch.cuda.current_device()))]
    assert mem["graphs"] <= 3 and mem["static_bytes"] > 0


def _bert_base_shape(gen, seq, model_type="bert"):
    """A 4-layer bert-base-shaped BertModel (or ``model_type``'s model: RoBERTa's positions
    follow its ids) as the fp32 reference on the GPU, its patched and its unpatched fp16
    copies, and 32 sequences of ``seq`` token ids with random right padding."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, vocab_size=30522, hidden_size=768, num_hidden_layers=4,
                                               num_attention_heads=12, intermediate_size=3072,
                                               attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(gen.seed_value)
    ref = transformers.AutoModel.from_config(config).cuda().eval()
    model = fusedenc.patch_hf(copy.deepcopy(ref).half())
    same = copy.deepcopy(ref).half()
    b = 32
    ids = torch.randint(1000, 30000, (b, seq), generator=gen).cuda()
    mask = (torch.arange(seq)[None] < torch.tensor(_lengths(gen, b, seq)).clamp(min=1)[:, None]).long().cuda()
    return ref, model, same, ids, mask


def test_patched_bert_replays_one_graph_per_forward(gen, graphs_on):
    """A plain padded call of a patched BERT: its embeddings and the encoder's blocks as one
    stack in one graph (``hf_embedded``), one replay per forward, matching the
    layer-by-layer path and the fp32 model."""
    ref, model, same, ids, mask = _bert_base_shape(gen, seq=48)
    real = mask.bool()
    with torch.inference_mode():
        want, base = (m(input_ids=ids, attention_mask=mask) for m in (ref, same))
        outs = [model(input_ids=ids, attention_mask=mask) for _ in range(3)]
        blocks = [dict(_counts(layer.block)) for layer in model.encoder.layer]
        hook = model.encoder.layer[0].register_forward_pre_hook(lambda m, a: None)  # the layers one by one
        per_layer = model(input_ids=ids, attention_mask=mask)
        hook.remove()
    stack = hf_varlen.stack_of(model.encoder)
    c = auto_graphs.cache_of(model).stats()["counts"]
    assert c["captures"] == 1 and c["replays"] == 2 and c["eager: first calls"] == 1, c
    assert _counts(stack) == {}, "the stack runs inside the model's graph, not through its own"
    assert blocks == [{}] * len(blocks), "the blocks' own graphs are not used by the one-stack path"
    assert all(x is layer.block for x, layer in zip(stack.blocks, model.encoder.layer))
    assert torch.equal(outs[1].last_hidden_state, outs[2].last_hidden_state), "two replays of one graph"
    for i, got in enumerate([*outs, per_layer]):
        last = got.last_hidden_state
        assert torch.equal(last[~real], torch.zeros_like(last[~real]))
        assert_close_rule(last[real], want.last_hidden_state[real], base.last_hidden_state[real], torch.float16,
                          f"forward {i} seed={gen.seed_value}")  # fmt: skip
        assert_close_rule(got.pooler_output, want.pooler_output, base.pooler_output, torch.float16, f"pooler {i}")
        torch.testing.assert_close(last[real], per_layer.last_hidden_state[real], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_patched_bert_embeddings_in_the_graph_follow_each_batch(model_type, gen, graphs_on, monkeypatch):
    """The short path's graph with the embeddings in torch ops (BERT's switched to them,
    RoBERTa's always) on batches of other token counts, sequence counts and token types in
    one bucket, and on batches without padding (an all-ones mask, no mask), with poisoned
    statics (slack rows hold ids of no batch, the offsets nonsense, the output NaN): each
    replay is its own batch's forward."""
    from fusedenc.hf import embedded as hf_embedded

    monkeypatch.setenv(hf_embedded.FUSED_EMBEDDINGS_ENV, "0")
    _check_embedded_graph_batches(model_type, gen)


def _check_embedded_graph_batches(model_type, gen):
    ref, model, same, ids, mask = _bert_base_shape(gen, 40, model_type)
    if model_type == "roberta":  # real tokens with the pad id: positions that do not advance (HF's rule)
        ids[0, 5] = ids[3, 1] = ref.config.pad_token_id
    cache = auto_graphs.cache_of(model)
    types = torch.randint(0, 2, ids.shape, generator=gen).cuda()
    batches = [(ids, mask, None), (ids, mask, types)]
    for _ in range(4):  # fewer tokens and sequences, same buckets (their keys: with and without token types)
        keep = torch.randperm(ids.shape[0], generator=gen)[: ids.shape[0] - 5].cuda()
        shorter = mask[keep].clone()
        shorter[:, 30:] = 0
        batches.append((ids[keep], shorter, types[keep] if len(batches) % 2 else None))
    # Batches without padding: every row in order, with an all-ones mask or none at all.
    batches += [(ids, torch.ones_like(mask), types), (ids[:20], None, None)]
    with torch.inference_mode():
        for i, (b_ids, b_mask, b_types) in enumerate(batches):
            kw = dict(input_ids=b_ids, attention_mask=b_mask, token_type_ids=b_types)
            model(**kw)  # the first call at a key runs eagerly; the second captures and replays
            for entry in cache.entries():  # with padding: (ids, token types or None, offsets); without: (ids, types)
                entry.inputs[0].fill_(29999)  # ids of no batch here
                if entry.inputs[1] is not None:
                    entry.inputs[1].fill_(1)  # a valid token type (there are two)
                if len(entry.inputs) > 2:
                    entry.inputs[2].fill_(1 << 30)
                for out in entry.out.values():  # {"hidden", "pooled"}: HF's pooler runs in the graph
                    out.fill_(float("nan"))
            replays = cache.counts["replays"]
            got, want, base = model(**kw), ref(**kw), same(**kw)
            assert cache.counts["replays"] == replays + 1, (i, dict(cache.counts))
            real = b_mask.bool() if b_mask is not None else torch.ones_like(b_ids, dtype=torch.bool)
            last = got.last_hidden_state
            assert last.shape == (*b_ids.shape, ref.config.hidden_size)
            assert torch.isfinite(last).all() and torch.equal(last[~real], torch.zeros_like(last[~real]))
            assert_close_rule(last[real], want.last_hidden_state[real], base.last_hidden_state[real], torch.float16,
                              f"{model_type} batch {i} seed={gen.seed_value}")  # fmt: skip
            assert_close_rule(got.pooler_output, want.pooler_output, base.pooler_output, torch.float16, f"pooler {i}")
    assert cache.stats()["graphs"] >= 2, cache.stats()


def test_patched_bert_embeddings_in_one_kernel_follow_each_batch(gen, graphs_on, monkeypatch):
    """The same batches with the packed embeddings in one Triton kernel (the default;
    ``FUSEDENC_FUSED_EMBEDDINGS=0`` turns it off): each replay its own batch's forward, by the
    same rule, and the kernel is what ran."""
    from fusedenc.hf import embedded as hf_embedded
    from fusedenc.hf import triton_embeddings

    calls = []
    kernel = triton_embeddings.packed_embeddings

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_embeddings, "packed_embeddings", counted)
    monkeypatch.delenv(hf_embedded.FUSED_EMBEDDINGS_ENV, raising=False)  # the default
    _check_embedded_graph_batches("bert", gen)
    assert calls, "the kernel never ran"


@pytest.mark.parametrize("inputs_on", ["device", "host"])
@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_sentence_embeddings_pool_in_the_graph(model_type, inputs_on, gen, graphs_on):
    """``fusedenc.sentence_embeddings`` on a patched model: one replay a call (after the first
    call at a key), the graph's static output ``[B', D]`` poisoned between calls, batches of
    other sizes in one bucket and one without padding; each call's float32 embeddings held
    to the fp32 model's mean pooling by the project's rule, cosine >= 0.9999 every sentence.
    ``host``: the tokenizer's tensors on the CPU (``HostIdsFeed``'s graphs), the pinned
    staging buffer poisoned (0xFF bytes: ids of -1) between calls: only real positions are
    read, and the result is on the GPU."""
    from fusedenc.graphs import feeds as graph_feeds

    ref, model, same, ids, mask = _bert_base_shape(gen, 40, model_type)
    cache = auto_graphs.cache_of(model)
    types = torch.randint(0, 2, ids.shape, generator=gen).cuda() if model_type == "bert" else None
    batches = [(ids, mask, types)]
    for _ in range(3):
        keep = torch.randperm(ids.shape[0], generator=gen)[: ids.shape[0] - 6].cuda()
        shorter = mask[keep].clone()
        shorter[:, 28:] = 0
        batches.append((ids[keep], shorter, None if types is None else types[keep]))
    batches.append((ids, torch.ones_like(mask), types))

    def pooled(m, b_ids, b_mask, b_types):
        hidden = m(input_ids=b_ids, attention_mask=b_mask, token_type_ids=b_types).last_hidden_state
        keep = b_mask.unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden.float() * keep).sum(1) / keep.sum(1), dim=1)

    def given(t):
        return None if t is None else (t.cpu() if inputs_on == "host" else t)

    with torch.inference_mode():
        for i, (b_ids, b_mask, b_types) in enumerate(batches):
            fusedenc.sentence_embeddings(model, given(b_ids), given(b_mask), given(b_types))  # first call at a key: eager
            for entry in cache.entries():
                if isinstance(entry.out, torch.Tensor):
                    entry.out.fill_(float("nan"))
            torch.cuda.synchronize()
            for stage in graph_feeds._staging.values():
                stage.host.fill_(255)
            replays = cache.counts["replays"]
            got = fusedenc.sentence_embeddings(model, given(b_ids), given(b_mask), given(b_types))
            assert cache.counts["replays"] == replays + 1, (i, dict(cache.counts))
            assert got.is_cuda
            if i < len(batches) - 1:  # padded batches: the host feed's graphs for host tensors
                assert any("host ids" in str(k) for k in cache._graphs) == (inputs_on == "host")
            want, base = pooled(ref, b_ids, b_mask, b_types), pooled(same, b_ids, b_mask, b_types)
            assert got.shape == want.shape and got.dtype == torch.float32
            assert_close_rule(got, want, base, torch.float16, f"{model_type} batch {i} seed={gen.seed_value}")
            cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=1)
            assert cos.min() >= FP16_COSINE, (i, float(cos.min()))


# ------------------------------------------------------------ real sentences ----


def _sentences(n):
    with gzip.open(SENTENCES, "rt", encoding="utf-8") as fh:
        return fh.read().splitlines()[:n]


def _embed(model, tok, sentences, batch):
    out = []
    for i in range(0, len(sentences), batch):
        enc = tok(sentences[i:i + batch], padding=True, truncation=True, max_length=256, return_tensors="pt").to("cuda")
        with torch.inference_mode():
            h = model(**enc).last_hidden_state.float()
        keep = enc["attention_mask"][..., None].float()
        out.append(((h * keep).sum(1) / keep.sum(1)).cpu())
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_minilm_padding_free_real_sentences(dtype):
    real_models = pytest.importorskip("fusedenc.hf.real_models")
    try:
        ref, tok = real_models.load_minilm("cuda", torch.float32)
    except real_models.RealModelMissing as e:
        pytest.skip(str(e))
    sentences = _sentences(2000)
    want = _embed(ref, tok, sentences, 128)
    same = _embed(copy.deepcopy(ref).to(dtype), tok, sentences, 128)
    packed_model = fusedenc.patch_hf(copy.deepcopy(ref).to(dtype))
    padded_model = fusedenc.patch_hf(copy.deepcopy(ref).to(dtype), padding_free=False)
    got = _embed(packed_model, tok, sentences, 128)
    padded = _embed(padded_model, tok, sentences, 128)
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=1)
    cos_same = torch.nn.functional.cosine_similarity(same.double(), want.double(), dim=1)
    cos_padded = torch.nn.functional.cosine_similarity(padded.double(), want.double(), dim=1)
    if dtype == torch.float16:
        assert cos.min() >= FP16_COSINE, f"fp16 padding-free: min cosine {cos.min():.6f}"
    assert (1 - cos).max() <= 2 * (1 - cos_same).max() + 1e-6, (
        f"{dtype}: cosine error {(1 - cos).max():.2e} vs unpatched {(1 - cos_same).max():.2e}")
    assert (1 - cos).max() <= 2 * (1 - cos_padded).max() + 1e-6


def test_bert_base_shape_hf_packed_vs_padded(gen):
    ref, model, same, ids, mask = _bert_base_shape(gen, seq=80)
    with torch.inference_mode():
        want, got, base = (m(input_ids=ids, attention_mask=mask) for m in (ref, model, same))
    real = mask.bool()
    assert torch.equal(got.last_hidden_state[~real], torch.zeros_like(got.last_hidden_state[~real]))
    assert_close_rule(got.last_hidden_state[real], want.last_hidden_state[real], base.last_hidden_state[real],
                      torch.float16, f"bert-base shape seed={gen.seed_value}")  # fmt: skip
    assert_close_rule(got.pooler_output, want.pooler_output, base.pooler_output, torch.float16, "pooler")
