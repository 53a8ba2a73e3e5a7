"""From chess positions to moves: what the host side costs against the network alone.

    python3 bench/lc0_positions.py --synthetic t82            # (a), (b), (c) on the current GPU
    python3 bench/lc0_positions.py --net NET.pb.gz --devices cuda:0,cuda:1   # and (d)
    python3 bench/lc0_positions.py --device cpu --synthetic tiny --positions 256 --epd-positions 256  # smoke

Rows, per batch size (``--batch-sizes``, default 256,1024), one process, one net, fp16:

  (a) graph          ``Lc0GraphRunner`` on ready planes on the GPU (the positions' own planes,
                     encoded beforehand): the network's ceiling, positions/s from device events
                     (median of ``--reps`` calls); on the CPU the eager network, wall time
  (a2) graph, sustained  the same replayed back to back as many times as (b) runs batches
                     (GPU only; a GPU at its power limit clocks down under long load)
  (b) evaluator      ``Evaluator`` (one device, ``max_batch`` = the batch size, graphs of that
                     bucket) from positions to decoded moves: every position (a FEN plus a short
                     random legal history) submitted with ``submit_many`` in chunks of the batch
                     size from one thread that keeps the Evaluator's slots + 4 batches a device in flight (a chunk
                     submitted, then the oldest results read), at least 256 batches (the
                     positions again, in rounds); wall time from the first
                     submission to the last result, after a warm-up round (the inputs are built
                     first and frozen with gc.freeze(), as long-lived data)
  (b2) evaluator, minibatches  the same with ``submit_batch``: one future a chunk, as an engine
                     that gathers minibatches would submit them
                     (notes of (b), (b2), (d): the CPU time of this process, all its threads, per
                     position: what the process that drives the GPU pays; at 34k positions/s it
                     has ~29 us a position for everything)
  (d) evaluator-Ngpu with ``--devices`` naming several GPUs: the same on all of them at once
                     (one replica and pipeline each, pulling from one queue)
  (c) cli            ``python -m fusedenc.lc0 eval NET --epd FILE`` on a generated EPD file of
                     ``--epd-positions`` positions (default 100,000; FENs only, as EPD has no
                     history), ``--max-batch`` the batch size, on ``--device`` (one GPU): its own
                     positions/s line (the evaluation phase) and the wall time of the whole command

Each row's ratio is against (a) at the same batch size: the share of the network's speed
that survives parsing, history replay, encoding, copies, decoding and the futures.
Positions come from random games (fixed ``--seed``) played with fusedenc.lc0's board rules:
position k of a game is the FEN a few plies earlier plus the moves since.  Writes
``<out-dir>/lc0_positions_<tag>.json`` and ``.txt`` with the environment (device, torch,
CUDA, git commit).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fusedenc.common import dtypes  # noqa: E402
from fusedenc.lc0 import Lc0Network, read_net  # noqa: E402
from fusedenc.lc0 import board as B  # noqa: E402
from fusedenc.lc0.encoding import encode_planes  # noqa: E402
from fusedenc.lc0.evaluator import Evaluator  # noqa: E402
from fusedenc.lc0.positions import board_fen, parse_fens  # noqa: E402
from fusedenc.tune.timing import MIN_REPS, time_calls  # noqa: E402

SCHEMA = "fusedenc.bench.lc0_positions/1"
#: Batches an Evaluator row runs at least on a GPU (the positions submitted again, in rounds, where
#: they make fewer): the pipeline's fill (the first encoding) and drain (the last decode) are
#: ~50 ms, 2-3% of a 64-batch row at 1024 positions a batch; a search runs for minutes.
MIN_BATCHES = 256
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _synthetic(name: str, out_dir: str) -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from lc0_writer import write_preset  # the tests' writer: synthetic nets are test material

    path = os.path.join(out_dir, f"synthetic-{name}.pb.gz")
    if not os.path.exists(path):
        write_preset(path, name, seed=1)
    return path


def random_positions(n: int, seed: int, plies: int = 40, max_history: int = 7) -> tuple[list[Any], list[str]]:
    """``n`` positions from random games played all at once (vectorized legal moves): position
    (game g, ply p) is ``(FEN at ply p - h, the h moves since)`` with h random in 0..max_history.
    Returns (positions, their FENs at ply p)."""
    rng = np.random.default_rng(seed)
    games = -(-n // plies)
    boards = parse_fens(["startpos"] * games)
    fens = [[board_fen(boards, g)] for g in range(games)]
    moves: list[list[str]] = [[] for _ in range(games)]
    alive = np.ones(games, bool)
    for _ in range(plies):
        rows, codes = B.legal_moves(boards)
        order = np.argsort(rows, kind="stable")
        rows, codes = rows[order], codes[order]
        counts = np.bincount(rows, minlength=games)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        alive &= counts > 0
        pick = starts + (rng.random(games) * np.maximum(counts, 1)).astype(np.int64)
        chosen = np.where(alive, codes[np.minimum(pick, len(codes) - 1)], 0)
        idx = np.nonzero(alive)[0]
        if idx.size == 0:
            break
        after = B.apply_moves(boards.take(idx), chosen[idx])
        boards.put(idx, after)
        for g in idx.tolist():
            moves[g].append(B.UCI_TEXT[int(chosen[g])])
            fens[g].append(board_fen(boards, g))
    positions, current = [], []
    for g in range(games):
        for p in range(len(moves[g]) + 1):
            h = min(p, int(rng.integers(0, max_history + 1)))
            positions.append((fens[g][p - h], moves[g][p - h : p]))
            current.append(fens[g][p])
    return positions[:n], current[:n]


def _graph_rows(file, device, dtype, positions, b: int, reps: int, batches: int) -> list[dict[str, Any]]:
    """(a): the network on ready planes (graph runner on a GPU, eager on the CPU); on a GPU
    also ``batches`` replays back to back, as long as an Evaluator row keeps the GPU busy:
    a GPU near its power limit clocks down under sustained load, which a median of short
    bursts does not see."""
    net = Lc0Network(file, dtype=dtype, device=device)
    planes = encode_planes(positions[:b], net.input_format).to(device=device, dtype=dtype)
    if device.type == "cuda":
        runner = net.graph_runner([b])
        runner.capture_all()
        fn = runner
    else:
        fn = net
    with torch.inference_mode():
        t = time_calls(lambda x: fn(x), [planes], reps=reps, device=device)
    rows = [{"row": "graph" if device.type == "cuda" else "eager", "batch": b, "ms": t.ms, "nps": b / (t.ms * 1e-3),
             "how": f"{'Lc0GraphRunner' if device.type == 'cuda' else 'Lc0Network'}, {t.method}, median of {reps}"}]
    if device.type == "cuda":
        n = max(reps, batches)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(n):
                fn(planes)
            end.record()
            end.synchronize()
        ms = start.elapsed_time(end) / n
        rows.append({"row": "graph, sustained", "batch": b, "ms": ms, "nps": b / (ms * 1e-3),
                     "how": f"Lc0GraphRunner, {n} replays back to back, events around them"})
    return rows


def _evaluator_row(file, devices, dtype, positions, b: int, rounds: int, minibatches: bool = False,
                   **options: Any) -> dict[str, Any]:
    """(b)/(d): the Evaluator from positions to moves, ``submit_many`` in chunks of ``b`` (or
    with ``minibatches``, ``submit_batch``: one future a chunk)."""
    with Evaluator(file, devices=devices, dtype=dtype, max_batch=b, batch_sizes=[b], max_wait_ms=1.0, **options) as ev:
        warm = positions[: b * 2 * len(devices)]
        ev.evaluate(warm)  # warm-up: first batches, allocator, threads
        before = ev.stats()
        n = 0
        t0, cpu0 = time.perf_counter(), time.process_time()
        pending: collections.deque = collections.deque()
        in_flight = ev.batches_in_flight  # all devices' slots + 4 batches a device, as an engine's search keeps
        window = in_flight * b
        if minibatches:  # one future a chunk: ``window`` counts chunks
            window //= b

        def answered(future) -> int:  # positions answered by one future
            result = future.result()
            return len(result) if minibatches else 1

        for _ in range(rounds):
            for i in range(0, len(positions), b):
                chunk = positions[i : i + b]
                if minibatches:
                    pending.append(ev.submit_batch(chunk))
                else:
                    pending.extend(ev.submit_many(chunk))
                while len(pending) > window:
                    n += answered(pending.popleft())
        while pending:
            n += answered(pending.popleft())
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0  # every thread of this process (the host workers are others)
        stats = ev.stats()
    batches = stats["batches"] - before["batches"]
    name = "evaluator" if len(devices) == 1 else f"evaluator-{len(devices)}gpu"
    if minibatches:
        name += ", minibatches"
    if "pipeline_depth" in options:
        name += f" (depth {options['pipeline_depth']})"
    if "switch_interval" in options:
        name += f" (switch {'default' if options['switch_interval'] is None else options['switch_interval']})"
    return {"row": name, "batch": b, "positions": n, "seconds": seconds, "nps": n / seconds,
            "cpu_us_per_position": cpu / max(n, 1) * 1e6,
            "mean_batch": (stats["positions"] - before["positions"]) / max(batches, 1),
            "devices": [str(d) for d in devices],
            "per_device": {k: v["positions"] - before["devices"][k]["positions"] for k, v in stats["devices"].items()},
            "stage_seconds": {k: {s: round(t - before["devices"][k]["seconds"][s], 3) for s, t in v["seconds"].items()}
                              for k, v in stats["devices"].items()},
            # a batch's trip, hop by hop (evalstats.Trips: medians over the row's batches and the warm-up's)
            "trip_ms": {k: v["trip_ms"] for k, v in stats["devices"].items()},
            "how": f"{'submit_batch' if minibatches else 'submit_many'} in chunks of the batch size from one thread, "
                   f"{in_flight} batches in flight (Evaluator.batches_in_flight: {ev.pipeline_depth} slots + "
                   f"{in_flight // len(devices) - ev.pipeline_depth} queued a device)"}


def _cli_row(net_path: str, epd: str, device_arg: str, dtype_name: str, b: int, out_dir: str) -> dict[str, Any]:
    """(c): the command line on an EPD file, as a user runs it."""
    out = os.path.join(out_dir, f"lc0_positions_cli_{b}.jsonl")
    cmd = [sys.executable, "-m", "fusedenc.lc0", "eval", net_path, "--epd", epd, "--device", device_arg,
           "--dtype", dtype_name, "--max-batch", str(b), "--out", out, "--no-progress"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        *_, last = f
    summary = json.loads(last)["summary"]
    os.remove(out)
    return {"row": "cli", "batch": b, "positions": summary["positions"], "nps": summary["positions_per_s"],
            "seconds": summary["seconds"], "wall_s": wall, "wall_nps": summary["positions"] / wall,
            "read_seconds": summary["read_seconds"], "startup_seconds": summary["startup_seconds"],
            "mean_batch": summary["mean_batch"], "how": "python -m fusedenc.lc0 eval --epd (evaluation phase; "
            "wall_nps: the whole command)"}  # fmt: skip


def report(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"   {'batch':>5}  {'row':28s} {'positions/s':>12} {'x graph':>8}  notes"]
    for b in sorted({r["batch"] for r in rows}):
        base = next((r["nps"] for r in rows if r["batch"] == b and r["row"] in ("graph", "eager")), None)
        for r in (r for r in rows if r["batch"] == b):
            ratio = f"{r['nps'] / base:.2f}x" if base else "-"
            notes = []
            if "mean_batch" in r:
                notes.append(f"mean batch {r['mean_batch']:.0f}")
            if "cpu_us_per_position" in r:
                notes.append(f"this process's CPU {r['cpu_us_per_position']:.1f} us/position")
            if r.get("per_device") and len(r["per_device"]) > 1:
                notes.append("per device " + ", ".join(f"{k} {v}" for k, v in r["per_device"].items()))
            if r.get("stage_seconds"):
                first = next(iter(r["stage_seconds"].values()))
                notes.append("stages (s, first device) " + ", ".join(f"{k} {v:.2f}" for k, v in first.items()))
            trip = next(iter(r.get("trip_ms", {}).values()), None)
            if trip:
                notes.append("trip (median ms) " + ", ".join(f"{k} {v:.1f}" for k, v in trip.items() if k != "batches"))
            if "wall_nps" in r:
                notes.append(f"whole command {r['wall_nps']:,.0f}/s ({r['wall_s']:.1f} s: reading+checking "
                             f"{r['read_seconds']:.1f} s, start-up {r['startup_seconds']:.1f} s)")
            lines.append(f"   {b:>5}  {r['row']:28s} {r['nps']:>12,.0f} {ratio:>8}  {'; '.join(notes)}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--net", help="an lc0 network file (.pb.gz)")
    src.add_argument("--synthetic", choices=("tiny", "t82", "bt4"), help="a synthetic net of that shape (default t82; "
                     "tiny on the CPU)")  # fmt: skip
    ap.add_argument("--batch-sizes", type=lambda s: [int(v) for v in common.comma_list(s)], default=None,
                    help="default 256,1024 (8,32 on the CPU)")  # fmt: skip
    ap.add_argument("--positions", type=int, default=None,
                    help="positions for the Evaluator rows (default 65536 on a GPU, 256 on the CPU)")
    ap.add_argument("--rounds", type=int, default=1,
                    help=f"times the Evaluator rows submit every position (on a GPU at least enough for {MIN_BATCHES} batches)")
    ap.add_argument("--epd-positions", type=int, default=None,
                    help="positions in the CLI row's EPD file (default 100000; 256 on the CPU; 0: no CLI row)")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    ap.add_argument("--devices", default=None, help="several GPUs for row (d), e.g. cuda:0,cuda:1")
    ap.add_argument("--dtype", choices=sorted(dtypes.BY_NAME), default=None, help="default float16 (float32 on CPU)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=os.environ.get(common.RESULTS_DIR_ENV) or common.DEFAULT_RESULTS_DIR)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--compare-switch", action="store_true",
                    help="also the 1-GPU Evaluator with a 0.2 ms thread switch interval (switch_interval=0.0002)")
    ap.add_argument("--compare-depth", type=int, default=None, metavar="N",
                    help="also the 1-GPU Evaluator (submit_many) with pipeline_depth=N slots")
    args = ap.parse_args(argv)
    if args.compare_depth is not None and args.compare_depth < 1:
        ap.error("--compare-depth must be at least 1")
    if args.reps < MIN_REPS:
        ap.error(f"--reps must be at least {MIN_REPS}")
    device = common.resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gpu = device.type == "cuda"
    dtype = dtypes.BY_NAME[args.dtype] if args.dtype else (torch.float16 if gpu else torch.float32)
    dtype_name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    batches = args.batch_sizes or ([256, 1024] if gpu else [8, 32])
    n_pos = args.positions or (65536 if gpu else 256)
    n_epd = (100_000 if gpu else 256) if args.epd_positions is None else args.epd_positions
    multi = common.comma_list(args.devices) if args.devices else []
    if multi and (not gpu or len(multi) < 2):
        ap.error("--devices names two or more GPUs (and --device must be a GPU)")
    os.makedirs(args.out_dir, exist_ok=True)
    net_path = args.net or _synthetic(args.synthetic or ("t82" if gpu else "tiny"), args.out_dir)
    file = read_net(net_path)
    env = common.environment(device)
    head = (f"fusedenc Lc0 positions -> moves on {common.describe_environment(env)}; fusedenc backend: "
            f"{env['fusedenc_backend']}; {os.path.basename(net_path)}, {dtype_name}")  # fmt: skip
    print(head, flush=True)

    t0 = time.perf_counter()
    positions, _ = random_positions(max(n_pos, max(batches)), args.seed)
    print(f"   {len(positions):,} positions generated in {time.perf_counter() - t0:.1f} s", flush=True)
    # The inputs live as long as the run, as an engine's own data would: frozen, the garbage
    # collector stops rescanning them (each full collection pauses every thread for tens of ms).
    gc.freeze()
    epd = None
    if n_epd:
        t0 = time.perf_counter()
        _, fens = random_positions(n_epd, args.seed + 1)
        epd = os.path.join(args.out_dir, f"lc0_positions_{n_epd}.epd")
        with open(epd, "w", encoding="utf-8") as f:
            for i, fen in enumerate(fens):
                f.write(f"{' '.join(fen.split()[:4])} hmvc {fen.split()[4]}; fmvn {fen.split()[5]}; id \"p{i}\";\n")
        print(f"   EPD file of {n_epd:,} positions written in {time.perf_counter() - t0:.1f} s", flush=True)

    rows: list[dict[str, Any]] = []
    tag = args.tag or f"{os.path.basename(net_path).split('.')[0]}_{dtype_name}_{common.slug(env['device_name'])}"
    base = os.path.join(args.out_dir, f"lc0_positions_{tag}")

    def save() -> None:
        common.write_json(base + ".json", {"schema": SCHEMA, "environment": env, "args": vars(args), "net": net_path,
                                           "rows": rows})  # fmt: skip
        with open(base + ".txt", "w", encoding="utf-8") as f:
            f.write("\n".join([head, *report(rows)]) + "\n")

    for b in batches:
        rounds = max(args.rounds, -(-MIN_BATCHES * b // n_pos)) if gpu else args.rounds
        graph_rows = _graph_rows(file, device, dtype, positions, b, args.reps, batches=rounds * n_pos // b)
        rows.extend(graph_rows)
        print("\n".join(report(rows)[-len(graph_rows):]), flush=True)
        rows.append(_evaluator_row(file, [device], dtype, positions[:n_pos], b, rounds))
        print(report(rows)[-1], flush=True)
        rows.append(_evaluator_row(file, [device], dtype, positions[:n_pos], b, rounds, minibatches=True))
        print(report(rows)[-1], flush=True)
        if args.compare_switch:
            rows.append(_evaluator_row(file, [device], dtype, positions[:n_pos], b, rounds,
                                       switch_interval=0.0002))
            print(report(rows)[-1], flush=True)
        if args.compare_depth:
            rows.append(_evaluator_row(file, [device], dtype, positions[:n_pos], b, rounds,
                                       pipeline_depth=args.compare_depth))
            print(report(rows)[-1], flush=True)
        if multi:
            rows.append(_evaluator_row(file, multi, dtype, positions[:n_pos], b, rounds))
            print(report(rows)[-1], flush=True)
        if epd:
            rows.append(_cli_row(net_path, epd, str(device), dtype_name, b, args.out_dir))
            print(report(rows)[-1], flush=True)
        save()
    print("\n".join(["", head, *report(rows)]))
    print(f"wrote {base}.json, {base}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
