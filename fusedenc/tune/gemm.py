"""``python -m fusedenc.tune gemm``: measure the GEMM library's candidates and write the tuning file.

The block's four GEMMs per preset and batch size, every heuristic candidate
timed, the fastest correct one kept when it beats the heuristic's own pick
(candidate 0) by more than noise.  Where the library has no epilogue for the
activation (it runs BIAS plus an activation pass), the Triton FFN1 kernel's
configs are timed in the same interleaved run and replace the library when
they beat its pick by more than noise, confirmed twice (``"kernel": "triton"``
in the file; ``gemm_routes``).  Every GEMM runs through ``core``, the package's
one seam to the native core, with the arguments the block's native path passes.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, Optional

import torch

from .. import core
from ..common import dtypes, table_files
from ..common.activations import apply_activation
from ..common.device import device_arch
from ..core import gemm_routes, gemm_tuning
from . import timing
from .cli import int_list, name_list, no_gpu_reason
from .presets import GPU_PRESETS, PRESETS, GemmProblem, block_gemms

__all__ = ["add_arguments", "merge_gemm_file", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", type=name_list(tuple(PRESETS)), default=None, help="default t82,bt4,bert-base")
    p.add_argument("--batch-sizes", type=int_list, default=None, help="sequences per call (default 1,16,64,256)")
    p.add_argument("--dtype", type=name_list(tuple(dtypes.BY_NAME)), default=None, help="default float16")
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

    def __init__(self, problem: GemmProblem, dtype: torch.dtype, device, stream: int, ws, gen, l2_bytes: int):
        self.p, self.dtype, self.device, self.stream, self.ws = problem, dtype, device, stream, ws
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

    def problem(self, i: int) -> dict:
        """``core.gemm``'s keyword arguments for input set ``i`` (what the block's native path passes)."""
        x, w, b, r, out = self.inputs[i]
        p = self.p
        return dict(
            a=x, lda=p.k, w=w, ldw=p.k, out=out, ldo=p.n, m=p.m, n=p.n, k=p.k, bias=b, residual=r, ldr=p.n,
            activation=p.activation, alpha=p.alpha, stream=self.stream, workspace=self.ws,
        )  # fmt: skip

    def reference(self) -> torch.Tensor:
        """fp32 result of input set 0."""
        x, w, b, r, _ = self.inputs[0]
        y = torch.matmul(x.float(), w.float().t()) * self.p.alpha
        if b is not None:
            y = y + b.float()
        if r is not None:
            return y + r.float()
        return apply_activation(y, self.p.activation)


def _measure_gemm(case: _GemmCase, count: int, args, stream: torch.cuda.Stream) -> dict:
    """Every candidate of one problem: accuracy against fp32, then timing; the winner.
    Everything runs on ``stream`` (the one ``case``'s arguments name)."""
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the current stream
    try:
        with torch.cuda.stream(stream):
            return _measure_gemm_on_stream(case, count, args, stream)
    finally:
        torch.cuda.synchronize()  # nothing in flight when the caller frees the inputs


def _measure_gemm_on_stream(case: _GemmCase, count: int, args, stream) -> dict:
    found = core.gemm_candidates(count=count, **case.problem(0))
    n_cand = len(found["candidates"])
    ref = case.reference()
    out0 = case.inputs[0][4]
    atol = dtypes.ATOL[case.dtype]
    errs: list[float] = []
    ok: list[bool] = []
    for i in range(n_cand):
        out0.fill_(float("nan"))  # poison: a candidate that writes nothing fails
        try:
            core.gemm_with_candidate(count=count, index=i, **case.problem(0))
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
    # Candidate 0 is by construction the algorithm the default plan runs: check it bitwise
    # (run again: out0 holds whatever ran last).
    out0.fill_(float("nan"))
    core.gemm_with_candidate(count=count, index=0, **case.problem(0))
    cand0 = out0.clone()
    out0.fill_(float("nan"))
    # The default cuBLASLt plan (tune cleared choices and routes), without the sm90 kernel.
    with core.sm90_gemm_disabled():
        core.gemm(**case.problem(0))
    torch.cuda.synchronize()
    same_as_default = bool(torch.equal(cand0, out0))
    del cand0
    # Where the Hopper epilogue GEMM takes the problem it is what runs by default, so it is the
    # one to beat: a library candidate (plus its activation pass) or a Triton config must be
    # faster than it, and a library choice installed for such a problem replaces it.
    sm90_err = _sm90_error(case, ref, args) if _sm90_serves(case) else None
    sm90_ok = sm90_err is not None and not math.isnan(sm90_err) and sm90_err <= 2 * base + atol
    del ref

    def runner(i: int) -> Callable[[], None]:
        problems = [case.problem(s) for s in range(case.sets)]

        def run() -> None:
            for p in problems:
                core.gemm_with_candidate(count=count, index=i, **p)

        return run

    good = [i for i in range(n_cand) if ok[i]]
    triton_good = [i for i in range(len(triton_configs)) if triton_ok[i]]
    calls = [runner(i) for i in good] + [_triton_runner(case, triton_configs[i]) for i in triton_good]
    if sm90_ok:
        calls.append(_sm90_runner(case))
    us_all, method = timing.time_interleaved(calls, args.reps, args.warmup, stream)  # interleaved: one comparison
    us: list[Optional[float]] = [None] * n_cand
    for i, t in zip(good, us_all):
        us[i] = t / case.sets
    triton_us: list[Optional[float]] = [None] * len(triton_configs)
    for i, t in zip(triton_good, us_all[len(good):]):
        triton_us[i] = t / case.sets
    sm90_us = us_all[-1] / case.sets if sm90_ok else None
    winner, confirmed, replaces_sm90 = 0, None, False
    if sm90_ok and good:
        best = min(good, key=lambda i: us[i])
        if us[best] < sm90_us * (1 - args.min_gain):
            again, _ = timing.time_interleaved([_sm90_runner(case), runner(best)], args.reps, args.warmup, stream)
            confirmed = (again[0] / case.sets, again[1] / case.sets)
            if confirmed[1] < confirmed[0] * (1 - args.min_gain):
                winner, replaces_sm90 = best, True
    elif ok[0] and len(good) > 1:
        best = min(good, key=lambda i: us[i])
        if best != 0 and us[best] < us[0] * (1 - args.min_gain):
            # Confirm against candidate 0 in a second interleaved run before trusting a small gain.
            again, _ = timing.time_interleaved([runner(0), runner(best)], args.reps, args.warmup, stream)
            confirmed = (again[0] / case.sets, again[1] / case.sets)
            if confirmed[1] < confirmed[0] * (1 - args.min_gain):
                winner = best
    default_us = sm90_us if sm90_ok else us[0]
    speedup = default_us / us[winner] if default_us and us[winner] else 1.0
    if confirmed and (winner or replaces_sm90):
        speedup = confirmed[0] / confirmed[1]
    # What a Triton config must beat: what runs once this problem's choice is installed.
    pick_is_sm90 = sm90_ok and not replaces_sm90
    pick_us = sm90_us if pick_is_sm90 else us[winner]
    pick_runner = _sm90_runner(case) if pick_is_sm90 else runner(winner)
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
        if triton_good and pick_us is not None:
            best = min(triton_good, key=lambda i: triton_us[i])
            if triton_us[best] < pick_us * (1 - args.min_gain):
                # Confirm against the pick in a second interleaved run, as above.
                again, _ = timing.time_interleaved(
                    [pick_runner, _triton_runner(case, triton_configs[best])], args.reps, args.warmup, stream
                )
                triton["confirmed_us"] = [round(again[0] / case.sets, 3), round(again[1] / case.sets, 3)]
                if again[1] < again[0] * (1 - args.min_gain):
                    triton["chosen"] = best
    return {
        "key": gemm_tuning.key_from_core(found["key"]),
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
        # None where the Hopper epilogue GEMM does not take this problem.
        "sm90": None if sm90_err is None else {
            "us": None if sm90_us is None else round(sm90_us, 3),
            "err": sm90_err if math.isfinite(sm90_err) else None,
            "ok": sm90_ok,
            "replaced": replaces_sm90,
        },
        "triton": triton,  # None where the library's epilogue applies the activation (or --no-triton)
    }


def _sm90_serves(case: _GemmCase) -> bool:
    """Whether the Hopper epilogue GEMM takes this problem when nothing is installed."""
    x, w, b, r, out = case.inputs[0]
    return r is None and bool(core.sm90_gemm_applies(x, w, b, out, case.p.activation)[0])


def _sm90_error(case: _GemmCase, ref: torch.Tensor, args) -> float:
    """Max abs error of the Hopper epilogue GEMM on input set 0 (NaN if it fails)."""
    out = case.inputs[0][4]
    out.fill_(float("nan"))  # poison: a kernel that writes nothing fails
    try:
        core.gemm(**case.problem(0))  # tune cleared the choices and routes: the sm90 kernel runs
        torch.cuda.synchronize()
    except RuntimeError as exc:
        print(f"    sm90: {type(exc).__name__}: {str(exc)[:200]}")
        return math.nan
    return (out.float() - ref).abs().max().item()


def _sm90_runner(case: _GemmCase) -> Callable[[], None]:
    problems = [case.problem(s) for s in range(case.sets)]

    def run() -> None:
        for p in problems:
            core.gemm(**p)

    return run


def _triton_configs(case: _GemmCase, found: dict, args) -> list:
    """The Triton FFN1 kernel's configs to time at this problem, or [] where it is not a candidate:
    only where the library runs the BIAS epilogue plus an activation pass (no residual, alpha 1)."""
    p = case.p
    if args.no_triton or p.residual or p.alpha != 1.0 or p.activation == "none":
        return []
    if found["epilogue"] not in ("BIAS", "DEFAULT") or not gemm_routes.triton_available():
        return []
    from ..core import triton_gemm  # imports Triton: only where it is a candidate

    return triton_gemm.tuning_candidates(p.m, p.n, p.k, case.dtype)


def _triton_error(case: _GemmCase, config, ref: torch.Tensor) -> float:
    """Max abs error of one Triton config on input set 0 (NaN if it fails to compile or launch)."""
    from ..core import triton_gemm

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
    from ..core import triton_gemm

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
    sm90 = row["sm90"]
    if sm90:
        if not sm90["ok"]:
            print(f"    sm90 epilogue GEMM: WRONG or failed (err {sm90['err']}); the library serves this problem")
        elif sm90["replaced"]:
            print(f"    sm90 epilogue GEMM {sm90['us']:.2f} us: replaced by candidate {row['winner']} "
                  f"({row['speedup']:.3f}x, confirmed {row['confirmed_us']} us)")  # fmt: skip
        else:
            ranked = [c["us"] for c in row["candidates"] if c["us"] is not None]
            best = sm90["us"] / min(ranked) if ranked else float("nan")
            print(f"    sm90 epilogue GEMM {sm90['us']:.2f} us: stays (best library candidate {best:.3f}x it)")
    triton = row["triton"]
    if triton:
        pick_is_sm90 = bool(sm90 and sm90["ok"] and not sm90["replaced"])
        pick = "sm90 kernel" if pick_is_sm90 else "library's pick"
        library = sm90["us"] if pick_is_sm90 else row["candidates"][row["winner"]]["us"]
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
            print(f"    => Triton kernel T{triton['chosen']}: {blaslt_us / triton_us:.3f}x the {pick} "
                  f"(confirmed {triton['confirmed_us']} us); ratios above are against the {pick}")  # fmt: skip
        else:
            print(f"    => the {pick} stays (Triton needs > {1 / (1 - min_gain):.3f}x it, confirmed)")
    print()


def run(args: argparse.Namespace) -> int:
    reason = no_gpu_reason()
    if reason:
        print(f"fusedenc.tune gemm: {reason}", file=sys.stderr)
        return 2
    if core.backend().name == "reference":
        print(f"fusedenc.tune gemm: the native core is not active ({core.backend()})", file=sys.stderr)
        return 2
    if args.reps < 20:
        print("fusedenc.tune gemm: --reps must be at least 20", file=sys.stderr)
        return 2
    library = core.library_info()
    count = args.candidates or (64 if library["vendor"] == "hip" else 8)
    if not 1 <= count <= core.max_gemm_candidates():
        print(f"fusedenc.tune gemm: --candidates must be in 1..{core.max_gemm_candidates()}", file=sys.stderr)
        return 2
    if not 0 <= args.min_gain < 1:
        print("fusedenc.tune gemm: --min-gain must be in [0, 1)", file=sys.stderr)
        return 2
    presets = args.preset or list(GPU_PRESETS)
    batches = args.batch_sizes or [1, 16, 64, 256]
    dtype_names = args.dtype or ["float16"]
    device = torch.device("cuda", torch.cuda.current_device())
    arch = device_arch(device)
    meta = gemm_tuning.device_metadata(library, device.index)
    out_path = args.out or gemm_tuning.gemm_tuning_path(arch)
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
    gemm_routes.install({})
    # The heuristic calls and the timed GEMMs see the workspace size the ops use.
    ws = torch.empty(core.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)  # CUDA graphs cannot capture the default stream
    stream = side.cuda_stream
    gen = torch.Generator().manual_seed(0)
    measured: dict[tuple, dict] = {}
    for dtype_name in dtype_names:
        dtype = dtypes.BY_NAME[dtype_name]
        for name in presets:
            preset = PRESETS[name]
            for batch in batches:
                for problem in block_gemms(preset, batch, args.norm_first):
                    label = f"{name} batch {batch} {dtype_name}"
                    case = _GemmCase(problem, dtype, device, stream, ws, gen, l2)
                    with torch.cuda.stream(side):
                        probe = core.gemm_candidates(count=count, **case.problem(0))
                    ident = gemm_tuning.key_ident(gemm_tuning.key_from_core(probe["key"]))
                    if ident in measured:
                        measured[ident]["used_by"].append(f"{label} {problem.name}")
                        print(f"{label}  {problem.name}: same problem as {measured[ident]['used_by'][0]}\n")
                        continue
                    try:
                        row = _measure_gemm(case, count, args, side)
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
        default_us = row["candidates"][0]["us"]
        sm90 = row["sm90"]
        if sm90 and sm90["ok"]:
            # The Hopper epilogue GEMM ran by default: it stays (a record, nothing to install),
            # or the library's winner replaces it.
            default_us = choice["us"]["sm90"] = sm90["us"]
            if sm90["replaced"]:
                choice["replaces_sm90"] = True
            else:
                choice["kernel"] = "sm90"
                choice["us"]["chosen"] = sm90["us"]
        triton = row["triton"]
        if triton and triton["chosen"] is not None:
            # The Triton kernel serves this problem; ``index`` stays the library's pick (used without Triton).
            best = triton["configs"][triton["chosen"]]
            choice.update(kernel="triton", triton_config=best["config"])
            choice["us"]["triton"] = best["us"]
            choice["speedup"] = round(default_us / best["us"], 4)
        choices.append(choice)
    table = merge_gemm_file(out_path, arch, meta, choices, replace=args.replace)
    table["measurements"] = list(measured.values())
    table_files.write_json_atomically(out_path, table)
    wins = [c for c in table["choices"] if gemm_tuning.changes_default(c)]
    routed = [c for c in table["choices"] if c.get("kernel") == "triton"]
    print(f"wrote {len(table['choices'])} problems ({len(wins)} with a measured winner other than the heuristic's "
          f"pick, {len(routed)} of them the Triton kernel) to {out_path}; processes load it when the native core "
          "is first used")  # fmt: skip
    return 0


def merge_gemm_file(path, arch, meta, choices: list[dict], replace: bool) -> dict:
    """The file to write: the new choices, plus the old file's choices for other problems when
    the old file is valid and was measured on this same setup (as the loader would judge it)."""
    old = table_files.entries_to_keep(
        path, replace=replace, parse=lambda text: gemm_tuning.parse_gemm_tuning(text, arch), here=meta,
        keys=gemm_tuning.GEMM_MATCH_KEYS,
    )  # fmt: skip
    new = {gemm_tuning.key_ident(c["key"]) for c in choices}
    old = [c for c in old if gemm_tuning.key_ident(c["key"]) not in new]
    return {
        "schema": gemm_tuning.GEMM_TUNING_SCHEMA,
        "arch": arch,
        "source": table_files.measured_by("gemm"),
        "measured_with": meta,
        "choices": choices + old,
    }
