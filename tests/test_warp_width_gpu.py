"""The reductions at every warp width the core is compiled for (csrc/kernels/warp.cuh).

The LayerNorm and FP8-quantization kernels reduce across a warp with shuffles, then across warps
through shared memory, with the width W a template parameter the host picks per device: 32 on
NVIDIA and on AMD's RDNA GPUs (wave32), 64 on CDNA (MI200/MI300, wave64).  The HIP core holds
W = 32 and 64; no NVIDIA GPU has 64 lanes, so the CUDA core runs the same templates at its own
32 and, in a test build (FUSEDENC_WARP_TESTS=1, which tools/build_core.sh sets), at 16: any W up
to the hardware's is valid (the shuffles stay inside aligned groups of W lanes), and halving W
moves every row length to the other side of the warp boundary -- what wave32 does to the row
lengths that wave64 reduces in one warp.  Every width must give the reference's LayerNorm (by the
tolerance rule: the sums' order changes with W) and the same FP8 codes and scales bit for bit (a
maximum does not depend on the order).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rule, poisoned, randn, ref_dtype
from layer_norm_helpers import ln_formula, ln_same_dtype

import fusedenc.ops.norm  # noqa: F401 - registers the ops
from fusedenc import core
from fusedenc.common.device import current_stream
from fusedenc.fp8 import rowwise as fp8
from fusedenc.ops.norm import layer_norm

DEV = "cuda"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Row lengths whose thread groups are narrower than, equal to and wider than a warp of 16, 32
# and 64 lanes (16-byte vectors: 8 fp16 or 4 fp32 values a thread per chunk, up to 4 chunks).
DIMS = [8, 64, 128, 256, 512, 768, 1024, 2048, 4096, 16384]


def _module():
    module = core.native_module()
    if module is None:
        pytest.skip(f"no native core: {core.backend()}")
    return module


def _hardware_warp() -> int:
    return getattr(torch.cuda.get_device_properties(0), "warp_size", 32)  # torch says, where it can


def _widths() -> list[int]:
    module = core.native_module()
    if module is None:
        return [32]
    hardware = _hardware_warp() if torch.cuda.is_available() else 64
    return [w for w in module.WARP_WIDTHS if w <= hardware]


@pytest.fixture
def width(request):
    """Forces the reductions' warp width for the test, then back to each device's own."""
    module = _module()
    module.set_forced_warp_width(request.param)
    yield request.param
    module.set_forced_warp_width(0)


def test_the_core_lists_the_widths_it_is_compiled_for():
    module = _module()
    widths = tuple(module.WARP_WIDTHS)
    assert 32 in widths and widths == tuple(sorted(widths))
    assert (64 in widths) == (module.VENDOR == "hip")  # wave64: AMD's CDNA only
    assert set(widths) <= {16, 32, 64}
    for bad in (8, 128, 48):
        with pytest.raises(ValueError, match="not one this build's reductions are compiled for"):
            module.set_forced_warp_width(bad)
    assert module.forced_warp_width() == 0


@pytest.mark.gpu
def test_each_device_runs_its_own_width():
    module = _module()
    assert module.reduction_warp_width(0) == _hardware_warp()
    if module.VENDOR == "cuda":
        with pytest.raises(ValueError):
            module.set_forced_warp_width(64)  # no NVIDIA GPU has 64 lanes: not compiled


@pytest.mark.gpu
def test_the_gpu_machine_build_holds_a_narrower_width():
    """tools/build_core.sh builds with FUSEDENC_WARP_TESTS=1: the tests below then run two widths."""
    module = _module()
    if module.VENDOR == "cuda" and 16 not in module.WARP_WIDTHS:
        pytest.skip("this CUDA core was built without FUSEDENC_WARP_TESTS=1: only the 32-lane reductions run")
    assert len(_widths()) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("width", _widths(), indirect=True, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("d", DIMS)
def test_layer_norm_at_each_width(width, dtype, d, gen):
    t = 37  # rows that do not fill the last block
    x = randn((t, d), dtype, DEV, gen=gen)
    residual = (randn((t, d), dtype, DEV, gen=gen) + 3.0).to(dtype)  # a row mean away from 0
    weight, bias, x_bias = (randn((d,), dtype, DEV, gen=gen) for _ in range(3))
    out, sum_out = poisoned((t, d), dtype, DEV), poisoned((t, d), dtype, DEV)
    layer_norm(x, weight, bias, 1e-5, residual=residual, alpha=0.7, x_bias=x_bias, out=out, sum_out=sum_out)
    args = (x, weight, bias, 1e-5, residual, 0.7, x_bias)
    ref, ref_h = ln_formula(*args, dtype=ref_dtype(dtype))
    same, same_h = ln_same_dtype(*args)
    what = f"W={width} D={d} {dtype} seed={gen.seed_value}"
    assert_close_rule(out, ref, same, dtype, what=what)
    assert_close_rule(sum_out, ref_h, same_h, dtype, what=f"{what} sum_out")


def _require_fp8():
    if not core.fp8_status(torch.device(DEV, torch.cuda.current_device()))[0]:
        pytest.skip("no FP8 on this GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("width", _widths(), indirect=True, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("k", [16, 1000, 1024, 2048, 2304, 4096, 8192])
def test_fp8_quantize_rows_is_bit_identical_at_each_width(width, dtype, k, gen):
    """Both kernels (one warp a row while the row fits the registers, k <= 8 x W x 16 bytes, else
    one block a row; k = 1000 is not a whole number of vectors: the block kernel) against the
    CPU reference, which fixes every code and scale."""
    _require_fp8()
    x = randn((67, k), dtype, DEV, gen=gen, scale=3.0)
    x[5] = 0  # a row of zeros: scale 1
    got = fp8.quantize_rows(x)
    want = fp8.quantize_rows(x.cpu(), fp8.format_for(x.device))
    assert torch.equal(got.scale.cpu(), want.scale), f"W={width} k={k} {dtype}: scales differ"
    assert torch.equal(got.q.view(torch.uint8).cpu(), want.q.view(torch.uint8)), f"W={width} k={k} {dtype}: codes differ"


@pytest.mark.gpu
@pytest.mark.parametrize("width", _widths(), indirect=True, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("cols", [64, 768, 1024, 4096, 16384])
def test_layer_norm_fp8_copy_at_each_width(width, dtype, cols, gen):
    """The LayerNorm's e4m3 copy: the codes quantize_rows makes of its output, bit for bit."""
    _require_fp8()
    rows = 37
    x = randn((rows, cols), dtype, DEV, gen=gen)
    w, b = randn((cols,), dtype, DEV, gen=gen, scale=30.0), randn((cols,), dtype, DEV, gen=gen)
    out = torch.full_like(x, float("nan"))
    q = torch.full((rows, cols), 0x7F, dtype=torch.uint8, device=DEV)
    scale = torch.full((rows,), float("nan"), device=DEV)
    # FP8 runs here (_require_fp8): a failing launch is a failure, not a skip
    core.layer_norm(x=x, ldx=cols, rows=rows, cols=cols, out=out, ldo=cols, weight=w, bias=b, eps=1e-5,
                    q_out=q, q_scale=scale, stream=current_stream(x.device))  # fmt: skip
    want = fp8.quantize_rows(out)
    assert torch.equal(scale, want.scale), f"W={width} D={cols} {dtype}: scales differ"
    assert torch.equal(q, want.q.view(torch.uint8)), f"W={width} D={cols} {dtype}: codes differ"
