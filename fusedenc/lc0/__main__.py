"""``python -m fusedenc.lc0 NET.pb.gz [--batch-sizes 64,256,1024] [--no-bench]``

Prints what the net is (format, layers, width, heads, FFN, activations, smolgen,
embedding, heads, parameter count, encodings) and whether fusedenc runs it; with a
GPU, times the whole network (planes in, heads out) in fp16, eager and as one CUDA
graph, at each batch size.  A file fusedenc cannot read or run exits with status 2
and one line saying why.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

from ..tune.cli import int_list
from ..tune.timing import time_graph
from .errors import Lc0FileError, Lc0FormatError
from .netfile import read_net
from .network import Lc0Network
from .support import check_supported


def _bench(net: Lc0Network, batches: list[int]) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"\nwhole network, fp16 on {torch.cuda.get_device_name(device)}, positions/s (median device time):")
    for b in batches:
        planes = (torch.rand((b, 112, 8, 8), device=device) < 0.1).to(torch.float16)
        with torch.inference_mode():
            t = time_graph(lambda _: net(planes), [None], reps=20, device=device)
        print(f"  batch {b:>5}: {b / (t.ms * 1e-3):>10,.0f}  ({t.ms:.3f} ms, {t.method})")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusedenc.lc0", description=__doc__.split("\n\n")[1])
    ap.add_argument("net", help="an lc0 network file (.pb.gz)")
    ap.add_argument("--batch-sizes", type=int_list, default=[64, 256, 1024])
    ap.add_argument("--no-bench", action="store_true", help="describe only")
    args = ap.parse_args(argv)
    try:
        file = read_net(args.net)
    except (OSError, Lc0FileError) as exc:
        print(f"fusedenc.lc0: cannot read {args.net}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(file.describe(), indent=1, default=str))
    try:
        check_supported(file)
    except Lc0FormatError as exc:
        print(f"fusedenc.lc0: fusedenc does not run this net: {exc}", file=sys.stderr)
        return 2
    if args.no_bench:
        return 0
    if not torch.cuda.is_available():
        print("\nno GPU: not benchmarked (fusedenc.lc0.load_network(path, device='cpu', dtype=torch.float32) runs it on CPU)")
        return 0
    _bench(Lc0Network(file, dtype=torch.float16, device="cuda"), args.batch_sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
