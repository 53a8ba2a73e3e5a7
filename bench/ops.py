"""Per-op microbenchmarks at each preset's shapes: what each fusion saves, against the ceilings.

    python3 bench/ops.py                        # t82, bt4, bert-base on a GPU; tiny on CPU
    python3 bench/ops.py --preset t82 --tokens 16384 --ops qkv,ffn1,attention

For each preset run (T tokens per call, default 16384: 256 positions of 64
tokens, 128 sequences of 128, 32 of 512), every case of each op:

  qkv        3x F.linear (torch: three GEMMs, bias in each) | 3x fusedenc.linear |
             F.linear on the packed [3D, D] weight (one torch GEMM) | fusedenc.fused_qkv
             (one GEMM, bias epilogue, q/k/v as views)
  ffn1       torch.mm + bias add + activation (three kernels) | F.linear + activation (torch) |
             fusedenc.linear with the activation epilogue (native, or BIAS + fusedenc's
             activation kernel where the library lacks it: fusedenc.capabilities()) |
             fusedenc.core.triton_gemm.linear_act: a Triton GEMM with bias + activation in its
             own epilogue (one kernel; on a GPU with triton installed)
  out_proj,  F.linear then r + alpha*y (torch) | fusedenc.linear then r + alpha*y |
  ffn2       fusedenc.linear with the residual in the epilogue (one call; the bias is
             pre-scaled by alpha once, as a loader would)
  attention  F.scaled_dot_product_attention on the in_proj output (torch's own choice) |
             fusedenc.attention forced to each backend that can serve the shape
             ("default" marks the one fusedenc picks)
  layernorm  F.layer_norm(r + alpha*y) (torch: separate kernels) |
             fusedenc.ops.norm.layer_norm(y, residual=r, alpha=alpha) (one kernel)

Reported per case: microseconds per call, TFLOP/s and its fraction of the GEMM
rate, GB/s (the bytes the op must move at least: inputs and weights read once,
output written once) and its fraction of the copy bandwidth; both ceilings are
measured on the device in the same run.

Each case is checked before it is timed against an fp32 reference (fp64 for
fp32 runs) with the tests' rule ``max|out - ref| <= 2 * max|torch - ref| + atol``
(``torch`` = the op's torch case); a case that fails is reported and not timed.
Timing: a CUDA graph of back-to-back calls cycling through enough copies of
the inputs and weights to span 4x L2, so neither launch overhead nor cache
reuse shows; median of >= 20 event-timed replays.  Outputs
``<out-dir>/ops_<tag>.json`` and ``.txt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import traceback
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script: import the sibling modules

import common  # noqa: E402

import fusedenc  # noqa: E402
from fusedenc import attention as fattn  # noqa: E402
from fusedenc import core  # noqa: E402
from fusedenc.common import dtypes  # noqa: E402
from fusedenc.common.activations import apply_activation, canonical_activation, torch_function  # noqa: E402
from fusedenc.core import gemm_routes
from fusedenc.ops.norm import layer_norm  # noqa: E402
from fusedenc.tune.presets import Run, select_runs  # noqa: E402
from fusedenc.tune.timing import rotation_sets, time_graph  # noqa: E402

OPS = ("qkv", "ffn1", "out_proj", "ffn2", "attention", "layernorm")
SCHEMA = "fusedenc.bench.ops/1"


@dataclasses.dataclass
class Case:
    name: str
    fn: Callable[[dict], Any]  # one call on one input set
    baseline: bool = False  # the torch computation in the op's dtype: the rule's "same"


@dataclasses.dataclass
class Op:
    name: str
    make_set: Callable[[torch.Generator], dict]  # inputs and weights (one rotation set)
    reference: Callable[[dict, torch.dtype], torch.Tensor]  # the math in higher precision, as [T, N]
    canon: Callable[[Any], torch.Tensor]  # a case's output as [T, N]
    flops: Optional[int]
    nbytes: int
    cases: list[Case]
    shape: str


def _routed_to_triton(device, m: int, n: int, k: int, dtype, activation: str) -> bool:
    """Whether a loaded GEMM tuning file sends fusedenc.linear at this problem to the Triton kernel."""
    key = gemm_routes.RouteKey(device.index or 0, m, n, k, dtypes.code(dtype), canonical_activation(activation), True)
    return key in gemm_routes.routes()


def _triton_gemm():
    """fusedenc.core.triton_gemm, or None where triton cannot be imported."""
    try:
        from fusedenc.core import triton_gemm
    except Exception:  # noqa: BLE001 - no triton, or a triton that cannot load here: no case
        return None
    return triton_gemm


def _gelu_unit(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, activation: str, t: int, f: int) -> torch.Tensor:
    """FFN1 on the Hopper GELU unit (switched on for the call): what a folded FFN1 runs."""
    x2 = x.reshape(t, -1)
    out = torch.empty((t, f), dtype=x.dtype, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with core.sm90_gelu_epilogue():
        core.sm90_norm_gemm(x2, w, out, b, activation, None, None, None, stream, core.workspace(x.device, stream))
    return out


def _units_off(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``call()`` with the Hopper GELU units switched off: cuBLASLt + the activation pass."""
    with core.sm90_gelu_epilogue(False):
        return call()


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.reshape(n, -1)


def build_ops(run: Run, batch: int, device: torch.device, wanted: list[str]) -> list[Op]:
    p = run.preset
    d, f, h, dh, s = p.d_model, p.d_ff, p.heads, run.head_dim, run.seq_len
    t = batch * s
    dt = run.dtype
    elt = torch.empty((), dtype=dt).element_size()
    alpha, eps = p.alpha, p.eps
    act = torch_function(p.activation)

    def rnd(g, *shape, scale=1.0):
        return (torch.randn(shape, generator=g, device=device) * scale).to(dt)

    def weight(g, n, k):  # scaled so outputs stay O(1) in half precision
        return rnd(g, n, k, scale=k**-0.5)

    ops: list[Op] = []

    if "qkv" in wanted:

        def qkv_set(g):
            x = rnd(g, batch, s, d)
            wq, wk, wv = (weight(g, d, d) for _ in range(3))
            bq, bk, bv = (rnd(g, d, scale=0.1) for _ in range(3))
            w_qkv, b_qkv = fusedenc.pack_qkv(wq, wk, wv, bq, bk, bv)
            return dict(x=x, wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv, w_qkv=w_qkv, b_qkv=b_qkv)

        def qkv_ref(k, rd):
            return _rows(k["x"], t).to(rd) @ k["w_qkv"].to(rd).t() + k["b_qkv"].to(rd)

        ops.append(Op(
            "qkv", qkv_set, qkv_ref, lambda out: torch.cat([_rows(o, t) for o in out], dim=-1),
            2 * t * d * 3 * d, (t * d + 3 * d * d + 3 * d + 3 * t * d) * elt,
            [
                Case("3x F.linear (torch, 3 GEMMs)", lambda k: tuple(F.linear(k["x"], k["w" + c], k["b" + c])
                                                                     for c in "qkv"), baseline=True),
                Case("3x fusedenc.linear (3 BLASLt calls)", lambda k: tuple(
                    fusedenc.linear(k["x"], k["w" + c], k["b" + c]) for c in "qkv")),
                Case("F.linear, packed weight (torch, 1 GEMM)", lambda k: (F.linear(k["x"], k["w_qkv"], k["b_qkv"]),)),
                Case("fusedenc.fused_qkv (1 GEMM, bias epilogue)",
                     lambda k: fusedenc.fused_qkv(k["x"], k["w_qkv"], k["b_qkv"], h)),
            ],
            f"[{t}, {d}] x [{3 * d}, {d}]^T",
        ))  # fmt: skip

    if "ffn1" in wanted:
        caps = fusedenc.capabilities()["activations"].get(str(dt).replace("torch.", ""), {}).get(p.activation, {})
        how = {"native": f"{caps.get('epilogue')} epilogue", "fallback": "BIAS epilogue + act. kernel",
               "reference": "PyTorch reference"}.get(caps.get("fusion"), "?")  # fmt: skip
        if device.type == "cuda" and _routed_to_triton(device, t, f, d, dt, p.activation):
            how = "Triton kernel: the GEMM tuning file routes this problem"

        tg = _triton_gemm() if device.type == "cuda" else None
        unit_why = common.gelu_unit_reason(device, dt, p.activation)
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
        if hopper and "sm90" in caps and "Triton" not in how:
            # The library's own routing answer at this shape (empty tensors: only their shapes,
            # strides and addresses are read), so the label cannot drift from sm90_gemm.cpp.
            probe = [torch.empty(*shape, device=device, dtype=dt) for shape in ((t, d), (f, d), (f,), (t, f))]
            runs, why = core.sm90_gemm_applies(*probe, canonical_activation(p.activation))
            del probe
            how = caps["sm90"]["kernel"] if runs else f"{how}; not {caps['sm90']['kernel']}: {why}"

        def ffn1_set(g):
            return dict(x=rnd(g, t, d), w=weight(g, f, d), b=rnd(g, f, scale=0.1))

        def ffn1_ref(k, rd):
            return apply_activation(k["x"].to(rd) @ k["w"].to(rd).t() + k["b"].to(rd), p.activation)

        ops.append(Op(
            "ffn1", ffn1_set, ffn1_ref, lambda out: out,
            2 * t * d * f, (t * d + f * d + f + t * f) * elt,
            [
                Case(f"torch.mm + bias add + {p.activation} (3 kernels)",
                     lambda k: act(torch.mm(k["x"], k["w"].t()).add_(k["b"]))),
                Case(f"F.linear + {p.activation} (torch)", lambda k: act(F.linear(k["x"], k["w"], k["b"])),
                     baseline=True),
                Case(f"fusedenc.linear + {p.activation} ({how})",
                     lambda k: fusedenc.linear(k["x"], k["w"], k["b"], p.activation)),
            ] + ([  # the A/B row of the exact-GELU unit (on by default where built; a plain tanh-GELU
                #       GEMM keeps cuBLASLt's GELU epilogue)
                Case(f"fusedenc.linear + {p.activation}, GELU units off (BIAS epilogue + act. kernel)",
                     lambda k: _units_off(lambda: fusedenc.linear(k["x"], k["w"], k["b"], p.activation))),
            ] if unit_why is None and p.activation == "gelu" else []) + ([  # GPU with triton only (the module imports triton)
                Case(f"triton GEMM + {p.activation} epilogue (1 kernel)",
                     lambda k: tg.linear_act(k["x"], k["w"], k["b"], p.activation)),
            ] if tg is not None else []) + ([  # a build with the Hopper GELU unit, on an sm90 GPU
                Case(f"Hopper {p.activation} unit (1 kernel, as in a folded FFN1)",
                     lambda k: _gelu_unit(k["x"], k["w"], k["b"], p.activation, t, f)),
            ] if unit_why is None else []),
            f"[{t}, {d}] x [{f}, {d}]^T, {p.activation}",
        ))  # fmt: skip

    for name, k_in in (("out_proj", d), ("ffn2", f)):
        if name not in wanted:
            continue

        def res_set(g, k_in=k_in):
            b = rnd(g, d, scale=0.1)
            return dict(a=rnd(g, t, k_in), w=weight(g, d, k_in), b=b, b_alpha=(b.float() * alpha).to(dt),
                        r=rnd(g, t, d))  # fmt: skip

        def res_ref(k, rd):
            y = k["a"].to(rd) @ k["w"].to(rd).t() + k["b"].to(rd)
            return k["r"].to(rd) + alpha * y

        def torch_residual(r, y):
            return r + y if alpha == 1.0 else r + alpha * y

        ops.append(Op(
            name, res_set, res_ref, lambda out: out,
            2 * t * k_in * d, (t * k_in + d * k_in + d + 2 * t * d) * elt,
            [
                Case("F.linear, then r + alpha*y (torch)", lambda k: torch_residual(k["r"], F.linear(k["a"], k["w"], k["b"])),
                     baseline=True),
                Case("fusedenc.linear, then r + alpha*y",
                     lambda k: torch_residual(k["r"], fusedenc.linear(k["a"], k["w"], k["b"]))),
                Case("fusedenc.linear, residual epilogue (1 call)",
                     lambda k: fusedenc.linear(k["a"], k["w"], k["b_alpha"], residual=k["r"], alpha=alpha)),
            ],
            f"[{t}, {k_in}] x [{d}, {k_in}]^T + residual, alpha {alpha:.4g}",
        ))  # fmt: skip

    if "attention" in wanted:

        def attn_set(g):
            return dict(qkv=rnd(g, batch, s, 3, h, dh))

        def attn_ref(k, rd):
            q, kk, v = k["qkv"].to(rd).permute(2, 0, 3, 1, 4)
            probs = torch.softmax((q @ kk.transpose(-1, -2)) * dh**-0.5, dim=-1)
            return _rows((probs @ v).transpose(1, 2), t)

        def torch_sdpa(k):
            q, kk, v = k["qkv"].permute(2, 0, 3, 1, 4)  # what the idiomatic block does after in_proj
            return F.scaled_dot_product_attention(q, kk, v).transpose(1, 2).reshape(batch, s, d)

        probe = torch.empty(batch, s, 3, h, dh, device=device, dtype=dt)
        q, k_, v = probe.unbind(2)
        call = fattn.describe_call(q, k_, v, None, None)
        default = fattn.explain(q, k_, v).backend
        cases = [Case("F.scaled_dot_product_attention (torch's choice)", torch_sdpa, baseline=True)]
        for bname, backend in fattn.BACKENDS.items():
            if backend.available() and backend.supports(call)[0]:
                label = f"fusedenc attention, {bname}" + (" (default)" if bname == default else "")
                cases.append(Case(label, lambda k, bname=bname: fattn.attention(*k["qkv"].unbind(2), backend=bname)))
        del probe
        ops.append(Op(
            "attention", attn_set, attn_ref, lambda out: _rows(out, t),
            4 * batch * h * s * s * dh, 4 * t * d * elt, cases,
            f"B {batch}, S {s}, H {h}, Dh {dh}, no bias/mask",
        ))  # fmt: skip

    if "layernorm" in wanted:

        def ln_set(g):
            return dict(y=rnd(g, t, d), r=rnd(g, t, d), w=(1 + 0.1 * torch.randn(d, generator=g, device=device)).to(dt),
                        b=rnd(g, d, scale=0.1))  # fmt: skip

        def ln_ref(k, rd):
            hsum = k["r"].to(rd) + alpha * k["y"].to(rd)
            return F.layer_norm(hsum, (d,), k["w"].to(rd), k["b"].to(rd), eps)

        def torch_ln(k):
            hsum = k["r"] + k["y"] if alpha == 1.0 else k["r"] + alpha * k["y"]
            return F.layer_norm(hsum, (d,), k["w"], k["b"], eps)

        ops.append(Op(
            "layernorm", ln_set, ln_ref, lambda out: out, None, 3 * t * d * elt,
            [
                Case("F.layer_norm(r + alpha*y) (torch)", torch_ln, baseline=True),
                Case("fusedenc layer_norm (residual + alpha fused)",
                     lambda k: layer_norm(k["y"], k["w"], k["b"], eps, residual=k["r"], alpha=alpha)),
            ],
            f"[{t}, {d}], alpha {alpha:.4g}, eps {eps:g}",
        ))  # fmt: skip
    return ops


def _set_bytes(st: dict) -> int:
    return sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    e = (out.to(ref.dtype) - ref).abs().max().item()
    return math.inf if math.isnan(e) else e


def run_op(op: Op, run: Run, device: torch.device, args, ceilings: dict, progress: common.Progress) -> dict[str, Any]:
    rd = torch.float64 if run.dtype == torch.float32 else torch.float32
    atol = dtypes.ATOL[run.dtype]
    g = torch.Generator(device=device).manual_seed(args.seed)
    first = op.make_set(g)
    n_sets = rotation_sets(_set_bytes(first), device)
    sets = [first] + [op.make_set(g) for _ in range(n_sets - 1)]
    ref = op.reference(first, rd)
    baseline = next(c for c in op.cases if c.baseline)
    base = _max_err(op.canon(baseline.fn(first)), ref)
    rec: dict[str, Any] = {"shape": op.shape, "flops": op.flops, "bytes": op.nbytes, "input_sets": n_sets,
                           "check": {"rule": "max|out - ref| <= 2 * max|torch - ref| + atol", "atol": atol,
                                     "torch_err": base, "reference_dtype": str(rd).replace("torch.", "")},
                           "cases": []}  # fmt: skip
    for case in op.cases:
        progress.step(f"{run.name}: {op.name}: {case.name}")
        row: dict[str, Any] = {"case": case.name, "baseline": case.baseline}
        try:
            err = _max_err(op.canon(case.fn(first)), ref)
            bound = 2 * base + atol
            row["check"] = {"max_abs_err": err, "bound": bound, "passed": err <= bound}
            if not row["check"]["passed"]:
                progress.write(f"!! CHECK FAILED {run.name}: {op.name}: {case.name}: max|out-ref| = {err:.3g} > "
                               f"{bound:.3g}; NOT TIMED")  # fmt: skip
            else:
                timing = time_graph(case.fn, sets, reps=args.reps, device=device)
                us = timing.ms * 1e3
                row.update(us=us, method=timing.method, samples=len(timing.samples_ms))
                if op.flops:
                    row["tflops"] = op.flops / (us * 1e-6) / 1e12
                    row["pct_gemm_rate"] = 100 * row["tflops"] / ceilings["gemm"]["tflops"]
                row["gbs"] = op.nbytes / (us * 1e-6) / 1e9
                row["pct_copy_bw"] = 100 * row["gbs"] / ceilings["copy"]["gbs"]
        except Exception as exc:  # noqa: BLE001 - one failing case must not stop the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            row["traceback"] = traceback.format_exc(limit=6)
            progress.write(f"!! {run.name}: {op.name}: {case.name}: {row['error']}")
        rec["cases"].append(row)
    base_us = next((r.get("us") for r in rec["cases"] if r["baseline"]), None)
    for row in rec["cases"]:
        row["x_torch"] = base_us / row["us"] if (base_us and row.get("us")) else None
    del sets, first, ref
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def report_lines(rec: dict[str, Any]) -> list[str]:
    out = [f"== {rec['describe']}", f"   T = {rec['tokens']} tokens ({rec['batch']} x {rec['seq_len']})", ""]
    hdr = f"   {'op':10s} {'case':60s} {'us':>9} {'TFLOP/s':>8} {'%GEMM':>6} {'GB/s':>7} {'%copy':>6} {'x torch':>8}  check"
    out += [hdr, "   " + "-" * (len(hdr) - 3)]
    for op_name, op in rec["ops"].items():
        out.append(f"   {op_name:10s} {op['shape']}  ({op['input_sets']} input sets rotated)")
        for r in op["cases"]:
            if "error" in r:
                out.append(f"   {'':10s} {r['case']:60s} ERROR: {r['error']}")
                continue
            c = r["check"]
            verdict = f"ok ({c['max_abs_err']:.2g})" if c["passed"] else f"FAILED {c['max_abs_err']:.3g} > {c['bound']:.3g}"
            if "us" not in r:
                out.append(f"   {'':10s} {r['case']:60s} {'not timed':>9} {'':47s}{verdict}")
                continue

            def fmt(key, spec):
                v = r.get(key)
                return "-" if v is None else f"{v:{spec}}"

            out.append(
                f"   {'':10s} {r['case']:60s} {r['us']:>9.2f} {fmt('tflops', '.1f'):>8} {fmt('pct_gemm_rate', '.0f'):>6} "
                f"{fmt('gbs', '.0f'):>7} {fmt('pct_copy_bw', '.0f'):>6} {fmt('x_torch', '.2f'):>8}  {verdict}"
            )
    return out


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench/ops.py", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    common.add_preset_arg(ap)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per call; batch = tokens // seq_len (16384)")
    ap.add_argument("--ops", type=common.comma_list, default=list(OPS),
                    help=f"comma list of {', '.join(OPS)} (default all)")  # fmt: skip
    ap.add_argument("--activation", default=None,
                    help="FFN1's activation in every preset instead of its own, e.g. gelu_tanh (runs named NAME-ACT)")  # fmt: skip
    common.add_common_args(ap, "timed replays")
    args = ap.parse_args(argv)
    common.check_common_args(ap, args)
    if args.tokens <= 0:
        ap.error("--tokens must be positive")
    if args.activation is not None and args.activation not in fusedenc.ACTIVATIONS:
        ap.error(f"unknown --activation {args.activation}; choose from {', '.join(fusedenc.ACTIVATIONS)}")
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        ap.error(f"unknown --ops {', '.join(bad)}; choose from {', '.join(OPS)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device, args.reps = common.start(args.device, args.reps)
    on_gpu = device.type == "cuda"
    try:
        runs = select_runs(args.preset, args.dtype, on_gpu)
    except ValueError as exc:
        print(f"bench/ops.py: {exc}", file=sys.stderr)
        return 2
    if args.activation is not None:  # the same shapes with another activation (GELU's tanh form, ...)
        runs = [dataclasses.replace(r, preset=dataclasses.replace(r.preset, activation=args.activation),
                                    name=f"{r.name}-{args.activation}") for r in runs]  # fmt: skip
    notes = []
    if not on_gpu:
        notes.append("no GPU: CPU timings (wall clock, no CUDA graphs)"
                     + ("" if args.dtype else " in float32 (fp16 matmuls are slow on CPU)"))  # fmt: skip
    if on_gpu and fusedenc.backend().name == "reference":
        notes.append(f"WARNING: no active native core ({fusedenc.backend()}): fusedenc cases time the reference")

    env = common.environment(device)
    plans = []
    for run in runs:
        batch = max(1, args.tokens // run.seq_len)
        plans.append((run, batch, build_ops(run, batch, device, args.ops)))
    total = 2 + sum(len(op.cases) for _, _, ops in plans for op in ops)
    progress = common.Progress(total, "ops", enabled=not args.no_progress, step_timeout=args.step_timeout)
    records = []
    with torch.inference_mode():
        progress.step("ceilings: GEMM rate")
        ceilings = {"gemm": common.gemm_rate(device, runs[0].dtype, reps=args.reps)}
        progress.step("ceilings: copy bandwidth")
        ceilings["copy"] = common.copy_bandwidth(device, reps=args.reps)
        head = [
            f"fusedenc per-op benchmark on {common.describe_environment(env)}; "
            f"fusedenc backend: {env['fusedenc_backend']}",
            f"ceilings: GEMM {ceilings['gemm']['tflops']:.4g} TFLOP/s ({ceilings['gemm']['dtype']}, "
            f"m,n,k={ceilings['gemm']['shape_mnk']}), copy {ceilings['copy']['gbs']:.0f} GB/s (read + write); "
            f"median of {args.reps} " + ("CUDA-graph replays" if on_gpu else "calls (wall clock)"),
            "%GEMM: TFLOP/s / GEMM rate; GB/s: minimal bytes moved / time; %copy: GB/s / copy bandwidth; "
            "x torch: speed relative to the op's torch case",
        ] + notes
        progress.write("\n".join(head))
        for run, batch, ops in plans:
            rec = {"name": run.name, "describe": run.describe(), "config": run.config(), "batch": batch,
                   "seq_len": run.seq_len, "tokens": batch * run.seq_len, "ops": {}}  # fmt: skip
            for op in ops:
                rec["ops"][op.name] = run_op(op, run, device, args, ceilings, progress)
            records.append(rec)
            progress.write("\n" + "\n".join(report_lines(rec)))  # each table as soon as it is done
    progress.close()

    failures = [f"{r['name']}: {o}: {c['case']}" for r in records for o, op in r["ops"].items()
                for c in op["cases"] if c.get("check", {}).get("passed") is False]  # fmt: skip
    errors = [f"{r['name']}: {o}: {c['case']}: {c['error']}" for r in records for o, op in r["ops"].items()
              for c in op["cases"] if "error" in c]  # fmt: skip
    summary = []
    if failures:
        summary += ["", "CHECK FAILURES (not timed): " + "; ".join(failures)]
    if errors:
        summary += ["", "ERRORS:"] + [f"  {e}" for e in errors]
    if summary:
        print("\n".join(summary))

    base_path = common.result_base_path(args, runs, env, "ops")
    common.write_json(base_path + ".json", {
        "schema": SCHEMA,
        "command": ["bench/ops.py"] + (argv if argv is not None else sys.argv[1:]),
        "env": env, "ceilings": ceilings, "notes": notes,
        "methodology": {"timing": "CUDA graph of back-to-back calls, event-timed replays" if on_gpu else
                        "perf_counter per call (CPU)", "reps": args.reps, "statistic": "median",
                        "input_rotation": "inputs and weights rotate among enough sets to span 4x L2 (<= 16 sets)",
                        "check": "max|out - ref| <= 2 * max|torch - ref| + atol, before timing"},
        "check_passed": not failures, "errors": errors, "runs": records,
    })  # fmt: skip
    lines = head + [line for rec in records for line in [""] + report_lines(rec)] + summary
    with open(base_path + ".txt", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {base_path}.json, {base_path}.txt")
    return 1 if (failures or errors) else 0


if __name__ == "__main__":
    sys.exit(main())
