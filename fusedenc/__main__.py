"""``python -m fusedenc``: what this installation runs on, in a few lines.

The README's set-up ends with it, so a build without the native core says why
(and what to install) at set-up time, not at the first slow run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from . import __version__, core


def report() -> list[str]:
    """The lines ``python -m fusedenc`` prints."""
    b = core.backend()
    info = core.library_info()
    built = f"{info['vendor']} core with {info['library']}" if info else "no native core"
    lines = [f"fusedenc {__version__}: {built}; torch {torch.__version__}"]
    if b.build:
        lines.append(f"  build: {b.build}")
    if b.name != "reference":
        lines.append(f"  active: GPU tensors run the native core ({b.reason})")
    else:
        lines.append(f"  not active: {b.reason}; every op runs its PyTorch reference")
        if info is None:
            lines.append("  to build it: install a CUDA build of torch (it brings cuBLASLt) with nvcc on the PATH "
                         "(ROCm: a ROCm torch, its clang and hipBLASLt), then run the set-up again; "
                         "FUSEDENC_GPU=cuda builds the CUDA core with any torch (cuBLASLt: pip install nvidia-cublas)")
    from .report import hopper_lines  # a CUDA core without its Hopper kernels: loud on an sm90 GPU

    lines.extend(hopper_lines())
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["embed"]:  # python -m fusedenc embed MODEL INPUT -o OUTPUT [--ray [ADDRESS]]
        if any(a == "--ray" or a.startswith("--ray=") for a in argv):
            from .distributed.cli import embed_main as ray_embed_main

            return ray_embed_main(argv[1:])
        from .embed.cli import main as embed_main

        return embed_main(argv[1:])
    # argparse for its --help (usage, exit 0) and for refusing what it does not know (usage
    # on stderr, exit 2): an unknown argument is a typo, not a request for the status.
    ap = argparse.ArgumentParser(
        prog="python -m fusedenc",
        description="Print what this fusedenc installation runs on: its native core (or why there is none), "
                    "the torch it runs with, and whether GPU tensors take the fused kernels.",
        epilog="Related: python -m fusedenc embed MODEL INPUT -o OUTPUT (embeddings of a corpus), "
               "python -m fusedenc.lc0 (lc0 networks: describe, eval, synth), "
               "python -m fusedenc.tune (tuning tables).",
    )  # fmt: skip
    ap.parse_args(argv)
    print("\n".join(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
