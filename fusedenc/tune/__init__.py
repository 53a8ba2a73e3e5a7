"""Measure kernels on this GPU and write the tables fusedenc picks them from.

    python -m fusedenc.tune attention [--dtype float16] [--head-dims 32,64,128]
        [--seq-lens 64,128,...] [--batch-heads 64,512,4096]
        [--variants none,bias,mask,bias+mask] [--out PATH] [--quick]
    python -m fusedenc.tune gemm [--preset t82,bt4,bert-base] [--batch-sizes 1,16,64,256]
        [--dtype float16] [--norm-first] [--out PATH]

``attention`` (``tune/attention.py``) times the attention backends and writes
``$FUSEDENC_CONFIG_DIR/attention_<arch>.json``; ``gemm`` (``tune/gemm.py``)
times the GEMM library's candidate algorithms (and the Triton FFN1 kernel where
the library has no epilogue for the activation) and writes ``gemm_<arch>.json``.
Processes read both when they first need them.  ``presets`` (the encoder shapes)
and ``timing`` (device timing) are shared with the benchmarks in ``bench/``.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from . import attention, gemm

__all__ = ["SUBCOMMANDS", "main"]

#: name -> (help, add_arguments(parser), run(args) -> exit status)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "attention": ("time the attention backends and write attention_<arch>.json", attention.add_arguments, attention.run),
    "gemm": (
        "time the GEMM library's candidate algorithms (and the Triton FFN1 kernel where the library has no "
        "epilogue for the activation) and write gemm_<arch>.json",
        gemm.add_arguments,
        gemm.run,
    ),
}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedenc.tune", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_text, add_args, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(run=run)
    args = parser.parse_args(argv)
    return args.run(args)
