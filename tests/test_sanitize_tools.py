"""CPU tests of the compute-sanitizer tooling: tools/sanitize.sh, tools/sanitize_shards.sh
and tools/sanitize_coverage.py.

The scripts run as a user runs them, with a fake compute-sanitizer (COMPUTE_SANITIZER)
that runs the command it wraps and writes the report we tell it to: so what the
scripts conclude from a clean run, a race in one of our kernels, a race in a vendor
kernel and a failed test is checked without a GPU.  The tests they run are a
throwaway file of our own, with a space in one node id (pytest allows it; one of
our suites has "[129-32-at most 128]").
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_SANITIZER = textwrap.dedent("""\
    #!/usr/bin/env bash
    # Stands in for compute-sanitizer: runs the wrapped command, writes $FAKE_REPORT as its log.
    if [ "${1:-}" = "--version" ]; then echo "Version 0.0 (fake)"; exit 0; fi
    [ -n "${FAKE_ARGS:-}" ] && printf '%s\\n' "$@" > "$FAKE_ARGS"
    log=""
    while [ $# -gt 0 ]; do
      case "$1" in
        --log-file) log="$2"; shift 2 ;;
        python3) break ;;
        *) shift ;;
      esac
    done
    "$@"; rc=$?
    printf '%s\\n' "${FAKE_REPORT:-========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)}" > "${log//%p/$$}"
    exit $rc
    """)

THROWAWAY_TESTS = textwrap.dedent("""\
    import os
    import time
    import pytest

    @pytest.mark.parametrize("case", ["plain", "at most 128"])
    def test_passes(case):
        assert os.environ.get("FAKE_FAIL") != case
        time.sleep(float(os.environ.get("FAKE_SLEEP", "0")) if case == "at most 128" else 0)

    def test_is_skipped():
        pytest.skip("nothing to check here")
    """)


FAKE_NVIDIA_SMI = """#!/bin/sh
# two GPUs: a line each, unless -i picks one
if [ "$1" = "-i" ]; then echo "GPU $2: FakeH100"; else printf 'GPU 0: FakeH100\\nGPU 1: FakeH100\\n'; fi
"""


@pytest.fixture
def setup(tmp_path):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    tests_file = tmp_path / "test_throwaway.py"
    tests_file.write_text(THROWAWAY_TESTS)
    ids = [f"{tests_file}::test_passes[plain]", f"{tests_file}::test_passes[at most 128]",
           f"{tests_file}::test_is_skipped"]
    listing = tmp_path / "tests.txt"
    listing.write_text("# a comment, then node ids; a ledger's outcome word is allowed\n"
                       + "\n".join(ids) + " passed\n")
    env = dict(os.environ, COMPUTE_SANITIZER=str(fake), PYTHONPATH=str(ROOT))
    env.pop("FAKE_REPORT", None)
    return tmp_path, ids, listing, env


def _run(cmd: list[str], env: dict, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *cmd], cwd=ROOT, env=dict(env, OUT=str(out)),
                          capture_output=True, text=True, timeout=240, check=False)


def _covered(out: Path) -> dict[str, str]:
    """The run's covered list, read as the ledger it is appended to is read."""
    path = out / "sanitize-racecheck-covered.txt"
    return _coverage_module().read_ledger(path) if path.exists() else {}


def _sanitize(setup, out_name: str, limit: int = 200, **extra_env) -> tuple[subprocess.CompletedProcess, Path]:
    tmp_path, _, listing, env = setup
    out = tmp_path / out_name
    proc = _run(["tools/sanitize.sh", "--no-build", "--tools", "racecheck", "--timeout", str(limit),
                 "--tests-file", str(listing)], dict(env, **extra_env), out)
    return proc, out


def _key(node_id: str) -> str:
    """pytest -v prints a node id relative to the rootdir: compare by what follows the file name."""
    return node_id.split("test_throwaway.py", 1)[1]


def test_clean_run_lists_every_test_it_covered(setup):
    proc, out = _sanitize(setup, "clean")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    covered = {_key(k): v for k, v in _covered(out).items()}
    assert covered == {"::test_passes[plain]": "passed", "::test_passes[at most 128]": "passed",
                       "::test_is_skipped": "skipped"}
    summary = (out / "sanitize-summary.txt").read_text()
    assert "== racecheck: 0 reports in fusedenc or PyTorch kernels" in summary
    assert "3 tests reported" in summary
    # per-test times in the log, so a run cut short says what each test cost
    assert any(line.rstrip().endswith(("s", "ms", "us"))
               for line in (out / "sanitize-racecheck-pytest.log").read_text().splitlines() if " PASSED" in line)


def test_a_race_in_our_kernel_fails_the_run_and_covers_nothing(setup):
    report = "========= Error: Race reported between Write access at layer_norm_kernel+0x1a0"
    proc, out = _sanitize(setup, "ours", FAKE_REPORT=report)
    assert proc.returncode == 1
    assert _covered(out) == {}
    assert "== racecheck: 1 reports in fusedenc or PyTorch kernels" in (out / "sanitize-summary.txt").read_text()


def test_a_race_in_a_vendor_kernel_is_listed_not_counted(setup):
    report = "========= Error: Race reported between Read access at nvjet_sm90_hsh_64x64_64x13_1x2_h_bz_NNT+0x40"
    proc, out = _sanitize(setup, "vendor", FAKE_REPORT=report)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(_covered(out)) == 3
    summary = (out / "sanitize-summary.txt").read_text()
    assert "0 reports in fusedenc or PyTorch kernels" in summary and "1 race reports in vendor library kernels" in summary


def test_a_failed_test_covers_nothing(setup):
    proc, out = _sanitize(setup, "failed", FAKE_FAIL="at most 128")
    assert proc.returncode == 1
    assert _covered(out) == {}


KILLED = "========= Error: process didn't terminate successfully"


def test_a_killed_process_fails_the_run_and_is_not_called_a_report_in_our_kernels(setup):
    """The OOM killer ending a racecheck process is a failed run, and the summary says so,
    not that our kernels have a race."""
    proc, out = _sanitize(setup, "killed", FAKE_REPORT=KILLED)
    assert proc.returncode == 1
    assert _covered(out) == {}
    summary = (out / "sanitize-summary.txt").read_text()
    assert "== racecheck: 0 reports in fusedenc or PyTorch kernels" in summary
    assert "1 process(es) killed or crashed" in summary


def test_a_run_cut_short_covers_what_it_finished_and_exits_3(setup):
    """The limit stops the run inside its second test: exit 3 (no problem, not complete) and the
    first test is covered; the one interrupted is not."""
    proc, out = _sanitize(setup, "short", limit=8, FAKE_SLEEP="120")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert {_key(k): v for k, v in _covered(out).items()} == {"::test_passes[plain]": "passed"}
    assert "TIMED OUT after 8s (partial)" in (out / "sanitize-summary.txt").read_text()


def test_more_sanitizer_options_reach_the_sanitizer_and_the_summary(setup):
    tmp_path = setup[0]
    proc, out = _sanitize(setup, "flags", FAKE_ARGS=str(tmp_path / "args.txt"),
                          FUSEDENC_SANITIZE_FLAGS="--racecheck-num-hazards 1024")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (tmp_path / "args.txt").read_text().splitlines()
    assert args[args.index("--racecheck-num-hazards") + 1] == "1024"
    assert args.index("--racecheck-num-hazards") < args.index("python3")
    assert "sanitizer options: --tool racecheck --racecheck-report analysis --racecheck-num-hazards 1024" in (
        out / "sanitize-summary.txt").read_text()


def test_stack_dumps_name_the_test_that_was_running(setup):
    """FUSEDENC_SANITIZE_STACKS_S: a test process writes its stack while a slow test runs."""
    proc, out = _sanitize(setup, "stacks", FUSEDENC_SANITIZE_STACKS_S="0.5", FAKE_SLEEP="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dumps = list(out.glob("stacks-*.txt"))
    assert len(dumps) == 1
    text = dumps[0].read_text()
    assert re.match(r"pid \d+: started \d\d:\d\d:\d\d, a dump every 0.5 s\n--- \d\d:\d\d:\d\d\n", text)
    assert "in test_passes" in text
    assert "stack-dumps" not in text  # the dumping thread leaves itself out
    proc, out = _sanitize(setup, "stacks", FAKE_SLEEP="2")  # off by default, and stale dumps go
    assert list(out.glob("stacks-*.txt")) == []


BUSY_TEST = textwrap.dedent("""\
    import time

    def recurse(n):
        return n if n < 2 else recurse(n - 1)

    def test_busy():
        start = time.monotonic()
        while time.monotonic() - start < 1.5:
            recurse(40)
    """)


def test_stack_dumps_are_safe_while_the_test_runs_python(tmp_path):
    """Dumps every millisecond while the test keeps pushing and popping frames.  The first form
    of the plugin (faulthandler's watchdog, which reads frames without the GIL) crashed this
    with SIGSEGV in 10 of 10 runs."""
    (tmp_path / "test_busy.py").write_text(BUSY_TEST)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tools"), FUSEDENC_DUMP_STACKS_S="0.001",
               FUSEDENC_DUMP_STACKS_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_stack_dumps",
                           "test_busy.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (dump,) = tmp_path.glob("stacks-*.txt")
    text = dump.read_text()
    assert text.count("\n--- ") > 10 and "in recurse" in text


def test_shards_split_the_list_and_merge_what_they_covered(setup):
    tmp_path, ids, listing, env = setup
    out = tmp_path / "shards"
    proc = _run(["tools/sanitize_shards.sh", "--tool", "racecheck", "--shards", "2", "--timeout", "200",
                 "--no-build", str(listing)], env, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {_key(k) for k in _covered(out)} == {_key(i) for i in ids}
    summary = (out / "sanitize-summary.txt").read_text()
    assert "#### shard 0 (2 tests): finished, no problem" in summary and "#### shard 1 (1 tests): finished" in summary
    assert (out / "sanitize-logs.tgz").exists() and not list(out.glob("shard-*"))


def test_shards_cut_short_exit_3_and_keep_what_they_finished(setup):
    """Shard 1 holds the slow test and is stopped by the limit: exit 3, shard 0's tests and
    none of shard 1's are covered; the monitor wrote each shard's memory."""
    tmp_path, _, listing, env = setup
    out = tmp_path / "shards-short"
    # A machine of two GPUs where the tests see GPU 1 first: the samples and the summary name it alone
    # (nvidia-smi prints a line per GPU unless -i picks one).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(env, PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", CUDA_VISIBLE_DEVICES="1,0")
    proc = _run(["tools/sanitize_shards.sh", "--tool", "racecheck", "--shards", "2", "--timeout", "8",
                 "--no-build", str(listing)], dict(env, FAKE_SLEEP="120", FUSEDENC_SANITIZE_MONITOR_S="1"), out)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert {_key(k) for k in _covered(out)} == {"::test_passes[plain]", "::test_is_skipped"}
    summary = (out / "sanitize-summary.txt").read_text()
    assert "#### shard 0 (2 tests): finished, no problem" in summary
    assert "#### shard 1 (1 tests): cut short by the limit, no problem" in summary
    samples = (out / "host-memory.txt").read_text().splitlines()
    assert samples and all(re.search(r"GB \(shards: \d+ \d+\), gpu GPU 1: ", line) for line in samples), samples
    assert [line for line in summary.splitlines() if line.startswith("gpu: ")] == ["gpu: GPU 1: FakeH100"] * 2


def test_a_shard_with_a_problem_fails_the_whole_and_covers_nothing(setup):
    tmp_path, _, listing, env = setup
    out = tmp_path / "shards-killed"
    proc = _run(["tools/sanitize_shards.sh", "--tool", "racecheck", "--shards", "2", "--timeout", "200",
                 "--no-build", str(listing)], dict(env, FAKE_REPORT=KILLED), out)
    assert proc.returncode == 1
    assert _covered(out) == {}
    assert "A PROBLEM (exit 1): covers nothing" in (out / "sanitize-summary.txt").read_text()


@pytest.mark.parametrize("args, message", [
    (["--tool", "racecheck", "--shards", "0"], "--shards takes a positive count"),
    (["--tool", "initcheck"], "--tool memcheck or racecheck"),
    (["--tool", "racecheck", "/nonexistent/list.txt"], "a readable list of node ids is required"),
])
def test_shards_refuse_bad_arguments(setup, args, message):
    tmp_path, _, _, env = setup
    proc = _run(["tools/sanitize_shards.sh", *args], env, tmp_path / "bad")
    assert proc.returncode == 2 and message in proc.stderr


def _coverage_module():
    spec = importlib.util.spec_from_file_location("sanitize_coverage", ROOT / "tools" / "sanitize_coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_coverage_counts_per_file_and_keeps_collection_order(tmp_path):
    cov = _coverage_module()
    ledger = tmp_path / "ledger.txt"
    ledger.write_text("# comment\n\ntests/a.py::t[at most 128] passed\ntests/b.py::u skipped\nold.py::gone ran\n")
    covered = cov.read_ledger(ledger)
    assert covered == {"tests/a.py::t[at most 128]": "passed", "tests/b.py::u": "skipped", "old.py::gone": "ran"}
    suite = ["tests/a.py::s", "tests/a.py::t[at most 128]", "tests/b.py::u", "tests/b.py::v"]
    assert cov.coverage_table(suite, covered) == [("tests/a.py", 2, 1, 0), ("tests/b.py", 2, 1, 1)]


@pytest.mark.parametrize("line", ["tests/a.py::t", "tests/a.py::t finished", "no_node_id passed"])
def test_coverage_names_a_malformed_ledger_line(tmp_path, line):
    cov = _coverage_module()
    ledger = tmp_path / "ledger.txt"
    ledger.write_text(f"tests/a.py::ok passed\n{line}\n")
    with pytest.raises(SystemExit, match=r"ledger.txt:2: expected"):
        cov.read_ledger(ledger)


@pytest.mark.parametrize("tool", ["racecheck", "memcheck"])
def test_committed_ledger_names_only_tests_of_the_suite(tmp_path, tool):
    """Each ledger in reports/ is read back by the real tool: every line parses and names a
    test the suite still collects (a renamed test's line would claim coverage nobody has)."""
    remaining = tmp_path / "remaining.txt"
    proc = subprocess.run([sys.executable, "tools/sanitize_coverage.py", "--tool", tool,
                           "--remaining", str(remaining)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "name no test of the suite" not in proc.stdout, proc.stdout
    cov = _coverage_module()
    ledger = cov.read_ledger(ROOT / "reports" / f"{tool}-covered.txt")
    left = remaining.read_text().splitlines()
    assert not set(left) & set(ledger)
    # what is covered and what is left make up the suite (no left-over list once all is covered)
    done, total = map(int, re.search(r"^  all +(\d+) of (\d+)$", proc.stdout, re.MULTILINE).groups())
    assert total > 0 and done + len(left) == total, proc.stdout


@pytest.mark.parametrize(("tool", "switch", "term"), [
    ("racecheck", "FUSEDENC_SANITIZE_CONCURRENCY", "not eight_threads"),
    ("memcheck", "FUSEDENC_SANITIZE_CACHING", "not graph"),
])
def test_print_k_names_each_tools_exclusions_and_their_switch_lifts_them(tool, switch, term):
    def print_k(**env):
        return subprocess.run(["bash", "tools/sanitize.sh", "--print-k", tool], cwd=ROOT, check=True,
                              env=dict({k: v for k, v in os.environ.items() if k != switch}, **env),
                              capture_output=True, text=True).stdout

    assert term in print_k() and "not stress" in print_k()
    assert term not in print_k(**{switch: "1"}) and "not stress" in print_k(**{switch: "1"})
