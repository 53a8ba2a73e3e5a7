"""fusedenc.distributed on a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
a head and a worker node, one CPU each, so the job's two actors sit on different nodes): the
embeddings equal the single-process ones, every id exactly once."""

from __future__ import annotations

import os

import numpy as np
import torch
import pytest

import fusedenc.embed

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "fusedenc[ray]")')
st_helpers = pytest.importorskip("st_helpers")


@pytest.mark.slow
def test_embed_on_two_nodes_equals_one_process(tmp_path):
    from ray.cluster_utils import Cluster

    from fusedenc import distributed

    folder = str(st_helpers.hf_model_dir(tmp_path, "bert", seed=9))
    pool = st_helpers.sentences()
    texts = [pool[(i * 53) % len(pool)] for i in range(400)]
    want, _ = fusedenc.embed.encode(fusedenc.embed.load_model(folder, device="cpu"), texts)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}})  # fmt: skip
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
        rows = distributed.embed(ds, folder, device="cpu", concurrency=2, block_rows=40).take_all()
    finally:
        ray.shutdown()
        cluster.shutdown()
    ids = [r["id"] for r in rows]
    assert sorted(ids) == list(range(400))
    got = np.stack([r["embedding"] for r in sorted(rows, key=lambda r: r["id"])])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _command(*args: str) -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "fusedenc", "embed", *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rows/s (the whole command)" in run.stderr.strip().splitlines()[-1], run.stderr[-1000:]


@pytest.mark.slow
def test_the_embed_command_with_ray_writes_what_it_writes_without(tmp_path, capsys):
    """``python -m fusedenc embed ... --ray local``: a text file to ``.npy`` equals the
    single-process command's file; a Parquet directory to a directory keeps every row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fusedenc.__main__ import main

    folder = str(st_helpers.hf_model_dir(tmp_path, "bert", seed=9))
    pool = st_helpers.sentences()
    texts = [pool[(i * 31) % len(pool)] for i in range(120)]
    src = tmp_path / "c.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main(["embed", folder, str(src), "-o", str(tmp_path / "one.npy"), "--no-progress", "--device", "cpu"]) == 0
    # an output file with no folder to go in: refused before a cluster starts
    assert main(["embed", folder, str(src), "-o", str(tmp_path / "nodir" / "x.npy"), "--ray", "local"]) == 2
    assert "no folder" in capsys.readouterr().err
    # --ray runs in a process of its own, as a user runs it (each starts and stops its local cluster)
    _command(folder, str(src), "-o", str(tmp_path / "ray.npy"), "--device", "cpu", "--ray", "local", "--block-rows", "32")
    np.testing.assert_allclose(np.load(tmp_path / "ray.npy"), np.load(tmp_path / "one.npy"), rtol=1e-4, atol=1e-5)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"doc": list(range(120)), "body": texts}), tmp_path / "in" / "part-0.parquet")
    _command(folder, str(tmp_path / "in"), "-o", str(tmp_path / "out"), "--field", "body", "--device", "cpu",
             "--ray", "local")
    table = pq.read_table(tmp_path / "out")
    assert sorted(table.column("doc").to_pylist()) == list(range(120))
    by_doc = dict(zip(table.column("doc").to_pylist(), table.column("embedding").to_pylist()))
    np.testing.assert_allclose(np.array([by_doc[i] for i in range(120)], dtype=np.float32), np.load(tmp_path / "one.npy"),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.slow
def test_lc0_eval_with_ray_writes_what_it_writes_without(tmp_path):
    """``python -m fusedenc.lc0 eval NET --pgn FILE --ray local``: the same JSON lines (every
    position of every game, in order, with their histories) as the single-machine command."""
    import json
    import subprocess
    import sys

    from lc0_writer import write_preset

    net = tmp_path / "tiny.pb.gz"
    write_preset(str(net), "tiny", seed=8)
    pgn = tmp_path / "games.pgn"
    pgn.write_text('[Event "a"]\n\n1. e4 e5 2. Nf3 Nc6 3. Bb5 a6 *\n\n[Event "b"]\n\n1. d4 d5 2. c4 e6 *\n', encoding="utf-8")

    def run(*extra: str) -> list[dict]:
        out = tmp_path / f"out{len(extra)}.jsonl"
        cmd = [sys.executable, "-m", "fusedenc.lc0", "eval", str(net), "--pgn", str(pgn), "--device", "cpu",
               "--out", str(out), "--no-progress", "--top", "0", *extra]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in out.read_text().splitlines()][:-1]

    local, on_ray = run(), run("--ray", "local", "--block-rows", "4")
    assert len(local) == len(on_ray) == 12
    for a, b in zip(local, on_ray, strict=True):
        assert (a["game"], a["ply"], a["fen"], a["best_move"], a["moves"]) == (b["game"], b["ply"], b["fen"],
                                                                               b["best_move"], b["moves"])  # fmt: skip
        np.testing.assert_allclose(b["probs"], a["probs"], atol=2e-6)
        np.testing.assert_allclose(b["wdl"], a["wdl"], atol=2e-6)


def _lc0_eval(net, *args: str):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "fusedenc.lc0", "eval", str(net), "--device", "cpu", "--top", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_lc0_eval_reads_parquet_positions_and_training_frames_on_ray(tmp_path):
    """``--parquet DIR`` (FENs and moves, an illegal FEN among them) and ``--frames FILE`` on
    ``--ray local``, each written by the cluster as a Parquet directory: every input row once,
    the net's moves as the single-machine evaluation gives them, the bad row an error."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from lc0_writer import write_preset

    from fusedenc import lc0
    from fusedenc.lc0 import trainingdata

    net = tmp_path / "tiny.pb.gz"
    write_preset(str(net), "tiny", seed=9)
    fens = ["startpos", "r1bqkbnr/pppp1ppp/2n5/4p3/4P3/5N2/PPPP1PPP/RNBQKB1R w KQkq - 2 3", "not a fen", "startpos"]
    moves = ["", "", "", "e2e4 e7e5"]
    src = tmp_path / "positions"
    src.mkdir()
    pq.write_table(pa.table({"key": [10, 11, 12, 13], "fen": fens, "played": moves}), src / "part-0.parquet")
    out = tmp_path / "evaluated"
    done = _lc0_eval(net, "--parquet", str(src), "--moves-column", "played", "--out", str(out), "--ray", "local",
                     "--block-rows", "2")  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]  # one row failed
    assert "1 rows failed" in done.stderr
    rows = {r["key"]: r for r in pq.read_table(out).to_pylist()}
    assert sorted(rows) == [10, 11, 12, 13]
    assert rows[12]["error"] and rows[12]["best_move"] is None
    net_cpu = lc0.load_network(str(net), device="cpu", dtype=torch.float32)
    want = net_cpu.evaluate([fens[0], fens[1], ("startpos", ["e2e4", "e7e5"])])
    for key, ev in zip((10, 11, 13), want):
        assert rows[key]["error"] is None and rows[key]["best_move"] == ev.best_move

    frames = tmp_path / "games.gz"
    trainingdata.write_frames(frames, ["startpos", fens[1], ("startpos", ["d2d4"])], net_cpu.input_format)
    relabelled = tmp_path / "relabelled"
    done = _lc0_eval(net, "--frames", str(frames), "--out", str(relabelled), "--ray", "local")
    assert done.returncode == 0, done.stderr[-3000:]
    table = pq.read_table(relabelled).to_pylist()
    assert sorted(r["index"] for r in table) == [0, 1, 2]
    for r in table:
        policy = np.asarray(r["net_policy"])
        assert abs(policy.sum() - 1) < 1e-5 and (policy >= 0).all()


def test_lc0_eval_refuses_cluster_inputs_it_cannot_take(tmp_path):
    """Before any cluster starts: --parquet or --frames without --ray, or without a directory
    to write; an output file with no folder to go in; a missing frames file or net; each one
    line, exit 2."""
    from lc0_writer import write_preset

    net = tmp_path / "tiny.pb.gz"
    write_preset(str(net), "tiny", seed=9)
    (tmp_path / "dir").mkdir()
    epd = tmp_path / "one.epd"
    epd.write_text("rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1\n", encoding="utf-8")
    cases = {
        ("--parquet", str(tmp_path / "dir"), "--out", str(tmp_path / "o")): "add --ray",
        ("--parquet", str(tmp_path / "dir"), "--out", str(tmp_path / "o.jsonl"), "--ray", "local"): "--out DIR",
        ("--frames", str(tmp_path / "missing.gz"), "--out", str(tmp_path / "o"), "--ray", "local"): "no such file",
        ("--parquet", str(tmp_path / "nodir"), "--out", str(tmp_path / "o"), "--ray", "local"): "not a directory",
        ("--epd", str(epd), "--out", str(tmp_path / "nodir" / "o.jsonl"), "--ray", "local"): "no folder",
    }
    for args, message in cases.items():
        done = _lc0_eval(net, *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr[-2000:])
    done = _lc0_eval(tmp_path / "nonet.pb.gz", "--frames", str(net), "--out", str(tmp_path / "o"), "--ray", "local")
    assert done.returncode == 2 and "no such net file" in done.stderr, done.stderr[-2000:]
