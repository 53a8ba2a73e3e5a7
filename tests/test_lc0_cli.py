"""``python -m fusedenc.lc0``: describe (unchanged), and ``eval`` for a FEN, an EPD and a PGN file.

Runs on the CPU with a tiny synthetic net.  The printed moves and JSON lines are checked
against ``Lc0Network.evaluate`` on the same positions; bad input must exit 2 with one line
on stderr and build no network (the constructor is replaced by one that fails the test).
One test runs the module as a subprocess, as a user would.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from lc0_writer import PRESETS, write_net, write_preset

import fusedenc.lc0.__main__ as cli
from fusedenc.lc0 import Lc0Network, read_net
from fusedenc.lc0.gamefiles import read_pgn
from fusedenc.lc0.schema import InputFormat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIWIPETE = "r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R w KQkq -"
EPD = f"""# a test suite
rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq e3 bm e5; id "e4";
{KIWIPETE} id "kiwipete"; hmvc 2; fmvn 9;

8/P7/8/8/8/8/6k1/K7 w - - bm a8=Q; id "promotion";
"""
PGN = """[Event "one"]
[Result "1-0"]

1. e4 e5 2. Qh5 Nc6 {comment} 3. Bc4 Nf6 (3... g6) 4. Qxf7# 1-0

[Event "two"]
[SetUp "1"]
[FEN "8/P7/8/8/8/8/6k1/K7 w - - 0 1"]
[Result "*"]

1. a8=Q+ Kf2 2. Qa7+ *
"""


@pytest.fixture(scope="module")
def net_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny.pb.gz"
    write_preset(str(path), "tiny", seed=5)
    return str(path)


@pytest.fixture(scope="module")
def cpu_net(net_path):
    return Lc0Network(read_net(net_path), dtype=torch.float32, device="cpu")


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _close_probs(rec_moves, rec_probs, ev) -> None:
    ref = dict(zip(ev.moves, ev.probs, strict=True))
    for m, p in zip(rec_moves, rec_probs, strict=True):
        assert abs(ref[m] - p) <= 1e-5, (m, p, ref[m])
    # The written moves are the most probable ones (ties within rounding aside).
    assert min(rec_probs) >= sorted(ev.probs, reverse=True)[len(rec_probs) - 1] - 1e-5


def test_eval_fen_prints_moves_and_wdl(net_path, cpu_net, capsys):
    rc, out, err = _run(["eval", net_path, "--fen", "startpos", "--moves", "e2e4", "e7e5", "--device", "cpu",
                         "--dtype", "fp32", "--top", "4"], capsys)  # fmt: skip
    assert rc == 0, err
    [ev] = cpu_net.evaluate([("startpos", ["e2e4", "e7e5"])])
    assert "WDL" in out and "Q " in out and "moves left" in out and "after e2e4 e7e5" in out
    win, draw, loss = ev.wdl
    assert f"win {win:.1%}" in out and f"draw {draw:.1%}" in out and f"loss {loss:.1%}" in out
    printed = [(m.group(1), float(m.group(2)) / 100) for m in re.finditer(r"^\s+\d+\. (\S+)\s+([\d.]+)%$", out, re.M)]
    assert len(printed) == 4, out
    ref = dict(zip(ev.moves, ev.probs, strict=True))
    for m, p in printed:  # printed to 0.01%
        assert abs(ref[m] - p) <= 6e-5, (m, p, ref[m])
    # The top move is the net's.
    assert printed[0][0] == ev.best_move or abs(ev.probs[0] - ev.probs[1]) < 1e-4


def test_eval_fen_json(net_path, cpu_net, capsys):
    rc, out, err = _run(["eval", net_path, "--fen", KIWIPETE, "--device", "cpu", "--json", "--top", "0",
                         "--temperature", "0.5"], capsys)  # fmt: skip
    assert rc == 0, err
    rec = json.loads(out)
    [ev] = cpu_net.evaluate([KIWIPETE], temperature=0.5)
    assert len(rec["moves"]) == len(ev.moves) == 48  # --top 0: every legal move
    _close_probs(rec["moves"], rec["probs"], ev)
    assert rec["wdl"] == pytest.approx(list(ev.wdl), abs=1e-5) and rec["q"] == pytest.approx(ev.q, abs=1e-5)


def test_eval_epd_writes_json_lines(net_path, cpu_net, tmp_path, capsys):
    epd = tmp_path / "suite.epd"
    epd.write_text(EPD, encoding="utf-8")
    out_path = tmp_path / "out.jsonl"
    rc, out, err = _run(["eval", net_path, "--epd", str(epd), "--device", "cpu", "--out", str(out_path),
                         "--no-progress", "--max-batch", "2"], capsys)  # fmt: skip
    assert rc == 0, err
    lines = [json.loads(line) for line in out_path.read_text(encoding="utf-8").splitlines()]
    records, summary = lines[:-1], lines[-1]["summary"]
    assert [r["id"] for r in records] == ["e4", "kiwipete", "promotion"]
    assert [r["line"] for r in records] == [2, 3, 5]
    assert records[0]["bm"] == ["e5"] and records[1]["fen"].endswith(" w KQkq - 2 9")
    refs = cpu_net.evaluate([r["fen"] for r in records])
    for r, ev in zip(records, refs, strict=True):
        assert len(r["moves"]) == min(5, len(ev.moves)) and r["best_move"] == r["moves"][0]
        _close_probs(r["moves"], r["probs"], ev)
        assert r["wdl"] == pytest.approx(list(ev.wdl), abs=1e-5)
    assert summary["positions"] == 3 and summary["failed"] == 0 and summary["positions_per_s"] > 0
    assert summary["batches"] >= 2  # --max-batch 2
    parts = ("read_seconds", "load_seconds", "startup_seconds", "seconds")
    assert summary["command_seconds"] >= sum(summary[k] for k in parts) - 0.01, summary
    last = err.strip().splitlines()[-1]
    assert "positions/s" in last and "loading the net" in last and "the whole command" in last, last


def test_eval_pgn_every_position_of_every_game(net_path, cpu_net, tmp_path, capsys):
    pgn = tmp_path / "games.pgn"
    pgn.write_text(PGN, encoding="utf-8")
    rc, out, err = _run(["eval", net_path, "--pgn", str(pgn), "--device", "cpu", "--no-progress", "--top", "3"], capsys)
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    records, summary = lines[:-1], lines[-1]["summary"]
    games = list(read_pgn(str(pgn)))
    # Game 1 ends in mate (its final position has no moves: not evaluated); game 2 does not.
    expected = [(g.number, ply) for g in games for ply in range(len(g.moves) + (g.number == 2))]
    assert [(r["game"], r["ply"]) for r in records] == expected
    assert [r["played"] for r in records] == games[0].moves + games[1].moves + [None]
    histories = [(g.start_fen, g.moves[:ply]) for g in games for ply in range(len(g.moves) + (g.number == 2))]
    refs = cpu_net.evaluate(histories)  # the same positions given as (start, moves): the same history
    for r, ev in zip(records, refs, strict=True):
        _close_probs(r["moves"], r["probs"], ev)
        assert r["q"] == pytest.approx(ev.q, abs=1e-5)
    assert summary["positions"] == len(expected) and summary["positions_per_s"] > 0


def _no_network(monkeypatch):
    """Bad input must be refused before any network is built (before any GPU work)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a network was built for bad input")

    monkeypatch.setattr(cli, "Lc0Network", refuse)
    import fusedenc.lc0.evaluator as evaluator

    monkeypatch.setattr(evaluator, "Lc0Network", refuse)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--fen", "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP w KQkq - 0 1"], ["--fen", "ranks"]),
        (["--fen", "startpos", "--moves", "e2e4", "e2e4"], ["e2e4", "illegal"]),
        (["--fen", "startpos", "--moves", "e9e4"], ["e9e4"]),
        (["--fen", "4k3/8/8/8/8/8/8/8 w - - 0 1"], ["kings"]),
        (["--epd", "{bad_epd}"], ["line 3"]),
        (["--epd", "{bad_epd_fen}"], ["line 2", "kings"]),
        (["--pgn", "{bad_pgn}"], ["game 2", "'Nf5'"]),
        (["--epd", "/nonexistent/suite.epd"], ["cannot read", "/nonexistent/suite.epd"]),
        (["--pgn", "/nonexistent/games.pgn"], ["cannot read"]),
        (["--epd", "{good_epd}", "--out", "/nonexistent/out.jsonl"], ["--out", "no folder /nonexistent"]),
        (["--epd", "{good_epd}", "--out", "{good_epd_dir}"], ["--out", "is a folder"]),
    ],
)
def test_bad_input_exits_2(net_path, tmp_path, monkeypatch, capsys, args, words):
    files = {
        "bad_epd": "startpos\n".replace("startpos", KIWIPETE) + "\n8/8/8 w - -\n",
        "bad_epd_fen": KIWIPETE + "\n8/8/8/8/8/8/8/8 w - -\n",
        "bad_pgn": "1. e4 e5 *\n\n1. e4 e5 2. Nf3 Nc6 3. Nf5 *\n",
        "good_epd": KIWIPETE + "\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "good_epd_dir").mkdir()
    args = [a.format(**{k: str(tmp_path / k) for k in (*files, "good_epd_dir")}) for a in args]
    _no_network(monkeypatch)

    def not_yet(path):  # the input is checked before the net file is read (seconds on a CPU)
        raise AssertionError(f"the net {path} was read before the input was checked")

    monkeypatch.setattr(cli, "_load", not_yet)
    rc, out, err = _run(["eval", net_path, *args, "--device", "cpu"], capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err


def test_bad_net_exits_2(tmp_path, monkeypatch, capsys):
    _no_network(monkeypatch)
    junk = tmp_path / "junk.pb.gz"
    junk.write_bytes(b"not a network")
    unknown = tmp_path / "unknown-format.pb.gz"
    write_net(str(unknown), **{**PRESETS["tiny"], "input_format": InputFormat.UNKNOWN})
    for path, words in ((str(tmp_path / "missing.pb.gz"), ["cannot read"]), (str(junk), ["cannot read"]),
                        (str(unknown), ["input format", "UNKNOWN"])):  # fmt: skip
        rc, out, err = _run(["eval", path, "--fen", "startpos", "--device", "cpu"], capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        for w in words:
            assert w in err, err


def test_no_gpu_exits_2(net_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _no_network(monkeypatch)
    rc, _, err = _run(["eval", net_path, "--fen", "startpos", "--device", "cuda"], capsys)
    assert rc == 2 and "no GPU" in err


def test_describe_unchanged(net_path, capsys):
    for argv in ([net_path, "--no-bench"], ["describe", net_path, "--no-bench"]):
        rc, out, err = _run(argv, capsys)
        assert rc == 0, err
        assert json.loads(out)["layers"] == PRESETS["tiny"]["layers"]
    rc, _, err = _run(["/nonexistent.pb.gz", "--no-bench"], capsys)
    assert rc == 2 and "cannot read" in err


def test_a_position_failing_in_a_chunk_is_written_as_its_error(net_path, cpu_net, tmp_path, monkeypatch, capsys):
    """The file is checked before any evaluation, so a refused position is not expected there;
    should one be refused all the same (checks skipped here), its chunk is evaluated again a
    position at a time: that position's line is its error, every other line as before, in
    order, and the command exits 1."""
    import fusedenc.lc0.evalinputs as evalinputs

    monkeypatch.setattr(evalinputs, "check_positions", lambda *a, **k: None)
    good = [KIWIPETE + " 0 1", "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq -", "8/P7/8/8/8/8/6k1/K7 w - -"]
    lines = [good[0], "8/8/8/8/8/8/8/8 w - -", good[1], good[2], good[0], good[1], good[2]]
    epd = tmp_path / "mixed.epd"
    epd.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out_path = tmp_path / "out.jsonl"
    rc, _, err = _run(["eval", net_path, "--epd", str(epd), "--device", "cpu", "--out", str(out_path), "--no-progress",
                       "--max-batch", "3"], capsys)  # fmt: skip
    assert rc == 1, err
    records = [json.loads(line) for line in out_path.read_text(encoding="utf-8").splitlines()]
    summary = records.pop()["summary"]
    assert [r["index"] for r in records] == list(range(7)) and [r["line"] for r in records] == list(range(1, 8))
    assert "error" in records[1] and "kings" in records[1]["error"] and "moves" not in records[1]
    refs = cpu_net.evaluate([r["fen"] for i, r in enumerate(records) if i != 1])
    for r, ev in zip(records[:1] + records[2:], refs, strict=True):
        assert "error" not in r and len(r["moves"]) == min(5, len(ev.moves))
        _close_probs(r["moves"], r["probs"], ev)
    assert summary["positions"] == 6 and summary["failed"] == 1


def test_subprocess_epd_to_stdout(net_path, tmp_path):
    epd = tmp_path / "suite.epd"
    epd.write_text(EPD, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "fusedenc.lc0", "eval", net_path, "--epd", str(epd), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in io.StringIO(proc.stdout)]
    assert len(lines) == 4 and "summary" in lines[-1] and lines[-1]["summary"]["positions_per_s"] > 0
    assert "positions/s" in proc.stderr


@pytest.mark.parametrize("top", [None, 3, 1])
def test_json_lines_equal_json_dumps_of_each_record(net_path, cpu_net, top):
    """The CLI writes a batch's lines from its arrays (``evaluate.json_lines``); they must be
    the very text ``json.dumps`` makes of each evaluation's dict, for every head layout,
    positions without legal moves, batches split across chunks, and a stand-alone
    ``Evaluation``."""
    from fusedenc.lc0.evaluate import Evaluation, json_lines

    mated = "rnb1kbnr/pppp1ppp/8/4p3/6Pq/5P2/PPPPP2P/RNBQKBNR w KQkq - 1 3"
    positions = ["startpos", mated, ("startpos", ["e2e4", "e7e5", "g1f3"]),
                 "r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R w KQkq - 0 1", "8/P7/8/8/8/8/6k1/K7 w - - 0 1"]
    evals = cpu_net.evaluate(positions) + cpu_net.evaluate(positions[:2])  # two batches
    evals.append(Evaluation(["e2e4", "d2d4"], [0.75, 0.25], q=0.125, wdl=[0.5, 0.125, 0.375], moves_left=33.3))
    ids = [{"index": i, "fen": "x\"y" if i == 1 else f"f{i}", **({"id": "é"} if i == 2 else {})} for i in range(len(evals))]
    prefixes = [json.dumps(r)[:-1] for r in ids]
    got = json_lines(evals, prefixes, top)
    want = [{**r, "best_move": e.best_move, **e.to_dict(top=top)} for r, e in zip(ids, evals, strict=True)]
    parsed = [json.loads(line) for line in got]
    assert parsed == want  # the same numbers (round(x, 6) is the number "%.6f" writes)
    assert [list(p) for p in parsed] == [list(w) for w in want]  # fields in the same order
    assert parsed[1]["moves"] == [] and parsed[1]["best_move"] is None  # mate
    # Split inside a batch: the same text.
    assert json_lines(evals[:2], prefixes[:2], top) + json_lines(evals[2:], prefixes[2:], top) == got


def test_json_lines_write_non_finite_heads_as_json_dumps_does(cpu_net):
    from fusedenc.lc0.evaluate import json_lines

    [ev] = cpu_net.evaluate(["startpos"])
    ev._heads.q[0] = float("nan")
    [line] = json_lines([ev], ['{"index": 7'], 2)
    assert line == json.dumps({"index": 7, "best_move": ev.best_move, **ev.to_dict(top=2)}) and "NaN" in line


def test_json_lines_of_a_net_without_wdl_or_moves_left(tmp_path):
    from fusedenc.lc0.evaluate import json_lines

    path = tmp_path / "value.pb.gz"
    write_preset(str(path), "tiny", wdl=False, moves_left=False, seed=2)
    net = Lc0Network(read_net(str(path)), dtype=torch.float32, device="cpu")
    evals = net.evaluate(["startpos", ("startpos", ["d2d4"])])
    got = [json.loads(line) for line in json_lines(evals, ['{"index": 0', "{"], 2)]
    assert got == [{"index": 0, "best_move": evals[0].best_move, **evals[0].to_dict(top=2)},
                   {"best_move": evals[1].best_move, **evals[1].to_dict(top=2)}]
    assert "wdl" not in got[0] and "moves_left" not in got[0]
