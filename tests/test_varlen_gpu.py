"""The padding-free path on the GPU: varlen attention backends, stacks (fp16, bf16, FP8) on
packed rows, the token-bucketed graph runner, and patch_hf on real sentences.

Rule (DESIGN.md): ``|out - ref32| <= 2 * |same - ref32| + atol`` with ``ref32`` the padded
fp32 computation and ``same`` the padded computation in the test's dtype; compared on real
tokens only.  Graph static buffers are poisoned with NaN before replays: rows outside
every sequence must never reach the real ones.
"""

from __future__ import annotations

import copy
import gzip
import pathlib

import pytest
import torch
from helpers import assert_close_rule

import fusedenc
from fusedenc import varlen
from fusedenc.attention import reference_varlen_attention, varlen_attention
from fusedenc.attention import varlen as attention_varlen

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
SENTENCES = pathlib.Path(__file__).parent / "data" / "real_sentences" / "sentences.txt.gz"
FP16_COSINE = 0.9999


def _lengths(gen, n, longest):
    lengths = torch.randint(1, longest + 1, (n,), generator=gen).tolist()
    lengths[0], lengths[-1] = longest, 1
    lengths[n // 2] = 0  # an empty sequence
    return lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("backend", ["flash_varlen", "padded"])
def test_varlen_attention_backends(backend, head_dim, dtype, gen):
    if backend == "flash_varlen" and attention_varlen.flash_unusable(dtype, head_dim, torch.device("cuda")):
        pytest.skip(attention_varlen.flash_unusable(dtype, head_dim, torch.device("cuda")))
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
    if not fusedenc.capabilities().get("fp8"):
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
    real_models = pytest.importorskip("fusedenc.real_models")
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
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=4, num_attention_heads=12,
                                     intermediate_size=3072, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(gen.seed_value)
    ref = transformers.BertModel(config).cuda().eval()
    model = fusedenc.patch_hf(copy.deepcopy(ref).half())
    same = copy.deepcopy(ref).half()
    b, s = 32, 80
    ids = torch.randint(1000, 30000, (b, s), generator=gen).cuda()
    mask = (torch.arange(s)[None] < torch.tensor(_lengths(gen, b, s)).clamp(min=1)[:, None]).long().cuda()
    with torch.inference_mode():
        want, got, base = (m(input_ids=ids, attention_mask=mask) for m in (ref, model, same))
    real = mask.bool()
    assert torch.equal(got.last_hidden_state[~real], torch.zeros_like(got.last_hidden_state[~real]))
    assert_close_rule(got.last_hidden_state[real], want.last_hidden_state[real], base.last_hidden_state[real],
                      torch.float16, f"bert-base shape seed={gen.seed_value}")  # fmt: skip
    assert_close_rule(got.pooler_output, want.pooler_output, base.pooler_output, torch.float16, "pooler")
