"""Running Triton kernels' test cases on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before triton is imported and would leak
into every later test of the process, so a test module runs its own cases in a
child process (the module re-executed as a script: ``report_cases``) and reads one
JSON line per case: ``{"case": id, "error": null or a message}``
(``run_cases_in_interpreter``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch


_LOOP_PROBE = """
import triton, triton.language as tl, torch
@triton.jit
def k(out, n):
    acc = 0
    for i in range(0, n, 2):
        acc += 1
    tl.store(out, acc)
o = torch.zeros(1, dtype=torch.int32)
k[(1,)](o, 5)
assert int(o) == 3, int(o)
"""


@functools.lru_cache(maxsize=None)
def interpreter_loop_problem() -> str | None:
    """Why this Triton's interpreter cannot run our kernels, or None.

    Triton 3.6's interpreter holds a scalar argument as a one-element 1-d numpy
    array and converts it with ``int()``, which NumPy 2.4 refuses, so every
    ``range`` over a runtime bound raises there (newer Triton works).  That is the
    environment, not our kernels: the cases are skipped with the versions named.
    """
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _LOOP_PROBE], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode == 0:
        return None
    if "only 0-dimensional arrays can be converted" in r.stderr:
        import numpy
        import triton

        return (
            f"Triton {triton.__version__}'s interpreter cannot run a loop over a runtime bound "
            f"with NumPy {numpy.__version__} (upstream bug; newer Triton runs these cases)"
        )
    pytest.fail(f"the interpreter's loop probe failed:\n{r.stderr[-3000:]}")


def run_cases_in_interpreter(script: str) -> tuple[int, dict, str]:
    """(seed, {case id: error or None}, the child's stderr tail) for the cases of ``script``."""
    problem = interpreter_loop_problem()
    if problem:
        pytest.skip(problem)
    seed = int.from_bytes(os.urandom(4), "little")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, script, str(seed)], capture_output=True, text=True, env=env, timeout=600)
    found = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            found[row["case"]] = row["error"]
    if r.returncode != 0 and not found:
        pytest.fail(f"interpreter run failed (seed {seed}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return seed, found, r.stderr[-3000:]


def assert_case_passed(results: tuple[int, dict, str], name: str) -> None:
    """The parent's check of one case in ``run_cases_in_interpreter``'s results: it ran, and
    raised nothing."""
    seed, found, stderr = results
    assert name in found, f"{name}: no result (seed {seed}); child stderr:\n{stderr}"
    assert found[name] is None, f"{name} (seed {seed}): {found[name]}"


def report_cases(seed: int, cases, name_of, run) -> int:
    """The child's side: ``run(case, gen)`` for every case, each with a generator seeded
    ``seed`` + its index, one JSON line per case (its error, if it raised); the exit status."""
    torch.set_num_threads(1)  # the interpreter's per-program numpy work gains nothing from threads
    failed = 0
    for i, case in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + i)
        try:
            run(case, gen)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the parent, one case at a time
            error = f"{type(exc).__name__}: {exc}"
            failed += 1
        print(json.dumps({"case": name_of(case), "error": error}), flush=True)
    return 1 if failed else 0


def interpreter_suite(script: str, cases, name_of):
    """The parent's side of a test module whose cases run in the interpreter: ``(results
    fixture, parametrized test)`` to bind at module level as ``results`` and
    ``test_case_under_interpreter`` (pytest collects them by those names)."""

    @pytest.fixture(scope="module")
    def results():
        """Every case run once in a child process with the interpreter on."""
        return run_cases_in_interpreter(script)

    @pytest.mark.parametrize("case", cases, ids=name_of)
    def test_case_under_interpreter(case, results):
        assert_case_passed(results, name_of(case))

    return results, test_case_under_interpreter
