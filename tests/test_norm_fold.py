"""LayerNorm folded into the GEMMs (fusedenc.ops.norm_fold, issue 20 lever 2): the algebra on
the CPU, where the folded path runs in torch (``layer_norm_folding("force")``), against
the unfolded path and against fp64 LayerNorm math.  The kernels are
tests/test_norm_fold_gpu.py's."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from helpers import randn

from fusedenc import EncoderStack
from fusedenc.ops import norm_fold
from fusedenc.testing import layer_norm_folding


def _stack(layers, d, heads, d_ff, act, gen, bias=True, norm_first=False, mean=0.0):
    stack = EncoderStack.build(
        layers, d, heads, d_ff, activation=act, residual_alpha=0.7, dtype=torch.float32, device="cpu",
        bias=bias, norm_first=norm_first,
    )  # fmt: skip
    with torch.no_grad():
        for b in stack.blocks:
            for name, p in b.named_parameters():
                if name.startswith("norm") and name.endswith("weight"):
                    p.copy_(1 + 0.5 * randn(p.shape, torch.float32, gen=gen))
                elif name.startswith("norm"):
                    p.copy_(mean + 0.3 * randn(p.shape, torch.float32, gen=gen))
    return stack.eval()


def test_fold_weight_algebra(gen):
    w = randn((48, 32), torch.float32, gen=gen)
    b = randn((48,), torch.float32, gen=gen)
    gamma, beta = randn((32,), torch.float32, gen=gen), randn((32,), torch.float32, gen=gen)
    z = randn((20, 32), torch.float32, gen=gen, scale=3.0) + 5.0
    f = norm_fold.fold(w, b, gamma, beta)
    rstd, shift = norm_fold.stats(z, 1e-5)
    folded = rstd[:, None] * (z @ f.weight.t()) + shift[:, None] * f.colsum + f.bias
    ln = torch.nn.functional.layer_norm(z.double(), (32,), gamma.double(), beta.double(), 1e-5)
    torch.testing.assert_close(folded.double(), ln @ w.double().t() + b.double(), rtol=1e-5, atol=1e-4)
    nobias = norm_fold.fold(w, None, gamma, None)
    torch.testing.assert_close(nobias.bias, torch.zeros(48))


def test_stats_match_layer_norm_with_a_large_mean(gen):
    z = randn((64, 256), torch.float32, gen=gen) + 1000.0
    rstd, shift = norm_fold.stats(z, 1e-5)
    ln = torch.nn.functional.layer_norm(z.double(), (256,), eps=1e-5)
    torch.testing.assert_close((z.double() * rstd[:, None].double() + shift[:, None].double()), ln, rtol=0, atol=2e-3)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", ["mish", "gelu", "relu"])
def test_folded_stack_matches_the_unfolded_one(bias, act, gen):
    stack = _stack(3, 64, 4, 160, act, gen, bias=bias)
    x = randn((3, 24, 64), torch.float32, gen=gen)
    ref = stack(x)
    with layer_norm_folding("force"):
        assert norm_fold.applies(stack.blocks, x.view(-1, 64))
        got = stack(x)
        single = stack.blocks[0](x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(single, stack.blocks[0](x), rtol=1e-4, atol=1e-4)


def test_large_residual_means_stay_accurate(gen):
    """Norm betas of 30: every residual stream has a mean far from zero."""
    stack = _stack(2, 64, 4, 128, "swish", gen, mean=30.0)
    x = randn((2, 16, 64), torch.float32, gen=gen) + 30.0
    ref = stack(x)
    with layer_norm_folding("force"):
        got = stack(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-4)


def test_when_folding_applies(gen):
    post = _stack(2, 64, 4, 128, "relu", gen)
    pre = _stack(2, 64, 4, 128, "relu", gen, norm_first=True)
    rows = torch.zeros((32, 64))
    assert not norm_fold.applies(post.blocks, rows)  # auto: no Hopper kernels on a CPU
    with layer_norm_folding("force"):
        assert norm_fold.applies(post.blocks, rows)
        assert not norm_fold.applies(pre.blocks, rows)  # pre-LN keeps its passes
        assert not norm_fold.applies(post.blocks, rows[:0])  # empty batch
        x = randn((2, 16, 64), torch.float32, gen=gen)
        torch.testing.assert_close(pre(x), pre(x))  # still runs
    with layer_norm_folding("off"):
        assert not norm_fold.applies(post.blocks, rows)
    with pytest.raises(ValueError, match="one of"):
        with layer_norm_folding("sometimes"):
            pass
    with pytest.raises(ValueError, match="post-LN"):
        pre.blocks[0].folded_rows(rows, 2, 16)


def test_fold_cache_follows_parameter_changes_and_copies(gen):
    stack = _stack(2, 64, 4, 128, "mish", gen)
    x = randn((2, 16, 64), torch.float32, gen=gen)
    with layer_norm_folding("force"):
        first = stack(x)
        with torch.no_grad():
            stack.blocks[0].norm1_weight.mul_(2.0)  # in place: the cached fold must not survive
        second = stack(x)
        assert not torch.allclose(first, second)
        torch.testing.assert_close(second, _unfolded(stack, x), rtol=1e-4, atol=1e-4)
        clone = copy.deepcopy(stack)
        torch.testing.assert_close(clone(x), second)
        torch.testing.assert_close(pickle.loads(pickle.dumps(stack))(x), second)


def _unfolded(stack, x):
    with layer_norm_folding("off"):
        return stack(x)


def test_materialize_of_pending_rows(gen):
    z = randn((10, 32), torch.float32, gen=gen) * 2 + 1
    gamma, beta = randn((32,), torch.float32, gen=gen), randn((32,), torch.float32, gen=gen)
    rstd, shift = norm_fold.stats(z, 1e-5)
    pending = norm_fold.NormedRows(z, rstd, shift, gamma, beta)
    ref = torch.nn.functional.layer_norm(z, (32,), gamma, beta, 1e-5)
    torch.testing.assert_close(norm_fold.materialize(pending, 1e-5), ref, rtol=1e-5, atol=1e-5)
    assert norm_fold.materialize(z, 1e-5) is z


def test_a_stack_built_under_inference_mode_folds(gen):
    """Its parameters are inference tensors: no version counter to key the fold cache on."""
    with torch.inference_mode():
        stack = _stack(2, 64, 4, 128, "swish", gen)
        x = randn((2, 16, 64), torch.float32, gen=gen)
        ref = _unfolded(stack, x)
        with layer_norm_folding("force"):
            got = stack(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
