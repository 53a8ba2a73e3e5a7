"""A patched BERT / RoBERTa / XLM-R model's short path (``fusedenc.hf.embedded``) on the CPU:
which calls take it, that they give the unpatched model's outputs, and that every other call
takes HF's forward with HF's results.

The oracle is the unpatched fp32 model: on real tokens the short path gives its numbers
(summation order aside), padding positions come out zero (as the encoder's padding-free
path), the pooler's output is HF's.  Which path ran is seen by replacing HF's
model ``forward`` with a counting wrapper.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hf_helpers import SMALL, small_models

import fusedenc
from fusedenc.graphs import auto as auto_graphs
from fusedenc.graphs import feeds as graph_feeds
from fusedenc.hf import embedded as hf_embedded

transformers = pytest.importorskip("transformers")
from transformers.models.bert import modeling_bert  # noqa: E402

MODEL_TYPES = ["bert", "roberta", "xlm-roberta"]

TOL = dict(rtol=2e-5, atol=2e-5)
PAD = 0  # the pad id of these tests' models


def _models(gen, model_type="bert", head=None, impl="sdpa"):
    """(patched, unpatched fp32 copy) of a small model of ``model_type`` (its base model, or
    ``head``: an ``AutoModelFor...`` class) with weights drawn from ``gen``."""
    return small_models(gen, model_type, impl=impl, pad_token_id=PAD, head=head)


def _batch(gen, b=6, s=14):
    """Token ids (the pad id at padding, as a tokenizer gives them), token types and a
    right-padded mask (one sequence full, one of one token)."""
    ids = torch.randint(2, SMALL["vocab_size"], (b, s), generator=gen)
    lengths = torch.randint(1, s + 1, (b,), generator=gen)
    lengths[0], lengths[-1] = s, 1
    mask = (torch.arange(s)[None] < lengths[:, None]).long()
    types = torch.randint(0, 2, (b, s), generator=gen)
    return ids.masked_fill(mask == 0, PAD), types, mask


@pytest.fixture
def hf_calls(monkeypatch):
    """``count(model)``: from then on, calls of HF's own forward of ``model``'s class (the path
    every call but the short one takes) are appended to the list it returns."""

    def count(model):
        calls = []
        hf_class = getattr(type(model), "_fusedenc_hf_class", type(model))
        original = hf_class.forward

        def counted(self, *args, **kwargs):
            calls.append(1)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(hf_class, "forward", counted)
        return calls

    return count


def _assert_packed_like(got, want, mask, what):
    real = mask.bool()
    last = got.last_hidden_state
    assert type(got) is type(want), what
    torch.testing.assert_close(last[real], want.last_hidden_state[real], **TOL, msg=what)
    assert torch.equal(last[~real], torch.zeros_like(last[~real])), f"{what}: padding positions are zero"
    torch.testing.assert_close(got.pooler_output, want.pooler_output, **TOL, msg=what)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("how", ["keywords", "ids positional", "token types", "neutral arguments", "int32 ids",
                                 "no padding", "no mask"])  # fmt: skip
def test_a_plain_call_takes_the_short_path(how, model_type, gen, hf_calls):
    model, ref = _models(gen, model_type)
    assert isinstance(model, hf_embedded.EmbeddedModel) and type(model).__name__ == type(ref).__name__
    calls = hf_calls(model)
    ids, types, mask = _batch(gen)
    kw = {"attention_mask": mask}
    if how == "token types":
        kw["token_type_ids"] = types
    if how == "neutral arguments":  # what a task head passes on
        kw.update(token_type_ids=types, position_ids=None, head_mask=None, inputs_embeds=None,
                  output_attentions=False, output_hidden_states=None, return_dict=True)  # fmt: skip
    if how == "int32 ids":
        ids, kw["token_type_ids"] = ids.int(), types.int()
    if how in ("no padding", "no mask"):  # every token real: the rows in order, nothing gathered or scattered
        mask = torch.ones_like(mask)
        kw["attention_mask"] = mask if how == "no padding" else None
    args = (ids,) if how == "ids positional" else ()
    if not args:
        kw["input_ids"] = ids
    with torch.no_grad():
        want = ref(*args, **kw)
        calls.clear()  # the reference's own call
        got = model(*args, **kw)
    assert calls == [], "HF's forward must not run on the short path"
    _assert_packed_like(got, want, mask, f"{model_type} {how} seed={gen.seed_value}")
    assert auto_graphs.cache_of(model).counts["eager: no native core"] == 1, "on the CPU: eagerly, no graph"


def _case(case, gen):
    """(args, keyword arguments, mask, whether HF's padded values are expected everywhere)."""
    ids, types, mask = _batch(gen)
    kw = {"attention_mask": mask}
    padded = False
    if case == "left padding":
        mask = kw["attention_mask"] = mask.flip(1)
        padded = True
    elif case == "an all-padding sequence":
        mask[2] = 0
        padded = True
    elif case == "holes":
        mask[0, 3] = 0  # position 0 real: the encoder packs, but HF's positions are not the packed index
    elif case == "position_ids":
        kw["position_ids"] = torch.arange(ids.shape[1]).flip(0)[None].expand_as(ids)
    elif case == "output_hidden_states":
        kw["output_hidden_states"] = True
        padded = True
    elif case == "return_dict=False":
        kw["return_dict"] = False
    elif case == "two positional":
        return (ids, mask), {}, mask, False
    return (ids,), kw, mask, padded


@pytest.mark.parametrize("case", ["left padding", "an all-padding sequence", "holes", "position_ids",
                                  "output_hidden_states", "return_dict=False", "two positional"])  # fmt: skip
def test_other_calls_take_hf_forward(case, gen, hf_calls):
    model, ref = _models(gen)
    calls = hf_calls(model)
    args, kw, mask, padded = _case(case, gen)
    with torch.no_grad():
        want = ref(*args, **kw)
        calls.clear()
        got = model(*args, **kw)
    assert calls == [1], f"{case}: HF's forward, once"
    if case == "return_dict=False":
        assert type(got) is tuple and type(want) is tuple
        got, want = modeling_bert.BaseModelOutputWithPoolingAndCrossAttentions(*got[:2]), \
            modeling_bert.BaseModelOutputWithPoolingAndCrossAttentions(*want[:2])  # fmt: skip
    if padded:  # the padded path: HF's values at every position
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **TOL)
        torch.testing.assert_close(got.pooler_output, want.pooler_output, **TOL)
    else:
        _assert_packed_like(got, want, mask, f"{case} seed={gen.seed_value}")
    if case == "output_hidden_states":
        assert len(got.hidden_states) == len(want.hidden_states) == SMALL["num_hidden_layers"] + 1


@pytest.mark.parametrize("where", ["model", "embeddings", "word_embeddings", "LayerNorm", "a layer", "global"])
def test_a_hook_sees_its_call(where, gen, hf_calls):
    """A hook on the model, its embeddings (or their parts) or a layer must see the call it
    hooks: HF's forward runs."""
    model, ref = _models(gen)
    calls = hf_calls(model)
    ids, _, mask = _batch(gen)
    seen = []
    target = {"model": model, "embeddings": model.embeddings, "word_embeddings": model.embeddings.word_embeddings,
              "LayerNorm": model.embeddings.LayerNorm, "a layer": model.encoder.layer[1]}.get(where)  # fmt: skip
    if target is None:
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: seen.append(m) if m is model.embeddings else None)
        target = model.embeddings
    else:
        handle = target.register_forward_hook(lambda m, a, o: seen.append(m))
    try:
        with torch.no_grad():
            got = model(ids, attention_mask=mask)
    finally:
        handle.remove()
    assert seen == [target] and calls == [1], where
    with torch.no_grad():
        _assert_packed_like(got, ref(ids, attention_mask=mask), mask, where)
        calls.clear()
        model(ids, attention_mask=mask)
    assert calls == [], "unhooked again: the short path"


@pytest.mark.parametrize("where", ["pooler", "pooler.dense"])
def test_a_hooked_pooler_runs_after_the_graph_function(where, gen, hf_calls):
    """HF's pooler runs inside the short path's graph function, unless a hook is on it or a
    part of it: then eagerly after it, where the hook sees (and here changes) its call."""
    model, ref = _models(gen)
    calls = hf_calls(model)
    ids, _, mask = _batch(gen)
    target = model.pooler if where == "pooler" else model.pooler.dense
    seen = []

    def doubled(module, args, out):
        seen.append(module)
        return out * 2

    handle = target.register_forward_hook(doubled)
    try:
        assert model._fusedenc_graph_pooler() is None
        with torch.no_grad():
            want = ref(ids, attention_mask=mask)  # HF's class: counted too
            first = want.last_hidden_state[:, 0]
            expected = want.pooler_output * 2 if where == "pooler" else torch.tanh(2 * ref.pooler.dense(first))
            calls.clear()
            got = model(ids, attention_mask=mask)
    finally:
        handle.remove()
    assert seen == [target] and calls == [], f"{where}: the short path, the pooler after it"
    torch.testing.assert_close(got.pooler_output, expected, **TOL)
    assert model._fusedenc_graph_pooler() is model.pooler, "unhooked: in the graph function again"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_task_head_model_runs_its_base_model_on_the_short_path(model_type, gen, hf_calls):
    model, ref = _models(gen, model_type, transformers.AutoModelForSequenceClassification)
    base = model.base_model
    assert isinstance(base, hf_embedded.EmbeddedModel)
    calls = hf_calls(base)
    ids, types, mask = _batch(gen)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        calls.clear()
        got = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    assert calls == []
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_roberta_positions_follow_the_ids(model_type, gen, hf_calls):
    """RoBERTa counts positions over the ids that are not the pad id: a real token with the
    pad id keeps position padding_idx and does not advance the count, as in HF."""
    model, ref = _models(gen, model_type)
    calls = hf_calls(model)
    ids, _, mask = _batch(gen)
    ids[0, 3] = ids[1, 0] = PAD  # real tokens with the pad id (mask 1)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask)
        calls.clear()
        got = model(ids, attention_mask=mask)
    assert calls == []
    _assert_packed_like(got, want, mask, f"{model_type} seed={gen.seed_value}")


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_the_graph_function_on_a_buckets_statics(model_type, gen):
    """What a graph runs (on a GPU), run on the CPU: the short path's function on the static
    inputs of a bucket larger than the batch, poisoned past the call's ``[B, S]`` (ids of
    no sentence, other token types), with slack rows past T, gives the eager call's output
    in ``[:B, :S]``."""
    model, ref = _models(gen, model_type)
    ids, types, mask = _batch(gen, b=5, s=11)
    if model_type == "roberta":
        ids[0, 3] = PAD  # a real token with the pad id: its position does not advance
    real = mask.numpy() != 0
    offsets = np.zeros(ids.shape[0] + 1, dtype=np.int32)
    np.cumsum(real.sum(1), out=offsets[1:])
    inputs = (ids, types, offsets, int(offsets[-1]), int(real.sum(1).max()))
    feed = graph_feeds.PaddedIdsFeed.of(inputs)
    assert feed.bucket.tokens > offsets[-1] and feed.bucket.sequences > 5 and feed.seq_bucket > 11, feed.key
    statics, views = feed.statics(inputs)
    statics[0].fill_(SMALL["vocab_size"] - 1)
    statics[1].fill_(1)
    statics[2].fill_(1 << 20)
    feed.fill(statics, inputs)
    assert statics[2].tolist() == [*offsets.tolist(), *[offsets[-1]] * (feed.bucket.sequences - 5)]
    assert model._fusedenc_graph_pooler() is model.pooler, "HF's unhooked pooler runs in the graph"
    fn = model._fusedenc_embedded_rows(model.encoder._fusedenc_as_stack(), hf_embedded._Scattered(model.pooler))
    with torch.no_grad():
        out = fn(*views)
        want = ref(ids, attention_mask=mask, token_type_ids=types)
        eager = model(ids, attention_mask=mask, token_type_ids=types)
    hidden = out["hidden"]
    assert hidden.shape == (feed.bucket.sequences, feed.seq_bucket, SMALL["hidden_size"])
    assert out["pooled"].shape == (feed.bucket.sequences, SMALL["hidden_size"])
    got = feed.take(out)
    assert got["hidden"].shape == (5, 11, SMALL["hidden_size"]) and got["pooled"].shape == (5, SMALL["hidden_size"])
    torch.testing.assert_close(got["hidden"], eager.last_hidden_state, **TOL)  # other row counts: other sums
    torch.testing.assert_close(got["pooled"], eager.pooler_output, **TOL)
    torch.testing.assert_close(got["hidden"][mask.bool()], want.last_hidden_state[mask.bool()], **TOL)
    torch.testing.assert_close(got["pooled"], want.pooler_output, **TOL)
    assert torch.equal(hidden[5:], torch.zeros_like(hidden[5:]))
    assert torch.equal(hidden[:, 11:], torch.zeros_like(hidden[:, 11:]))


def test_which_models_get_it(gen):
    electra = fusedenc.patch_hf(transformers.ElectraModel(transformers.ElectraConfig(**SMALL)).eval())
    assert not isinstance(electra, hf_embedded.EmbeddedModel), "ELECTRA (its embedding projection): HF's forward"
    unpacked = fusedenc.patch_hf(transformers.BertModel(transformers.BertConfig(**SMALL)).eval(), padding_free=False)
    assert not isinstance(unpacked, hf_embedded.EmbeddedModel), "no padding-free encoder: nothing to join"


def test_bad_input_gets_hf_errors(gen):
    """Inputs the short path does not take reach HF's forward, which raises as unpatched."""
    model, ref = _models(gen)
    ids, _, mask = _batch(gen)
    long_ids = torch.randint(1, SMALL["vocab_size"], (2, SMALL["max_position_embeddings"] + 1), generator=gen)
    long_mask = torch.ones_like(long_ids)
    long_mask[1, 5:] = 0
    cases = [((ids.float(),), {"attention_mask": mask}), ((ids,), {"attention_mask": mask[:, :-1]}),
             ((long_ids,), {"attention_mask": long_mask})]  # fmt: skip
    for args, kw in cases:
        for m in (ref, model):
            with pytest.raises((IndexError, RuntimeError, ValueError, TypeError)), torch.no_grad():
                m(*args, **kw)
    with torch.no_grad():  # an empty batch: HF's forward (HF's own layers refuse it; the patched ones return it)
        got = model(ids[:0], attention_mask=mask[:0])
    assert got.last_hidden_state.shape == (0, ids.shape[1], SMALL["hidden_size"])


def test_moved_model_drops_its_graphs_and_copies_keep_the_path(gen, hf_calls):
    model, ref = _models(gen)
    calls = hf_calls(model)
    ids, _, mask = _batch(gen)
    cache = auto_graphs.cache_of(model)
    model.double()  # graphs (none on a CPU) are dropped with the old weights
    assert cache.stats()["graphs"] == 0
    model.float()
    clone = copy.deepcopy(model)
    assert type(clone) is type(model)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask)
        calls.clear()
        for m in (model, clone):
            _assert_packed_like(m(ids, attention_mask=mask), want, mask, "after .double().float() / deepcopy")
    assert calls == []


def test_a_replaced_layer_or_block_makes_a_new_stack(gen):
    """The encoder's cached stack is made of the blocks the layers hold when it is made: a
    layer's block replaced afterwards (a fine-tuned copy swapped in) or the layers reordered get
    a new stack of the blocks as they are, and the call computes with them."""
    model, ref = _models(gen)
    ids, _, mask = _batch(gen)
    encoder = model.encoder
    first = encoder._fusedenc_as_stack()
    assert encoder._fusedenc_as_stack() is first  # cached while nothing changed
    with torch.no_grad():
        new_block = copy.deepcopy(encoder.layer[1].block)
        new_block.ffn1_bias.add_(0.5)  # a different FFN1 bias: a different output
        ref.encoder.layer[1].intermediate.dense.bias.add_(0.5)
        encoder.layer[1].block = new_block
        second = encoder._fusedenc_as_stack()
        assert second is not first and second.blocks[1] is new_block and second.blocks[0] is first.blocks[0]
        _assert_packed_like(model(ids, attention_mask=mask), ref(ids, attention_mask=mask), mask, "a new block")
        # layers swapped: the same blocks in another order
        encoder.layer[0], encoder.layer[1] = encoder.layer[1], encoder.layer[0]
        ref.encoder.layer[0], ref.encoder.layer[1] = ref.encoder.layer[1], ref.encoder.layer[0]
        third = encoder._fusedenc_as_stack()
        assert third is not second and list(third.blocks) == [second.blocks[1], second.blocks[0], *second.blocks[2:]]
        _assert_packed_like(model(ids, attention_mask=mask), ref(ids, attention_mask=mask), mask, "layers swapped")
        # A layer that is not this encoder's (a patched layer copied, an HF layer put back): no
        # stack, and no packed rows either (that layer would attend across the sequences): the
        # padded path, HF's values at every position.
        for foreign in (copy.deepcopy(encoder.layer[0]), copy.deepcopy(ref.encoder.layer[0])):
            encoder.layer[0] = foreign
            assert encoder._fusedenc_as_stack() is None
            got, want = model(ids, attention_mask=mask), ref(ids, attention_mask=mask)
            torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **TOL)
            torch.testing.assert_close(got.pooler_output, want.pooler_output, **TOL)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
@pytest.mark.slow
def test_a_patched_model_pickles_whole(model_type, gen, tmp_path):
    """``torch.save(model)`` of a patched model (its classes are made at patch time) loads in
    a new process, where those classes do not exist yet, and gives the same outputs."""
    import subprocess
    import sys

    model, _ = _models(gen, model_type, transformers.AutoModelForSequenceClassification)
    ids, types, mask = _batch(gen)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    path = tmp_path / "patched.pt"
    torch.save({"model": model, "inputs": (ids, types, mask), "want": want}, path)
    code = (
        "import sys, torch\n"
        "d = torch.load(sys.argv[1], weights_only=False)\n"
        "m = d['model']; ids, types, mask = d['inputs']\n"
        "from fusedenc.hf import embedded as hf_embedded, varlen as hf_varlen\n"
        "assert isinstance(m.base_model, hf_embedded.EmbeddedModel)\n"
        "assert isinstance(m.base_model.encoder, hf_varlen.PaddingFreeEncoder)\n"
        "with torch.no_grad():\n"
        "    got = m(input_ids=ids, attention_mask=mask, token_type_ids=types).logits\n"
        "torch.testing.assert_close(got, d['want'], rtol=0, atol=0)\n"
        "with torch.no_grad():  # transformers 5 finds what the loaded class records by its name\n"
        "    hidden = m(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states\n"
        "assert hidden is not None and len(hidden) == m.config.num_hidden_layers + 1, hidden\n"
        "print('ok', type(m.base_model).__name__, type(m.base_model.encoder.layer[0]).__name__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["ok", type(model.base_model).__name__, type(model.base_model.encoder.layer[0]).__name__]
    clone = copy.deepcopy(model)
    assert type(clone.base_model) is type(model.base_model)
    with torch.no_grad():
        torch.testing.assert_close(clone(input_ids=ids, attention_mask=mask, token_type_ids=types).logits, want,
                                   rtol=0, atol=0)  # fmt: skip


# ------------------------------------------------------------ sentence embeddings ----


def _mean_pooled(hidden, mask, normalize=True):
    """sentence-transformers' mean pooling over real tokens (fp32), then L2 normalization."""
    keep = mask.unsqueeze(-1).double()
    pooled = (hidden.double() * keep).sum(1) / keep.sum(1).clamp(min=1e-9)
    return (torch.nn.functional.normalize(pooled, dim=1) if normalize else pooled).float()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_embeddings_take_the_short_path(model_type, normalize, gen, hf_calls, monkeypatch):
    """``fusedenc.sentence_embeddings`` on a patched model: the short path pools the packed
    rows itself (HF's forward never runs), float32 ``[B, D]``, equal to mean pooling of the
    unpatched model's last hidden state (and normalized when asked); also without padding
    and without a mask (the dense variant)."""
    model, ref = _models(gen, model_type)
    pooled_calls = []
    for name in ("packed", "dense"):
        method = getattr(hf_embedded._Pooled, name)
        monkeypatch.setattr(hf_embedded._Pooled, name,
                            lambda self, *a, _m=method, _n=name: (pooled_calls.append(_n), _m(self, *a))[1])  # fmt: skip
    ids, types, mask = _batch(gen)
    full = torch.ones_like(mask)
    cases = {"padded": (mask, types), "no types": (mask, None), "no padding": (full, types), "no mask": (None, None)}
    with torch.no_grad():  # the unpatched model's calls before HF's forward is counted
        wants = {case: _mean_pooled(ref(ids, attention_mask=m, token_type_ids=t).last_hidden_state,
                                    full if m is None else m, normalize) for case, (m, t) in cases.items()}  # fmt: skip
    calls = hf_calls(model)
    for case, (m, t) in cases.items():
        got = fusedenc.sentence_embeddings(model, ids, m, t, normalize=normalize)
        assert got.dtype == torch.float32 and got.shape == (ids.shape[0], SMALL["hidden_size"]), case
        torch.testing.assert_close(got, wants[case], **TOL, msg=case)
    assert not calls, "HF's forward ran"
    assert pooled_calls == ["packed", "packed", "dense", "dense"], pooled_calls


def _pooled_reference(hidden: torch.Tensor, mask: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """sentence-transformers' Pooling modes in fp32 (padding's rows never count)."""
    hidden, real = hidden.float(), mask.bool()[:, :, None]
    if mode == "cls":
        pooled = hidden[:, 0]
    elif mode == "max":
        pooled = hidden.masked_fill(~real, -1e9).amax(1)
    else:
        sums, counts = (hidden * real).sum(1), real.sum(1).float()
        pooled = sums / (counts if mode == "mean" else counts.sqrt())
    return torch.nn.functional.normalize(pooled, dim=1) if normalize else pooled


@pytest.mark.parametrize("mode", hf_embedded.POOLING_MODES)
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_embeddings_pool_in_the_graph_function_on_poisoned_statics(gen, mode, normalize):
    """The short path's graph function with the pooling tail (each mode), on statics padded
    to a bucket and poisoned past the call: the call's rows are its embeddings (the mean
    modes give the bucket's spare sequences zeros), nothing of the slack rows leaks in."""
    model, ref = _models(gen)
    ids, types, mask = _batch(gen, b=5, s=11)
    real = mask.numpy() != 0
    offsets = np.zeros(ids.shape[0] + 1, dtype=np.int32)
    np.cumsum(real.sum(1), out=offsets[1:])
    inputs = (ids, types, offsets, int(offsets[-1]), int(real.sum(1).max()))
    feed = graph_feeds.PaddedIdsFeed.of(inputs)
    statics, views = feed.statics(inputs)
    statics[0].fill_(SMALL["vocab_size"] - 1)
    statics[1].fill_(1)
    feed.fill(statics, inputs)
    fn = model._fusedenc_embedded_rows(model.encoder._fusedenc_as_stack(), hf_embedded._Pooled(mode, normalize))
    with torch.no_grad():
        out = fn(*views)
        hidden = ref(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        want = _pooled_reference(hidden, mask, mode, normalize)
    assert out.shape == (feed.bucket.sequences, SMALL["hidden_size"]) and out.dtype == torch.float32
    torch.testing.assert_close(feed.take(out), want, **TOL)
    if mode in ("mean", "mean_sqrt_len_tokens"):
        assert torch.equal(out[5:], torch.zeros_like(out[5:]))


def test_sentence_embeddings_elsewhere_run_the_model_then_pool(gen, hf_calls):
    """Where the short path does not apply (left padding, an all-padding sequence, an
    unpatched model) the model's own call runs and the same pooling
    follows; a sequence with no real token gets zeros."""
    model, ref = _models(gen)
    ids, types, mask = _batch(gen)
    left = mask.flip(1)
    empty = mask.clone()
    empty[2] = 0
    cases = {"left padding": left, "all-padding row": empty}
    with torch.no_grad():
        wants = {case: _mean_pooled(ref(ids, attention_mask=m, token_type_ids=types).last_hidden_state, m)
                 for case, m in cases.items()}  # fmt: skip
    calls = hf_calls(model)
    for case, m in cases.items():
        torch.testing.assert_close(fusedenc.sentence_embeddings(model, ids, m, types), wants[case], **TOL, msg=case)
    assert len(calls) == 2, "HF's forward, once a case"
    assert torch.equal(fusedenc.sentence_embeddings(model, ids, empty, types)[2], torch.zeros(SMALL["hidden_size"]))
    with torch.no_grad():
        want = _mean_pooled(ref(ids, attention_mask=mask, token_type_ids=types).last_hidden_state, mask, False)
    torch.testing.assert_close(fusedenc.sentence_embeddings(ref, ids, mask, types, normalize=False), want, **TOL)


def test_sentence_embeddings_refuse_bad_input(gen):
    model, _ = _models(gen)
    ids, types, mask = _batch(gen)
    with pytest.raises(TypeError, match="input_ids must be a 2-D integer tensor"):
        fusedenc.sentence_embeddings(model, ids.float(), mask)
    with pytest.raises(TypeError, match="input_ids must be a 2-D integer tensor"):
        fusedenc.sentence_embeddings(model, ids[0], mask[0])
    with pytest.raises(ValueError, match="attention_mask must be a tensor of input_ids' shape"):
        fusedenc.sentence_embeddings(model, ids, mask[:, :-1])
    with pytest.raises(ValueError, match="token_type_ids must be a tensor"):
        fusedenc.sentence_embeddings(model, ids, mask, [0, 1])
    with pytest.raises(TypeError, match="normalize must be True, False or None"):
        fusedenc.sentence_embeddings(model, ids, mask, normalize="yes")
    with pytest.raises(TypeError, match=r"unexpected arguments \['modality'\] for a .*SentenceTransformer"):
        fusedenc.sentence_embeddings(model, ids, mask, modality="text")  # an ST's tokenize() given to an HF model
    import transformers

    classifier, _ = _models(gen, head=transformers.AutoModelForSequenceClassification)
    with pytest.raises(TypeError, match=r"needs a base model whose first output is the last hidden state .* "
                                        r"returned \(6, 2\) first"):  # fmt: skip
        fusedenc.sentence_embeddings(classifier, ids, mask, types)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sentence_embeddings_refuse_ids_outside_the_tables_before_running(model_type, gen, hf_calls, monkeypatch):
    """Host ids or token types outside the model's embedding tables (a tokenizer of another
    model) are refused with the offending value before the short path or HF's forward runs,
    patched or not; the largest and smallest valid values pass."""
    model, ref = _models(gen, model_type)
    ids, types, mask = _batch(gen)
    vocab = SMALL["vocab_size"]
    calls = hf_calls(model)

    def must_not_run(*args, **kwargs):
        raise AssertionError("the short path ran on ids it should have refused")

    monkeypatch.setattr(model, "_fusedenc_pooled_call", must_not_run)
    for bad, value in ((ids.clone(), vocab), (ids.clone(), -1), (ids.to(torch.int32), vocab + 1000)):
        bad[1, 2] = value
        for m in (model, ref):
            with pytest.raises(IndexError, match=rf"input_ids holds {value}, outside the model's vocabulary of {vocab} "):
                fusedenc.sentence_embeddings(m, bad, mask)
    bad_types = types.clone()
    bad_types[0, 0] = SMALL["type_vocab_size"]
    with pytest.raises(IndexError, match=rf"token_type_ids holds {SMALL['type_vocab_size']}, outside .* token types"):
        fusedenc.sentence_embeddings(model, ids, mask, bad_types)
    assert calls == []
    monkeypatch.undo()
    edges = ids.clone()
    edges[0, :2] = torch.tensor([0, vocab - 1])
    assert fusedenc.sentence_embeddings(model, edges, mask).shape == (ids.shape[0], SMALL["hidden_size"])
