"""pytest plugin: write every thread's Python stack to a file at a fixed interval.

    FUSEDENC_DUMP_STACKS_S=10 FUSEDENC_DUMP_STACKS_DIR=out PYTHONPATH=tools python3 -m pytest -p pytest_stack_dumps ...

tools/sanitize.sh loads it when FUSEDENC_SANITIZE_STACKS_S is set.  Why: under racecheck a
few tests grow their process by tens of GB of host memory until the OOM killer ends it, and
the sanitizer's log then says only "process didn't terminate successfully".  A stack every
N seconds, each stamped with the time of day, set beside tools/sanitize_shards.sh's
host-memory.txt (a line every N seconds, with the time of day), names the test line that
was running while memory grew.

The dumps come from a daemon Python thread that holds the GIL while it reads the frames
(sys._current_frames).  Not faulthandler.dump_traceback_later: its watchdog reads the other
threads' frames without the GIL and crashes the process when it catches one mid-update
(SIGSEGV in 10 of 10 runs at a 1 ms interval on CPython 3.11, and once in CI at 0.5 s).
The price of the GIL: while the main thread sits in a C call that holds it, the dump waits
for the call to end; the stamp then says when it was written, and the dump before it names
the test.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

_stop = threading.Event()
_dumper: threading.Thread | None = None


def format_dump(skip_thread: int | None = None) -> str:
    """Every thread's stack but skip_thread's, innermost call last, under a time-of-day stamp."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"--- {time.strftime('%H:%M:%S')}"]
    for ident, frame in sys._current_frames().items():
        if ident == skip_thread:
            continue
        lines.append(f"thread {names.get(ident, '?')} ({ident}):")
        lines.extend(entry.rstrip("\n") for entry in traceback.format_stack(frame))
    return "\n".join(lines) + "\n"


def _dump_every(seconds: float, path: str) -> None:
    with open(path, "a") as f:
        while not _stop.wait(seconds):
            f.write(format_dump(skip_thread=threading.get_ident()))
            f.flush()  # the process may be OOM-killed at any moment: every dump must be on disk


def pytest_configure(config):
    global _dumper
    seconds = float(os.environ.get("FUSEDENC_DUMP_STACKS_S") or 0)
    if seconds <= 0:
        return
    directory = os.environ.get("FUSEDENC_DUMP_STACKS_DIR") or "."
    path = os.path.join(directory, f"stacks-{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write(f"pid {os.getpid()}: started {time.strftime('%H:%M:%S')}, a dump every {seconds:g} s\n")
    _stop.clear()
    _dumper = threading.Thread(target=_dump_every, args=(seconds, path), name="stack-dumps", daemon=True)
    _dumper.start()


def pytest_unconfigure(config):
    global _dumper
    if _dumper is not None:
        _stop.set()
        _dumper.join()
        _dumper = None
