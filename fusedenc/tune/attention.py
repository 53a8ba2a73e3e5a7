"""``python -m fusedenc.tune attention``: time every attention backend and write the user table.

Times every backend that can serve each table key on inputs laid out like
``fused_qkv``'s (strided views of one packed ``[B, S, 3, H, Dh]`` buffer),
after checking its output against sdpa_math with the tolerance rule
``|out - ref| <= 2 * |math - ref| + atol`` (a fast wrong answer cannot win).
Times are medians of at least 20 CUDA-event-timed replays of a CUDA graph
holding a few calls (device time, no host overhead; eager launches when
capture fails).  It prints one table per (dtype, head dim, batch*heads,
variant) with the winner and crossover points, and writes the user table
(merged with an existing one measured on this same setup, unless
``--replace``) with the device and library versions.

Each measured point becomes one exact rule for its table key (its sequence and
batch*heads buckets); keys nobody measured fall through to the shipped table.
On an H100, ``--quick`` takes under a minute; the full default grid (432 points)
about 12 minutes, most of it cuDNN graph builds and the sdpa_math timings.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Callable

import torch

from .. import attention as A
from ..common import dtypes, table_files
from ..common.device import device_arch, device_metadata
from . import timing
from .cli import int_list, name_list, no_gpu_reason

__all__ = ["add_arguments", "merge_table", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", type=name_list(tuple(dtypes.BY_NAME)), default=None, help="default float16,bfloat16")
    p.add_argument("--head-dims", type=int_list, default=None, help="default 32,64,128")
    p.add_argument("--seq-lens", type=int_list, default=None, help="default 64,128,256,512,1024,2048")
    p.add_argument("--batch-heads", type=int_list, default=None, help="batch*heads values (default 64,512,4096)")
    p.add_argument("--heads", type=int, default=8, help="heads per sequence; batch = batch_heads / heads (default 8)")
    p.add_argument("--variants", type=name_list(A.EXTRAS), default=None, help="default none,bias,mask,bias+mask")
    p.add_argument("--backends", type=name_list(tuple(A.BACKENDS)), default=None, help="default: every available one")
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


def _time_us(fn: Callable[[], object], reps: int, warmup: int, device: torch.device) -> tuple[float, str]:
    """Median device time per call: CUDA-event-timed replays of a CUDA graph holding enough
    back-to-back calls for ~100 us (eager launches if capture fails)."""
    t = timing.time_graph(lambda _: fn(), [None], reps=reps, device=device, target_us=100.0, max_calls=16, warmup=warmup)
    return t.ms * 1000.0, t.method


def run(args: argparse.Namespace) -> int:
    reason = no_gpu_reason()
    if reason:
        print(f"fusedenc.tune attention: {reason}", file=sys.stderr)
        return 2
    if args.reps < 20:
        print("fusedenc.tune attention: --reps must be at least 20", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    if args.quick:
        dtype_names = args.dtype or ["float16"]
        head_dims = args.head_dims or [64]
        seq_lens = args.seq_lens or [64, 128, 256]
        # 4096 too: at inference batch sizes the winner changes (on an H100 the
        # short-sequence kernel loses at 256 batch*heads and wins 1.7x at 4096).
        batch_heads = args.batch_heads or [256, 4096]
        variants = args.variants or ["none", "bias+mask"]
    else:
        dtype_names = args.dtype or ["float16", "bfloat16"]
        head_dims = args.head_dims or [32, 64, 128]
        seq_lens = args.seq_lens or [64, 128, 256, 512, 1024, 2048]
        batch_heads = args.batch_heads or [64, 512, 4096]
        variants = args.variants or list(A.EXTRAS)
    names = args.backends or [n for n, b in A.BACKENDS.items() if b.available()]
    arch = device_arch(device)
    meta = device_metadata(device)
    out_path = args.out or A.user_table_path(device)
    print(f"fusedenc.tune attention on {meta['device_name']} ({arch}, {meta['multiprocessor_count']} SMs), "
          f"torch {meta['torch']}, CUDA {meta['cuda']}, HIP {meta['hip']}, cuDNN {meta['cudnn']}")  # fmt: skip
    print(f"backends: {', '.join(names)}; device time per call in us (median of {args.reps}); '-' cannot serve, "
          "'WRONG' failed the accuracy check\n")  # fmt: skip

    gen = torch.Generator().manual_seed(0)
    measurements = []
    rules: dict[tuple, dict] = {}
    for dtype_name in dtype_names:
        dtype = dtypes.BY_NAME[dtype_name]
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
                        row = _measure_case(names, b, s, h, d, dtype, variant, device, gen, args)
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

    table = merge_table(out_path, arch, meta, rules, replace=args.replace)
    table_files.write_json_atomically(out_path, table)
    A.clear_cache()
    print(f"wrote {len(table['rules'])} rules to {out_path}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"metadata": meta, "arch": arch, "measurements": measurements}, f, indent=1)
        print(f"wrote measurements to {args.json}")
    return 0


def _measure_case(names, b, s, h, d, dtype, variant, device, gen, args) -> dict:
    q, k, v, bias, mask = _case_inputs(b, s, h, d, dtype, variant, device, gen)
    call = A.describe_call(q, k, v, bias, mask)
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
            good, err, bound = _within_rule(out[:rows], ref, same, dtypes.ATOL[dtype])
            if not good:
                row["results"][n] = {"status": "WRONG", "err": err, "bound": bound}
                continue
            tensors = (q, k, v, bias, mask)
            us, method = _time_us(lambda t=tensors, n=n: A.attention(*t, backend=n), args.reps, args.warmup, device)
            row["results"][n] = {"us": us, "method": method, "err": err, "bound": bound}
        except Exception as exc:  # noqa: BLE001 - a failing backend loses, it does not stop the run
            row["results"][n] = {"status": "ERROR", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    del q, k, v, bias, mask, ref, same
    return row


def merge_table(path, arch, meta, rules: dict, replace: bool) -> dict:
    """The table to write: the new rules, plus the old file's rules for other problems when
    the old file is valid and was measured on this same setup (as the loader would judge it)."""

    def parse(text: str) -> tuple[dict, list]:
        table, measured_with = A.parse_table(text, path, "user", arch)
        return measured_with, list(table.rules)

    old = table_files.entries_to_keep(path, replace=replace, parse=parse, here=meta, keys=A.METADATA_KEYS)
    old_rules = [r for r in old if tuple(r.get("match", {}).values()) not in rules]
    return {
        "schema": A.TABLE_SCHEMA,
        "arch": arch,
        "source": table_files.measured_by("attention"),
        "measured_with": meta,
        "rules": list(rules.values()) + old_rules,
    }
