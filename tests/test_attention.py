"""fusedenc.attention on CPU (sdpa_math is the only CPU backend): math, layout, validation,
tables, forcing, explain(), torch.compile and the tune command's no-GPU exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import assert_close_rule, attention_formula, randn, ref_dtype

import fusedenc
import fusedenc.attention as A
from fusedenc.attention import AttentionTableWarning, attention, explain
from fusedenc.common import table_files
from fusedenc.common.device import device_metadata

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


pytestmark = pytest.mark.usefixtures("no_attention_tables")


def packed_qkv(b, s, h, d, dtype, gen, scale=1.0):
    """q, k, v as fused_qkv returns them: [B, S, H, Dh] views of one packed [B, S, 3*H*Dh] buffer."""
    qkv = randn((b, s, 3 * h * d), dtype, gen=gen, scale=scale)
    return fusedenc.ops.gemm.split_qkv(qkv, h)


def padding_mask(b, s, gen, fully_masked=(1,)):
    """Random trailing padding per sequence (each keeps >= 1 key), plus sequences that are all padding."""
    lengths = torch.randint(1, s + 1, (b,), generator=gen)
    mask = torch.arange(s)[None, :] >= lengths[:, None]
    for i in fully_masked:
        if i < b:
            mask[i] = True
    return mask


def check(out, q, k, v, bias, mask, scale, dtype, what):
    ref = attention_formula(q, k, v, bias, mask, dtype=ref_dtype(dtype), scale=scale)
    same = attention_formula(q, k, v, bias, mask, dtype=dtype, scale=scale)
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}"
    assert out.dtype == dtype and out.is_contiguous(), f"{what}: dtype {out.dtype}, contiguous {out.is_contiguous()}"
    assert_close_rule(out, ref, same, dtype, what)


# ------------------------------------------------------------ math ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias_kind", ["none", "per_batch", "broadcast", "float32"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
def test_matches_formula(dtype, bias_kind, with_mask, gen):
    b, s, h, d = 3, 10, 2, 16
    q, k, v = packed_qkv(b, s, h, d, dtype, gen)
    bias = None
    if bias_kind == "per_batch":
        bias = randn((b, h, s, s), dtype, gen=gen)
    elif bias_kind == "broadcast":
        bias = randn((1, h, s, s), dtype, gen=gen)
    elif bias_kind == "float32":
        bias = randn((b, h, s, s), torch.float32, gen=gen)
    mask = padding_mask(b, s, gen) if with_mask else None
    out = attention(q, k, v, bias, mask)
    check(out, q, k, v, bias, mask, None, dtype, f"{dtype} bias={bias_kind} mask={with_mask} seed={gen.seed_value}")


def test_scale_argument(gen):
    q, k, v = packed_qkv(2, 7, 3, 8, torch.float32, gen)
    out = attention(q, k, v, scale=0.3)
    check(out, q, k, v, None, None, 0.3, torch.float32, f"scale=0.3 seed={gen.seed_value}")


def test_separate_contiguous_inputs(gen):
    """q, k, v need not come from one buffer: any [B, S, H, Dh] with unit last stride."""
    q, k, v = (randn((2, 6, 2, 8), torch.float32, gen=gen) for _ in range(3))
    check(attention(q, k, v), q, k, v, None, None, None, torch.float32, f"separate seed={gen.seed_value}")


def test_strided_mask_and_bias(gen):
    """A mask and a bias that are views with odd strides are read correctly (copied where needed)."""
    b, s, h, d = 2, 6, 2, 8
    q, k, v = packed_qkv(b, s, h, d, torch.float32, gen)
    mask = padding_mask(b, s, gen, fully_masked=()).t().contiguous().t()  # [B, S] view of an [S, B] buffer
    bias = randn((b, h, s, s), torch.float32, gen=gen).transpose(-1, -2)  # stride(-1) != 1
    for bb in (None, bias):
        check(attention(q, k, v, bb, mask), q, k, v, bb, mask, None, torch.float32, f"strided seed={gen.seed_value}")


def test_fully_masked_sequence_gives_zeros(gen):
    """A sequence whose keys are all padding: its rows are exactly 0 (nn.TransformerEncoderLayer's SDPA path)."""
    b, s, h, d = 3, 9, 2, 8
    q, k, v = packed_qkv(b, s, h, d, torch.float32, gen)
    mask = padding_mask(b, s, gen, fully_masked=(0, 2))
    bias = randn((1, h, s, s), torch.float32, gen=gen)
    for bb in (None, bias):
        out = attention(q, k, v, bb, mask).view(b, s, h * d)
        assert torch.equal(out[0], torch.zeros_like(out[0])), f"seed={gen.seed_value}"
        assert torch.equal(out[2], torch.zeros_like(out[2])), f"seed={gen.seed_value}"
        assert not torch.isnan(out).any() and out[1].abs().max() > 0, f"seed={gen.seed_value}"


def test_matches_multihead_attention(gen):
    """The key_padding_mask convention and the all-padding rows match nn.MultiheadAttention's SDPA path."""
    b, s, h, d = 3, 8, 2, 8
    e = h * d
    mha = torch.nn.MultiheadAttention(e, h, bias=False, batch_first=True, dropout=0.0)
    with torch.no_grad():
        mha.in_proj_weight.copy_(randn((3 * e, e), torch.float32, gen=gen, scale=e**-0.5))
        mha.out_proj.weight.copy_(torch.eye(e))
    mha.train()  # the slow path: in-projection, masks merged, F.scaled_dot_product_attention
    x = randn((b, s, e), torch.float32, gen=gen)
    mask = padding_mask(b, s, gen, fully_masked=(1,))
    with torch.no_grad():
        expected, _ = mha(x, x, x, key_padding_mask=mask, need_weights=False)
        q, k, v = fusedenc.ops.gemm.split_qkv(x @ mha.in_proj_weight.t(), h)
        out = attention(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out.view(b, s, e), expected, msg=lambda m: f"{m} seed={gen.seed_value}")


def test_output_layout_rows_are_b_s_and_columns_h_d(gen):
    """Row b*S+s, columns h*Dh:(h+1)*Dh hold head h of token s of sequence b."""
    b, s, h, d = 2, 5, 3, 8
    q, k, v = packed_qkv(b, s, h, d, torch.float32, gen)
    out = attention(q, k, v)
    assert out.shape == (b * s, h * d) and out.stride() == (h * d, 1)
    one = attention(q[1:2, :, 2:3], k[1:2, :, 2:3], v[1:2, :, 2:3])  # sequence 1, head 2 alone
    torch.testing.assert_close(out[s : 2 * s, 2 * d : 3 * d], one)


def test_empty_batch(gen):
    q, k, v = packed_qkv(0, 4, 2, 8, torch.float32, gen)
    out = attention(q, k, v)
    assert out.shape == (0, 16)


# ------------------------------------------------------------ validation ----


def _base(gen, dtype=torch.float32):
    q, k, v = packed_qkv(2, 4, 2, 8, dtype, gen)
    return {"q": q, "k": k, "v": v, "attn_bias": None, "key_padding_mask": None}


_BAD_CASES = {
    "q not a tensor": (lambda a: {**a, "q": a["q"].numpy()}, TypeError, "q must be a torch.Tensor"),
    "v not a tensor": (lambda a: {**a, "v": [1.0]}, TypeError, "v must be a torch.Tensor"),
    "q int dtype": (lambda a: {**a, "q": a["q"].to(torch.int32), "k": a["k"].to(torch.int32), "v": a["v"].to(torch.int32)}, TypeError, "q.dtype"),
    "q float64": (lambda a: {**a, "q": a["q"].double(), "k": a["k"].double(), "v": a["v"].double()}, TypeError, "q.dtype"),
    "k dtype differs": (lambda a: {**a, "k": a["k"].half()}, TypeError, "k.dtype"),
    "q rank 3": (lambda a: {**a, "q": a["q"].reshape(2, 4, 16)}, ValueError, "q must be 4-D"),
    "k shape differs": (lambda a: {**a, "k": a["k"][:, :3]}, ValueError, "k has shape"),
    "v shape differs": (lambda a: {**a, "v": a["v"][:1]}, ValueError, "v has shape"),
    "v device differs": (lambda a: {**a, "v": a["v"].to("meta")}, ValueError, "v is on meta"),
    "q last stride": (lambda a: {**a, "q": a["q"].transpose(2, 3).contiguous().transpose(2, 3)}, ValueError, "q must have unit stride"),
    "bias not a tensor": (lambda a: {**a, "attn_bias": 1.0}, TypeError, "attn_bias must be a torch.Tensor"),
    "bias dtype": (lambda a: {**a, "attn_bias": torch.zeros(2, 2, 4, 4, dtype=torch.float64)}, TypeError, "attn_bias.dtype"),
    "bias rank": (lambda a: {**a, "attn_bias": torch.zeros(2, 4, 4)}, ValueError, "attn_bias must have shape"),
    "bias heads": (lambda a: {**a, "attn_bias": torch.zeros(2, 3, 4, 4)}, ValueError, "attn_bias must have shape"),
    "bias batch": (lambda a: {**a, "attn_bias": torch.zeros(3, 2, 4, 4)}, ValueError, "attn_bias must have shape"),
    "bias seq": (lambda a: {**a, "attn_bias": torch.zeros(2, 2, 4, 5)}, ValueError, "attn_bias must have shape"),
    "bias device": (lambda a: {**a, "attn_bias": torch.zeros(2, 2, 4, 4, device="meta")}, ValueError, "attn_bias is on meta"),
    "mask not a tensor": (lambda a: {**a, "key_padding_mask": [[True]]}, TypeError, "key_padding_mask must be a torch.Tensor"),
    "mask dtype": (lambda a: {**a, "key_padding_mask": torch.zeros(2, 4)}, TypeError, "key_padding_mask must be a bool"),
    "mask shape": (lambda a: {**a, "key_padding_mask": torch.zeros(2, 1, 4, dtype=torch.bool)}, ValueError, "key_padding_mask must have shape"),
    "mask batch": (lambda a: {**a, "key_padding_mask": torch.zeros(1, 4, dtype=torch.bool)}, ValueError, "key_padding_mask must have shape"),
    "mask device": (lambda a: {**a, "key_padding_mask": torch.zeros(2, 4, dtype=torch.bool, device="meta")}, ValueError, "key_padding_mask is on meta"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_BAD_CASES))
def test_validation(case, gen):
    mutate, exc, text = _BAD_CASES[case]
    args = mutate(_base(gen))
    with pytest.raises(exc, match=text.replace("(", r"\(").replace(".", r"\.")):
        attention(args["q"], args["k"], args["v"], args["attn_bias"], args["key_padding_mask"])
    with pytest.raises(exc, match=text.replace("(", r"\(").replace(".", r"\.")):
        explain(args["q"], args["k"], args["v"], args["attn_bias"], args["key_padding_mask"])


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        ({"scale": "0.5"}, TypeError, "scale must be a real number"),
        ({"scale": True}, TypeError, "scale must be a real number"),
        ({"scale": float("nan")}, ValueError, "scale=nan is not finite"),
        ({"backend": "nope"}, ValueError, "backend='nope' is not one of"),
        ({"backend": 3}, TypeError, "backend must be a str"),
    ],
)
def test_validation_keywords(kwargs, exc, text, gen):
    a = _base(gen)
    with pytest.raises(exc, match=text):
        attention(a["q"], a["k"], a["v"], **kwargs)


def test_validation_after_a_cached_call(gen):
    """The plan cache never lets a bad call through: a valid call first, then bad ones of other signatures."""
    a = _base(gen)
    attention(a["q"], a["k"], a["v"])
    with pytest.raises(ValueError, match="attn_bias must have shape"):
        attention(a["q"], a["k"], a["v"], torch.zeros(2, 2, 4, 3))
    with pytest.raises(TypeError, match="k.dtype"):
        attention(a["q"], a["k"].half(), a["v"])


# ------------------------------------------------------------ tables ----


def test_buckets():
    assert [A.seq_bucket(s) for s in (1, 64, 65, 128, 2048, 2049)] == ["<=64", "<=64", "<=128", "<=128", "<=2048", ">2048"]
    assert [A.batch_heads_bucket(x) for x in (1, 16, 17, 4096, 16385)] == ["<=16", "<=16", "<=64", "<=4096", ">16384"]


@pytest.mark.parametrize("name, arch", [("attention_sm90.json", "sm90"), ("attention_default.json", "*")])
def test_shipped_tables_parse(name, arch):
    res = __import__("importlib.resources").resources.files("fusedenc.configs") / name
    assert res.is_file(), f"{name} is not package data of fusedenc.configs"
    text = res.read_text(encoding="utf-8")
    table, measured = A.parse_table(text, str(res), "shipped", arch)
    # shipped tables say where their rules come from, and are never matched against device metadata
    assert json.loads(text)["source"].strip() and measured is None
    # every table key finds a rule, and every rule lists math or a backend math can back up
    for extras in A.EXTRAS:
        for dtype in ("float16", "bfloat16", "float32"):
            key = {"dtype": dtype, "head_dim": 64, "seq": "<=128", "batch_heads": "<=1024", "extras": extras}
            assert table.match(key) is not None, (name, key)


def _write_table(path, *, metadata, rules=None, arch="cpu", schema=A.TABLE_SCHEMA):
    rules = rules if rules is not None else [{"match": {}, "backends": ["sdpa_math"]}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": schema, "arch": arch, "source": "test", "measured_with": metadata, "rules": rules}))


def _call_three_times(gen):
    q, k, v = packed_qkv(2, 4, 2, 8, torch.float32, gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            attention(q, k, v)
        A.clear_cache()  # reloading does not warn again either
        attention(q, k, v)
        explanation = explain(q, k, v)
    return [w for w in caught if issubclass(w.category, AttentionTableWarning)], explanation


def test_user_table_with_matching_metadata_is_used(tmp_path, monkeypatch, gen):
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    rules = [{"match": {"extras": "none"}, "backends": ["sdpa_flash", "sdpa_math"]}]
    _write_table(tmp_path / "attention_cpu.json", metadata=device_metadata("cpu"), rules=rules)
    A.clear_cache()
    assert A.user_table_path("cpu") == str(tmp_path / "attention_cpu.json")
    warned, ex = _call_three_times(gen)
    assert warned == []
    assert ex.user_table == str(tmp_path / "attention_cpu.json") and ex.user_rule == rules[0]
    assert ex.backend == "sdpa_math"
    assert ex.candidates[0].name == "sdpa_flash" and ex.candidates[0].source == "user table"
    first = ex.candidates[0]
    assert not (first.available and first.supported)  # listed first, but cannot serve CPU tensors: never picked


@pytest.mark.parametrize(
    "field, value",
    [
        ("device_name", "NVIDIA H100 80GB HBM3"),
        ("multiprocessor_count", 132),
        ("torch", "0.0.1"),
        ("cuda", "99.0"),
        ("cudnn", 1),
    ],
)
def test_user_table_from_other_setup_is_ignored_with_one_warning(field, value, tmp_path, monkeypatch, gen):
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    meta = dict(device_metadata("cpu"), **{field: value})
    _write_table(tmp_path / "attention_cpu.json", metadata=meta)
    A.clear_cache()
    warned, ex = _call_three_times(gen)
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert field in str(warned[0].message) and "attention_cpu.json" in str(warned[0].message)
    assert ex.user_table is None and ex.backend == "sdpa_math"


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        json.dumps({"schema": "other/9", "arch": "cpu", "measured_with": None, "rules": []}),
        json.dumps({"schema": A.TABLE_SCHEMA, "arch": "sm90", "measured_with": {}, "rules": []}),
        json.dumps({"schema": A.TABLE_SCHEMA, "arch": "cpu", "measured_with": None, "rules": []}),
        "BACKENDS",
        "SEQ",
    ],
    ids=["bad-json", "not-object", "schema", "arch", "no-metadata", "unknown-backend", "bad-bucket"],
)
def test_corrupt_user_table_is_ignored_with_one_warning(content, tmp_path, monkeypatch, gen):
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    path = tmp_path / "attention_cpu.json"
    if content == "BACKENDS":
        _write_table(path, metadata=device_metadata("cpu"), rules=[{"match": {}, "backends": ["warp_speed"]}])
    elif content == "SEQ":
        _write_table(path, metadata=device_metadata("cpu"), rules=[{"match": {"seq": "<=100"}, "backends": ["sdpa_math"]}])
    else:
        path.write_text(content)
    A.clear_cache()
    warned, ex = _call_three_times(gen)
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert "attention_cpu.json" in str(warned[0].message)
    assert ex.user_table is None and ex.backend == "sdpa_math"


@pytest.mark.parametrize("old_file", ["same-setup", "other-setup", "corrupt", "no-metadata", "none", "replace"])
def test_tune_keeps_old_rules_only_from_a_valid_table_of_this_setup(old_file, tmp_path):
    from fusedenc.tune import attention as tune_attention

    meta = device_metadata("cpu")
    path = tmp_path / "attention_cpu.json"
    kept = {"match": {"dtype": "float16", "seq": "<=128"}, "backends": ["sdpa_math"]}
    replaced = {"match": {"dtype": "float16", "seq": "<=256"}, "backends": ["sdpa_flash", "sdpa_math"]}
    if old_file in ("same-setup", "replace"):
        _write_table(path, metadata=meta, rules=[kept, replaced])
    elif old_file == "other-setup":
        _write_table(path, metadata=dict(meta, torch="0.0.1"), rules=[kept, replaced])
    elif old_file == "corrupt":
        _write_table(path, metadata=meta, rules=[kept, dict(replaced, backends=["warp_speed"])])
    elif old_file == "no-metadata":
        _write_table(path, metadata=None, rules=[kept, replaced])
    new = {("float16", "<=256"): {"match": {"dtype": "float16", "seq": "<=256"}, "backends": ["sdpa_math"]}}
    merged = tune_attention.merge_table(str(path), "cpu", meta, new, replace=old_file == "replace")
    assert merged["measured_with"] == meta and merged["arch"] == "cpu"
    assert merged["rules"] == list(new.values()) + ([kept] if old_file == "same-setup" else [])
    table, measured = A.parse_table(json.dumps(merged), str(path), "user", "cpu")  # the loader accepts it
    assert measured == meta and list(table.rules) == merged["rules"]


# ------------------------------------------------------------ forcing, explain ----


def test_forced_by_environment(monkeypatch, gen):
    q, k, v = packed_qkv(2, 4, 2, 8, torch.float32, gen)
    monkeypatch.setenv(A.BACKEND_ENV, "sdpa_math")
    A.clear_cache()
    ex = explain(q, k, v)
    assert ex.backend == "sdpa_math" and A.BACKEND_ENV in ex.reason
    check(attention(q, k, v), q, k, v, None, None, None, torch.float32, f"forced seed={gen.seed_value}")

    monkeypatch.setenv(A.BACKEND_ENV, "sdpa_flash")
    A.clear_cache()
    with pytest.raises(ValueError, match=r"'sdpa_flash'.*FUSEDENC_ATTENTION_BACKEND.*cannot serve this call: (not available|needs a GPU)"):
        attention(q, k, v)
    monkeypatch.setenv(A.BACKEND_ENV, "warp_speed")
    A.clear_cache()
    with pytest.raises(ValueError, match="warp_speed"):
        attention(q, k, v)


@pytest.mark.parametrize("name", sorted(set(A.BACKENDS) - {"sdpa_math"}))
def test_forced_by_argument_names_backend_and_reason(name, gen):
    q, k, v = packed_qkv(2, 4, 2, 8, torch.float16, gen)
    with pytest.raises(ValueError, match=rf"'{name}' \(forced by backend=\).*cannot serve"):
        attention(q, k, v, backend=name)
    assert attention(q, k, v, backend="sdpa_math").shape == (8, 16)


def test_supports_reasons_for_cuda_like_calls():
    """What each GPU backend says about calls it cannot serve (checked without a GPU)."""
    base = A.AttentionCall("cuda", 0, "sm90", False, (9, 0), torch.float16, 2, 64, 4, 64, False, None, 0, False, True, True)
    repl = lambda **kw: A.AttentionCall(**{**base.__dict__, **kw})  # noqa: E731
    flash, eff, cudnn = A.BACKENDS["sdpa_flash"], A.BACKENDS["sdpa_efficient"], A.BACKENDS["sdpa_cudnn"]
    assert flash.supports(base) == (True, "") and eff.supports(base) == (True, "") and cudnn.supports(base) == (True, "")
    assert "attn_bias" in flash.supports(repl(has_bias=True, bias_dtype=torch.float16, bias_batch=2))[1]
    assert "key_padding_mask" in flash.supports(repl(has_mask=True))[1]
    assert "float16/bfloat16" in flash.supports(repl(dtype=torch.float32))[1]
    assert "float16/bfloat16" in cudnn.supports(repl(dtype=torch.float32))[1]
    assert eff.supports(repl(dtype=torch.float32, has_mask=True))[0]
    assert "head dim" in flash.supports(repl(head_dim=12))[1]
    assert "head dim" in cudnn.supports(repl(head_dim=256, capability=(8, 0), arch="sm80"))[1]
    assert "sm80" in flash.supports(repl(capability=(7, 5), arch="sm75"))[1]
    assert "aligned" in eff.supports(repl(aligned=False))[1]
    assert "ROCm" in A.BACKENDS["aiter"].supports(base)[1]
    assert "varlen" in A.BACKENDS["flash_attn"].supports(repl(has_mask=True))[1]
    assert not cudnn.supports(repl(rocm=True, capability=None, arch="gfx942"))[0]


def test_explain(gen):
    q, k, v = packed_qkv(3, 100, 4, 16, torch.bfloat16, gen)
    mask = padding_mask(3, 100, gen)
    ex = explain(q, k, v, randn((1, 4, 100, 100), torch.bfloat16, gen=gen), mask)
    assert ex.backend == "sdpa_math"
    assert ex.key == {"arch": "cpu", "dtype": "bfloat16", "head_dim": 16, "seq": "<=128", "batch_heads": "<=16", "extras": "bias+mask"}
    assert ex.call.packed and ex.call.has_bias and ex.call.has_mask and ex.call.bias_batch == 1
    names = [c.name for c in ex.candidates]
    assert set(A.FALLBACK_ORDER) <= set(names)
    assert all(not (c.available and c.supported) for c in ex.candidates if c.name != "sdpa_math")
    assert all(c.reason for c in ex.candidates if c.name != "sdpa_math")
    # the shipped rule's entries come first, then the fallback order fills in the rest
    assert ex.shipped_rule is not None and names[: len(ex.shipped_rule["backends"])] == ex.shipped_rule["backends"]
    text = str(ex)
    assert "sdpa_math" in text and "bias+mask" in text


def test_plans_are_cached_per_signature(gen):
    q, k, v = packed_qkv(2, 4, 2, 8, torch.float32, gen)
    attention(q, k, v)
    n = A.cache_info()["plans"]
    q2, k2, v2 = packed_qkv(2, 4, 2, 8, torch.float32, gen)  # same signature, other tensors
    attention(q2, k2, v2)
    assert A.cache_info()["plans"] == n
    attention(*packed_qkv(2, 5, 2, 8, torch.float32, gen))
    assert A.cache_info()["plans"] == n + 1


# ------------------------------------------------------------ compile, custom op ----


def test_compile_fullgraph_matches_eager(gen):
    torch._dynamo.reset()
    b, s, h, d = 2, 6, 2, 8
    e = h * d
    x = randn((b, s, e), torch.float32, gen=gen)
    w_qkv = randn((3 * e, e), torch.float32, gen=gen, scale=e**-0.5)
    bias = randn((1, h, s, s), torch.float32, gen=gen)
    mask = padding_mask(b, s, gen)

    def block(t):
        q, k, v = fusedenc.ops.gemm.split_qkv(t @ w_qkv.t(), h)
        return attention(q, k, v, bias, mask, scale=0.25) * 2.0

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), block(x), msg=lambda m: f"{m} seed={gen.seed_value}")


def test_opcheck(gen):
    q, k, v = packed_qkv(2, 5, 2, 8, torch.float32, gen)
    bias = randn((2, 2, 5, 5), torch.float32, gen=gen)
    mask = padding_mask(2, 5, gen, fully_masked=())
    torch.library.opcheck(torch.ops.fusedenc.attention.default, (q, k, v, bias, mask, None, None))
    torch.library.opcheck(torch.ops.fusedenc.attention.default, (q, k, v, None, None, 0.5, "sdpa_math"))


# ------------------------------------------------------------ tune ----


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_tune_without_gpu_exits_nonzero(tmp_path):
    env = dict(os.environ, FUSEDENC_CONFIG_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "fusedenc.tune", "attention", "--quick"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    assert "no CUDA/ROCm GPU" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # wrote nothing


def test_tune_needs_a_subcommand():
    r = subprocess.run([sys.executable, "-m", "fusedenc.tune"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "COMMAND" in r.stderr
