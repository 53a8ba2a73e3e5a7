"""The nps benchmark's outputs: the text tables, the JSON file and the throughput plot.

``report_lines`` is one run's table (printed as each run finishes);
``write_outputs`` rewrites ``<out-dir>/nps_<tag>.json`` and ``.txt`` with every
run finished so far; ``plot`` draws ``.png``.  The JSON's layout is ``SCHEMA``.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import common

from fusedenc.tune.presets import Run

__all__ = ["SCHEMA", "fp8_lines", "plot", "report_lines", "write_outputs"]

SCHEMA = "fusedenc.bench.nps/1"
#: Kernels of a ``--kernels`` point listed in the table (the JSON keeps ``common.TOP_KERNELS``).
KERNEL_LINES = 6


def _fmt_rate(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v / 1e3:,.1f}k" if v >= 1e4 else f"{v:,.1f}"


def _fmt(v: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def report_lines(rec: dict[str, Any], run: Run, on_gpu: bool = True) -> list[str]:
    """One run's table.  On a CPU the GEMM floor and the roofline (a GPU's ceilings) are left
    out: the PyTorch reference ops run there, and a CPU's torch.mm says nothing about them."""
    unit = run.rate_unit
    out = [f"== {rec['describe']}"]
    c = rec["check"]
    out.append(
        f"   check at batch {c['batch']} against a {c['reference_dtype']} reference: {c['rule']} "
        f"(torch error {c['torch_same_dtype_err']:.3g}, slack {c['slack']}, atol {c['atol']:g})"
    )
    if "fp8" in c:
        f8 = c["fp8"]
        out.append(f"   FP8 rows: {f8['rule']} (e_fp8 {f8['emulated_rel_err']:.3g}: {f8['emulated']}; "
                   f"slack {f8['slack']}, floor {f8['floor']:g})")  # fmt: skip
    for name, e in rec["impls"].items():
        label = e.get("label", name)
        if "error" in e:
            out.append(f"   {label:42s} ERROR: {e['error'].strip().splitlines()[-1]}")
            continue
        ch = e["check"]
        verdict = {True: "ok", False: "FAILED: NOT TIMED", None: "not judged (stand-in)"}[ch["passed"]]
        err = f"err {ch['max_abs_err']:.3g} <= {ch['bound']:.3g}" if "max_abs_err" in ch else ch.get("reason", "")
        if "rel_err" in ch:
            err = f"rel err {ch['rel_err']:.3g} <= {ch['bound']:.3g} ({_fmt(ch['x_emulated'], '.2f', 'x')} e_fp8)"
        if ch["passed"] is None and "max_abs_err" in ch:
            err = f"err {ch['max_abs_err']:.3g} (other math)"
        out.append(f"   {label:42s} {err:32s} {verdict}; setup {e['setup_s']:.2f} s")
        for note in e.get("notes", []):
            out.append(f"   {'':42s} {note}")
    for name, why in rec["skipped"].items():
        out.append(f"   {name:42s} skipped: {why}")

    floor_col = f"{'% floor':>8}  " if on_gpu else ""
    header = f"   {'batch':>5}  {'implementation':42s} {unit:>11} {'ms/batch':>10} {'x torch':>8} {'x compile':>9} " \
             f"{floor_col}{'first call':>10}"  # fmt: skip
    out += ["", header, "   " + "-" * (len(header) - 3)]
    for b in rec["batch_sizes"]:
        key = str(b)
        for name, e in rec["impls"].items():
            pt = e.get("points", {}).get(key)
            if pt is None:
                continue
            label = e.get("label", name)
            if "error" in pt:
                out.append(f"   {b:>5}  {label:42s} ERROR: {pt['error']}")
                continue
            out.append(
                f"   {b:>5}  {label:42s} {_fmt_rate(pt['per_s']):>11} {pt['ms']:>10.3f} "
                f"{_fmt(pt['x_torch'], '.2f', 'x'):>8} {_fmt(pt['x_compile'], '.2f', 'x'):>9} "
                + (f"{_fmt(pt['pct_gemm_floor'], '.0f', '%'):>8}  " if on_gpu else "")
                + f"{pt['first_call_s']:>9.2f}s"
            )
            if "kernels" in pt:  # --kernels: what the GPU did of a call, the longest kernels first
                out.append(f"   {'':>5}  {'':42s} {common.kernel_note(pt['kernels'])}")
                for top in pt["kernels"].get("top_kernels", [])[:KERNEL_LINES]:
                    out.append(f"   {'':>5}  {'':42s}   {top['us_per_batch']:8.1f} us, {top['per_batch']:4.0f} calls: "
                               f"{top['kernel'][:72]}")  # fmt: skip
        if not on_gpu:
            out.append("")
            continue
        lines = rec["reference_lines"][key]
        fl = lines["gemm_floor"]
        if "ms" in fl:
            out.append(f"   {b:>5}  {'gemm-floor (' + fl['via'] + ', ' + fl['method'] + ')':42s} "
                       f"{_fmt_rate(lines['gemm_floor_per_s']):>11} {fl['ms']:>10.3f}")  # fmt: skip
        out.append(f"   {b:>5}  {'roofline (all matmul FLOPs)':42s} "
                   f"{_fmt_rate(lines['roofline_per_s']):>11} {lines['roofline_ms']:>10.3f}")  # fmt: skip
        out.append("")

    # Compact matrix: rate by implementation and batch size.
    names = [n for n, e in rec["impls"].items() if e.get("points")]
    if names:
        out.append(f"   {unit} by batch size")
        out.append(f"   {'':42s} " + " ".join(f"{b:>10}" for b in rec["batch_sizes"]))
        rows = [(rec["impls"][n].get("label", n), [rec["impls"][n]["points"].get(str(b), {}).get("per_s")
                 for b in rec["batch_sizes"]]) for n in names]  # fmt: skip
        if on_gpu:
            rows.append(("gemm-floor", [rec["reference_lines"][str(b)]["gemm_floor_per_s"] for b in rec["batch_sizes"]]))
            rows.append(("roofline", [rec["reference_lines"][str(b)]["roofline_per_s"] for b in rec["batch_sizes"]]))
        for label, vals in rows:
            out.append(f"   {label:42s} " + " ".join(f"{_fmt_rate(v):>10}" for v in vals))
    out.append("   x torch / x compile: speed relative to torch / torch-compile at that batch size (stand-ins "
               "excluded); " + ("% floor: GEMM-floor time / this time; " if on_gpu else "")
               + "first call: compile, autotune and planning, untimed")  # fmt: skip
    if not on_gpu:
        out.append("   on a CPU fusedenc runs its PyTorch reference ops: these rows show that everything runs "
                   "and agrees, not fusedenc's speed (that needs an NVIDIA GPU)")
    if "fp8" in c:
        out += fp8_lines(rec)
    return out


def fp8_lines(rec: dict[str, Any]) -> list[str]:
    """The FP8 rows against the fastest fp16 fusedenc row and the fastest torch-fp8 row, per batch."""
    names = [n for n, e in rec["impls"].items() if e.get("precision") == "fp8" and e.get("points")]
    out = ["", "   FP8 rows: speed against the fastest fp16 fusedenc row (x fusedenc16) and the fastest "
           "torch-fp8 row (x torch-fp8) at that batch size",
           f"   {'batch':>5}  {'implementation':42s} {'ms/batch':>10} {'x fusedenc16':>12} {'x torch-fp8':>11}"]  # fmt: skip
    out.append("   " + "-" * (len(out[-1]) - 3))
    for b in rec["batch_sizes"]:
        key = str(b)
        lines = rec["reference_lines"][key]
        for name in names:
            e = rec["impls"][name]
            pt = e["points"].get(key)
            if pt is None or "ms" not in pt:
                continue
            out.append(f"   {b:>5}  {e.get('label', name):42s} {pt['ms']:>10.3f} "
                       f"{_fmt(pt.get('x_fusedenc_fp16'), '.2f', 'x'):>12} {_fmt(pt.get('x_torch_fp8'), '.2f', 'x'):>11}")  # fmt: skip
        against = [f"{what} {best['impl']} {best['ms']:.3f} ms" for what, best in
                   (("fp16 fusedenc:", lines.get("best_fusedenc_fp16", {})), ("torch-fp8:", lines.get("best_torch_fp8", {})))
                   if best.get("ms")]  # fmt: skip
        out.append(f"   {b:>5}  fastest {'; '.join(against) if against else '(none timed)'}")
    return out


def plot(records: list[dict[str, Any]], runs: list[Run], path: str, env: dict[str, Any]) -> Optional[str]:
    """Throughput vs batch size, one panel per run; returns why not, if it could not plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    n = len(records)
    cols = min(2, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax, rec, run in zip(axes.flat, records, runs):
        bs = rec["batch_sizes"]
        for name, e in rec["impls"].items():
            pts = [(b, e.get("points", {}).get(str(b), {}).get("per_s")) for b in bs]
            pts = [(b, v) for b, v in pts if v]
            if pts:
                style = "--" if not e.get("checked", True) else "-"
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=e.get("label", name))
        floor = [(b, rec["reference_lines"][str(b)]["gemm_floor_per_s"]) for b in bs]
        floor = [(b, v) for b, v in floor if v]
        if floor:
            ax.plot(*zip(*floor), ":", color="black", label="GEMM floor")
        roof = [(b, rec["reference_lines"][str(b)]["roofline_per_s"]) for b in bs]
        ax.plot(*zip(*roof), ":", color="gray", label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel(f"batch ({run.preset.unit} per call)")
        ax.set_ylabel(run.rate_unit)
        ax.set_title(f"{run.name} ({str(run.dtype).replace('torch.', '')})", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(f"fusedenc nps benchmark: {common.describe_environment(env)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(
    base_path, head, records, runs, ceilings, env, notes, args, argv, nets=(), net_lines=()
) -> tuple[list[str], list[str]]:
    """The JSON and the text tables of the runs finished so far, then those of the lc0 nets
    (``--net``: ``nets`` as bench/lc0.py records them, ``net_lines`` its table lines);
    returns (check failures, errors)."""
    on_gpu = env["device"].startswith("cuda")
    lines = head[:]
    for rec, run in zip(records, runs):
        lines += [""] + report_lines(rec, run, on_gpu)
    lines += list(net_lines)
    failures = [f"{r['name']}: {n}" for r in records for n, e in r["impls"].items()
                if e.get("check", {}).get("passed") is False]  # fmt: skip
    failures += [f"{n['net']}: {impl}" for n in nets for impl, c in n["check"].items() if not c["ok"]]
    errors = [f"{r['name']}: {e}" for r in records for e in r["errors"]]
    if failures:
        lines += ["", "CHECK FAILURES (not timed): " + "; ".join(failures)]
    if errors:
        lines += ["", "ERRORS:"] + [f"  {e}" for e in errors]
    result = {
        "schema": SCHEMA,
        "command": ["bench/nps.py"] + (argv if argv is not None else sys.argv[1:]),
        "complete": len(records) == len(runs),
        "env": env,
        "ceilings": ceilings,
        "methodology": {
            "timing": "device events per call, back to back" if on_gpu else "perf_counter per call (CPU)",
            "reps": args.reps, "warmup": args.warmup, "statistic": "median",
            "input_rotation": "inputs rotate among enough sets to span 4x L2 (at most 16 sets)",
            "gemm_floor": "4 GEMMs x layers with each layer's weights, one CUDA graph, faster of torch.mm "
                          "and fusedenc.linear",
            "roofline": "all matmul FLOPs (GEMMs + attention QK^T and PV) at the measured GEMM rate",
            "compile_dynamic": args.compile_dynamic,
            "check": f"max|out - ref| <= {args.check_slack} * 2 * max|torch - ref| + atol, before timing",
            **({"check_fp8": f"||out - ref|| / ||ref|| <= {args.check_slack} * e_fp8 + floor, e_fp8 the same "
                             "measure of the net with every GEMM in emulated FP8, before timing"}
               if getattr(args, "fp8", False) else {}),
        },  # fmt: skip
        "notes": notes,
        "check_passed": not failures,
        "errors": errors,
        "runs": records,
        "nets": list(nets),
    }
    common.write_json(base_path + ".json", result)
    with open(base_path + ".txt", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return failures, errors
