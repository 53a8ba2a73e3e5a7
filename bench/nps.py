"""End-to-end encoder throughput: fusedenc against PyTorch, same weights, same inputs, one process.

    python3 bench/nps.py                          # t82, bt4, bert-base on a GPU; tiny on CPU
    python3 bench/nps.py --preset t82 --batch-sizes 1,16,256 --impl torch,torch-compile,fusedenc-graph
    python3 bench/nps.py --compile-modes max-autotune-no-cudagraphs,reduce-overhead
    python3 bench/nps.py --preset t82 --net NET.pb.gz   # a whole lc0 net beside the presets (bench/lc0.py)
    python3 bench/nps.py --preset t82 --dtype fp8 --batch-sizes 256,1024   # FP8 rows beside fp16

Presets (fusedenc/tune/presets.py): t82, bt4 (Lc0-style post-LN with alpha = (2L)^-0.25,
64 tokens per position), bert-base (sequence 128 and 512; ``bert-base-s512``
for one), tiny and tiny-bert (CPU-sized).  Batch = positions or sequences per call.

Implementations (all built from one idiomatic PyTorch model's weights):

  unfused          the plain library path the fused GEMMs replace: three Q/K/V
                   GEMMs (torch.mm), each bias add and the activation as their own
                   kernels, alpha as its own multiply, residual add, F.layer_norm;
                   attention is F.scaled_dot_product_attention.
  torch            idiomatic PyTorch: one in_proj nn.Linear (bias in the GEMM),
                   F.scaled_dot_product_attention, torch.nn.functional activation,
                   nn.LayerNorm; the alpha multiply only when alpha != 1.
  torch-fastpath   nn.TransformerEncoder in eval mode, batch_first, under
                   inference_mode, where its fused fast path
                   (torch._transformer_encoder_layer_fwd) can serve the preset:
                   relu/gelu and alpha = 1 (bert-base).  For t82/bt4/tiny it
                   cannot; a stand-in with the same shapes, gelu and alpha = 1 is
                   timed ("torch-fastpath (gelu stand-in)"), excluded from the
                   check and from the ratios.  Whether the fast path really ran is
                   verified by counting calls of torch._transformer_encoder_layer_fwd.
  torch-compile    torch.compile(torch model), default mode, one static graph per
                   batch size (``--compile-dynamic`` for one dynamic graph);
                   ``--compile-modes`` adds torch-compile:<mode> rows.
  fusedenc         fusedenc.encoder.blocks.EncoderStack, called plainly: automatic CUDA graphs
                   (fusedenc.graphs.auto; first call eager, the second captures).
  fusedenc-eager   the same with automatic graphs off (every launch from the host).
  fusedenc-compile torch.compile(EncoderStack, fullgraph=True), default mode (meant to be >= 0.95x
                   eager fusedenc at every batch).
  fusedenc-graph   EncoderStack.graph_runner (one CUDA graph per batch size).
  fusedenc-gelu-pass  the plain call with the Hopper GELU units off: GELU a pass after the GEMM
                   (GELU presets on an H100/H200; only when named in --impl).
  fusedenc-folded  the plain call with LayerNorm folding forced at every batch size (the
                   library folds where the GEMMs span four waves: only when named in --impl);
                   fusedenc-unfolded with folding off at every batch size, and
                   fusedenc-unfolded-gelu-pass with folding off and the GELU units off.

Reference lines: ``gemm-floor``, the four GEMMs of every layer alone (each
layer's own weights, the faster of torch.mm and fusedenc.linear, i.e. the
vendor library) captured in one CUDA graph so small batches are not
launch-bound; ``roofline``, all matmul FLOPs (GEMMs and attention's two
batched matmuls) at the dense GEMM rate measured on this device in this run.
With ``--kernels`` (GPU) each point also says what the GPU did of a call: the
kernels it launched, their summed device time against the call's (how much of
the call the GPU was busy: the floor that fusions and fewer launches work
against) and the longest kernels by name.

Correctness, before any timing: each implementation runs the check batch (the
smallest batch size >= 4 of the sweep) and its output is compared with an
fp32 reference of the same math (written out with matmul/softmax/layer_norm,
on the half-precision weights upcast; fp64 when the run is fp32):

    max|out - ref| <= slack * 2 * max|torch - ref| + atol

``torch`` is the idiomatic implementation in the run's dtype; slack defaults
to 1.5 (``--check-slack``) because rounding differences compound over 15
post-LN layers; atol is 1e-3 (fp16), 8e-3 (bf16), 1e-5 (fp32).  An
implementation that fails is reported loudly and not timed, and the exit
status is 1.

Timing: device events around each call (eager calls issued back to back, so
host launch cost shows where it limits), warm-up, median of >= 20 calls
(``--reps``), inputs rotated among several sets when one set fits in L2;
compile and CUDA-graph capture time is measured apart (first call / capture)
and reported in the JSON and the table.  Outputs: ``<out-dir>/nps_<tag>.json``
and ``.txt`` (the tables), rewritten after each preset so a cut-off run keeps
what finished, and ``.png`` (throughput vs batch size).  A step that makes no
progress for ``--step-timeout`` seconds (a hung kernel) ends the run with
status 3, naming the step.  On an H100 one preset takes about 1.5 minutes
(t82) to 3 (bert-base at 512 tokens), most of it torch.compile.

On CPU (no GPU): tiny preset, float32 (fp16 matmuls are slow on CPU),
torch-compile, fusedenc-compile and fusedenc-graph skipped unless asked for with --impl.
There the fusedenc rows time the PyTorch reference ops (no native core on the CPU), not
fusedenc's GPU path, and the output says so above the tables.

FP8, ``--dtype fp8``: the model is built in float16 and the FP8
implementations of bench/fp8_peers.py run beside the fp16 ones, so one run gives
every ratio: torch-fp8 and torch-fp8-compile (the torchao-style row-wise
``torch._scaled_mm`` peer on the torch model's weights), fusedenc-fp8 (eager),
fusedenc-fp8-graph, fusedenc-fp8-fast (fast accumulation), fusedenc-fp8-static (fast, with
static scales from calibration; the LayerNorms folded into the FP8 GEMMs where the Hopper
kernels run) and fusedenc-fp8-static-ln (the same with the LayerNorm passes), graph runners;
fusedenc-fp8-static-plain, fusedenc-fp8-static's stack called plainly (automatic graphs).
They cannot meet the fp16 rule; theirs is measured against what FP8 itself costs on
this net: the same fp32 reference net with every GEMM in emulated FP8
(fusedenc.fp8.rowwise's reference math; the rest fp32) has relative error
e_fp8 = ||emulated - ref|| / ||ref||, and an FP8 implementation passes when

    ||out - ref|| / ||ref|| <= slack * e_fp8 + 0.002

(float64 norms, slack = --check-slack).  The tables add, per batch size, each FP8
row's speed against the fastest fp16 fusedenc row and the fastest torch-fp8 row.
Implementations that cannot run here are listed as skipped with the reason
(torch._scaled_mm with row-wise scales needs an sm89+ GPU or a torch whose CPU
build takes it; the graph runners need a GPU).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import os
import sys
import time
import traceback
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script: import the sibling modules

import common  # noqa: E402
import fp8_peers  # noqa: E402
import lc0 as lc0_bench  # noqa: E402  (bench/lc0.py: whole lc0 networks)
from nps_report import plot, report_lines, write_outputs  # noqa: E402
from peers import (  # noqa: E402
    GELU_UNIT_ROWS,
    IMPLS,
    ON_REQUEST,
    Impl,
    block_state_dicts,
    build_torch_model,
    builders,
    gemm_floor,
    reference_forward,
)

import fusedenc  # noqa: E402
from fusedenc.common.dtypes import ATOL  # noqa: E402
from fusedenc.tune.presets import Run, select_runs  # noqa: E402
from fusedenc.tune.timing import rotation_sets, sync, time_calls  # noqa: E402

GPU_ONLY_BY_DEFAULT = ("torch-compile", "fusedenc-compile", "fusedenc-graph")
DEFAULT_BATCHES = (1, 16, 64, 256, 1024)
#: The FP8 rule's absolute term: relative-error noise a different but valid order of
#: rounding can add on top of FP8's own error (fp16 storage between the ops, other sums).
FP8_FLOOR = 2e-3


# ------------------------------------------------------------ checking ----


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = (out.to(ref.dtype) - ref).abs().max().item()
    return math.inf if math.isnan(err) else err


def _checked_output(impl: Impl, x: torch.Tensor, ref: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[dict]]:
    """``impl``'s output on ``x`` (its own copy), or the failed check when its shape is not ``ref``'s."""
    out = impl.call(x)
    if impl.output_is_view:
        out = out.clone()
    if tuple(out.shape) != tuple(ref.shape):
        return None, {"passed": False, "reason": f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"}
    return out, None


def check_impl(impl: Impl, x: torch.Tensor, ref: torch.Tensor, base: float, atol: float, slack: float) -> dict:
    out, failed = _checked_output(impl, x, ref)
    if failed:
        return failed
    err = max_abs_err(out, ref)
    bound = slack * 2 * base + atol
    result = {"max_abs_err": err, "bound": bound, "finite": bool(torch.isfinite(out).all())}
    result["passed"] = bool(result["finite"] and err <= bound)
    if not impl.checked:
        result["passed"] = None  # a stand-in computes other math: reported, not judged
    return result


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (inf for NaN)."""
    o, r = out.double(), ref.double()
    err = ((o - r).norm() / r.norm()).item()
    return math.inf if math.isnan(err) else err


def check_fp8_impl(impl: Impl, x: torch.Tensor, ref: torch.Tensor, emulated: float, slack: float) -> dict:
    """The FP8 rule: relative error within ``slack`` times emulated FP8's on the same net, plus FP8_FLOOR."""
    out, failed = _checked_output(impl, x, ref)
    if failed:
        return failed
    err = rel_err(out, ref)
    bound = slack * emulated + FP8_FLOOR
    result = {"rel_err": err, "bound": bound, "finite": bool(torch.isfinite(out).all()),
              "x_emulated": err / emulated if emulated > 0 else None, "max_abs_err": max_abs_err(out, ref)}  # fmt: skip
    result["passed"] = bool(result["finite"] and err <= bound)
    return result


def _check_text(c: dict) -> str:
    if "rel_err" in c:
        return (f"{c.get('reason') or ''}||out-ref||/||ref|| = {c['rel_err']:.3g} > bound {c['bound']:.3g} "
                f"(finite: {c.get('finite')})")  # fmt: skip
    return (f"{c.get('reason') or ''}max|out-ref| = {c.get('max_abs_err', math.nan):.3g} > bound "
            f"{c.get('bound', math.nan):.3g} (finite: {c.get('finite')})")  # fmt: skip


# ------------------------------------------------------------ one run ----


def _inputs(run: Run, batch: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    set_bytes = run.tokens(batch) * run.preset.d_model * torch.empty((), dtype=run.dtype).element_size()
    n = rotation_sets(set_bytes, device)
    g = torch.Generator(device=device).manual_seed(seed + batch)
    shape = (batch, run.seq_len, run.preset.d_model)
    return [torch.randn(shape, device=device, dtype=run.dtype, generator=g) for _ in range(n)]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_preset(run: Run, args, device: torch.device, ceilings: dict, progress: common.Progress) -> dict[str, Any]:
    batches = args.batch_sizes
    check_batch = min([b for b in batches if b >= 4] or [max(batches)])
    ref_dtype = torch.float64 if run.dtype == torch.float32 else torch.float32
    atol = ATOL[run.dtype]
    rec: dict[str, Any] = {
        "name": run.name, "config": run.config(), "describe": run.describe(), "batch_sizes": batches,
        "flops_per_batch_element": run.flops(1), "gemm_flops_per_batch_element": run.gemm_flops(1),
        "impls": {}, "skipped": {}, "errors": [], "reference_lines": {},
    }  # fmt: skip
    model = build_torch_model(run, device, args.seed)
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    check_x = torch.randn(check_batch, run.seq_len, run.preset.d_model, device=device, dtype=run.dtype, generator=g)

    progress.step(f"{run.name}: reference output")
    ref = reference_forward(block_state_dicts(model), check_x, run, ref_dtype)
    base = max_abs_err(model(check_x), ref)
    rec["check"] = {
        "batch": check_batch, "reference_dtype": str(ref_dtype).replace("torch.", ""),
        "torch_same_dtype_err": base, "atol": atol, "slack": args.check_slack,
        "rule": "max|out - ref| <= slack * 2 * max|torch - ref| + atol",
    }  # fmt: skip
    if args.fp8:
        progress.step(f"{run.name}: emulated FP8 reference")
        emulated = reference_forward(block_state_dicts(model), check_x, run, ref_dtype, fp8_peers.emulated_linear)
        rec["check"]["fp8"] = {
            "emulated_rel_err": rel_err(emulated, ref), "slack": args.check_slack, "floor": FP8_FLOOR,
            "rule": "||out - ref|| / ||ref|| <= slack * e_fp8 + floor, e_fp8 = ||emulated - ref|| / ||ref||",
            "emulated": "every GEMM in fusedenc.fp8.rowwise's reference math (e4m3 rows / output channels, fp32 sums), "
                        "the rest fp32",
        }  # fmt: skip
        del emulated

    for name, reason in args.skipped.items():
        rec["skipped"][name] = reason
    table = builders(args.impls, run, device, batches, check_x, args.compile_modes, args.compile_dynamic)
    why = common.gelu_unit_reason(device, run.dtype, run.preset.activation)
    for name in [n for n in GELU_UNIT_ROWS if n in table] if why else []:
        rec["skipped"][name] = why
        del table[name]
    if args.fp8:
        table.update(fp8_peers.builders(args.impls, run, device, batches, args.compile_modes, args.compile_dynamic,
                                        args.scaled_mm_out))  # fmt: skip
    for name, build in table.items():
        progress.step(f"{run.name}: {name}: build + check")
        entry: dict[str, Any] = {"points": {}}
        try:
            t0 = time.perf_counter()
            impl = build(model)
            sync(device)
            entry["setup_s"] = time.perf_counter() - t0
            entry["label"], entry["checked"], entry["notes"], entry["info"] = impl.name, impl.checked, impl.notes, impl.info
            t0 = time.perf_counter()
            if fp8_peers.is_fp8(name):
                entry["precision"] = "fp8"
                emulated = rec["check"]["fp8"]["emulated_rel_err"]
                entry["check"] = check_fp8_impl(impl, check_x, ref, emulated, args.check_slack)
            else:
                entry["check"] = check_impl(impl, check_x, ref, base, atol, args.check_slack)
            sync(device)
            entry["check"]["first_call_s"] = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - one broken implementation must not stop the others
            rec["errors"].append(f"{name}: build/check failed: {type(exc).__name__}: {exc}")
            entry["error"] = traceback.format_exc(limit=6)
            rec["impls"][name] = entry
            progress.write(f"!! {run.name}: {name} failed to build or run: {type(exc).__name__}: {exc}")
            for _ in batches:
                progress.step(f"{run.name}: {name}: skipped")
            _free(device)
            continue
        rec["impls"][name] = entry
        if entry["check"]["passed"] is False:
            progress.write(f"!! CHECK FAILED {run.name}: {name}: {_check_text(entry['check'])}; NOT TIMED")
            for _ in batches:
                progress.step(f"{run.name}: {name}: not timed")
        else:
            for b in batches:
                progress.step(f"{run.name}: {name}: batch {b}")
                pt = entry["points"][str(b)] = _time_point(impl, run, b, device, args)
                if "error" in pt:
                    rec["errors"].append(f"{name} batch {b}: {pt['error']}")
                elif b == check_batch:  # the check made the first call at this shape (compiled it)
                    pt["first_call_s"] += entry["check"]["first_call_s"]
        impl.cleanup()
        del impl
        _free(device)

    for b in batches:
        progress.step(f"{run.name}: GEMM floor, batch {b}")
        try:
            floor = gemm_floor(model, run, b, device, args.reps)
        except Exception as exc:  # noqa: BLE001
            floor = {"error": f"{type(exc).__name__}: {exc}"}
            rec["errors"].append(f"gemm-floor batch {b}: {floor['error']}")
        roof_ms = run.flops(b) / (ceilings["gemm"]["tflops"] * 1e12) * 1e3
        rec["reference_lines"][str(b)] = {"gemm_floor": floor, "roofline_ms": roof_ms}
        _free(device)
    derive(rec, run)
    del model
    _free(device)
    return rec


#: Calls profiled at a point with ``--kernels`` (their kernels are averaged per call).
KERNEL_CALLS = 5


def _time_point(impl: Impl, run: Run, batch: int, device: torch.device, args) -> dict[str, Any]:
    try:
        xs = _inputs(run, batch, device, args.seed)
        t0 = time.perf_counter()
        impl.call(xs[0])  # first call at this shape: compiles, autotunes, plans (not timed)
        sync(device)
        first_s = time.perf_counter() - t0
        timing = time_calls(impl.call, xs, reps=args.reps, warmup=args.warmup, device=device)
        point = {"first_call_s": first_s, **timing.summary()}
        if args.kernels:  # what the GPU does of a call: the floor fusions and launches work against
            calls = [xs[i % len(xs)] for i in range(KERNEL_CALLS)]
            point["kernels"] = common.kernel_profile(impl.call, calls, point["ms"] * 1e-3 * KERNEL_CALLS)
        return point
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        xs = None
        _free(device)


def derive(rec: dict[str, Any], run: Run) -> None:
    """Rates, ratios to torch and torch-compile, and % of the GEMM floor, per point."""
    for b in rec["batch_sizes"]:
        key = str(b)
        lines = rec["reference_lines"][key]
        floor_ms = lines["gemm_floor"].get("ms")
        lines["gemm_floor_per_s"] = b / (floor_ms * 1e-3) if floor_ms else None
        lines["roofline_per_s"] = b / (lines["roofline_ms"] * 1e-3)

        def ms_of(name):
            pt = rec["impls"].get(name, {}).get("points", {}).get(key, {})
            return pt.get("ms")

        torch_ms, compile_ms = ms_of("torch"), ms_of("torch-compile")
        for name, entry in rec["impls"].items():
            pt = entry.get("points", {}).get(key)
            if not pt or "ms" not in pt:
                continue
            pt["per_s"] = b / (pt["ms"] * 1e-3)
            comparable = entry.get("checked", True)
            pt["x_torch"] = torch_ms / pt["ms"] if (torch_ms and comparable) else None
            pt["x_compile"] = compile_ms / pt["ms"] if (compile_ms and comparable) else None
            pt["pct_gemm_floor"] = 100.0 * floor_ms / pt["ms"] if floor_ms else None
        if "fp8" in rec["check"]:
            _derive_fp8(rec, key, ms_of)


#: The fp16 fusedenc rows, and the FP8 peer rows, the FP8 rows are compared with (the fastest of each).
FUSEDENC_FP16 = ("fusedenc", "fusedenc-eager", "fusedenc-compile", "fusedenc-graph")


def _derive_fp8(rec: dict[str, Any], key: str, ms_of) -> None:
    """Each FP8 row's speed against the fastest fp16 fusedenc row and the fastest torch-fp8 row
    at batch ``key`` (the FP8 gate's ratios), and which rows those were."""
    names = rec["impls"]
    best = {}
    for label, group in (("fusedenc_fp16", [n for n in names if n in FUSEDENC_FP16]),
                         ("torch_fp8", [n for n in names if n == "torch-fp8" or n.startswith("torch-fp8-compile")])):
        timed = [(ms_of(n), n) for n in group if ms_of(n)]
        best[label] = min(timed) if timed else (None, None)
        rec["reference_lines"][key][f"best_{label}"] = {"impl": best[label][1], "ms": best[label][0]}
    for name, entry in names.items():
        pt = entry.get("points", {}).get(key)
        if entry.get("precision") != "fp8" or not pt or "ms" not in pt:
            continue
        for label, (ms, _) in best.items():
            pt[f"x_{label}"] = ms / pt["ms"] if ms else None


# ------------------------------------------------------------ command line ----


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in common.comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench/nps.py", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    common.add_preset_arg(ap)
    ap.add_argument("--batch-sizes", type=_ints, default=list(DEFAULT_BATCHES),
                    help="positions or sequences per call (default 1,16,64,256,1024)")  # fmt: skip
    ap.add_argument("--impl", action="append", default=None,
                    help=f"repeatable or comma list of {', '.join(IMPLS)} (default: all; on CPU without "
                         f"{' and '.join(GPU_ONLY_BY_DEFAULT)}); with --dtype fp8 also "
                         f"{', '.join(fp8_peers.FP8_IMPLS)} (default: those that run here)")  # fmt: skip
    ap.add_argument("--compile-modes", type=common.comma_list, default=[],
                    help="extra torch.compile modes to time besides default, e.g. "
                         "max-autotune-no-cudagraphs,reduce-overhead")  # fmt: skip
    ap.add_argument("--compile-dynamic", action="store_true",
                    help="one dynamic-shape torch.compile graph for all batch sizes (default: static per size)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (after the first call)")
    ap.add_argument("--check-slack", type=float, default=1.5, help="slack factor of the correctness rule (1.5)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    ap.add_argument("--kernels", action="store_true",
                    help="GPU: after timing each point, profile a few more calls: the kernels a call launches, "
                         "their summed device time against the call's, and the longest kernels by name")  # fmt: skip
    ap.add_argument("--net", action="append", default=[],
                    help="an lc0 network file (.pb.gz), repeatable: its whole network (planes in, heads out) "
                         "goes into the table beside the presets, timed as bench/lc0.py times it")  # fmt: skip
    common.add_common_args(ap, "timed calls per point",
                           extra_dtypes={"fp8": "a float16 model with the FP8 implementations beside the fp16 ones"})
    args = ap.parse_args(argv)
    common.check_common_args(ap, args)
    if args.check_slack < 1.0:
        ap.error("--check-slack must be >= 1")
    # fp8 is a mode, not a dtype: the model, the check's reference and the fp16 rows stay float16.
    args.fp8 = args.dtype == "fp8"
    if args.fp8:
        args.dtype = "float16"
    impls = [i for item in (args.impl or []) for i in common.comma_list(item)]
    bad = [i for i in impls if i not in IMPLS + fp8_peers.FP8_IMPLS]
    if bad:
        ap.error(f"unknown --impl {', '.join(bad)}; choose from {', '.join(IMPLS + fp8_peers.FP8_IMPLS)}")
    fp8_named = [i for i in impls if i in fp8_peers.FP8_IMPLS]
    if fp8_named and not args.fp8:
        ap.error(f"--impl {', '.join(fp8_named)} needs --dtype fp8")
    args.impl = impls
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def _fp8_wanted(args: argparse.Namespace, wanted: list[str], device: torch.device, notes: list[str]) -> list[str]:
    """``wanted`` with the FP8 rows: those named in --impl, else (the default) every one that
    runs here; the others go to ``args.skipped`` with the reason.  Sets ``args.scaled_mm_out``."""
    on_gpu = device.type == "cuda"
    if not args.impl:
        wanted = wanted + list(fp8_peers.FP8_IMPLS)
        if not on_gpu:  # as torch-compile: compiling on CPU is slow and not what the row is about
            wanted.remove("torch-fp8-compile")
            args.skipped["torch-fp8-compile"] = "not run on CPU by default (name it in --impl to run it)"
    if not on_gpu:
        for name in [i for i in fp8_peers.GRAPH_IMPLS if i in wanted]:
            wanted.remove(name)
            args.skipped[name] = "needs a GPU (CUDA graphs)"
    if any(i.startswith("torch-fp8") for i in wanted):
        ok, args.scaled_mm_out, why = fp8_peers.scaled_mm_status(device)
        if not ok:
            for name in [i for i in wanted if i.startswith("torch-fp8")]:
                wanted.remove(name)
                args.skipped[name] = why
        elif args.scaled_mm_out != torch.float16:
            notes.append(f"torch._scaled_mm takes row-wise scales with a {args.scaled_mm_out} output only in this "
                         "torch: the torch-fp8 rows cast its output to float16")  # fmt: skip
    ok, why = fp8_peers.fusedenc_fp8_status(device)
    if not ok:
        for name in [i for i in wanted if i.startswith("fusedenc-fp8")]:
            wanted.remove(name)
            args.skipped[name] = f"fusedenc's FP8 mode does not run on {device}: {why}"
    return wanted


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device, args.reps = common.start(args.device, args.reps)
    on_gpu = device.type == "cuda"
    notes: list[str] = []
    if args.kernels and not on_gpu:
        print("bench/nps.py: --kernels needs a GPU (it counts CUDA kernels)", file=sys.stderr)
        return 2

    try:
        runs = select_runs(args.preset, args.dtype, on_gpu)
    except ValueError as exc:
        print(f"bench/nps.py: {exc}", file=sys.stderr)
        return 2
    if not on_gpu and not args.dtype:
        notes.append("no GPU: running on CPU in float32 (fp16 matmuls are slow on CPU; --dtype overrides)")

    args.skipped = {}
    wanted = args.impl or [i for i in IMPLS if (on_gpu or i not in GPU_ONLY_BY_DEFAULT) and i not in ON_REQUEST]
    if not on_gpu and not args.impl:
        args.skipped["torch-compile"] = "not run on CPU by default (name it in --impl to run it)"
    if not on_gpu and ("fusedenc-graph" in wanted or not args.impl):
        wanted = [i for i in wanted if i != "fusedenc-graph"]
        args.skipped["fusedenc-graph"] = "needs a GPU (CUDA graphs)"
    args.scaled_mm_out = None
    if args.fp8:
        wanted = _fp8_wanted(args, wanted, device, notes)
    if any(i.startswith("fusedenc") for i in wanted):
        try:
            importlib.import_module("fusedenc.encoder.blocks")  # (an import statement here would make fusedenc local)
        except ImportError as exc:
            for i in [i for i in wanted if i.startswith("fusedenc")]:
                wanted.remove(i)
                args.skipped[i] = f"fusedenc.encoder.blocks is not importable ({exc})"
    args.impls = wanted

    backend = fusedenc.backend()
    if args.fp8:
        notes.append("--dtype fp8: float16 model; FP8 rows beside the fp16 ones, checked by the FP8 rule "
                     f"(||out - ref|| / ||ref|| <= {args.check_slack} * emulated FP8's + {FP8_FLOOR:g}); "
                     "roofline and GEMM floor stay fp16")  # fmt: skip
    if on_gpu and backend.name == "reference":
        notes.append(f"WARNING: fusedenc has no active native core ({backend}); fusedenc rows time its PyTorch "
                     "reference, not the fused kernels")  # fmt: skip
    if device.type == "cpu" and any(i.startswith("fusedenc") for i in wanted):
        # The README's first command ends here on a machine without a GPU: its fusedenc rows must
        # not read as fusedenc's speed.  Last of the notes, so it prints right above the tables.
        notes.append(common.CPU_NOTE)

    env = common.environment(device)
    base_path = common.result_base_path(args, runs, env, "nps", precision="fp8" if args.fp8 else None)

    n_impl_rows = len(wanted) + sum(len(args.compile_modes) for i in ("torch-compile", "torch-fp8-compile") if i in wanted)
    per_run = 1 + int(args.fp8) + n_impl_rows * (1 + len(args.batch_sizes)) + len(args.batch_sizes)
    total = 1 + len(runs) * per_run + len(args.net)
    progress = common.Progress(total, "nps", enabled=not args.no_progress, step_timeout=args.step_timeout)
    records: list[dict[str, Any]] = []
    with torch.inference_mode():
        progress.step("ceilings: GEMM rate")
        ceilings = {"gemm": common.gemm_rate(device, runs[0].dtype)}
        head = [
            f"fusedenc nps benchmark on {common.describe_environment(env)}; "
            f"fusedenc backend: {env['fusedenc_backend']}",
            f"GEMM rate (roofline ceiling): {ceilings['gemm']['tflops']:.4g} TFLOP/s "
            f"({ceilings['gemm']['dtype']}, {ceilings['gemm']['how']}, m,n,k={ceilings['gemm']['shape_mnk']}); "
            f"timing: median of {args.reps} calls after {args.warmup}+1 warm-up calls, "
            + ("device events" if on_gpu else "wall clock (CPU)"),
        ] + notes
        progress.write("\n".join(head))
        for run in runs:
            records.append(run_preset(run, args, device, ceilings, progress))
            # Each run's table as soon as it is done, and the files so far: a long run
            # that is cut off still leaves its finished presets behind.
            progress.write("\n" + "\n".join(report_lines(records[-1], run, env["device"].startswith("cuda"))))
            failures, errors = write_outputs(base_path, head, records, runs, ceilings, env, notes, args, argv)
        nets, net_lines = [], []
        for path in args.net:  # whole lc0 networks, after the presets
            progress.step(f"lc0 net {os.path.basename(path)}")
            try:
                rec = lc0_bench.run_net(path, args, device, runs[0].dtype,
                                        tuple(i for i in args.impls if i in lc0_bench.IMPLS))  # fmt: skip
            except lc0_bench.NetFileError as exc:  # the presets' tables are written already
                progress.close()
                print(f"bench/nps.py: {exc}", file=sys.stderr)
                return 2
            nets.append(rec)
            net_lines += [""] + lc0_bench.report(rec)
            progress.write("\n" + "\n".join(lc0_bench.report(rec)))
            failures, errors = write_outputs(
                base_path, head, records, runs, ceilings, env, notes, args, argv, nets, net_lines
            )  # fmt: skip
    progress.close()

    if failures:
        print("\nCHECK FAILURES (not timed): " + "; ".join(failures))
    if errors:
        print("\nERRORS:\n" + "\n".join(f"  {e}" for e in errors))
    written = [base_path + ".json", base_path + ".txt"]
    if not args.no_plot:
        why = plot(records, runs, base_path + ".png", env)
        if why:
            print(f"no plot: {why}")
        else:
            written.append(base_path + ".png")
    print("wrote " + ", ".join(written))
    return 1 if (failures or errors) else 0


if __name__ == "__main__":
    sys.exit(main())
