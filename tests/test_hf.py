"""patch_hf on CPU: patched Hugging Face BERT-family models against unpatched copies.

Models are built from small random configs (no download).  Every parameter is
redrawn at a scale where each sublayer visibly changes the output, LayerNorm
and bias terms included (HF's init zeroes biases and makes LayerNorms the
identity, which would hide a swapped or dropped weight).  Both sides compute
in fp32 on the CPU.
"""

from __future__ import annotations

import copy
import sys
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedenc.hf import masks  # noqa: E402
from fusedenc.hf import patch as hf  # noqa: E402
from fusedenc.hf.patch import HF_ACTIVATIONS, HFEncoderLayer, convert_mask, patch_hf  # noqa: E402

TF_MAJOR = int(transformers.__version__.split(".")[0])

#: What holds: eager matches to the bit, sdpa within 3.2e-6 * (1 + |ref|) over 60 seeds
#: (torch's CPU SDPA kernel sums in another order); 1e-5 leaves a 3x margin.
TOL = dict(rtol=1e-5, atol=1e-5)

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=40,
    type_vocab_size=2,
    pad_token_id=1,
)


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if name.endswith("LayerNorm.weight") else noise)


def _build(gen, model_cls=None, *, impl="sdpa", act="gelu", model_type="bert", **overrides):
    """(patched-to-be model, unpatched deep copy), eval mode, fp32."""
    config = transformers.AutoConfig.for_model(
        model_type, attn_implementation=impl, **{**SMALL, "hidden_act": act, **overrides}
    )
    model_cls = model_cls or transformers.AutoModel
    with torch.random.fork_rng():
        torch.manual_seed(gen.seed_value)
        model = model_cls.from_config(config) if model_cls.__name__.startswith("Auto") else model_cls(config)
    assert model.config._attn_implementation == impl
    _randomize(model, gen)
    model.eval()
    return model, copy.deepcopy(model)


def _inputs(gen, batch=4, seq=11, pad=True):
    ids = torch.randint(2, SMALL["vocab_size"], (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad:  # padding of different lengths in some sequences, none in the first
        mask[1, seq - 3 :] = 0
        mask[2, 2:] = 0
        mask[3, seq - 1 :] = 0
        ids[mask == 0] = SMALL["pad_token_id"]
    return ids, mask


def _outputs(out) -> dict:
    keys = ("last_hidden_state", "pooler_output", "logits")
    return {k: out[k] for k in keys if k in out and out[k] is not None}


def _packs(mask) -> bool:
    """Whether patch_hf's padding-free path runs for HF attention mask ``mask`` (0 = padding):
    some padding, and every sequence's position 0 a real token (fusedenc.hf.varlen)."""
    return mask is not None and bool((mask == 0).any()) and bool((mask[:, 0] != 0).all())


def _assert_same(got, want, what, mask=None):
    """HF's outputs; with ``mask`` where the padding-free path runs, ``last_hidden_state`` is
    HF's at real tokens and zero at padding positions (documented in fusedenc.hf.varlen)."""
    for key, ref in _outputs(want).items():
        out = got[key]
        if key == "last_hidden_state" and _packs(mask):
            pad = mask == 0
            assert torch.equal(out[pad], torch.zeros_like(out[pad])), f"{what}: padding positions are not zero"
            out, ref = out[~pad], ref[~pad]
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"{what} {key}: {m}")


def _snapshot(model):
    return [type(m) for m in model.modules()], {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, snap):
    types, state = snap
    assert [type(m) for m in model.modules()] == types, "the model's modules changed"
    now = model.state_dict()
    assert now.keys() == state.keys(), "the model's state dict keys changed"
    for k, v in state.items():
        assert torch.equal(now[k], v), f"{k} changed"


# ------------------------------------------------------------ outputs ----

MODELS = ["BertModel", "RobertaModel", "BertForSequenceClassification"]
TYPES = {"BertModel": "bert", "RobertaModel": "roberta", "BertForSequenceClassification": "bert"}


@pytest.mark.parametrize("act", ["gelu", "relu"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_patched_matches_hf(name, impl, act, gen):
    model, ref = _build(gen, getattr(transformers, name), impl=impl, act=act, model_type=TYPES[name])
    assert patch_hf(model) is model
    encoder = model.base_model.encoder
    assert all(isinstance(layer, HFEncoderLayer) for layer in encoder.layer)
    assert not any(isinstance(m, torch.nn.Linear) for m in encoder.modules()), "HF layers left behind"

    ids, mask = _inputs(gen)
    what = f"{name} {impl} {act} seed={gen.seed_value}"
    with torch.no_grad():
        _assert_same(model(ids, attention_mask=mask), ref(ids, attention_mask=mask), f"{what} padded", mask)
        _assert_same(model(ids), ref(ids), f"{what} no mask")  # None reaches the layers (or an all-keep mask)
        _assert_same(model(ids[:2, :5]), ref(ids[:2, :5]), f"{what} new shape")


@pytest.mark.parametrize("act", sorted(HF_ACTIVATIONS))
def test_every_supported_activation(act, gen):
    model, ref = _build(gen, act=act)
    patch_hf(model)
    ids, mask = _inputs(gen)
    with torch.no_grad():
        _assert_same(model(ids, attention_mask=mask), ref(ids, attention_mask=mask), f"{act} seed={gen.seed_value}", mask)


@pytest.mark.parametrize("model_type", hf.SUPPORTED_MODEL_TYPES)
def test_every_supported_model_type(model_type, gen):
    model, ref = _build(gen, impl="eager", model_type=model_type)  # 4.x has no sdpa for some of them
    patch_hf(model)
    assert all(isinstance(layer, HFEncoderLayer) for layer in model.base_model.encoder.layer)
    ids, mask = _inputs(gen)
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask), ref(ids, attention_mask=mask)
    _assert_same(got, want, f"{model_type} seed={gen.seed_value}", mask)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hidden_states_all_padding_and_inference_mode(impl, gen):
    model, ref = _build(gen, impl=impl)
    ids, mask = _inputs(gen)
    with torch.no_grad():  # records hidden states before patching: transformers 5 hooks the old layers
        ref(ids, attention_mask=mask, output_hidden_states=True)
        model(ids, attention_mask=mask, output_hidden_states=True)
    patch_hf(model)
    mask[1] = 0  # a sequence that is all padding: HF averages over every key (eager) or gives zeros (sdpa)
    with torch.inference_mode():
        got = model(ids, attention_mask=mask, output_hidden_states=True)
        want = ref(ids, attention_mask=mask, output_hidden_states=True)
    what = f"{impl} seed={gen.seed_value}"
    _assert_same(got, want, what)
    assert len(got.hidden_states) == len(want.hidden_states) == SMALL["num_hidden_layers"] + 1
    for i, (g, w) in enumerate(zip(got.hidden_states, want.hidden_states)):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{what} hidden_states[{i}]: {m}")


def test_masks_change_between_calls(gen):
    """The layers share one mask conversion per forward; a new mask must never see a stale one."""
    model, ref = _build(gen, impl="eager")
    patch_hf(model)
    ids, mask = _inputs(gen)
    with torch.no_grad():
        for cut in (3, 7, 11, 5):
            m = mask.clone()
            m[0, cut:] = 0
            _assert_same(model(ids, attention_mask=m), ref(ids, attention_mask=m), f"cut={cut} seed={gen.seed_value}", m)


@pytest.mark.parametrize("kind", ["bool-blocks", "float-bias", "float-per-key"])
def test_custom_4d_masks_on_the_encoder(kind, gen):
    """Masks that are not per-key become an additive bias; one buffer refilled in place is re-read."""
    model, ref = _build(gen, impl="sdpa")  # sdpa: HF hands bool masks to torch SDPA (True = attend)
    patch_hf(model)
    b, s, d = 3, 10, SMALL["hidden_size"]
    x = torch.randn(b, s, d, generator=gen)
    if kind == "bool-blocks":  # two attention blocks per sequence: varies by query
        idx = torch.arange(s)
        mask = ((idx[:, None] < 4) == (idx[None, :] < 4)).expand(b, 1, s, s).clone()
    elif kind == "float-bias":
        mask = torch.randn(b, 1, s, s, generator=gen)
    else:
        mask = torch.zeros(b, 1, 1, s)
        mask[1, ..., 6:] = torch.finfo(torch.float32).min
    with torch.no_grad():
        for step in range(2):
            got = model.base_model.encoder(x, attention_mask=mask)[0]
            want = ref.base_model.encoder(x, attention_mask=mask)[0]
            if kind == "float-per-key" and step == 0:  # finfo.min: key padding, the padding-free path
                pad = mask[:, 0, 0, :] < 0
                assert torch.equal(got[pad], torch.zeros_like(got[pad]))
                got, want = got[~pad], want[~pad]
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{kind} step {step} seed={gen.seed_value}: {m}")
            if kind == "bool-blocks":
                mask[0] = ~mask[0] | torch.eye(s, dtype=torch.bool)  # in place: the same object, new values
            else:
                mask.mul_(0.5)


# ------------------------------------------------------------ masks ----


def test_convert_mask_forms():
    b, s, h = 2, 5, 4
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    keep = ~pad
    minf = torch.finfo(torch.float32).min
    fmask = torch.zeros(b, s).masked_fill(pad, minf)

    assert convert_mask(None, b, s, h, torch.float32) == (None, None)
    for form in (keep.long(), keep):  # [B, S] flash-attention style
        bias, kpm = convert_mask(form, b, s, h, torch.float32)
        assert bias is None and torch.equal(kpm, pad)
    per_key = {
        "bool broadcast (stride 0)": keep[:, None, None, :].expand(b, 1, s, s),
        "bool materialized (5.x sdpa)": keep[:, None, None, :].expand(b, 1, s, s).clone(),
        "float [B,1,1,S] (4.x eager)": fmask[:, None, None, :],
        "float [B,1,S,S] (4.x sdpa, 5.x eager)": fmask[:, None, None, :].expand(b, 1, s, s).clone(),
        "float -inf": torch.zeros(b, 1, 1, s).masked_fill(pad[:, None, None, :], float("-inf")),
    }
    for what, form in per_key.items():
        bias, kpm = convert_mask(form, b, s, h, torch.float32)
        assert bias is None and torch.equal(kpm, pad), what
        assert kpm.is_contiguous() and kpm.dtype == torch.bool, what

    all_pad = fmask.clone()
    all_pad[1] = minf
    additive = {
        "varies by query": keep[:, None, :, None] & keep[:, None, None, :],
        "not 0/min": torch.randn(b, 1, 1, s),
        "a sequence all padding": all_pad[:, None, None, :],
    }
    for what, form in additive.items():
        bias, kpm = convert_mask(form, b, s, h, torch.float32)
        assert kpm is None and bias.shape == (b, h, s, s), what
    # Without value checks (compile, graph capture) a materialized mask stays a bias.
    materialized = per_key["float [B,1,S,S] (4.x sdpa, 5.x eager)"]
    bias, kpm = convert_mask(materialized, b, s, h, torch.float32, inspect_values=False)
    assert kpm is None and torch.equal(bias[:, 0], materialized[:, 0])
    bias, kpm = convert_mask(per_key["bool broadcast (stride 0)"], b, s, h, torch.float32, inspect_values=False)
    assert bias is None and torch.equal(kpm, pad), "strides alone vouch for a broadcast mask"
    # A bool bias is 0 / -inf in the hidden dtype; a float one of another dtype is cast.
    bias, _ = convert_mask(additive["varies by query"], b, s, h, torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and set(bias.unique().tolist()) == {0.0, float("-inf")}
    bias, _ = convert_mask(torch.randn(1, 1, s, s, dtype=torch.float64), b, s, h, torch.float16)
    assert bias.dtype == torch.float16 and bias.shape == (1, h, s, s)


def test_mask_read_agrees_with_convert_mask():
    """The padding-free encoder's one read of a mask (``MaskCache.read``): the key padding on
    the host where ``convert_mask`` finds one, None where it makes a bias; the layers of a
    padded forward then get ``convert_mask``'s result from the cache; the mask is not kept."""
    import gc
    import weakref

    b, s, h = 3, 6, 4
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False, True] * 3])
    keep, minf = ~pad, torch.finfo(torch.float32).min
    fmask = torch.zeros(b, s).masked_fill(pad, minf)
    all_pad = fmask.clone()
    all_pad[2] = minf
    forms = {
        "[B, S]": lambda: keep.long(),
        "bool broadcast": lambda: keep[:, None, None, :].expand(b, 1, s, s),
        "bool materialized": lambda: keep[:, None, None, :].expand(b, 1, s, s).clone(),
        "bool [1, 1, S, S]": lambda: keep[1:2, None, None, :].expand(1, 1, s, s).clone(),
        "float [B,1,1,S]": lambda: fmask[:, None, None, :].clone(),
        "float materialized": lambda: fmask[:, None, None, :].expand(b, 1, s, s).clone(),
        "float -inf": lambda: torch.zeros(b, 1, 1, s).masked_fill(pad[:, None, None, :], float("-inf")),
        "varies by query": lambda: (keep[:, None, :, None] & keep[:, None, None, :]).clone(),
        "not 0/min": lambda: torch.randn(b, 1, s, s),
        "all padding": lambda: all_pad[:, None, None, :].clone(),
        "heads differ": lambda: torch.stack([keep, ~keep] * 2, 1)[:, :, None, :].expand(b, h, s, s).clone(),
    }
    x = torch.zeros(b, s, 8)
    for what, make in forms.items():
        mask = make()
        want_bias, want_kpm = convert_mask(mask, b, s, h, torch.float32)
        cache = masks.MaskCache()
        host = cache.read(mask, x, h)
        if want_kpm is None:
            assert host is None, what
        else:
            assert host.dtype == bool and host.shape == (b, s) and (host == want_kpm.numpy()).all(), what
        bias, kpm = cache(mask, x, h, False)  # a padded forward's first layer: the read's conversion
        assert (bias is None) == (want_bias is None) and (kpm is None) == (want_kpm is None), what
        for got, want in ((bias, want_bias), (kpm, want_kpm)):
            if want is not None:
                assert torch.equal(got, want) and got.dtype == want.dtype and got.shape == want.shape, what
        if want_kpm is not None:
            assert kpm.is_contiguous(), what
            assert kpm.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr(), what
            ref = weakref.ref(mask)
            del mask
            gc.collect()
            assert ref() is None, f"{what}: the cache keeps the mask alive"


def test_convert_mask_refusals():
    b, s, h = 2, 5, 4
    with pytest.raises(TypeError, match="BlockMask"):
        convert_mask(object(), b, s, h, torch.float32)
    with pytest.raises(TypeError, match="bool or floating"):
        convert_mask(torch.zeros(b, 1, 1, s, dtype=torch.long), b, s, h, torch.float32)
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        convert_mask(torch.ones(b, s + 1), b, s, h, torch.float32)
    for shape in [(b, 1, s), (b, 3, 1, s), (b, 1, 1, s + 1), (b + 1, 1, 1, s)]:
        with pytest.raises(ValueError, match=r"\[B, H, S, S\]"):
            convert_mask(torch.zeros(shape), b, s, h, torch.float32)


# ------------------------------------------------------------ refusals ----

REFUSALS = {
    "decoder": (dict(is_decoder=True), ValueError, "is_decoder"),
    "cross-attention": (dict(is_decoder=True, add_cross_attention=True), ValueError, "add_cross_attention"),
    "relative positions": (dict(position_embedding_type="relative_key"), ValueError, "position_embedding_type"),
    "activation": (dict(act="gelu_fast"), ValueError, "hidden_act='gelu_fast'"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_config_refusals_leave_the_model_unchanged(case, gen):
    overrides, exc, message = REFUSALS[case]
    model, _ = _build(gen, transformers.BertForSequenceClassification, **overrides)
    snap = _snapshot(model)
    with pytest.raises(exc, match=message):
        patch_hf(model)
    _assert_unchanged(model, snap)


def test_other_refusals(gen):
    model, _ = _build(gen, impl="eager")  # transformers 5 itself refuses output_attentions with sdpa
    snap = _snapshot(model)
    model.train()
    with pytest.raises(ValueError, match=r"training mode.*model\.eval\(\)"):
        patch_hf(model)
    model.eval()
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions"):
        patch_hf(model)
    model.config.output_attentions = False
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='flex_attention'"):
        patch_hf(model)
    model.config._attn_implementation = "eager"
    _assert_unchanged(model, snap)
    with pytest.raises(TypeError, match="no BERT-style encoder"):
        patch_hf(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval())
    with pytest.raises(TypeError, match="no BERT-style encoder"):  # what it is, before its mode
        patch_hf(torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match="nn.Module"):
        patch_hf("bert")


def test_unsupported_model_type_is_refused(gen):
    # RoFormer's layers look like BertLayer but rotate q and k: same names, other math.
    model, _ = _build(gen, impl="eager", model_type="roformer")
    snap = _snapshot(model)
    with pytest.raises(TypeError, match="model_type='roformer'"):
        patch_hf(model)
    _assert_unchanged(model, snap)


def test_call_time_refusals(gen):
    model, _ = _build(gen)
    patch_hf(model)
    ids, mask = _inputs(gen)
    with torch.no_grad():
        with pytest.raises(ValueError, match="output_attentions"):
            model(ids, attention_mask=mask, output_attentions=True)
        head_mask = torch.ones(SMALL["num_hidden_layers"], SMALL["num_attention_heads"])
        with pytest.raises(ValueError, match="head_mask"):
            model(ids, attention_mask=mask, head_mask=head_mask)
        model.train()
        with pytest.raises(RuntimeError, match=r"inference-only.*model\.eval\(\)"):
            model(ids, attention_mask=mask)
        model.eval()
        model(ids, attention_mask=mask)  # still fine afterwards


# ------------------------------------------------------------ patching ----


def test_not_inplace_and_idempotent(gen):
    model, ref = _build(gen)
    snap = _snapshot(model)
    patched = patch_hf(model, inplace=False)
    assert patched is not model
    _assert_unchanged(model, snap)
    assert patch_hf(patched) is patched  # a second patch changes nothing
    layers = list(patched.encoder.layer)
    patch_hf(patched)
    assert all(a is b for a, b in zip(layers, patched.encoder.layer))
    ids, mask = _inputs(gen)
    with torch.no_grad():
        _assert_same(patched(ids, attention_mask=mask), ref(ids, attention_mask=mask), f"seed={gen.seed_value}", mask)
        _assert_same(model(ids, attention_mask=mask), ref(ids, attention_mask=mask), "original")


def test_layer_interface(gen):
    """Each version's call signature and return type; weights frozen; classes stay HF's."""
    model, ref = _build(gen)
    layer_cls = type(ref.encoder.layer[0])
    patch_hf(model)
    layer = model.encoder.layer[0]
    assert isinstance(layer, layer_cls) and type(layer).__name__ == f"Fused{layer_cls.__name__}"
    assert not any(p.requires_grad for p in layer.parameters())
    x = torch.randn(2, 6, SMALL["hidden_size"], generator=gen, requires_grad=True)
    out = layer(x)
    want = ref.encoder.layer[0](x)
    if TF_MAJOR < 5:
        assert isinstance(out, tuple) and len(out) == 1
        out, want = out[0], want[0]
    else:
        assert isinstance(out, torch.Tensor)
    assert not out.requires_grad, "inference only: no autograd graph"
    torch.testing.assert_close(out, want.detach(), **TOL)
    # Positional arguments the way each version's encoder loop passes them.
    if TF_MAJOR < 5:  # hidden_states, attention_mask, head_mask, encoder_hidden_states, ...
        out = layer(x, None, None, None, None, None, False)[0]
    else:  # hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, past_key_values
        out = layer(x, None, None, None, None, position_ids=None)
    torch.testing.assert_close(out, want.detach(), **TOL)


@pytest.mark.skipif(TF_MAJOR < 5, reason="transformers 4 builds its masks without _create_attention_masks")
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_the_model_hands_its_2d_mask_to_the_padding_free_encoder(impl, gen):
    """A patched transformers 5 model builds no 4-D mask where the encoder runs padding-free
    (that building is host work and a sync of its own); where the padded path runs (here: a
    sequence all padding) HF's own mask is built then, and every output is HF's.  A batch
    without padding takes the model's short path (``hf_embedded``): nothing is built."""
    model, ref = _build(gen, impl=impl)
    patch_hf(model)
    calls = []
    modeling = sys.modules[type(ref).__module__]  # HF's (a patched BertModel's class is fusedenc's)
    original = modeling.create_bidirectional_mask

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    ids, mask = _inputs(gen)
    all_padding = mask.clone()
    all_padding[1] = 0
    with mock.patch.object(modeling, "create_bidirectional_mask", counted), torch.no_grad():
        assert "_create_attention_masks" in model.__dict__  # the pass-through, installed by patch_hf
        for m, builds in ((mask, 0), (all_padding, 1), (torch.ones_like(mask), 0), (mask, 0)):
            calls.clear()
            _assert_same(model(ids, attention_mask=m), ref(ids, attention_mask=m), f"{impl} seed={gen.seed_value}", m)
            assert len(calls) == builds + 1  # the reference's own call, and the patched model's where it builds
