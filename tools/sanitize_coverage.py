"""How much of the GPU test suite a compute-sanitizer tool has covered.

    python3 tools/sanitize_coverage.py --tool racecheck [--ledger FILE] [--remaining FILE]

The suite is what tools/sanitize.sh's default selection runs under the tool
(``sanitize.sh --print-k``: the design exclusions in its header), collected
here without a GPU.  The ledger (default ``reports/<tool>-covered.txt``) holds
one ``<node id> passed|skipped|ran`` line per test a sanitizer run covered, appended
from the ``sanitize-<tool>-covered.txt`` of each run.  Prints, per test file,
how many tests the ledger covers; ``--remaining`` writes the node ids it does not
cover, in collection order, for ``tools/sanitize_shards.sh``.  Ledger lines that
no longer name a collected test (a renamed or removed test) are listed: coverage
is not claimed for them.

Why a ledger: under racecheck the suite takes hours of GPU time and one device
call at most ten minutes, so coverage is built over many calls and sessions.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = ("passed", "skipped", "ran")


def suite_k(tool: str) -> str:
    """The -k expression of sanitize.sh's default selection under ``tool``."""
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "sanitize.sh"), "--print-k", tool],
        capture_output=True, text=True, check=True)
    return result.stdout.strip()


def collect(k: str) -> list[str]:
    """Node ids of the GPU tests that ``-m gpu -k k`` selects, in collection order."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "gpu", "-k", k, "tests"],
        cwd=ROOT, capture_output=True, text=True, check=False)
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    if result.returncode not in (0, 5) or not ids:
        raise SystemExit(f"collection failed (exit {result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return ids


def read_ledger(path: Path) -> dict[str, str]:
    """node id -> outcome; a malformed line is an error that names it."""
    covered: dict[str, str] = {}
    if not path.exists():
        return covered
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(None, 1)  # a node id may hold spaces: "[129-32-at most 128]"
        if len(parts) != 2 or "::" not in parts[0] or parts[1] not in OUTCOMES:
            raise SystemExit(f"{path}:{number}: expected '<node id> {'|'.join(OUTCOMES)}', got {line!r}")
        covered[parts[0]] = parts[1]
    return covered


def file_of(node_id: str) -> str:
    return node_id.split("::", 1)[0]


def coverage_table(suite: list[str], covered: dict[str, str]) -> list[tuple[str, int, int, int]]:
    """(file, tests, covered, of them skipped) per test file, in collection order."""
    totals: Counter[str] = Counter(file_of(t) for t in suite)
    done: Counter[str] = Counter(file_of(t) for t in suite if t in covered)
    skipped: Counter[str] = Counter(file_of(t) for t in suite if covered.get(t) == "skipped")
    return [(f, totals[f], done[f], skipped[f]) for f in dict.fromkeys(file_of(t) for t in suite)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", required=True, choices=("memcheck", "racecheck"))
    parser.add_argument("--ledger", type=Path, help="default: reports/<tool>-covered.txt")
    parser.add_argument("--remaining", type=Path, help="write the uncovered node ids here")
    args = parser.parse_args(argv)
    ledger = args.ledger or ROOT / "reports" / f"{args.tool}-covered.txt"

    covered = read_ledger(ledger)
    k = suite_k(args.tool)
    suite = collect(k)
    suite_set = set(suite)

    print(f"{args.tool} coverage of the GPU suite (-m gpu -k \"{k}\") by {ledger.relative_to(ROOT) if ledger.is_relative_to(ROOT) else ledger}")
    width = max(len(f) for f in {file_of(t) for t in suite})
    for name, total, done, skipped in coverage_table(suite, covered):
        note = f" ({skipped} skipped: nothing to check on this machine)" if skipped else ""
        print(f"  {name:<{width}}  {done:>4} of {total}{note}")
    remaining = [t for t in suite if t not in covered]
    print(f"  {'all':<{width}}  {len(suite) - len(remaining):>4} of {len(suite)}")
    stale = sorted(t for t in covered if t not in suite_set)
    if stale:
        print(f"{len(stale)} ledger lines name no test of the suite (renamed, removed or excluded); not counted:")
        for t in stale[:20]:
            print(f"  {t}")
    if args.remaining:
        args.remaining.write_text("".join(f"{t}\n" for t in remaining))
        print(f"{len(remaining)} uncovered tests written to {args.remaining}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
