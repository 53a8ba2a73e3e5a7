"""``python -m fusedenc.lc0 [describe] NET.pb.gz``, ``python -m fusedenc.lc0 eval NET.pb.gz ...``
and ``python -m fusedenc.lc0 synth OUT.pb.gz ...``

Describes an lc0 network, evaluates chess positions with it, or writes a random one to try.

``python -m fusedenc.lc0 NET.pb.gz [--batch-sizes 64,256,1024] [--no-bench]`` (``describe``
may be written first) prints what the net is (format, layers, width, heads, FFN,
activations, smolgen, embedding, heads, parameter count, encodings) and whether fusedenc
runs it, then times the whole network (planes in, heads out) at each batch size: with a
GPU in fp16 as one CUDA graph; without one on the CPU in float32 (batch 16 by default),
which times the PyTorch reference ops, not fusedenc's GPU path (the output says so).

``python -m fusedenc.lc0 synth OUT.pb.gz [--preset tiny|t82|bt4] [--seed N] [--layers N]``
writes a net with random weights in a preset's shape (``fusedenc.lc0.writer``): untrained,
for trying fusedenc and timing it.

``python -m fusedenc.lc0 eval NET.pb.gz --fen FEN [--moves e2e4 e7e5 ...]`` prints the
network's top moves with their probabilities, its WDL (from the side to move's view), Q
and moves left for one position (``--fen startpos`` is the initial position).
``--epd FILE`` evaluates every position of an EPD file, ``--pgn FILE`` every position of
every game of a PGN file (in game order, each with its history), through the batching
``Evaluator``; one JSON object per position goes to ``--out`` (default stdout), and the
last line is a summary object with positions/s.  ``--device`` (cuda, cuda:N, a comma list
of GPUs, or cpu), ``--dtype`` (fp16, bf16, fp32; fp16 on a GPU, fp32 on the CPU by
default), ``--top N``, ``--temperature T``.

Anything wrong with the input (a file that cannot be read, a net fusedenc does not run, a
bad FEN, an illegal move) exits with status 2 and one line on stderr saying why, before
any work on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import os
import sys
import time
from typing import Any, Optional, TextIO

import torch

from ..common.device import parse_devices
from ..common.dtypes import CLI_NAMES
from ..common.paths import output_file_problem
from ..tune.cli import int_list
from ..tune.timing import time_graph
from .errors import Lc0FileError, Lc0FormatError, reason
from .evalinputs import InputError, epd_items, eval_parser, pgn_items
from .evaluate import json_lines
from .netfile import NetFile, read_net
from .network import Lc0Network
from .support import check_supported

PROG = "python -m fusedenc.lc0"
DTYPES = CLI_NAMES


# ------------------------------------------------------------ describe ----


#: Timed calls per batch size on the CPU, after one warm-up: a t82-sized net takes seconds a
#: call there, so the GPU's 20 would keep a first try waiting for minutes.
CPU_REPS = 3


def _cpu_ms(net: Lc0Network, planes: torch.Tensor) -> float:
    net(planes)
    samples = []
    for _ in range(CPU_REPS):
        t0 = time.perf_counter()
        net(planes)
        samples.append((time.perf_counter() - t0) * 1e3)
    return sorted(samples)[CPU_REPS // 2]


def _bench(net: Lc0Network, batches: list[int], device: torch.device) -> None:
    if device.type == "cuda":
        print(f"\nwhole network, fp16 on {torch.cuda.get_device_name(device)}, positions/s (median device time):")
    else:
        print(f"\nno GPU: whole network on the CPU in float32, positions/s (median of {CPU_REPS} calls, wall time; "
              "--no-bench skips it).  CPU numbers time the PyTorch reference ops, not fusedenc's GPU path "
              "(fused kernels, CUDA graphs):", flush=True)  # fmt: skip
    for b in batches:
        planes = (torch.rand((b, 112, 8, 8), device=device) < 0.1).to(net.dtype)
        with torch.inference_mode():
            if device.type == "cuda":
                t = time_graph(lambda _: net(planes), [None], reps=20, device=device)
                ms, how = t.ms, t.method
            else:
                ms, how = _cpu_ms(net, planes), "wall"
        print(f"  batch {b:>5}: {b / (ms * 1e-3):>10,.0f}  ({ms:.3f} ms, {how})", flush=True)


def describe_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description="Describe an lc0 network and time it (on a GPU, or on "
                                 f"the CPU without one).  '{PROG} eval --help' evaluates positions; '{PROG} synth "
                                 "--help' writes a random net to try.")  # fmt: skip
    ap.add_argument("net", help="an lc0 network file (.pb.gz)")
    ap.add_argument("--batch-sizes", type=int_list, default=None, help="default 64,256,1024 on a GPU, 16 on the CPU")
    ap.add_argument("--no-bench", action="store_true", help="describe only")
    args = ap.parse_args(argv)
    try:
        file = read_net(args.net)
    except (OSError, Lc0FileError) as exc:
        print(f"fusedenc.lc0: cannot read {args.net}: {reason(exc, args.net)}", file=sys.stderr)
        return 2
    print(json.dumps(file.describe(), indent=1, default=str))
    try:
        check_supported(file)
    except Lc0FormatError as exc:
        print(f"fusedenc.lc0: {args.net}: {reason(exc, file.source)}", file=sys.stderr)
        return 2
    if args.no_bench:
        return 0
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    batches = args.batch_sizes or ([64, 256, 1024] if gpu else [16])
    _bench(Lc0Network(file, dtype=torch.float16 if gpu else torch.float32, device=device), batches, device)
    return 0


# ------------------------------------------------------------ eval ----


def _devices(text: Optional[str]) -> list[torch.device]:
    """``--device`` (default: cuda where torch sees a GPU, else cpu) -> devices, or InputError."""
    try:
        out = parse_devices(text or ("cuda" if torch.cuda.is_available() else "cpu"))
    except ValueError as exc:
        hint = " (use --device cpu --dtype fp32)" if "no GPU" in str(exc) else ""
        raise InputError(f"--device {str(exc).removeprefix('devices: ')}{hint}") from None
    if len(out) > 1 and any(d.type == "cpu" for d in out):
        raise InputError("--device: cpu cannot be combined with GPUs")
    return out


def _load(path: str) -> NetFile:
    """The net file, checked: fusedenc runs it and its input format is encoded here."""
    try:
        file = read_net(path)
    except (OSError, Lc0FileError) as exc:
        raise InputError(f"cannot read {path}: {reason(exc, path)}") from None
    try:
        check_supported(file)
    except Lc0FormatError as exc:
        raise InputError(f"{path}: {reason(exc, file.source)}") from None
    from .encoding import resolve_input_format

    try:
        resolve_input_format(file.input_format)
    except (Lc0FormatError, ValueError) as exc:
        raise InputError(f"fusedenc does not encode positions for {path}: {exc}") from None
    return file


def _top(ev: Any, n: int) -> tuple[list[str], list[float]]:
    k = len(ev.moves) if n <= 0 else min(n, len(ev.moves))
    return list(ev.moves[:k]), [round(float(p), 6) for p in ev.probs[:k]]


def _record(ev: Any, top: int, **ids: Any) -> dict[str, Any]:
    rec = dict(ids)
    rec["best_move"] = ev.best_move
    rec.update(ev.to_dict(top=None if top <= 0 else top))  # moves, probs, q, wdl, moves_left
    return rec


def _print_one(ev: Any, fen: str, moves: list[str], source: str, device, dtype, top: int) -> None:
    after = f" after {' '.join(moves)}" if moves else ""
    print(f"position   {fen}{after}")
    print(f"net        {os.path.basename(source)} ({device}, {str(dtype).replace('torch.', '')})")
    if ev.wdl is not None:
        win, draw, loss = (float(x) for x in ev.wdl)
        print(f"WDL        win {win:.1%}  draw {draw:.1%}  loss {loss:.1%}  (for the side to move)")
        print(f"Q          {ev.q:+.4f}")
    else:
        print(f"value      {ev.q:+.4f}  (tanh, for the side to move)")
    if ev.moves_left is not None:
        print(f"moves left {ev.moves_left:.1f}")
    names, probs = _top(ev, top)
    print(f"top moves  ({len(names)} of {len(ev.moves)} legal)")
    for i, (m, p) in enumerate(zip(names, probs, strict=True), 1):
        print(f"  {i:>3}. {m:<6} {p:8.2%}")
    if not ev.moves:
        print("  (no legal moves: the game is over)")


class _Progress:
    """A tqdm bar where tqdm is installed and stderr is a terminal; else a line on stderr
    every few seconds (and at the end), so a log shows progress without redraws."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="pos", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
            except ImportError:
                pass

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now - self.last >= 2.0:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            print(f"{PROG}: {self.done:,}/{self.total:,} positions ({rate:,.0f}/s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _open_out(path: Optional[str]) -> TextIO:
    if path is None:
        return sys.stdout
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None


def _checked_one(args) -> tuple[str, Any]:
    """(the FEN, the prepared position) of --fen and --moves, or InputError: checked before the
    net loads (seconds on a CPU), so that a typo costs nothing."""
    from .positions import prepare

    fen = "startpos" if args.fen.strip() == "startpos" else args.fen
    try:
        return fen, prepare([(fen, list(args.moves))])
    except ValueError as exc:
        raise InputError(f"--fen/--moves: {str(exc).removeprefix('position 0 ')}") from None


def _eval_one(args, file: NetFile, devices: list[torch.device], dtype: torch.dtype, checked: tuple[str, Any]) -> int:
    from .positions import Position

    fen, prepared = checked
    net = Lc0Network(file, dtype=dtype, device=devices[0])
    [ev] = net.evaluate(prepared, temperature=args.temperature)
    shown = Position.from_fen(fen).fen() if fen == "startpos" else fen
    if args.json:
        print(json.dumps(_record(ev, args.top, fen=shown, moves_played=list(args.moves))))
    else:
        _print_one(ev, shown, list(args.moves), file.source, devices[0], dtype, args.top)
    return 0


def _eval_file(args, file: NetFile, devices: list[torch.device], dtype: torch.dtype,
               items: tuple[list[Any], list[dict[str, Any]]], read_seconds: float, load_seconds: float) -> int:
    """Evaluate the positions of the EPD or PGN file, already read and checked (``items``)."""
    from .evaluator import Evaluator

    positions, ids = items
    prefixes = [json.dumps(rec)[:-1] for rec in ids]  # each line's opening: the position's own fields
    out = _open_out(args.out)
    max_batch = args.max_batch or (1024 if devices[0].type == "cuda" else 256)
    failed = 0
    # The positions and their ids live until the end: frozen, the garbage collector stops
    # rescanning them (each full collection of a heap this size stops every thread, the
    # Evaluator's too, for ~100 ms: measured, a third of the evaluation phase's time).
    frozen = gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    try:
        t0 = time.perf_counter()
        with Evaluator(file, devices=devices, dtype=dtype, max_batch=max_batch, temperature=args.temperature) as ev:
            t_ready = time.perf_counter()
            progress = _Progress(len(positions), not args.no_progress)
            top = None if args.top <= 0 else args.top

            def write(start: int, evaluations: list[Any]) -> None:
                # Lines a batch at a time from the batch's arrays (json_lines): per position
                # json.dumps would cost this process, which also drives the GPU, ~50 us a position.
                if evaluations:
                    out.write("\n".join(json_lines(evaluations, prefixes[start:start + len(evaluations)], top)) + "\n")
                    progress.update(len(evaluations))

            def written(start: int, future: Any) -> int:
                """Write a chunk's lines; how many of its positions failed."""
                try:
                    evaluations = future.result()
                except Exception:  # noqa: BLE001 - a position failed: the chunk again, to write each one's error
                    evaluations = None
                if evaluations is not None:
                    write(start, evaluations)
                    return 0
                bad, done, end = 0, [], min(start + chunk, len(positions))
                for i, f in enumerate(ev.submit_many(positions[start:end]), start):
                    try:
                        done.append(f.result())
                    except Exception as exc:  # noqa: BLE001 - written as that position's error
                        write(i - len(done), done)
                        done = []
                        bad += 1
                        out.write(json.dumps({**ids[i], "error": str(exc)}) + "\n")
                        progress.update()
                write(end - len(done), done)
                return bad

            # Submitted a chunk of a batch at a time (submit_batch: one future a chunk), a few
            # batches ahead of what is written: a burst of 100k submissions would hold the GIL
            # while the GPU waits, and every result would live until the end.
            chunk, ahead = max_batch, ev.batches_in_flight
            pending: collections.deque = collections.deque()
            for start in range(0, len(positions), chunk):
                pending.append((start, ev.submit_batch(positions[start:start + chunk])))
                if len(pending) > ahead:
                    failed += written(*pending.popleft())
            while pending:
                failed += written(*pending.popleft())
            t_end = time.perf_counter()
            progress.close()
            stats = ev.stats()
        seconds = t_end - t_ready
        summary = {
            "positions": len(positions) - failed, "failed": failed, "seconds": round(seconds, 4),
            "positions_per_s": round((len(positions) - failed) / seconds, 1) if seconds > 0 else math.inf,
            "mean_batch": round(stats["mean_batch"], 1), "batches": stats["batches"],
            "devices": [str(d) for d in devices], "dtype": str(dtype).replace("torch.", ""),
            "startup_seconds": round(t_ready - t0, 3), "read_seconds": round(read_seconds, 3),
            "load_seconds": round(load_seconds, 3),
            "command_seconds": round(time.perf_counter() - t0 + read_seconds + load_seconds, 3),
        }  # fmt: skip
        out.write(json.dumps({"summary": summary}) + "\n")
        out.flush()
    finally:
        if frozen:
            gc.unfreeze()
        if out is not sys.stdout:
            out.close()
    print(f"{PROG}: {summary['positions']:,} positions in {seconds:.2f} s of evaluation: "
          f"{summary['positions_per_s']:,.0f} positions/s (mean batch {summary['mean_batch']}, "
          f"{', '.join(summary['devices'])}, {summary['dtype']}); the whole command {summary['command_seconds']:.2f} s: "
          f"reading and checking the file {summary['read_seconds']:.2f} s, loading the net "
          f"{summary['load_seconds']:.2f} s, start-up {summary['startup_seconds']:.2f} s, evaluation {seconds:.2f} s",
          file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


def eval_main(argv: list[str]) -> int:
    ap = eval_parser()
    args = ap.parse_args(argv)
    if args.moves and not args.fen:
        ap.error("--moves goes with --fen")
    if args.parquet or args.frames:
        ap.error(f"{'--parquet' if args.parquet else '--frames'} is read by a Ray cluster: add --ray "
                 f"(pip install \"fusedenc[ray]\"; --ray local runs one on this machine)")
    if args.temperature <= 0 or not math.isfinite(args.temperature):
        ap.error(f"--temperature must be > 0, got {args.temperature}")
    if args.max_batch is not None and args.max_batch <= 0:
        ap.error(f"--max-batch must be > 0, got {args.max_batch}")
    try:
        devices = _devices(args.device)
        if args.fen is not None and len(devices) > 1:
            raise InputError("--fen evaluates on one device; name one in --device")
        dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if devices[0].type == "cuda" else torch.float32)
        # The input first: a bad FEN or file is refused before the net loads (seconds on a CPU).
        t0 = time.perf_counter()
        if args.fen is not None:
            checked = _checked_one(args)
        else:
            items = epd_items(args.epd) if args.epd else pgn_items(args.pgn)
        if args.out is not None and (why := output_file_problem(args.out)):  # before the net loads too
            raise InputError(f"--out {args.out}: {why}")
        t_read = time.perf_counter()
        file = _load(args.net)
        if args.fen is not None:
            return _eval_one(args, file, devices, dtype, checked)
        return _eval_file(args, file, devices, dtype, items, t_read - t0, time.perf_counter() - t_read)
    except InputError as exc:
        print(f"fusedenc.lc0: {exc}", file=sys.stderr)
        return 2


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval":
        if any(a == "--ray" or a.startswith("--ray=") for a in argv):
            from ..distributed.cli import eval_main as ray_eval_main  # the entry point may reach any layer

            return ray_eval_main(argv[1:])
        return eval_main(argv[1:])
    if argv and argv[0] == "synth":
        from .writer import synth_main

        return synth_main(argv[1:], prog=f"{PROG} synth")
    if argv and argv[0] == "describe":
        argv = argv[1:]
    return describe_main(argv)


if __name__ == "__main__":
    sys.exit(main())
