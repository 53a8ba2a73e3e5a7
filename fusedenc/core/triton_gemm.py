"""FFN1 in one kernel: ``act(x @ W^T + b)`` as a Triton GEMM with its own activation epilogue.

cuBLASLt has no swish, mish, relu^2, selu or exact-GELU epilogue, so
``fusedenc.linear`` runs those as the BIAS epilogue followed by an in-place
activation pass: one extra read and write of the ``[T, F]`` output (about
45 us per layer at t82).  This kernel applies the activation to the fp32
accumulator tile while it is still in registers and stores once.  Whether
that wins depends on how close a Triton GEMM gets to cuBLASLt at the shape:
``bench/ops.py`` measures it against the BIAS-epilogue + kernel path
(bench/NOTES.md, "FFN1 GEMM with its own activation epilogue").

Design:

* one program per ``BLOCK_M x BLOCK_N`` output tile (not persistent), in
  grouped order: ``GROUP_M`` row blocks share a column block before moving
  on, so a band of W tiles stays in L2 while the x rows stream.  Not
  persistent because the gain of a persistent Hopper GEMM comes from
  overlapping one tile's epilogue with the next tile's loads, which needs TMA
  descriptors / warp specialization whose Triton APIs changed between 3.6
  and 3.9; the default large-M tile (128 x 128 x 64, 3 stages, 96 KB of
  shared memory) lets two programs share an SM instead, so one's epilogue
  overlaps the other's main loop;
* x ``[M, K]`` and W ``[N, K]`` (``nn.Linear`` layout) are read through
  pointers with any row strides; row strides are passed in units of 16 bytes
  and multiplied back in the kernel, so the compiler knows every row starts
  16-byte aligned and vectorizes the loads whatever the stride;
* rows past M and columns past N are clamped (wrapped) on load, so the main
  loop has no masks; K needs masks only when it is not a multiple of BLOCK_K;
* epilogue: ``+ bias`` and the activation in fp32 on the accumulator, one
  rounding to the output dtype, a masked store into ``[M, N]`` rows of any
  row stride.

Math, the same as ``fusedenc.reference_linear``: fp32 accumulation (fp32
inputs: full-precision products, no TF32), ``act(acc + bias)``, rounded once.
The activations use only ``exp``/``erf``/division (so Triton's interpreter runs
them too) in forms with no overflow to NaN: swish ``x / (1 + e^-x)``, mish
``x * n / (n + 2)`` with ``n = e^x (e^x + 2)`` (that is ``x * tanh(softplus(x))``
exactly) and ``x`` above 20 (torch's softplus threshold), gelu_tanh
``x * sigmoid(2u)``, relu written as a comparison, and so on; NaN in gives NaN
out for every activation, like csrc/kernels/bias_activation.cu.

Importing this module imports Triton; ``import fusedenc`` does not import it.
Set ``TRITON_INTERPRET=1`` before the import to run the kernel on CPU tensors
(slowly: the tests do that).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import checks
from ..common.activations import canonical_activation
from .gemm_routes import GemmConfig  # defined there so that loading routes needs no Triton import

__all__ = [
    "CANDIDATES", "GemmConfig", "launch", "launch_config", "linear_act", "m_bucket", "sweep", "tuning_candidates",
]  # fmt: skip


#: Largest M bucket: every M above 4096 shares one entry.
_LARGE_M = 8192


def m_bucket(m: int) -> int:
    """The table's M key: the next power of two >= m, between 16 and 8192 (8192 = any M > 4096)."""
    return min(_LARGE_M, max(16, triton.next_power_of_2(max(int(m), 1))))


def _default_config(bucket: int) -> GemmConfig:
    """Guessed for an H100, not yet measured.

    Small M reads all of W for a few rows: narrow column blocks give more
    programs to pull W through more SMs.  Large M: 128 x 128 x 64 with 8 warps
    (two warpgroups of wgmma, 64 fp32 accumulators per thread, room for the
    epilogue's temporaries) and 3 stages (96 KB of shared memory, two programs
    per SM).
    """
    if bucket <= 16:
        return GemmConfig(16, 32, 128, 1, 4, 4)
    if bucket <= 32:
        return GemmConfig(32, 32, 128, 1, 4, 4)
    if bucket <= 64:
        return GemmConfig(64, 64, 64, 1, 4, 4)
    if bucket <= 512:
        return GemmConfig(64, 128, 64, 8, 4, 4)
    return GemmConfig(128, 128, 64, 8, 8, 3)


#: (M bucket, N, K) -> config, for 16-bit inputs.  The FFN1 shapes of the
#: bench presets (t82: N 2304, K 768; bt4: 1536, 1024; bert-base: 3072, 768)
#: hold the default until ``sweep`` has measured them on the GPU: replace the
#: entries with its winners (and add the small-M buckets that matter).
_CONFIGS: dict[tuple[int, int, int], GemmConfig] = {
    (_LARGE_M, 2304, 768): _default_config(_LARGE_M),
    (_LARGE_M, 1536, 1024): _default_config(_LARGE_M),
    (_LARGE_M, 3072, 768): _default_config(_LARGE_M),
}

#: What ``sweep`` tries by default: the Triton matmul tutorial's Hopper-friendly
#: configs around the default (block_k 64 = one 128-byte row of fp16 per load).
CANDIDATES: tuple[GemmConfig, ...] = (
    GemmConfig(128, 128, 64, 8, 8, 3),
    GemmConfig(128, 128, 64, 8, 4, 3),
    GemmConfig(128, 128, 64, 8, 4, 4),
    GemmConfig(128, 256, 64, 8, 8, 3),
    GemmConfig(256, 128, 64, 8, 8, 3),
    GemmConfig(128, 64, 64, 8, 4, 4),
    GemmConfig(64, 128, 64, 8, 4, 4),
    GemmConfig(128, 128, 32, 8, 4, 4),
)


def _fit(block: int, size: int) -> int:
    """Shrink a tile dimension to the problem: at most next_power_of_2(size), at least 16 (tl.dot's minimum)."""
    return max(16, min(block, triton.next_power_of_2(size)))


@functools.lru_cache(maxsize=None)
def launch_config(m_key: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """The table's config for ``(m_bucket(M), N, K)`` (else the bucket's default), fitted to the problem.

    Float32 inputs take block_k <= 32 and <= 3 stages: their tiles are twice as many bytes.
    """
    return _fitted(_CONFIGS.get((m_key, n, k)) or _default_config(m_key), m_key, n, k, dtype)


def _fitted(cfg: GemmConfig, m_key: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    block_k, stages = cfg.block_k, cfg.num_stages
    if dtype == torch.float32:
        block_k, stages = min(block_k, 32), min(stages, 3)
    return cfg._replace(
        block_m=_fit(cfg.block_m, m_key), block_n=_fit(cfg.block_n, n), block_k=_fit(block_k, k), num_stages=stages
    )


#: Small-M alternatives ``tuning_candidates`` tries (block_m follows the M bucket):
#: narrow or wide column blocks, deeper or shallower K steps.
_SMALL_M_SHAPES = ((32, 128, 4), (64, 128, 3), (64, 64, 4), (128, 64, 4))  # (block_n, block_k, stages)


def tuning_candidates(m: int, n: int, k: int, dtype: torch.dtype) -> list[GemmConfig]:
    """The configs ``tune gemm`` times at one problem: the table's (first), then the
    large-M ``CANDIDATES`` or the small-M alternatives, each fitted to the problem, no repeats."""
    m_key = m_bucket(m)
    pool = [launch_config(m_key, n, k, dtype)]
    if m_key <= 64:
        pool += [GemmConfig(m_key, bn, bk, 1, 4, stages) for bn, bk, stages in _SMALL_M_SHAPES]
    else:
        pool += list(CANDIDATES)
    out: list[GemmConfig] = []
    for cfg in pool:
        cfg = _fitted(cfg, m_key, n, k, dtype)
        if cfg not in out:
            out.append(cfg)
    return out


# ------------------------------------------------------------ the kernel ----


@triton.jit
def _tanh(x):
    # Odd and saturating: e = exp(-2|x|) is in [0, 1], so nothing overflows; NaN stays NaN.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr):
    """``ACTIVATION`` (a name from fusedenc.ACTIVATIONS) on fp32 ``x``; NaN in gives NaN out."""
    if ACTIVATION == "relu":
        y = tl.where(x < 0.0, 0.0, x)  # a comparison, not max: NaN < 0 is false, so NaN passes
    elif ACTIVATION == "relu2":
        r = tl.where(x < 0.0, 0.0, x)
        y = r * r
    elif ACTIVATION == "gelu_tanh":
        # 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = x / (1.0 + tl.exp(-2.0 * u))
    elif ACTIVATION == "gelu":
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == "swish":
        y = x / (1.0 + tl.exp(-x))
    elif ACTIVATION == "mish":
        # tanh(log(1 + e)) = n / (n + 2) with n = e (e + 2): one exp, one division, and
        # no cancellation for negative x.  Above 20 softplus(x) = x and tanh = 1 in fp32
        # (torch's threshold); the clamp keeps e finite there (where, not minimum: NaN stays).
        e = tl.exp(tl.where(x > 20.0, 20.0, x))
        n = e * (e + 2.0)
        y = tl.where(x > 20.0, x, x * (n / (n + 2.0)))
    elif ACTIVATION == "selu":
        neg = tl.where(x > 0.0, 0.0, x)  # exp only of the non-positive part: no overflow
        y = 1.0507009873554805 * tl.where(x > 0.0, x, 1.6732632423543772 * (tl.exp(neg) - 1.0))
    elif ACTIVATION == "tanh":
        y = _tanh(x)
    elif ACTIVATION == "sigmoid":
        y = 1.0 / (1.0 + tl.exp(-x))
    else:
        tl.static_assert(ACTIVATION == "none", "unknown activation")
        y = x
    return y


@triton.jit
def _linear_act_kernel(
    a_ptr, w_ptr, bias_ptr, d_ptr,
    M, N, K, lda_units, ldw_units, ldd_units,
    ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # Row strides arrive in units of ALIGN elements (16 bytes): the product tells the
    # compiler that every row starts 16-byte aligned.
    lda = lda_units * ALIGN
    ldw = ldw_units * ALIGN
    ldd = ldd_units * ALIGN

    # Grouped order: GROUP_M row blocks walk one column block before the next one.
    pid = tl.program_id(0)
    pid_rows = tl.cdiv(M, BLOCK_M)
    pid_cols = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * pid_cols
    first_row = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(pid_rows - first_row, GROUP_M)
    pid_m = first_row + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Loads wrap rows past M and columns past N onto valid ones (their results are
    # never stored), so the main loop needs no row or column masks.  int64: M * lda
    # can pass 2**31 elements.
    a_rows = (rows % M).to(tl.int64)
    w_rows = (cols % N).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * lda + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + w_rows[None, :] * ldw + ks[:, None]  # [BLOCK_K, BLOCK_N]: W^T, k contiguous

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=ks[:, None] < k_left, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    y = _activate(acc, ACTIVATION)

    d_ptrs = d_ptr + rows.to(tl.int64)[:, None] * ldd + cols[None, :]
    tl.store(d_ptrs, y.to(d_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


# ------------------------------------------------------------ launcher ----


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def linear_act(
    x: torch.Tensor,
    w: torch.Tensor,
    b: Optional[torch.Tensor] = None,
    activation: str = "none",
    *,
    out: Optional[torch.Tensor] = None,
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """``act(x @ w.T + b)`` in one Triton kernel; returns ``[..., N]`` (``out`` when given).

    The argument rules of ``fusedenc.linear`` (``checks.check_linear``), without
    residual or alpha: x ``[..., K]`` with unit last stride and any row stride,
    w ``[N, K]`` row-major (any row stride), b ``[N]`` contiguous or None, out
    ``[..., N]`` or None; fp16, bf16 or fp32; K, N and row strides multiples of
    16 bytes, 16-byte aligned data.  GPU tensors (CPU tensors only under
    ``TRITON_INTERPRET=1``).  ``config`` overrides the table (benchmarks,
    tests); it is used as given, not fitted to the problem.
    """
    activation = canonical_activation(activation)
    p = checks.check_linear(x, w, b, activation, None, 1.0, 1.0, out)
    if not (x.is_cuda or _interpreting()):
        raise ValueError(f"x is on {x.device}: linear_act runs on GPU tensors (on CPU only under TRITON_INTERPRET=1)")
    if out is None:
        out = torch.empty(p.out_shape, dtype=x.dtype, device=x.device)
    if p.m == 0:
        return out
    cfg = config or launch_config(m_bucket(p.m), p.n, p.k, x.dtype)
    _launch(p.x2d, p.ldx, w, p.ldw, b, out, p.ldo, p.m, p.n, p.k, activation, cfg)
    return out


def launch(
    x2d: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], out: torch.Tensor, activation: str, config: GemmConfig
) -> None:
    """``out[M, N] = act(x2d[M, K] @ w[N, K]^T + b)`` for dense rows, with no argument checks.

    For callers that already validated the problem (``fusedenc.linear``, the
    encoder's native path, ``tune gemm``): contiguous 2-D ``x2d`` and ``out``,
    ``w`` row-major, M > 0, the rules of ``linear_act``; ``activation`` canonical.
    """
    m, k = x2d.shape
    n = w.shape[0]
    _launch(x2d, k, w, k, b, out, n, m, n, k, activation, config)


def _launch(x2d, ldx, w, ldw, b, out, ldo, m, n, k, activation, cfg: GemmConfig) -> None:
    if x2d.is_cuda and x2d.device.index != torch.cuda.current_device():
        with torch.cuda.device(x2d.device):  # Triton launches on the current device's stream
            return _launch(x2d, ldx, w, ldw, b, out, ldo, m, n, k, activation, cfg)
    align = checks.align_elems(x2d.dtype)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _linear_act_kernel[grid](
        x2d, w, x2d if b is None else b, out,  # x2d: a placeholder pointer, never read
        m, n, k, ldx // align, ldw // align, ldo // align,
        ALIGN=align,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=b is not None, ACTIVATION=activation,
        # fp32 inputs: full-precision products, not TF32; 16-bit inputs: the target's default
        PRECISION="ieee" if x2d.dtype == torch.float32 else None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


# ------------------------------------------------------------ tuning ----


def sweep(
    m: int,
    n: int,
    k: int,
    activation: str = "none",
    dtype: torch.dtype = torch.float16,
    configs: tuple[GemmConfig, ...] = CANDIDATES,
    device: str = "cuda",
) -> list[tuple[float, GemmConfig]]:
    """Time ``linear_act`` with bias at one shape under each config on the GPU; ``[(us, config)]``, fastest first.

    Each config's output is checked against the table's config first (a config
    that fails to compile or disagrees is reported as ``inf``).  Median of
    ``triton.testing.do_bench``; L2 is flushed between calls by do_bench.  Use
    the winners to fill ``_CONFIGS``.
    """
    import triton.testing  # only here: the kernel itself does not need it

    activation = canonical_activation(activation)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((m, k), generator=g, device=device).to(dtype)
    w = (torch.randn((n, k), generator=g, device=device) * k**-0.5).to(dtype)
    b = (torch.randn((n,), generator=g, device=device) * 0.1).to(dtype)
    ref = linear_act(x, w, b, activation).float()
    results = []
    for cfg in configs:
        out = torch.empty((m, n), dtype=dtype, device=device)
        try:
            linear_act(x, w, b, activation, out=out, config=cfg)
            err = (out.float() - ref).abs().max().item()
            if not err <= 1e-2 * max(1.0, ref.abs().max().item()):
                raise RuntimeError(f"disagrees with the default config: max abs diff {err:.3g}")
            ms = triton.testing.do_bench(
                lambda cfg=cfg, out=out: linear_act(x, w, b, activation, out=out, config=cfg), quantiles=[0.5]
            )
            results.append((float(ms) * 1e3, cfg))
        except Exception as exc:  # noqa: BLE001 - a config that does not fit this GPU is just not a candidate
            print(f"sweep: {cfg}: {type(exc).__name__}: {exc}")
            results.append((float("inf"), cfg))
    return sorted(results, key=lambda r: r[0])
