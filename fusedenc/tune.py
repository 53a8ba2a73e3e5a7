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
On an H100, ``--quick`` takes about 15 s; the full default grid (432 points)
about 12 minutes, most of it cuDNN graph builds and the sdpa_math timings.
"""

from __future__ import annotations

import argparse
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
        "--quick", action="store_true", help="float16, head dim 64, S 64/256/1024, 256 batch*heads, none and bias+mask"
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
        seq_lens = args.seq_lens or [64, 256, 1024]
        batch_heads = args.batch_heads or [256]
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
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, out_path)
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


def _merge_table(A, path, arch, meta, rules: dict, replace: bool) -> dict:
    old_rules: list[dict] = []
    if not replace and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            if old.get("schema") == A.TABLE_SCHEMA and old.get("arch") == arch and old.get("measured_with") == meta:
                old_rules = [r for r in old.get("rules", []) if tuple(r.get("match", {}).values()) not in rules]
        except (OSError, ValueError, AttributeError):
            old_rules = []
    return {
        "schema": A.TABLE_SCHEMA,
        "arch": arch,
        "source": "measured by `python -m fusedenc.tune attention` on "
        + datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "measured_with": meta,
        "rules": list(rules.values()) + old_rules,
    }


# ------------------------------------------------------------ entry ----

#: name -> (help, add_arguments(parser), run(args) -> exit status)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "attention": ("time the attention backends and write attention_<arch>.json", _attention_args, _run_attention),
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
