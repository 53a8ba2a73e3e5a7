"""Shared test setup.

GPU tests carry ``@pytest.mark.gpu``.  They are skipped where no GPU with the
native core is available, except when FUSEDENC_REQUIRE_GPU=1 (set on the GPU
machine), where a missing GPU or core stops the run with an error instead: a GPU
run that quietly checked nothing must not exit 0.
"""

from __future__ import annotations

import os

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


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: only the tests that will run
def pytest_collection_modifyitems(config, items):
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


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """One line for the GPU tests skipped on a machine without one, instead of one ``-ra`` line
    per test location: they move to their own count ("N skipped (no GPU)") and out of the list."""
    skipped = terminalreporter.stats.get("skipped", [])
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
