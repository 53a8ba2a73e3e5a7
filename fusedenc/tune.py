"""Measure kernels on this GPU and write the tables fusedenc picks them from.

    python -m fusedenc.tune attention [--dtype float16] [--head-dims 32,64,128]
        [--seq-lens 64,128,...] [--batch-heads 64,512,4096]
        [--variants none,bias,mask,bias+mask] [--out PATH] [--quick]

Each subcommand registers itself in ``SUBCOMMANDS`` (a later ``gemm`` sits
beside ``attention``).  ``attention`` times every backend that can serve each
table key on inputs laid out like ``fused_qkv``'s (strided views of one packed
``[B, S, 3, H, Dh]`` buffer), after checking its output against sdpa_math
with the tolerance rule ``|out - ref| <= 2 * |math - ref| + atol`` (a fast
wrong answer cannot win).  Times are medians of at least 20 CUDA-event-timed
replays of a CUDA graph holding a few calls (device time, no host overhead;
eager launches when capture fails).  It prints one table per
(dtype, head dim, batch*heads, variant) with the winner and crossover points,
and writes the user table (merged with an existing one measured on this same
setup, unless ``--replace``) with the device and library versions.

Each measured point becomes one exact rule for its table key (its sequence and
batch*heads buckets); keys nobody measured fall through to the shipped table.
On an H100, ``--quick`` takes under a minute; the full default grid (432 points)
about 12 minutes, most of it cuDNN graph builds and the sdpa_math timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
from typing import Callable, Optional

import torch

__all__ = ["SUBCOMMANDS", "main"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_ATOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(x <= 0 for x in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in values if x not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return values

    return parse


def _no_gpu_reason() -> Optional[str]:
    if not torch.cuda.is_available():
        build = "CPU-only torch build" if not (torch.version.cuda or torch.version.hip) else "torch sees no GPU"
        return f"no CUDA/ROCm GPU available ({build}); tuning measures kernels on the GPU it runs on"
    return None


# ------------------------------------------------------------ attention ----


def _attention_args(p: argparse.ArgumentParser) -> None:
    from . import attention as A

    p.add_argument("--dtype", type=_names(tuple(_DTYPES)), default=None, help="default float16,bfloat16")
    p.add_argument("--head-dims", type=_ints, default=None, help="default 32,64,128")
    p.add_argument("--seq-lens", type=_ints, default=None, help="default 64,128,256,512,1024,2048")
    p.add_argument("--batch-heads", type=_ints, default=None, help="batch*heads values (default 64,512,4096)")
    p.add_argument("--heads", type=int, default=8, help="heads per sequence; batch = batch_heads / heads (default 8)")
    p.add_argument("--variants", type=_names(A.EXTRAS), default=None, help="default none,bias,mask,bias+mask")
    p.add_argument("--backends", type=_names(tuple(A.BACKENDS)), default=None, help="default: every available one")
    p.add_argument("--reps", type=int, default=25, help="timed repetitions, median taken (at least 20)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-gib", type=float, default=6.0, help="skip cases whose inputs exceed this (default 6)")
    p.add_argument("--out", default=None, help="table path (default: $FUSEDENC_CONFIG_DIR or ~/.cache/fusedenc)")
    p.add_argument("--replace", action="store_true", help="do not merge with an existing table at --out")
    p.add_argument(
        "--quick", action="store_true", help="float16, head dim 64, S 64/128/256, 256 and 4096 batch*heads, none and bias+mask"
    )
    p.add_argument("--json", default=None, help="also write every measurement to this file")


def _case_inputs(b, s, h, d, dtype, variant, device, gen):
    qkv = torch.randn((b, s, 3, h, d), generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    q, k, v = qkv.unbind(2)  # [B, S, H, Dh] views of the packed buffer, like fused_qkv's
    bias = mask = None
    if "bias" in variant:
        bias = torch.randn((b, h, s, s), generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    if "mask" in variant:
        lengths = torch.randint(max(1, s // 2), s + 1, (b,), generator=gen)  # every row keeps a key
        mask = (torch.arange(s)[None, :] >= lengths[:, None]).to(device)
    return q, k, v, bias, mask


def _math(q, k, v, bias, mask, dtype) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh) + bias + mask) v through aten's math kernel, in ``dtype``, as [B*S, H*Dh]."""
    b, s, h, d = q.shape
    add = None if bias is None else bias.to(dtype)
    if mask is not None:
        m = torch.zeros((b, 1, 1, s), dtype=dtype, device=q.device).masked_fill_(mask.view(b, 1, 1, s), -math.inf)
        add = m if add is None else add + m
    qt, kt, vt = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    out = torch.ops.aten._scaled_dot_product_attention_math(qt, kt, vt, add, scale=d**-0.5)[0]
    return out.transpose(1, 2).reshape(b * s, h * d)


def _reference(q, k, v, bias, mask, dtype, max_bytes):
    """sdpa_math in higher precision (fp32; fp64 for fp32 inputs) and in ``dtype``, on the
    first sequences only when the whole batch's score matrices would not fit ``max_bytes``."""
    b, s, h, _ = q.shape
    rows = max(1, min(b, int(max_bytes // max(1, 3 * h * s * s * 8))))
    sl = slice(0, rows)
    args = (q[sl], k[sl], v[sl], None if bias is None else bias[sl], None if mask is None else mask[sl])
    hi = torch.float64 if dtype == torch.float32 else torch.float32
    return _math(*args, hi), _math(*args, dtype), rows * s


def _within_rule(out, ref, same, atol) -> tuple[bool, float, float]:
    err = (out.to(ref.dtype) - ref).abs().max().item()
    base = (same.to(ref.dtype) - ref).abs().max().item()
    bound = 2 * base + atol
    return (err <= bound and not math.isnan(err)), err, bound


def _time_us(fn: Callable[[], object], reps: int, warmup: int) -> tuple[float, str]:
    """Median device time per call, over ``reps`` CUDA-event-timed replays of a CUDA graph that
    holds ``inner`` back-to-back calls (enough for ~100 us per replay; eager launches if capture fails)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    inner = max(1, min(16, round(100.0 / max(start.elapsed_time(end) * 1000.0, 1.0))))
    method = "graph"
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        replay: Callable[[], object] = graph.replay
        replay()
    except Exception:  # noqa: BLE001 - time eager launches instead
        method = "eager"

        def replay():
            for _ in range(inner):
                fn()

    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / inner)
    return statistics.median(times), method


def _run_attention(args: argparse.Namespace) -> int:
    from . import attention as A

    reason = _no_gpu_reason()
    if reason:
        print(f"fusedenc.tune attention: {reason}", file=sys.stderr)
        return 2
    if args.reps < 20:
        print("fusedenc.tune attention: --reps must be at least 20", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    if args.quick:
        dtypes = args.dtype or ["float16"]
        head_dims = args.head_dims or [64]
        seq_lens = args.seq_lens or [64, 128, 256]
        # 4096 too: at inference batch sizes the winner changes (on an H100 the
        # short-sequence kernel loses at 256 batch*heads and wins 1.7x at 4096).
        batch_heads = args.batch_heads or [256, 4096]
        variants = args.variants or ["none", "bias+mask"]
    else:
        dtypes = args.dtype or ["float16", "bfloat16"]
        head_dims = args.head_dims or [32, 64, 128]
        seq_lens = args.seq_lens or [64, 128, 256, 512, 1024, 2048]
        batch_heads = args.batch_heads or [64, 512, 4096]
        variants = args.variants or list(A.EXTRAS)
    names = args.backends or [n for n, b in A.BACKENDS.items() if b.available()]
    arch = A.device_arch(device)
    meta = A.device_metadata(device)
    out_path = args.out or A.user_table_path(device)
    print(f"fusedenc.tune attention on {meta['device_name']} ({arch}, {meta['multiprocessor_count']} SMs), "
          f"torch {meta['torch']}, CUDA {meta['cuda']}, HIP {meta['hip']}, cuDNN {meta['cudnn']}")  # fmt: skip
    print(f"backends: {', '.join(names)}; device time per call in us (median of {args.reps}); '-' cannot serve, "
          "'WRONG' failed the accuracy check\n")  # fmt: skip

    gen = torch.Generator().manual_seed(0)
    measurements = []
    rules: dict[tuple, dict] = {}
    for dtype_name in dtypes:
        dtype = _DTYPES[dtype_name]
        for d in head_dims:
            for bh in batch_heads:
                h = max(1, min(args.heads, bh))
                b = max(1, bh // h)
                for variant in variants:
                    header = f"{dtype_name}  head_dim={d}  batch*heads={b * h} (B={b}, H={h})  {variant}"
                    print(header)
                    print("  " + f"{'S':>6} " + " ".join(f"{n:>15}" for n in names) + "   winner")
                    winners = []
                    for s in seq_lens:
                        need = 3 * b * s * h * d * 2 + (b * h * s * s * 4 if "bias" in variant else 0)
                        if need / 2**30 > args.max_gib:
                            print(f"  {s:>6}  skipped: inputs need {need / 2**30:.1f} GiB > --max-gib {args.max_gib}")
                            continue
                        row = _measure_case(A, names, b, s, h, d, dtype, variant, device, gen, args)
                        measurements.append(row)
                        cells = []
                        for n in names:
                            r = row["results"][n]
                            cells.append(f"{r['us']:>15.2f}" if "us" in r else f"{r['status']:>15}")
                        ranked = sorted((r["us"], n) for n, r in row["results"].items() if "us" in r)
                        winner = ranked[0][1] if ranked else "-"
                        winners.append((s, winner))
                        print(f"  {s:>6} " + " ".join(cells) + f"   {winner}")
                        if ranked:
                            key = row["key"]
                            match = {f: key[f] for f in ("dtype", "head_dim", "seq", "batch_heads", "extras")}
                            rules[tuple(match.values())] = {
                                "match": match,
                                "backends": [n for _, n in ranked],
                                "median_us": {n: round(t, 3) for t, n in ranked},
                                "measured_at": {"batch": b, "seq": s, "heads": h},
                            }
                    cross = [
                        f"{w0} -> {w1} between S={s0} and S={s1}"
                        for (s0, w0), (s1, w1) in zip(winners, winners[1:])
                        if w0 != w1
                    ]
                    print("  crossover: " + ("; ".join(cross) if cross else "none (one winner throughout)") + "\n")

    table = _merge_table(A, out_path, arch, meta, rules, replace=args.replace)
    _write_json_atomically(out_path, table)
    A.clear_cache()
    print(f"wrote {len(table['rules'])} rules to {out_path}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"metadata": meta, "arch": arch, "measurements": measurements}, f, indent=1)
        print(f"wrote measurements to {args.json}")
    return 0


def _measure_case(A, names, b, s, h, d, dtype, variant, device, gen, args) -> dict:
    q, k, v, bias, mask = _case_inputs(b, s, h, d, dtype, variant, device, gen)
    call = A._describe(q, k, v, bias, mask)
    row = {"key": A.table_key(call), "batch": b, "seq": s, "heads": h, "results": {}}
    ref = same = None
    rows = 0
    for n in names:
        backend = A.BACKENDS[n]
        ok, why = backend.supports(call) if backend.available() else (False, "not available")
        if not ok:
            row["results"][n] = {"status": "-", "reason": why}
            continue
        try:
            if n == "sdpa_math" and 3 * b * h * s * s * 4 > args.max_gib * 2**30:
                row["results"][n] = {"status": "skipped", "reason": "score matrices exceed --max-gib"}
                continue
            if ref is None:
                ref, same, rows = _reference(q, k, v, bias, mask, dtype, min(2**31, args.max_gib * 2**30))
            out = A.attention(q, k, v, bias, mask, backend=n)
            good, err, bound = _within_rule(out[:rows], ref, same, _ATOL[dtype])
            if not good:
                row["results"][n] = {"status": "WRONG", "err": err, "bound": bound}
                continue
            us, method = _time_us(lambda: A.attention(q, k, v, bias, mask, backend=n), args.reps, args.warmup)
            row["results"][n] = {"us": us, "method": method, "err": err, "bound": bound}
        except Exception as exc:  # noqa: BLE001 - a failing backend loses, it does not stop the run
            row["results"][n] = {"status": "ERROR", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    del q, k, v, bias, mask, ref, same
    return row


def _write_json_atomically(path: str, obj: dict) -> None:
    """Write a table so that a reader (another process starting) never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _measured_by(subcommand: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"measured by `python -m fusedenc.tune {subcommand}` on {now}"


def _merge_table(A, path, arch, meta, rules: dict, replace: bool) -> dict:
    """The table to write: the new rules, plus the old file's rules for other problems when
    the old file is valid and was measured on this same setup (as the loader would judge it)."""
    from . import _native

    old_rules: list[dict] = []
    if not replace and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                old, measured_with = A._parse_table(f.read(), path, "user", arch)
            if not _native.metadata_differences(measured_with, meta, A.METADATA_KEYS):
                old_rules = [r for r in old.rules if tuple(r.get("match", {}).values()) not in rules]
        except (OSError, ValueError):
            old_rules = []
    return {
        "schema": A.TABLE_SCHEMA,
        "arch": arch,
        "source": _measured_by("attention"),
        "measured_with": meta,
        "rules": list(rules.values()) + old_rules,
    }


# ------------------------------------------------------------ gemm ----
# Issue 5, "algorithm choice by measurement": the block's four GEMMs per preset
# and batch size, every heuristic candidate timed, the fastest correct one kept
# when it beats the heuristic's own pick (candidate 0) by more than noise.
# Where the library has no epilogue for the activation (it runs BIAS plus an
# activation pass), the Triton FFN1 kernel's configs are timed in the same
# interleaved run and replace the library when they beat its pick by more than
# noise, confirmed twice ("kernel": "triton" in the file; fusedenc/gemm_routes.py).


@dataclasses.dataclass(frozen=True)
class GemmPreset:
    """The encoder shapes ``tune gemm`` measures (bench/presets.py has the same numbers)."""

    name: str
    d_model: int
    d_ff: int
    activation: str
    seq_len: int
    alpha: float  # residual scale; reaches a GEMM only in the pre-LN FFN2 (residual epilogue)


GEMM_PRESETS: dict[str, GemmPreset] = {
    p.name: p
    for p in (
        GemmPreset("t82", 768, 2304, "swish", 64, (2 * 15) ** -0.25),
        GemmPreset("bt4", 1024, 1536, "mish", 64, (2 * 15) ** -0.25),
        GemmPreset("bert-base", 768, 3072, "gelu", 128, 1.0),
    )
}


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """One ``_C.gemm`` call of an EncoderBlock: D[m, n] = act(alpha * A[m, k] @ W[n, k]^T + b) (+ residual)."""

    name: str  # qkv, out_proj, ffn1, ffn2
    m: int
    n: int
    k: int
    bias: bool
    activation: str
    residual: bool
    alpha: float


def block_gemms(preset: GemmPreset, batch: int, norm_first: bool = False) -> list[GemmProblem]:
    """The four GEMMs ``EncoderBlock``'s native path issues (fusedenc/encoder.py ``_run``) for
    ``batch`` sequences: dense rows (lda = k, ldw = k, ldd = n), outputs from ``torch.empty``."""
    t, d, f, act = batch * preset.seq_len, preset.d_model, preset.d_ff, preset.activation
    if not norm_first:  # post-LN: every GEMM has its bias; the residual goes through the LayerNorm
        return [
            GemmProblem("qkv", t, 3 * d, d, True, "none", False, 1.0),
            GemmProblem("out_proj", t, d, d, True, "none", False, 1.0),
            GemmProblem("ffn1", t, f, d, True, act, False, 1.0),
            GemmProblem("ffn2", t, d, f, True, "none", False, 1.0),
        ]
    # pre-LN: the out-projection's bias rides in the LayerNorm; FFN2 carries the residual and alpha.
    return [
        GemmProblem("qkv", t, 3 * d, d, True, "none", False, 1.0),
        GemmProblem("out_proj", t, d, d, False, "none", False, 1.0),
        GemmProblem("ffn1", t, f, d, True, act, False, 1.0),
        GemmProblem("ffn2", t, d, f, True, "none", True, preset.alpha),
    ]


def _gemm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", type=_names(tuple(GEMM_PRESETS)), default=None, help="default t82,bt4,bert-base")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="sequences per call (default 1,16,64,256)")
    p.add_argument("--dtype", type=_names(tuple(_DTYPES)), default=None, help="default float16")
    p.add_argument("--norm-first", action="store_true", help="the pre-LN block's GEMMs (default: post-LN, as the presets)")
    p.add_argument(
        "--candidates", type=int, default=None, help="heuristic candidates per GEMM (default 8 on CUDA, 64 on ROCm)"
    )
    p.add_argument("--reps", type=int, default=25, help="timed replays per candidate, median taken (at least 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--min-gain", type=float, default=0.02, help="keep a candidate only if this much faster than candidate 0 (0.02)"
    )
    p.add_argument("--out", default=None, help="tuning file (default: $FUSEDENC_CONFIG_DIR or ~/.cache/fusedenc/gemm_<arch>.json)")
    p.add_argument("--replace", action="store_true", help="do not merge with an existing file at --out")
    p.add_argument(
        "--no-triton", action="store_true",
        help="do not time the Triton FFN1 kernel where the library has no epilogue for the activation",
    )  # fmt: skip


class _GemmCase:
    """Operands for one GEMM problem: input sets rotated so the working set exceeds the L2 cache."""

    def __init__(self, core, problem: GemmProblem, dtype: torch.dtype, device, stream: int, ws, gen, l2_bytes: int):
        from . import _native
        from .activations import activation_id

        self.core, self.p, self.dtype, self.device, self.stream, self.ws = core, problem, dtype, device, stream, ws
        m, n, k = problem.m, problem.n, problem.k
        elt = torch.tensor([], dtype=dtype).element_size()
        per_set = (m * k + n * k + m * n + (m * n if problem.residual else 0) + n) * elt
        self.sets = max(1, min(32, math.ceil(2 * l2_bytes / per_set)))

        def rand(*shape, scale=1.0):
            return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)

        self.inputs = []
        for _ in range(self.sets):
            x = rand(m, k)
            w = rand(n, k, scale=k**-0.5)
            b = rand(n) if problem.bias else None
            r = rand(m, n) if problem.residual else None
            out = torch.empty((m, n), dtype=dtype, device=device)  # like the block's outputs
            self.inputs.append((x, w, b, r, out))
        self.code = _native.dtype_code(dtype)
        self.act = activation_id(problem.activation)

    def args(self, i: int) -> tuple:
        x, w, b, r, out = self.inputs[i]
        p = self.p
        return (
            self.device.index, self.stream, p.m, p.n, p.k, x.data_ptr(), p.k, w.data_ptr(), p.k,
            0 if b is None else b.data_ptr(), 0 if r is None else r.data_ptr(), p.n, out.data_ptr(), p.n,
            self.code, self.act, p.alpha, 1.0, self.ws.data_ptr(), self.ws.numel(),
        )  # fmt: skip

    def reference(self) -> torch.Tensor:
        """fp32 result of input set 0."""
        from .activations import apply_activation

        x, w, b, r, _ = self.inputs[0]
        y = torch.matmul(x.float(), w.float().t()) * self.p.alpha
        if b is not None:
            y = y + b.float()
        if r is not None:
            return y + r.float()
        return apply_activation(y, self.p.activation)


def _time_candidates(
    calls: list[Callable[[], None]], reps: int, warmup: int, stream: torch.cuda.Stream
) -> tuple[list[float], str]:
    """Median device time of each entry of ``calls`` (a function launching one pass over the input
    sets on ``stream``, which must not be the default stream: CUDA graphs capture on it),
    interleaved: every rep replays each candidate once, so drift hits all alike."""
    if not calls:
        return [], "-"
    method = "graph"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            for _ in range(warmup):
                fn()
        start.record()
        calls[0]()
        end.record()
    end.synchronize()
    per_pass = max(start.elapsed_time(end) * 1000.0, 1.0)
    rounds = max(1, min(64, round(200.0 / per_pass)))  # ~200 us per timed replay
    replays: list[Callable[[], object]] = []
    try:
        for fn in calls:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(rounds):
                    fn()
            replays.append(graph.replay)
        for r in replays:
            r()
    except Exception:  # noqa: BLE001 - time eager launches instead
        method = "eager"
        replays = []
        for fn in calls:

            def replay(fn=fn):
                for _ in range(rounds):
                    fn()

            replays.append(replay)
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in calls]
    with torch.cuda.stream(stream):
        for rep in range(reps):
            order = list(range(len(calls)))
            order = order[rep % len(order):] + order[: rep % len(order)]
            for i in order:
                start.record()
                replays[i]()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end) * 1000.0 / rounds)
    torch.cuda.synchronize()
    return [statistics.median(t) for t in times], method


def _measure_gemm(core, case: _GemmCase, count: int, args, stream: torch.cuda.Stream) -> dict:
    """Every candidate of one problem: accuracy against fp32, then timing; the winner.
    Everything runs on ``stream`` (the one ``case``'s arguments name)."""
    from . import _native

    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the current stream
    try:
        with torch.cuda.stream(stream):
            return _measure_gemm_on_stream(_native, core, case, count, args, stream)
    finally:
        torch.cuda.synchronize()  # nothing in flight when the caller frees the inputs


def _measure_gemm_on_stream(_native, core, case: _GemmCase, count: int, args, stream) -> dict:
    found = core.gemm_candidates(*case.args(0), count)
    n_cand = len(found["candidates"])
    ref = case.reference()
    out0 = case.inputs[0][4]
    atol = _ATOL[case.dtype]
    errs: list[float] = []
    ok: list[bool] = []
    for i in range(n_cand):
        out0.fill_(float("nan"))  # poison: a candidate that writes nothing fails
        try:
            core.gemm_with_candidate(*case.args(0), count, i)
            torch.cuda.synchronize()
            err = (out0.float() - ref).abs().max().item()
        except RuntimeError:  # the library refused to run it: it loses
            if i == 0:
                raise
            err = math.nan
        errs.append(err)
    base = errs[0]
    for err in errs:
        ok.append(not math.isnan(err) and err <= 2 * base + atol)
    triton_configs = _triton_configs(case, found, args)
    triton_errs = [_triton_error(case, cfg, ref) for cfg in triton_configs]
    triton_ok = [not math.isnan(e) and e <= 2 * base + atol for e in triton_errs]
    del ref
    # Candidate 0 is by construction the algorithm the default plan runs: check it bitwise
    # (run again: out0 holds whatever ran last).
    out0.fill_(float("nan"))
    core.gemm_with_candidate(*case.args(0), count, 0)
    cand0 = out0.clone()
    out0.fill_(float("nan"))
    core.gemm(*case.args(0))
    torch.cuda.synchronize()
    same_as_default = bool(torch.equal(cand0, out0))
    del cand0

    def runner(i: int) -> Callable[[], None]:
        all_args = [case.args(s) for s in range(case.sets)]

        def run() -> None:
            for a in all_args:
                core.gemm_with_candidate(*a, count, i)

        return run

    good = [i for i in range(n_cand) if ok[i]]
    triton_good = [i for i in range(len(triton_configs)) if triton_ok[i]]
    calls = [runner(i) for i in good] + [_triton_runner(case, triton_configs[i]) for i in triton_good]
    us_all, method = _time_candidates(calls, args.reps, args.warmup, stream)  # interleaved: one comparison
    us: list[Optional[float]] = [None] * n_cand
    for i, t in zip(good, us_all):
        us[i] = t / case.sets
    triton_us: list[Optional[float]] = [None] * len(triton_configs)
    for i, t in zip(triton_good, us_all[len(good):]):
        triton_us[i] = t / case.sets
    winner, confirmed = 0, None
    if ok[0] and len(good) > 1:
        best = min(good, key=lambda i: us[i])
        if best != 0 and us[best] < us[0] * (1 - args.min_gain):
            # Confirm against candidate 0 in a second interleaved run before trusting a small gain.
            again, _ = _time_candidates([runner(0), runner(best)], args.reps, args.warmup, stream)
            confirmed = (again[0] / case.sets, again[1] / case.sets)
            if confirmed[1] < confirmed[0] * (1 - args.min_gain):
                winner = best
    speedup = us[0] / us[winner] if us[0] and us[winner] else 1.0
    if confirmed and winner:
        speedup = confirmed[0] / confirmed[1]
    triton = None
    if triton_configs:
        triton = {
            "configs": [
                {
                    "config": list(c),
                    "us": None if t is None else round(t, 3),
                    "err": e if math.isfinite(e) else None,
                    "ok": o,
                }
                for c, t, e, o in zip(triton_configs, triton_us, triton_errs, triton_ok)
            ],
            "chosen": None,
            "confirmed_us": None,
        }
        if triton_good and us[winner] is not None:
            best = min(triton_good, key=lambda i: triton_us[i])
            if triton_us[best] < us[winner] * (1 - args.min_gain):
                # Confirm against the library's pick in a second interleaved run, as above.
                again, _ = _time_candidates(
                    [runner(winner), _triton_runner(case, triton_configs[best])], args.reps, args.warmup, stream
                )
                triton["confirmed_us"] = [round(again[0] / case.sets, 3), round(again[1] / case.sets, 3)]
                if again[1] < again[0] * (1 - args.min_gain):
                    triton["chosen"] = best
    return {
        "key": _native.key_from_core(found["key"]),
        "epilogue": found["epilogue"],
        "fell_back": found["fell_back"],
        "candidate_0_is_default": same_as_default,
        "input_sets": case.sets,
        "method": method,
        "candidates": [
            {
                "algo": c["algo"],
                "us": None if us[i] is None else round(us[i], 3),
                "err": errs[i] if math.isfinite(errs[i]) else None,  # None: not finite, or the library refused
                "ok": ok[i],
            }
            for i, c in enumerate(found["candidates"])
        ],
        "count": count,
        "winner": winner,
        "speedup": round(speedup, 4),
        "confirmed_us": None if confirmed is None else [round(confirmed[0], 3), round(confirmed[1], 3)],
        "triton": triton,  # None where the library's epilogue applies the activation (or --no-triton)
    }


def _triton_configs(case: _GemmCase, found: dict, args) -> list:
    """The Triton FFN1 kernel's configs to time at this problem, or [] where it is not a candidate:
    only where the library runs the BIAS epilogue plus an activation pass (no residual, alpha 1)."""
    from . import gemm_routes

    p = case.p
    if args.no_triton or p.residual or p.alpha != 1.0 or p.activation == "none":
        return []
    if found["epilogue"] not in ("BIAS", "DEFAULT") or not gemm_routes.triton_available():
        return []
    from . import triton_gemm

    return triton_gemm.tuning_candidates(p.m, p.n, p.k, case.dtype)


def _triton_error(case: _GemmCase, config, ref: torch.Tensor) -> float:
    """Max abs error of one Triton config on input set 0 (NaN if it fails to compile or launch)."""
    from . import triton_gemm

    x, w, b, _, out = case.inputs[0]
    out.fill_(float("nan"))  # poison: a config that writes nothing fails
    try:
        triton_gemm.launch(x, w, b, out, case.p.activation, config)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a config this GPU cannot run (shared memory, ...) loses
        print(f"    triton {tuple(config)}: {type(exc).__name__}: {str(exc)[:200]}")
        return math.nan
    return (out.float() - ref).abs().max().item()


def _triton_runner(case: _GemmCase, config) -> Callable[[], None]:
    from . import triton_gemm

    sets = [(x, w, b, out) for x, w, b, _, out in case.inputs]
    act = case.p.activation

    def run() -> None:
        for x, w, b, out in sets:
            triton_gemm.launch(x, w, b, out, act, config)

    return run


def _print_gemm(label: str, p: GemmProblem, row: dict, min_gain: float) -> None:
    epi = row["epilogue"] + (" + kernel" if p.activation != "none" and "BIAS" == row["epilogue"] else "")
    if row["fell_back"]:
        epi += " (epilogue fallback)"
    extra = (f" {p.activation}" if p.activation != "none" else "") + (" +residual" if p.residual else "")
    print(f"{label}  {p.name}: m={p.m} n={p.n} k={p.k}{extra}  [{epi}]  "
          f"{len(row['candidates'])} candidates, {row['input_sets']} input sets, {row['method']}")  # fmt: skip
    if not row["candidate_0_is_default"]:
        print("    NOTE: candidate 0's output differs bitwise from the default plan's (nondeterministic algorithm?)")
    base = row["candidates"][0]["us"]
    for i, c in enumerate(row["candidates"]):
        if c["us"] is None:
            cell = f"{'WRONG':>9}  err {c['err'] if c['err'] is not None else 'non-finite/refused'}"
        else:
            ratio = base / c["us"] if base else float("nan")
            cell = f"{c['us']:>9.2f}  {ratio:5.3f}x"
        mark = " <- winner" if i == row["winner"] and i != 0 else ""
        print(f"    {i:>3}  {c['algo'][:72]:<72} {cell}{mark}")
    if row["winner"]:
        print(f"    winner: candidate {row['winner']}, {row['speedup']:.3f}x candidate 0 (confirmed {row['confirmed_us']} us)")
    else:
        ranked = [c["us"] for c in row["candidates"] if c["us"] is not None]
        best = base / min(ranked) if ranked and base else 1.0
        print(f"    winner: candidate 0 kept (best other {best:.3f}x, needs > {1 / (1 - min_gain):.3f}x, confirmed)")
    triton = row["triton"]
    if triton:
        library = row["candidates"][row["winner"]]["us"]
        for i, c in enumerate(triton["configs"]):
            bm, bn, bk, group, warps, stages = c["config"]
            name = f"triton {bm}x{bn}x{bk} g{group} w{warps} s{stages}"
            if c["us"] is None:
                cell = f"{'WRONG':>9}  err {c['err'] if c['err'] is not None else 'non-finite/failed'}"
            else:
                cell = f"{c['us']:>9.2f}  {library / c['us']:5.3f}x" if library else f"{c['us']:>9.2f}"
            mark = " <- chosen" if i == triton["chosen"] else ""
            print(f"    T{i:<2}  {name:<72} {cell}{mark}")
        if triton["chosen"] is not None:
            blaslt_us, triton_us = triton["confirmed_us"]
            print(f"    => Triton kernel T{triton['chosen']}: {blaslt_us / triton_us:.3f}x the library's pick "
                  f"(confirmed {triton['confirmed_us']} us); ratios above are against the library's pick")  # fmt: skip
        else:
            print(f"    => the library's pick stays (Triton needs > {1 / (1 - min_gain):.3f}x it, confirmed)")
    print()


def _run_gemm(args: argparse.Namespace) -> int:
    from . import _native

    reason = _no_gpu_reason()
    if reason:
        print(f"fusedenc.tune gemm: {reason}", file=sys.stderr)
        return 2
    core = _native.native_module()
    if core is None or _native.backend().name == "reference" or not hasattr(core, "gemm_candidates"):
        print(f"fusedenc.tune gemm: the native core is not active ({_native.backend()})", file=sys.stderr)
        return 2
    if args.reps < 20:
        print("fusedenc.tune gemm: --reps must be at least 20", file=sys.stderr)
        return 2
    count = args.candidates or (64 if core.VENDOR == "hip" else 8)
    if not 1 <= count <= core.MAX_GEMM_CANDIDATES:
        print(f"fusedenc.tune gemm: --candidates must be in 1..{core.MAX_GEMM_CANDIDATES}", file=sys.stderr)
        return 2
    if not 0 <= args.min_gain < 1:
        print("fusedenc.tune gemm: --min-gain must be in [0, 1)", file=sys.stderr)
        return 2
    presets = args.preset or list(GEMM_PRESETS)
    batches = args.batch_sizes or [1, 16, 64, 256]
    dtypes = args.dtype or ["float16"]
    device = torch.device("cuda", torch.cuda.current_device())
    arch = _native._device_arch(device.index)
    meta = _native.gemm_device_metadata(core, device.index)
    out_path = args.out or _native.gemm_tuning_path(arch)
    props = torch.cuda.get_device_properties(device.index)
    l2 = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    print(f"fusedenc.tune gemm on {meta['device_name']} ({arch}, {meta['multiprocessor_count']} SMs, "
          f"L2 {l2 / 2**20:.0f} MiB), {meta['library']}, torch {meta['torch']}")  # fmt: skip
    print(f"up to {count} heuristic candidates per GEMM; device time per call in us (median of {args.reps} "
          f"interleaved CUDA-graph replays); ratio = candidate 0 / candidate; a winner must beat "
          f"candidate 0 by {args.min_gain:.0%} twice\n")  # fmt: skip

    # Measure the heuristic itself: choices loaded from an existing file must not steer the
    # default plan that candidate 0 is checked against.
    core.clear_gemm_choices()
    # The heuristic calls and the timed GEMMs see the workspace size the ops use.
    ws = torch.empty(_native.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)  # CUDA graphs cannot capture the default stream
    stream = side.cuda_stream
    gen = torch.Generator().manual_seed(0)
    measured: dict[tuple, dict] = {}
    for dtype_name in dtypes:
        dtype = _DTYPES[dtype_name]
        for name in presets:
            preset = GEMM_PRESETS[name]
            for batch in batches:
                for problem in block_gemms(preset, batch, args.norm_first):
                    label = f"{name} batch {batch} {dtype_name}"
                    case = _GemmCase(core, problem, dtype, device, stream, ws, gen, l2)
                    with torch.cuda.stream(side):
                        probe = core.gemm_candidates(*case.args(0), count)
                    ident = _native.key_ident(_native.key_from_core(probe["key"]))
                    if ident in measured:
                        measured[ident]["used_by"].append(f"{label} {problem.name}")
                        print(f"{label}  {problem.name}: same problem as {measured[ident]['used_by'][0]}\n")
                        continue
                    try:
                        row = _measure_gemm(core, case, count, args, side)
                    except Exception as exc:  # noqa: BLE001 - one failing problem does not stop the run
                        print(f"{label}  {problem.name}: ERROR {type(exc).__name__}: {exc}\n")
                        continue
                    finally:
                        del case
                    row["used_by"] = [f"{label} {problem.name}"]
                    measured[ident] = row
                    _print_gemm(label, problem, row, args.min_gain)

    choices = []
    for row in measured.values():
        w = row["winner"]
        choice = {
            "key": row["key"], "index": w, "candidates": row["count"], "algo": row["candidates"][w]["algo"],
            "us": {"candidate_0": row["candidates"][0]["us"], "chosen": row["candidates"][w]["us"]},
            "speedup": row["speedup"], "used_by": row["used_by"],
        }  # fmt: skip
        triton = row["triton"]
        if triton and triton["chosen"] is not None:
            # The Triton kernel serves this problem; ``index`` stays the library's pick (used without Triton).
            best = triton["configs"][triton["chosen"]]
            choice.update(kernel="triton", triton_config=best["config"])
            choice["us"]["triton"] = best["us"]
            choice["speedup"] = round(row["candidates"][0]["us"] / best["us"], 4)
        choices.append(choice)
    table = _merge_gemm_file(_native, out_path, arch, meta, choices, replace=args.replace)
    table["measurements"] = list(measured.values())
    _write_json_atomically(out_path, table)
    wins = [c for c in table["choices"] if c["index"] != 0 or c.get("kernel") == "triton"]
    routed = [c for c in table["choices"] if c.get("kernel") == "triton"]
    print(f"wrote {len(table['choices'])} problems ({len(wins)} with a measured winner other than the heuristic's "
          f"pick, {len(routed)} of them the Triton kernel) to {out_path}; processes load it when the native core "
          "is first used")  # fmt: skip
    return 0


def _merge_gemm_file(_native, path, arch, meta, choices: list[dict], replace: bool) -> dict:
    """The file to write: the new choices, plus the old file's choices for other problems when
    the old file is valid and was measured on this same setup (as the loader would judge it)."""
    old: list[dict] = []
    if not replace and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                measured_with, old_choices = _native.parse_gemm_tuning(f.read(), arch)
            if not _native.metadata_differences(measured_with, meta):
                new = {_native.key_ident(c["key"]) for c in choices}
                old = [c for c in old_choices if _native.key_ident(c["key"]) not in new]
        except (OSError, ValueError):
            old = []
    return {
        "schema": _native.GEMM_TUNING_SCHEMA,
        "arch": arch,
        "source": _measured_by("gemm"),
        "measured_with": meta,
        "choices": choices + old,
    }


# ------------------------------------------------------------ entry ----

#: name -> (help, add_arguments(parser), run(args) -> exit status)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "attention": ("time the attention backends and write attention_<arch>.json", _attention_args, _run_attention),
    "gemm": (
        "time the GEMM library's candidate algorithms (and the Triton FFN1 kernel where the library has no "
        "epilogue for the activation) and write gemm_<arch>.json",
        _gemm_args,
        _run_gemm,
    ),
}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedenc.tune", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_text, add_args, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    args = parser.parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
