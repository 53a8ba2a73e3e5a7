"""pytest plugin: write every thread's Python stack to a file at a fixed interval.

    FUSEDENC_DUMP_STACKS_S=10 FUSEDENC_DUMP_STACKS_DIR=out PYTHONPATH=tools python3 -m pytest -p pytest_stack_dumps ...

tools/sanitize.sh loads it when FUSEDENC_SANITIZE_STACKS_S is set.  Why: under racecheck a
few tests grow their process by tens of GB of host memory until the OOM killer ends it, and
the sanitizer's log then says only "process didn't terminate successfully".  A stack every
N seconds, beside tools/sanitize_shards.sh's host-memory.txt (a line every N seconds, with
the time of day), names the test line that was running while memory grew.

faulthandler's watchdog is a C thread that needs no GIL, so it dumps even while the main
thread sits in a long CUDA call.  It writes no time of day, so the file starts with the time
its first interval began: dump k was written k intervals after it.
"""

from __future__ import annotations

import faulthandler
import os
import time

_open_files = []


def pytest_configure(config):
    seconds = float(os.environ.get("FUSEDENC_DUMP_STACKS_S") or 0)
    if seconds <= 0:
        return
    directory = os.environ.get("FUSEDENC_DUMP_STACKS_DIR") or "."
    f = open(os.path.join(directory, f"stacks-{os.getpid()}.txt"), "w")  # noqa: SIM115 (kept open for the watchdog)
    f.write(f"pid {os.getpid()}: started {time.strftime('%H:%M:%S')}, a dump every {seconds:g} s after it\n")
    f.flush()  # faulthandler writes to the descriptor, past Python's buffer
    _open_files.append(f)
    faulthandler.dump_traceback_later(seconds, repeat=True, file=f)


def pytest_unconfigure(config):
    if _open_files:
        faulthandler.cancel_dump_traceback_later()
        while _open_files:
            _open_files.pop().close()
