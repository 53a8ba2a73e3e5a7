"""Shared test setup.

GPU tests carry ``@pytest.mark.gpu``.  They are skipped where no GPU with the
native core is available, except when FUSEDENC_REQUIRE_GPU=1 (set on the GPU
machine), where a missing GPU or core stops the run with an error instead: a GPU
run that quietly checked nothing must not exit 0; the GPU tests that still skip
there (a backend not installed, a feature the GPU lacks) are listed in the summary.

The default run is the short one.  ``--exhaustive`` (or FUSEDENC_EXHAUSTIVE=1) adds the
``slow`` tests (benchmark smoke runs, memory bombs, outside oracles over many games) and
every case of the ``sweep`` tests, of which a default run takes a random
``SWEEP_CASES`` per test (a new draw each run, printed, repeated by FUSEDENC_SWEEP_SEED).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import fusedenc
import fusedenc.attention as A
from fusedenc.common import table_files


def _gpu_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no GPU visible to torch"
    b = fusedenc.backend()
    if b.name == "reference":
        return f"native core not active: {b}"
    return None


#: Cases of each ``sweep`` test in a default run.
SWEEP_CASES = 12


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true", default=os.environ.get("FUSEDENC_EXHAUSTIVE") == "1",
                     help="also run the slow tests and every case of the sweeps (FUSEDENC_EXHAUSTIVE=1)")


def pytest_configure(config):
    # One draw for every pytest-xdist worker: the controller configures first and its
    # workers inherit its environment (each worker must collect the same cases).
    if not os.environ.get("FUSEDENC_SWEEP_SEED"):
        os.environ["FUSEDENC_SWEEP_SEED"] = str(random.SystemRandom().randrange(1 << 30))
    config.addinivalue_line("markers", "slow: runs only with --exhaustive (seconds each: subprocesses, big inputs)")
    config.addinivalue_line("markers", f"sweep: a parametrized sweep; without --exhaustive, {SWEEP_CASES} random cases")


def _short_run(config, items) -> tuple[list, int, int]:
    """The items a default run keeps, how many slow tests and sweep cases it leaves out."""
    seed = int(os.environ.get("FUSEDENC_SWEEP_SEED") or random.SystemRandom().randrange(1 << 30))
    config.sweep_seed = seed
    sweeps: dict[tuple, list] = {}
    kept, slow = [], 0
    for item in items:
        if "slow" in item.keywords:
            slow += 1
        elif "sweep" in item.keywords and hasattr(item, "callspec"):
            sweeps.setdefault((item.path, item.originalname), []).append(item)
            kept.append(item)
        else:
            kept.append(item)
    left_out = set()
    for key, cases in sorted(sweeps.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if len(cases) > SWEEP_CASES:
            left_out.update(id(c) for c in random.Random(f"{seed}:{key[1]}").sample(cases, len(cases) - SWEEP_CASES))
    return [i for i in kept if id(i) not in left_out], slow, len(left_out)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: only the tests that will run
def pytest_collection_modifyitems(config, items):
    if not config.getoption("exhaustive"):
        kept, slow, thinned = _short_run(config, items)
        if slow or thinned:
            kept_ids = {id(i) for i in kept}
            config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept_ids])
            items[:] = kept
            config.short_run = (slow, thinned)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    reason = _gpu_unavailable_reason() if gpu_items else None
    if reason is None:
        return
    if os.environ.get("FUSEDENC_REQUIRE_GPU") == "1":
        raise pytest.UsageError(
            f"FUSEDENC_REQUIRE_GPU=1, but the {len(gpu_items)} selected GPU tests cannot run: {reason}")
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=f"{_GPU_SKIP}: {reason}"))


_GPU_SKIP = "needs a GPU"


def _list_gpu_skips(terminalreporter, skipped) -> None:
    """The GPU tests that skipped on the GPU machine, counted by reason (a backend or a feature
    missing there passes quietly otherwise): the GPU run's summary shows what was not checked."""
    reasons: dict[str, int] = {}
    for report in skipped:
        # getattr: a collection report (pytest-xdist passes those on as skips too) has no keywords
        if "gpu" in getattr(report, "keywords", ()) and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
            where = report.nodeid.split("::")[0].removeprefix("tests/")
            reasons[f"{where}: {reason}"] = reasons.get(f"{where}: {reason}", 0) + 1
    if reasons:
        terminalreporter.write_sep("=", f"GPU tests skipped on this GPU machine: {sum(reasons.values())}")
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{count:5d}  {reason[:200]}")


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter, config):
    """One line for the GPU tests skipped on a machine without one, instead of one ``-ra`` line
    per test location: they move to their own count ("N skipped (no GPU)") and out of the list.
    On the GPU machine (FUSEDENC_REQUIRE_GPU=1), every GPU test that skipped anyway, by reason."""
    short = getattr(config, "short_run", None)
    if short:
        terminalreporter.write_line(
            f"short run: {short[0]} slow tests left out, sweeps at {SWEEP_CASES} random cases each "
            f"({short[1]} cases left out; FUSEDENC_SWEEP_SEED={config.sweep_seed} repeats the draw); "
            f"--exhaustive runs everything")
    skipped = terminalreporter.stats.get("skipped", [])
    if os.environ.get("FUSEDENC_REQUIRE_GPU") == "1":
        _list_gpu_skips(terminalreporter, skipped)
    gpu = [r for r in skipped if isinstance(r.longrepr, tuple) and str(r.longrepr[2]).startswith(f"Skipped: {_GPU_SKIP}")]
    if not gpu:
        return
    terminalreporter.stats["skipped"] = [r for r in skipped if r not in gpu]
    terminalreporter.stats["skipped (no GPU)"] = gpu
    reason = str(gpu[0].longrepr[2]).split(": ", 2)[-1]
    terminalreporter.write_line(
        f"{len(gpu)} GPU tests skipped: {reason} (FUSEDENC_REQUIRE_GPU=1 makes that an error)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under PYTORCH_NO_CUDA_MEMORY_CACHING=1 (memcheck, tools/sanitize.sh) PyTorch cannot capture
    CUDA graphs: a test that asks for one is skipped with that reason instead of failing."""
    outcome = yield
    excinfo = call.excinfo
    if excinfo is not None and excinfo.errisinstance(fusedenc.graphs.runner.CaptureUnavailable):
        report = outcome.get_result()
        report.outcome, report.longrepr = "skipped", (str(item.path), item.location[1], f"Skipped: {excinfo.value}")


@pytest.fixture(autouse=True)
def _fp32_matmuls_in_full_precision():
    """fp32 references computed by torch on the GPU must not silently use TF32 (every test)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def no_attention_tables(tmp_path, monkeypatch):
    """No user attention table (an empty config dir), no forced backend, fresh caches."""
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path / "no-tables"))
    monkeypatch.delenv(A.BACKEND_ENV, raising=False)
    A.clear_cache()
    yield
    A.clear_cache()


class SeededGenerator(torch.Generator):
    """A CPU generator that can say its seed, for failure messages."""

    @property
    def seed_value(self) -> int:
        return self.initial_seed()


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator with a fresh seed per test; tests put ``gen.seed_value`` in messages."""
    g = SeededGenerator()
    g.manual_seed(int.from_bytes(os.urandom(4), "little"))
    request.node.user_properties.append(("seed", g.seed_value))
    return g
