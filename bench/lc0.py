"""Whole Lc0 network throughput: fusedenc against PyTorch on the same net, planes in, heads out.

    python3 bench/lc0.py --net NET.pb.gz [--batch-sizes 64,256,1024]
    python3 bench/lc0.py --synthetic t82,bt4       # random nets of those shapes (fusedenc.lc0.writer)

Without a GPU it runs on the CPU in float32 (torch and fusedenc rows only), as bench/nps.py
--net and ``python -m fusedenc.lc0 NET`` do: CPU numbers time the PyTorch reference ops that
fusedenc runs there, not its GPU path, and the report says so.

Implementations (one process, the same file, the same input planes):

  torch                 fusedenc.lc0.reference.ReferenceNetwork with every weight already in
                        the run's dtype on the GPU: the whole net written plainly in PyTorch
                        (the idiomatic implementation, and the tests' oracle)
  torch-compile         torch.compile of it, default mode (``--compile-modes`` adds modes,
                        e.g. reduce-overhead: CUDA graphs)
  fusedenc              fusedenc.lc0.load_network's Lc0Network, called plainly: what a user gets
                        (automatic CUDA graphs: the first call eager, the second captures)
  fusedenc-eager        the same with automatic graphs off (every launch from the host)
  fusedenc-compile      torch.compile of the Lc0Network, default mode
  fusedenc-graph        the same, its whole forward captured as one CUDA graph per batch size
  fusedenc-fp8-static   with ``--fp8``: the same net with its body in FP8
                        (``quantize("fp8", fast_accum=True, calibration=256 other positions)``),
                        one CUDA graph per batch size, the LayerNorms folded into the FP8
                        GEMMs where the Hopper kernels run; checked by the FP8 rule below;
                        ``fusedenc-fp8-static-plain``: the same net called plainly
  fusedenc-fp8-static-ln  the same with ``fold_norms=False`` (the LayerNorm passes)
  lc0:<backend>         with ``--lc0 BINARY``: lc0's own ``backendbench`` on the same file
                        (``--lc0-backend``, default cuda-fp16), run in the same process's
                        turn; its median positions/s.  lc0 is not a dependency: point
                        ``--lc0`` at an ``lc0`` you built (its timing includes lc0's host
                        work per batch: encoding the positions, as in its search)

``--parts`` also times the stages of the fusedenc forward, each in its own CUDA graph:
the embedding, smolgen's bias generation of every layer, the encoder blocks (given those
biases) and the heads, so the report says what each costs per call.

Correctness before timing, at the smallest batch: every implementation's policy, WDL and
moves-left against the reference in fp32 (TF32 off), with the project's rule
``max|out - ref32| <= slack * 2 * max|torch - ref32| + atol`` (slack 1.5, ``--check-slack``).
The FP8 row cannot meet a 16-bit bound: its check is a gross-error guard (every output
finite, ``||out - ref32|| / ||ref32|| <= 0.25`` over the heads together), and the report gives
the FP8 gate metrics beside it: policy top-1 agreement and WDL max |diff| against the
fp16 fusedenc net (bench/fp8_accuracy.py --lc0 measures them on many positions).
Timing: device events, warm-up, median of ``--reps`` (>= 20) calls; compile and capture
time measured apart.  Writes ``<out-dir>/lc0_<tag>.json`` and ``.txt``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fusedenc.common import dtypes
from fusedenc.graphs import auto as auto_graphs  # noqa: E402
from fusedenc.lc0 import Lc0FileError, Lc0FormatError, Lc0Network, NetFile, check_supported, read_net  # noqa: E402
from fusedenc.lc0.errors import reason  # noqa: E402
from fusedenc.lc0.reference import ReferenceNetwork, placed  # noqa: E402
from fusedenc.tune.timing import MIN_REPS, capture_graph, sync, time_calls  # noqa: E402

SCHEMA = "fusedenc.bench.lc0/1"


def _synthetic(name: str, out_dir: str) -> str:
    """A synthetic net of preset ``name`` (random weights in lc0's shapes), written once."""
    from fusedenc.lc0.writer import write_preset

    path = os.path.join(out_dir, f"synthetic-{name}.pb.gz")
    if not os.path.exists(path):
        write_preset(path, name, seed=1)
    return path


class NetFileError(Exception):
    """A net file the benchmark cannot run: missing, damaged, or a net fusedenc does not run.
    Its message is what to tell the user (``main`` prints it and exits 2, as ``python -m
    fusedenc.lc0`` does); a traceback would read as a bug of the benchmark."""


def read_checked(path: str, dtype: torch.dtype) -> NetFile:
    """``read_net(path)``, checked as ``python -m fusedenc.lc0`` checks it (same messages);
    raises ``NetFileError``."""
    try:
        file = read_net(path)
    except (OSError, Lc0FileError) as exc:
        raise NetFileError(f"cannot read {path}: {reason(exc, path)}") from None
    try:
        check_supported(file, dtype=dtype)
    except Lc0FormatError as exc:  # "<path>: fusedenc cannot run this net:" and one line per reason
        raise NetFileError(str(exc)) from None
    return file


def _planes(batch: int, device: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    planes = (torch.rand((batch, 112, 8, 8), generator=g) < 0.1).float()
    planes[:, 108] = torch.rand((batch, 1, 1), generator=g)
    planes[:, 111] = 1.0
    return planes.to(device=device, dtype=dtype)


def _eager_call(net: Lc0Network, x: torch.Tensor) -> Any:
    """The plain call with automatic CUDA graphs off (the path before them)."""
    with auto_graphs.disabled():
        return net(x)


def _graphed(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    return capture_graph(fn, device).replay


#: The FP8 row's gross-error guard: relative error of the heads against fp32 (FP8 nets measure
#: a few percent; a wrong layout or scale gives ~100%).
FP8_REL_BOUND = 0.25
FP8_IMPL = "fusedenc-fp8-static"
#: The same calibrated net with ``fold_norms=False``: its LayerNorm passes (the fold's A/B).
FP8_LN_IMPL = "fusedenc-fp8-static-ln"


def _rel_err(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    o = torch.cat([out[k].double().flatten() for k in ref])
    r = torch.cat([ref[k].double().flatten() for k in ref])
    return ((o - r).norm() / r.norm()).item() if torch.isfinite(o).all() else float("inf")


def _fp8_check(out, fp16_out, ref, bound: float) -> dict[str, Any]:
    """The FP8 row's check record: the guard, and the gate metrics against the fp16 net."""
    rel = _rel_err(out, ref)
    agree = (out["policy"].argmax(-1) == fp16_out["policy"].argmax(-1)).float().mean().item()
    wdl = (out["wdl"].double() - fp16_out["wdl"].double()).abs().max().item()
    return {"rel_err": rel, "bound": bound, "ok": rel <= bound, "policy_top1_vs_fp16": agree, "wdl_max_diff_vs_fp16": wdl}


def _max_err(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max((out[k].double() - ref[k].double()).abs().max().item() for k in ref)


def _time_graphed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    replay = _graphed(fn, device)
    return time_calls(lambda _: replay(), [None], reps=reps, device=device).ms


def time_parts(net: Lc0Network, x: torch.Tensor, reps: int, device: torch.device) -> dict[str, float]:
    """Milliseconds per call of each stage of ``net``'s forward on planes ``x``, each stage in
    its own CUDA graph: embedding, smolgen (all layers), encoder blocks (all layers, each
    given its smolgen bias) and heads.  Their sum less the whole graph's time is what
    running them as one graph saves (launch gaps, cache reuse)."""
    n = len(net.blocks)
    h = net.embed(x)
    inputs, biases = [], []
    for i in range(n):
        inputs.append(h)
        biases.append(net.attention_bias(i, h))
        h = net.blocks[i](h, biases[-1])
    stages = {
        "embedding": lambda: net.embed(x),
        "smolgen": lambda: [net.attention_bias(i, inputs[i]) for i in range(n)],
        "blocks": lambda: [net.blocks[i](inputs[i], biases[i]) for i in range(n)],
        "heads": lambda: net.head_outputs(h),
    }
    return {name: _time_graphed(fn, device, reps) for name, fn in stages.items()}


def lc0_backendbench(binary: str, net: str, batch: int, backend: str, batches: int) -> dict[str, float]:
    """lc0's ``backendbench`` at one batch size: ``{"nps": median, "mean_nps": ..., "cutlass": bool}``.

    Its output is CSV lines ``size, mean nps, mean ms, sdev, cv, max nps, median, min nps,
    first max, first mean`` after a header; raises RuntimeError with lc0's output when
    it fails or prints no row for ``batch``."""
    cmd = [binary, "backendbench", f"--weights={net}", f"--backend={backend}", f"--batches={batches}",
           f"--start-batch-size={batch}", f"--max-batch-size={batch}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 7 and fields[0] == str(batch):
            # lc0's cuda backend says at start-up whether its fused (CUTLASS) attention is compiled in.
            said = proc.stdout + proc.stderr
            return {"nps": float(fields[6]), "mean_nps": float(fields[1]), "cutlass": "CUTLASS" in said}
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
    raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode} without a batch-{batch} row:\n{tail}")


#: What this benchmark can time; ``run_net``'s ``wanted`` picks among them (bench/nps.py --net).
IMPLS = ("torch", "torch-compile", "fusedenc", "fusedenc-eager", "fusedenc-compile", "fusedenc-graph")
#: On the CPU: compiling there is slow and not what the rows are about, graphs need a GPU.
CPU_IMPLS = ("torch", "fusedenc")
#: The line a CPU run's report carries (here and in bench/nps.py --net, which prints ``report``).
CPU_NOTE = "   " + common.CPU_NOTE  # under a net's table heading


def run_net(
    path: str, args, device: torch.device, dtype: torch.dtype, wanted: tuple[str, ...] = IMPLS
) -> dict[str, Any]:
    """Check, then time, the implementations in ``wanted`` on the net at ``path`` (``args``:
    batch_sizes, compile_modes, reps, seed, check_slack).  CUDA graphs only on a GPU.
    Raises ``NetFileError`` for a file it cannot run, before anything is built."""
    file = read_checked(path, dtype)
    desc = file.describe()
    ref_net = ReferenceNetwork(placed(file, device, torch.float32))
    torch_net = ReferenceNetwork(placed(file, device, dtype))
    fast = Lc0Network(file, dtype=dtype, device=device)
    impls: dict[str, Callable[[torch.Tensor], Any]] = {"torch": torch_net, "fusedenc": fast}
    if "fusedenc-eager" in wanted:
        impls["fusedenc-eager"] = lambda x: _eager_call(fast, x)
    if "fusedenc-compile" in wanted and device.type == "cuda":
        impls["fusedenc-compile"] = torch.compile(fast)
    if "torch-compile" in wanted:
        for mode in ["default"] + args.compile_modes:
            name = "torch-compile" if mode == "default" else f"torch-compile:{mode}"
            impls[name] = torch.compile(torch_net, mode=None if mode == "default" else mode)
    graph = "fusedenc-graph" in wanted and device.type == "cuda"
    fp8_nets = {}
    if getattr(args, "fp8", False) and device.type == "cuda":
        cal = _planes(256, device, dtype, args.seed + 7919)  # not the positions checked or timed
        for name, fold in ((FP8_IMPL, True), (FP8_LN_IMPL, False)):
            fp8_nets[name] = Lc0Network(file, dtype=dtype, device=device).quantize(
                "fp8", fast_accum=True, calibration=cal, fold_norms=fold)  # fmt: skip
    batches = args.batch_sizes
    rec: dict[str, Any] = {"net": path, "device": str(device), "description": desc, "rows": [], "check": {}}
    # Correctness at the smallest batch, before any timing.
    check_b = min(batches)
    x = _planes(check_b, device, dtype, args.seed)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = ref_net(x.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    base = _max_err(torch_net(x), ref)
    bound = args.check_slack * 2 * base + dtypes.ATOL[dtype]
    ok = {}
    for name, fn in impls.items():
        err = _max_err(fn(x), ref)
        ok[name] = err <= bound
        rec["check"][name] = {"err": err, "bound": bound, "ok": ok[name]}
        print(f"   check {name:28s} err {err:.3g} <= {bound:.3g}  {'ok' if ok[name] else 'FAILED: not timed'}")
    for name, net in fp8_nets.items():
        c = rec["check"][name] = _fp8_check(net(x), fast(x), ref, FP8_REL_BOUND)
        ok[name] = c["ok"]
        print(f"   check {name:28s} rel err {c['rel_err']:.3g} <= {c['bound']}  {'ok' if c['ok'] else 'FAILED: not timed'}"
              f"; against fp16: policy top-1 {c['policy_top1_vs_fp16']:.2%}, WDL max |diff| {c['wdl_max_diff_vs_fp16']:.4f}")
    for b in batches:
        x = _planes(b, device, dtype, args.seed + b)
        for name, fn in impls.items():
            if not ok[name]:
                continue
            t0 = time.perf_counter()
            fn(x)  # first call: compile, plans
            sync(device)
            first_s = time.perf_counter() - t0
            t = time_calls(lambda inp, fn=fn: fn(inp), [x], reps=args.reps, device=device)
            rec["rows"].append({"batch": b, "impl": name, "ms": t.ms, "nps": b / (t.ms * 1e-3), "first_call_s": first_s})
        if graph and ok["fusedenc"]:
            ms = _time_graphed(lambda x=x: fast(x), device, args.reps)
            rec["rows"].append({"batch": b, "impl": "fusedenc-graph", "ms": ms, "nps": b / (ms * 1e-3)})
        for name, net in fp8_nets.items():
            if ok[name]:
                ms = _time_graphed(lambda x=x, net=net: net(x), device, args.reps)
                rec["rows"].append({"batch": b, "impl": name, "ms": ms, "nps": b / (ms * 1e-3)})
                if name == FP8_IMPL:  # the same net called plainly (automatic CUDA graphs)
                    ms = time_calls(lambda inp, net=net: net(inp), [x], reps=args.reps, device=device).ms
                    rec["rows"].append({"batch": b, "impl": FP8_IMPL + "-plain", "ms": ms, "nps": b / (ms * 1e-3)})
        if getattr(args, "parts", False) and device.type == "cuda" and ok["fusedenc"]:
            rec.setdefault("parts", {})[str(b)] = time_parts(fast, x, args.reps, device)
        if getattr(args, "lc0", None):
            name = f"lc0:{args.lc0_backend}"
            try:
                r = lc0_backendbench(args.lc0, path, b, args.lc0_backend, args.lc0_batches)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                print(f"   {name} at batch {b} failed: {e}", file=sys.stderr)
                rec.setdefault("errors", []).append(f"{name} batch {b}: {e}")
            else:
                rec["rows"].append({"batch": b, "impl": name, "ms": b / r["nps"] * 1e3, **r})
    return rec


def report(rec: dict[str, Any]) -> list[str]:
    d = rec["description"]
    lines = [
        f"== {os.path.basename(rec['net'])}: {d.get('layers')} layers, d_model {d.get('d_model')}, {d.get('heads')} heads, "
        f"FFN {d.get('d_ff')}, activations {d.get('activations')}, smolgen {d.get('smolgen')}, embedding {d.get('embedding')}",
        f"   {'batch':>5}  {'implementation':28s} {'positions/s':>12} {'ms':>9} {'x torch':>8} {'x best torch':>12} {'x lc0':>6}",
    ]
    if rec.get("device") == "cpu":
        lines.insert(1, CPU_NOTE)
    for b in sorted({r["batch"] for r in rec["rows"]}):
        rows = [r for r in rec["rows"] if r["batch"] == b]
        torch_nps = next((r["nps"] for r in rows if r["impl"] == "torch"), None)
        best = max((r["nps"] for r in rows if r["impl"].startswith("torch")), default=None)
        lc0 = next((r["nps"] for r in rows if r["impl"].startswith("lc0:")), None)
        for r in rows:
            ratio = f"{r['nps'] / torch_nps:.2f}x" if torch_nps else "-"
            vs_best = f"{r['nps'] / best:.2f}x" if best else "-"
            vs_lc0 = f"{r['nps'] / lc0:.2f}x" if lc0 else "-"
            lines.append(f"   {b:>5}  {r['impl']:28s} {r['nps']:>12,.0f} {r['ms']:>9.3f} {ratio:>8} {vs_best:>12} {vs_lc0:>6}")
    c = rec["check"].get(FP8_IMPL)
    if c is not None:
        speed = []
        for b in sorted({r["batch"] for r in rec["rows"]}):
            got = {r["impl"]: r["nps"] for r in rec["rows"] if r["batch"] == b}
            fp16 = max((v for k, v in got.items() if k in ("fusedenc", "fusedenc-graph")), default=None)
            if FP8_IMPL in got and fp16:
                speed.append(f"{got[FP8_IMPL] / fp16:.2f}x at batch {b}")
        lines.append(f"   {FP8_IMPL} against the faster fusedenc fp16 row: {', '.join(speed) or 'not timed'}; relative error "
                     f"{c['rel_err']:.3g} against fp32 (guard {c['bound']}); against fp16 at the check batch: policy "
                     f"top-1 {c['policy_top1_vs_fp16']:.2%}, WDL max |diff| {c['wdl_max_diff_vs_fp16']:.4f}")  # fmt: skip
    for b, parts in rec.get("parts", {}).items():
        whole = next((r["ms"] for r in rec["rows"] if r["batch"] == int(b) and r["impl"] == "fusedenc-graph"), None)
        shares = ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
        lines.append(f"   batch {b}: stages, ms per call (each its own graph): {shares}; sum {sum(parts.values()):.3f}"
                     + (f", whole graph {whole:.3f}" if whole else ""))  # fmt: skip
    for e in rec.get("errors", []):
        lines.append(f"   not measured: {e.splitlines()[0]}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--net", action="append", help="an lc0 network file (.pb.gz); repeatable")
    src.add_argument("--synthetic", type=common.comma_list, help="synthetic nets: tiny, t82, bt4 (comma list)")
    ap.add_argument("--batch-sizes", type=lambda s: [int(v) for v in common.comma_list(s)], default=[64, 256, 1024])
    ap.add_argument("--compile-modes", type=common.comma_list, default=[],
                    help="torch.compile modes besides the default (e.g. reduce-overhead)")  # fmt: skip
    ap.add_argument("--parts", action="store_true", help="also time the stages of the fusedenc forward")
    ap.add_argument("--lc0", metavar="BINARY", help="an lc0 binary: time its backendbench on the same net")
    ap.add_argument("--lc0-backend", default="cuda-fp16", help="lc0 backend for --lc0 (default cuda-fp16)")
    ap.add_argument("--lc0-batches", type=int, default=100, help="batches per size for --lc0 (lc0's --batches)")
    ap.add_argument("--fp8", action="store_true", help="also the net's FP8 mode (static, fast accumulation), graphed")
    ap.add_argument("--dtype", choices=sorted(dtypes.BY_NAME), default=None,
                    help="default float16 on a GPU, float32 on the CPU")  # fmt: skip
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-slack", type=float, default=1.5)
    ap.add_argument("--out-dir", default=os.environ.get(common.RESULTS_DIR_ENV) or common.DEFAULT_RESULTS_DIR)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    if args.reps < MIN_REPS:
        ap.error(f"--reps must be at least {MIN_REPS}")
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    args.dtype = args.dtype or ("float16" if gpu else "float32")  # fp16 matmuls are slow on CPUs
    dtype = dtypes.BY_NAME[args.dtype]
    os.makedirs(args.out_dir, exist_ok=True)
    nets = args.net or [_synthetic(n, args.out_dir) for n in args.synthetic]
    env = common.environment(device)
    head = [f"fusedenc Lc0 whole-network benchmark on {common.describe_environment(env)}; "
            f"fusedenc backend: {env['fusedenc_backend']}; {args.dtype}, median of {args.reps} calls"]  # fmt: skip
    if not gpu:
        head.append(f"no GPU: running on the CPU in {args.dtype}, {', '.join(CPU_IMPLS)} rows only; "
                    + common.CPU_NOTE.removeprefix("CPU run: "))  # fmt: skip
    print("\n".join(head))
    tag = args.tag or "-".join(os.path.basename(p).split(".")[0] for p in nets) + f"_{args.dtype}_{common.slug(env['device_name'])}"
    base = os.path.join(args.out_dir, f"lc0_{tag}")
    records, lines = [], list(head)
    with torch.inference_mode():
        for path in nets:
            try:
                rec = run_net(path, args, device, dtype, IMPLS if gpu else CPU_IMPLS)
            except NetFileError as exc:  # the nets before it are written already
                print(f"bench/lc0.py: {exc}", file=sys.stderr)
                return 2
            records.append(rec)
            lines += [""] + report(rec)
            print("\n".join(report(rec)), flush=True)
            # Written after each net, so a run cut off by a time limit keeps what finished.
            common.write_json(base + ".json", {"schema": SCHEMA, "environment": env, "args": vars(args), "results": records})
            with open(base + ".txt", "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    print(f"wrote {base}.json, {base}.txt")
    return 0 if all(all(c["ok"] for c in r["check"].values()) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
