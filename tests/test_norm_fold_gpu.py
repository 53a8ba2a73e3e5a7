"""LayerNorm folded into the GEMMs on an H100 (issue 20, lever 2): the Hopper norm and
residual GEMMs and the statistics kernel against fp32 references with the tolerance rule
(``helpers.assert_close_rule``) and NaN-poisoned outputs; then whole folded stacks at
t82, bt4 and bert-base widths, with large residual means, and an Lc0 net.

Each test asserts first that the kernels really run (``core.sm90_fold_applies`` /
``norm_fold.applies``), so a dispatch change cannot turn these into tests of
the torch fallback.  They skip off compute capability 9.0 or without the kernels."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from encoder_helpers import randomize, stack_formula
from helpers import assert_close_rule, poisoned, randn

from fusedenc import EncoderBlock, EncoderStack, core
from fusedenc.common.activations import apply_activation
from fusedenc.common.device import current_stream
from fusedenc.ops import norm_fold
from fusedenc.testing import layer_norm_folding

pytestmark = pytest.mark.gpu

DEV = "cuda"
HALF = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def _require(dtype=torch.float16):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the folded LayerNorm GEMMs run on compute capability 9.0 only")
    a = torch.empty((512, 64), dtype=dtype, device=DEV)
    w = torch.empty((128, 64), dtype=dtype, device=DEV)
    out = torch.empty((512, 128), dtype=dtype, device=DEV)
    ok, why = core.sm90_fold_applies(a, w, out)
    if not ok:
        pytest.skip(f"no folded LayerNorm GEMMs here: {why}")


def _ln_inputs(m, k, dtype, gen, mean=2.0):
    z = (randn((m, k), torch.float32, gen=gen, scale=1.5) + mean).to(DEV, dtype)
    gamma = (1 + 0.5 * randn((k,), torch.float32, gen=gen)).to(DEV, dtype)
    beta = (0.3 * randn((k,), torch.float32, gen=gen) + 0.1).to(DEV, dtype)
    return z, gamma, beta


def _device():
    return torch.device(DEV, torch.cuda.current_device())


def _ws():
    stream = current_stream(_device())
    return stream, core.workspace(_device(), stream)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("act", ["none", "relu", "swish", "mish", "gelu"])
@pytest.mark.parametrize(
    "m,k,n",
    [
        (16384, 768, 2304),  # t82 QKV / FFN1 at 256 positions
        (4096 + 40, 1024, 1536),  # bt4 FFN1, M not a multiple of the tile
        (16384, 768, 32),  # smolgen's compress: one partial N tile
        (8192 + 8, 768, 3072),  # bert-base FFN1
        (16384 + 40, 1024, 3072),  # bt4 QKV: the wide-tile kernel without an activation, M partial
    ],
)
@pytest.mark.sweep
def test_norm_gemm_is_layer_norm_then_linear(dtype, act, m, k, n, gen):
    _require(dtype)
    z, gamma, beta = _ln_inputs(m, k, dtype, gen)
    w = randn((n, k), dtype, device=DEV, gen=gen, scale=k**-0.5)
    b = randn((n,), dtype, device=DEV, gen=gen)
    f = norm_fold.fold(w, b, gamma, beta)
    rstd, shift = norm_fold.stats(z, 1e-5)
    out = poisoned((m, n), dtype, DEV)
    assert core.sm90_fold_applies(z, f.weight, out)[0]
    assert core.sm90_norm_gemm(z, f.weight, out, f.bias, act, rstd, shift, f.colsum, *_ws())
    ln32 = F.layer_norm(z.float(), (k,), gamma.float(), beta.float(), 1e-5)
    ref = apply_activation(F.linear(ln32, w.float(), b.float()), act)
    same = apply_activation(F.linear(F.layer_norm(z, (k,), gamma, beta, 1e-5), w, b), act)
    assert_close_rule(out, ref, same, dtype, what=f"norm gemm {act} {m}x{k}x{n} seed {gen.seed_value}")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("pending", [False, True], ids=["plain", "pending"])
@pytest.mark.parametrize("m,k,n", [(16384, 2304, 768), (4096 + 40, 1024, 1024), (8192, 768, 776)])
def test_residual_gemm_and_its_statistics(dtype, pending, m, k, n, gen):
    _require(dtype)
    alpha = 0.6
    x = randn((m, k), dtype, device=DEV, gen=gen)
    w = randn((n, k), dtype, device=DEV, gen=gen, scale=k**-0.5)
    b = randn((n,), dtype, device=DEV, gen=gen)
    c, gamma, beta = _ln_inputs(m, n, dtype, gen, mean=-3.0)
    prev = None
    if pending:
        rstd_p, shift_p = norm_fold.stats(c, 1e-5)
        prev = norm_fold.NormedRows(c, rstd_p, shift_p, gamma, beta)
        r32 = F.layer_norm(c.float(), (n,), gamma.float(), beta.float(), 1e-5)
        r16 = F.layer_norm(c, (n,), gamma, beta, 1e-5)
    else:
        r32, r16 = c.float(), c
    tm, tn = core.stats_tile()
    sums = torch.full((2, -(-n // tn), -(-m // tm) * tm), float("nan"), device=DEV)
    out = poisoned((m, n), dtype, DEV)
    assert core.sm90_fold_applies(x, w, out, c)[0]
    assert core.sm90_residual_gemm(x, w, out, b, c, alpha, prev, sums[0], sums[1], *_ws())
    ref = alpha * F.linear(x.float(), w.float(), b.float()) + r32
    same = alpha * F.linear(x, w, b) + r16
    assert_close_rule(out, ref, same, dtype, what=f"residual gemm {m}x{k}x{n} seed {gen.seed_value}")
    rstd = torch.full((m,), float("nan"), device=DEV)
    shift = torch.full((m,), float("nan"), device=DEV)
    core.norm_stats(sums[0], sums[1], n, 1e-5, rstd, shift, current_stream(_device()))
    want_rstd, want_shift = norm_fold.stats(ref, 1e-5)  # of the fp32 sum, as the epilogue sees it
    torch.testing.assert_close(rstd, want_rstd, rtol=1e-4, atol=0)
    torch.testing.assert_close(shift, want_shift, rtol=1e-4, atol=1e-4)


def test_norm_stats_kernel_and_its_checks(gen):
    _require()
    rows, cols, tiles, ld = 1000, 768, 6, 1024
    z = randn((rows, cols), torch.float64, gen=gen) * 2 + 5
    parts = z.view(rows, tiles, cols // tiles)
    sums = torch.zeros((2, tiles, ld), dtype=torch.float32)
    sums[0, :, :rows] = parts.sum(-1).t().float()
    sums[1, :, :rows] = (parts**2).sum(-1).t().float()
    sums = sums.to(DEV)
    rstd = torch.full((rows,), float("nan"), device=DEV)
    shift = torch.full((rows,), float("nan"), device=DEV)
    stream = current_stream(_device())
    core.norm_stats(sums[0], sums[1], cols, 1e-5, rstd, shift, stream)
    var, mean = torch.var_mean(z, dim=1, unbiased=False)
    want = (var + 1e-5).rsqrt()
    torch.testing.assert_close(rstd.double().cpu(), want, rtol=1e-5, atol=0)
    torch.testing.assert_close(shift.double().cpu(), -mean * want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ld >= rows"):
        core.native_module().norm_stats(0, stream, rows, cols, tiles, rows - 1, sums[0].data_ptr(),
                                        sums[1].data_ptr(), rstd.data_ptr(), shift.data_ptr(), 1e-5)


def test_bad_fold_arguments_raise_before_launch(gen):
    _require()
    x = randn((4096, 768), torch.float16, device=DEV, gen=gen)
    w = randn((768, 768), torch.float16, device=DEV, gen=gen)
    out = torch.empty((4096, 768), dtype=torch.float16, device=DEV)
    rstd = torch.ones(4096, device=DEV)
    with pytest.raises(ValueError, match="rstd and shift come together"):
        core.sm90_norm_gemm(x, w, out, None, "none", rstd, None, None, *_ws())
    with pytest.raises(ValueError, match="not 16-byte aligned|multiple of 16 bytes"):
        core.sm90_norm_gemm(x[:, 1:], w[:, 1:], out, None, "none", None, None, None, *_ws())


# ------------------------------------------------------------ whole stacks ----


def _stack(layers, d, heads, d_ff, act, dtype, gen, mean=0.0):
    stack = EncoderStack([randomize(EncoderBlock(d, heads, d_ff, act, residual_alpha=0.7, dtype=dtype, device=DEV), gen)
                          for _ in range(layers)])  # fmt: skip
    if mean:
        with torch.no_grad():
            for b in stack.blocks:
                b.norm1_bias.add_(mean)
                b.norm2_bias.add_(mean)
    return stack.eval()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    "preset,d,heads,d_ff,act,batch,seq",
    [
        ("t82", 768, 24, 2304, "swish", 256, 64),
        ("bt4", 1024, 32, 1536, "mish", 256, 64),
        ("bert-base", 768, 12, 3072, "gelu", 128, 128),
    ],
)
def test_folded_stack_matches_the_fp32_reference(dtype, preset, d, heads, d_ff, act, batch, seq, gen):
    _require(dtype)
    stack = _stack(3, d, heads, d_ff, act, dtype, gen)
    x = randn((batch, seq, d), dtype, device=DEV, gen=gen)
    assert norm_fold.applies(stack.blocks, x.view(-1, d))
    with torch.inference_mode():
        out = stack(x)
        with layer_norm_folding("off"):
            unfolded = stack(x)
    ref = stack_formula(stack.blocks, x, dtype=torch.float32)
    same = stack_formula(stack.blocks, x, dtype=dtype)
    assert_close_rule(out, ref, same, dtype, what=f"folded {preset} seed {gen.seed_value}")
    assert_close_rule(unfolded, ref, same, dtype, what=f"unfolded {preset} seed {gen.seed_value}")


def test_folded_stack_with_large_residual_means(gen):
    _require()
    stack = _stack(3, 768, 24, 2304, "swish", torch.float16, gen, mean=20.0)
    x = randn((256, 64, 768), torch.float16, device=DEV, gen=gen) + 20.0
    with torch.inference_mode():
        out = stack(x)
    ref = stack_formula(stack.blocks, x, dtype=torch.float32)
    same = stack_formula(stack.blocks, x, dtype=torch.float16)
    assert_close_rule(out, ref, same, torch.float16, what=f"mean 20, seed {gen.seed_value}")


def test_small_batches_keep_the_layer_norm_passes(gen):
    _require()
    stack = _stack(2, 768, 24, 2304, "swish", torch.float16, gen)
    assert not norm_fold.applies(stack.blocks, torch.empty((64 * 64, 768), dtype=torch.float16, device=DEV))
    assert norm_fold.applies(stack.blocks, torch.empty((256 * 64, 768), dtype=torch.float16, device=DEV))


def test_lc0_network_folded_matches_unfolded_and_reference(tmp_path, gen):
    _require()
    sys.path.insert(0, "tests")
    from lc0_writer import random_planes, write_preset

    from fusedenc.lc0 import load_network

    path = tmp_path / "t82.pb.gz"
    write_preset(str(path), "t82", seed=gen.seed_value % 1000)
    net = load_network(str(path), dtype=torch.float16, device=DEV)
    planes = random_planes(256, gen).to(DEV, torch.float16)
    assert norm_fold.applies(net.blocks, torch.empty((256 * 64, net.blocks[0].d_model), dtype=torch.float16, device=DEV))
    folded = net(planes)
    with layer_norm_folding("off"):
        unfolded = net(planes)
    ref = load_network(str(path), dtype=torch.float32, device=DEV)(planes.float())
    for name in folded:
        err_f = (folded[name].float() - ref[name]).abs().max().item()
        err_u = (unfolded[name].float() - ref[name]).abs().max().item()
        assert err_f <= 2 * err_u + 1e-2, f"{name}: folded error {err_f:.3g} vs unfolded {err_u:.3g}"
