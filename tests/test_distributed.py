"""fusedenc.distributed on the CPU: the actors' classes alone (their rows equal the
single-process results; a bad row gets an error and the block goes on), then the jobs on a
local Ray cluster and on a two-node cluster on this machine (equal to the single-process
results, every id exactly once, also when an actor's process is killed mid-job)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from lc0_writer import write_preset

import fusedenc.embed
from fusedenc.distributed.actors import Embedder, FrameEvaluator, PositionEvaluator
from fusedenc.lc0 import load_network

st_helpers = pytest.importorskip("st_helpers")
TOL = dict(rtol=1e-4, atol=1e-5)
FENS = ["startpos", "r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R w KQkq - 0 1",
        "8/P7/8/8/8/8/6k1/K7 w - - 0 1", "8/8/8 w - -", "4k3/8/8/8/8/8/8/4K3 w - - 0 1"]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    return str(st_helpers.hf_model_dir(tmp_path_factory.mktemp("models"), "bert", seed=9))


@pytest.fixture(scope="module")
def net_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("net") / "tiny.pb.gz"
    write_preset(str(path), "tiny", seed=4)
    return str(path)


def _texts(n: int) -> list[str]:
    pool = st_helpers.sentences()
    return [pool[(i * 37) % len(pool)] for i in range(n)]


def test_the_embedder_gives_the_single_process_embeddings_and_errors_for_bad_rows(folder):
    texts = _texts(30)
    want, _ = fusedenc.embed.encode(fusedenc.embed.load_model(folder, device="cpu"), texts)
    block = {"id": np.arange(33), "text": np.array(texts[:10] + ["", "   "] + texts[10:20] + [None] + texts[20:], dtype=object)}
    out = Embedder(folder, device="cpu", max_batch_tokens=200)(block)
    good = [i for i in range(33) if i not in (10, 11, 22)]
    np.testing.assert_allclose(out["embedding"][good], want, **TOL)
    assert np.isnan(out["embedding"][[10, 11, 22]]).all()
    assert [out["error"][i] for i in (10, 11, 22)] == ["empty text", "empty text", "not a text: NoneType"]
    assert all(out["error"][i] is None for i in good) and out["id"].tolist() == list(range(33))
    with pytest.raises(KeyError, match="no column 'body'"):
        Embedder(folder, device="cpu", text_column="body")(block)


def test_the_embedder_refuses_only_the_long_texts_without_truncation(folder):
    texts = _texts(4) + ["word " * 400]
    out = Embedder(folder, device="cpu", truncate=False)({"text": np.array(texts, dtype=object)})
    assert out["error"][4] is not None and "more than the model's" in out["error"][4]
    assert all(e is None for e in out["error"][:4]) and np.isfinite(out["embedding"][:4]).all()


def test_the_position_evaluator_gives_the_nets_evaluations(net_path):
    net = load_network(net_path, device="cpu", dtype=torch.float32)
    moves = np.array(["e2e4 e7e5", "", None, None, "e1e2"], dtype=object)
    out = PositionEvaluator(net_path, device="cpu", moves_column="moves")({"fen": np.array(FENS, dtype=object),
                                                                          "moves": moves})  # fmt: skip
    want = net.evaluate([("startpos", ["e2e4", "e7e5"]), FENS[1], FENS[2], (FENS[4], ["e1e2"])])
    for i, ev in zip((0, 1, 2, 4), want):
        assert out["error"][i] is None and out["best_move"][i] == ev.best_move and out["moves"][i] == ev.moves
        np.testing.assert_allclose(out["probs"][i], ev.probs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["wdl"][i], ev.wdl, rtol=1e-5, atol=1e-6)
        assert abs(out["q"][i] - ev.q) < 1e-5
    assert out["best_move"][3] is None and "ranks" in out["error"][3] and np.isnan(out["wdl"][3]).all()


def _frames_file(tmp_path, net_path, positions, name="games.gz"):
    from fusedenc.lc0 import trainingdata

    net = load_network(net_path, device="cpu", dtype=torch.float32)
    path = tmp_path / name
    trainingdata.write_frames(path, positions, net.input_format)
    return net, path


TRAINING_POSITIONS = ["startpos", ("startpos", ["e2e4", "e7e5", "g1f3"]), FENS[1], FENS[2], FENS[4]]


def test_the_frame_evaluator_relabels_frames_with_the_net(net_path, tmp_path):
    """Frames of known positions: the net's policy (softmax over the frame's legal moves), WDL
    and moves left equal the net's on ``encode_planes`` of those positions; the frame's own
    policy and result come back beside them."""
    from fusedenc.lc0 import encode_planes, trainingdata

    net, path = _frames_file(tmp_path, net_path, TRAINING_POSITIONS)
    chunk = trainingdata.read_frames(path)
    out = FrameEvaluator(net_path, device="cpu")({"frame": np.array([f.tobytes() for f in chunk.frames], dtype=object)})
    heads = net(encode_planes(TRAINING_POSITIONS, net.input_format).to(torch.float32))
    legal = chunk.frames["probabilities"] >= 0
    want = torch.softmax(heads["policy"].masked_fill(~torch.from_numpy(legal), float("-inf")), dim=1).numpy()
    np.testing.assert_allclose(out["net_policy"], want, rtol=1e-5, atol=1e-7)
    assert (out["net_policy"][~legal] == 0).all() and np.allclose(out["net_policy"].sum(1), 1)
    np.testing.assert_allclose(out["net_wdl"], heads["wdl"].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(out["frame_policy"], trainingdata.frame_targets(chunk.frames)["probabilities"])
    assert out["frame_result_wdl"].shape == (len(TRAINING_POSITIONS), 3)


def test_the_frame_evaluator_takes_a_block_of_v6_and_v7_frames(net_path, tmp_path):
    """A dataset of V6 and V7 files gives blocks holding both: each frame gets the values it
    gets in a block of its own version, in the block's order; a frame of no known size is refused."""
    from fusedenc.lc0 import trainingdata

    net = load_network(net_path, device="cpu", dtype=torch.float32)
    v6 = trainingdata.write_frames(tmp_path / "a.gz", TRAINING_POSITIONS, net.input_format, version=6)
    v7 = trainingdata.write_frames(tmp_path / "b.gz", TRAINING_POSITIONS[::-1], net.input_format, version=7)
    evaluator = FrameEvaluator(net_path, device="cpu")
    mixed = [v6[0], v7[0], v7[1], v6[1], v6[2]]
    out = evaluator({"frame": np.array([f.tobytes() for f in mixed], dtype=object)})
    alone6 = evaluator({"frame": np.array([f.tobytes() for f in v6[:3]], dtype=object)})
    alone7 = evaluator({"frame": np.array([f.tobytes() for f in v7[:2]], dtype=object)})
    for name in ("net_policy", "net_wdl", "frame_policy", "frame_result_wdl", "frame_played_idx"):
        want = np.stack([alone6[name][0], alone7[name][0], alone7[name][1], alone6[name][1], alone6[name][2]])
        np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-7, err_msg=name)
    # a frame of no known size, and a row training_frames could not read: errors, NaN, the rest kept
    block = {"frame": np.array([v6[0].tobytes()[:-4], b"", v6[1].tobytes()], dtype=object),
             "error": np.array([None, "cannot read x.gz", None], dtype=object)}  # fmt: skip
    out = evaluator(block)
    assert "bytes" in out["error"][0] and out["error"][1] == "cannot read x.gz" and out["error"][2] is None
    assert np.isnan(out["net_policy"][:2]).all()
    np.testing.assert_allclose(out["net_policy"][2], alone6["net_policy"][1], rtol=1e-5, atol=1e-7)
    failed = evaluator({"frame": np.array([b""], dtype=object), "error": np.array(["x"], dtype=object)})
    assert set(failed) >= set(out) and failed["net_policy"].shape == (1, out["net_policy"].shape[1])


# ---------------------------------------------------------------- on Ray ----


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "fusedenc[ray]")')
    tests = os.path.dirname(os.path.abspath(__file__))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": tests}})  # fmt: skip
    yield ray
    ray.shutdown()


def _by_id(rows: list[dict]) -> dict:
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a row appears twice"
    return {r["id"]: r for r in rows}


@pytest.mark.slow
def test_embed_and_evaluate_on_a_local_cluster(ray_local, folder, net_path):
    from fusedenc import distributed

    texts = _texts(300)
    want, _ = fusedenc.embed.encode(fusedenc.embed.load_model(folder, device="cpu"), texts)
    ds = ray_local.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)] + [{"id": 300, "text": ""}])
    rows = _by_id(distributed.embed(ds, folder, device="cpu", block_rows=64).take_all())
    assert sorted(rows) == list(range(301))
    np.testing.assert_allclose(np.stack([rows[i]["embedding"] for i in range(300)]), want, **TOL)
    assert rows[300]["error"] == "empty text" and np.isnan(rows[300]["embedding"]).all()

    ds = ray_local.data.from_items([{"id": i, "fen": f} for i, f in enumerate(FENS * 20)])
    rows = _by_id(distributed.evaluate_positions(ds, net_path, device="cpu", block_rows=16).take_all())
    net = load_network(net_path, device="cpu", dtype=torch.float32)
    good = net.evaluate([f for f in FENS if f != FENS[3]])
    for i in range(100):
        k = i % 5
        if k == 3:
            assert rows[i]["error"] and rows[i]["best_move"] is None
        else:
            assert rows[i]["error"] is None and rows[i]["best_move"] == good[k - (k > 3)].best_move


def test_ray_missing_is_one_line(monkeypatch):
    import builtins

    from fusedenc import distributed

    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ImportError, match=r'pip install "fusedenc\[ray\]"'):
        distributed.embed(None, "minilm")


def test_the_embed_command_refuses_a_block_of_no_rows_before_ray_starts(folder, tmp_path, capsys, monkeypatch):
    """``--block-rows 0``: a clear message and status 2, no cluster started, no file written."""
    ray = pytest.importorskip("ray")
    from fusedenc.distributed import cli

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster started"))
    src = tmp_path / "texts.txt"
    src.write_text("one\ntwo\n", encoding="utf-8")
    rc = cli.embed_main([folder, str(src), "-o", str(tmp_path / "e.npy"), "--ray", "local", "--block-rows", "0"])
    assert rc == 2 and "--block-rows must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "e.npy").exists()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])  # the field after the state


def _map_worker_pids() -> list[int]:
    """Ray Data's map actors (``ray::_MapWorker``) of the cluster this process started: those
    whose ancestors include this process (a cluster of another process on the machine is not
    ours to kill)."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"MapWorker" not in f.read():
                    continue
            pid = int(entry)
            while pid > 1 and pid != me:
                pid = _parent(pid)
        except (OSError, ValueError, IndexError):
            continue
        if pid == me:
            pids.append(int(entry))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the actor's process in /proc (Linux)")
def test_a_killed_actor_loses_no_row_and_repeats_none(ray_local, folder):
    """An actor's process killed (SIGKILL) while the job runs: Ray restarts it and runs its
    block again; the output holds every id exactly once, each with its embedding."""
    from fusedenc import distributed

    texts = _texts(1500)
    ds = ray_local.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
    result = {}

    def run() -> None:
        result["rows"] = distributed.embed(ds, folder, device="cpu", block_rows=50).take_all()

    job = threading.Thread(target=run)
    job.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and time.monotonic() < deadline and job.is_alive():
        pids = _map_worker_pids()
        if pids:
            time.sleep(2)  # well inside the job: some blocks done, others held
            try:
                os.kill(pids[0], signal.SIGKILL)
                killed = pids[0]
            except ProcessLookupError:  # that actor ended meanwhile: look again
                pass
        time.sleep(0.2)
    job.join(timeout=600)
    assert killed is not None, "the job ended before an actor could be killed: make it longer"
    rows = _by_id(result["rows"])
    assert sorted(rows) == list(range(1500))
    assert all(r["error"] is None and np.isfinite(r["embedding"]).all() for r in rows.values())


@pytest.mark.slow
def test_relabel_training_frames_on_a_cluster(ray_local, net_path, tmp_path):
    """``training_frames`` of a .gz and a .tar of two .gz files, relabelled on the cluster:
    every frame once, with the same values as the actor class alone."""
    import tarfile

    from fusedenc import distributed

    _, one = _frames_file(tmp_path, net_path, TRAINING_POSITIONS, "a.gz")
    _, two = _frames_file(tmp_path, net_path, TRAINING_POSITIONS[::-1], "b.gz")
    tar = tmp_path / "chunk.tar"
    with tarfile.open(tar, "w") as t:
        t.add(one, arcname="a.gz")
        t.add(two, arcname="b.gz")
    broken = tmp_path / "broken.gz"
    broken.write_bytes(one.read_bytes()[:-100])  # truncated: its one row says so, the job goes on
    rows = distributed.relabel(distributed.training_frames([one, tar, broken]), net_path, device="cpu",
                               block_rows=3).take_all()  # fmt: skip
    failed = [r for r in rows if r["error"] is not None]
    assert len(failed) == 1 and failed[0]["source"] == str(broken) and failed[0]["index"] == -1, [r["error"] for r in failed][:3]
    rows = [r for r in rows if r["error"] is None]
    assert len(rows) == 3 * len(TRAINING_POSITIONS)
    keys = sorted((r["source"], r["index"]) for r in rows)
    assert len(set(keys)) == len(keys)
    alone = FrameEvaluator(net_path, device="cpu")
    for r in rows:
        want = alone({"frame": np.array([r["frame"]], dtype=object)})
        np.testing.assert_allclose(r["net_policy"], want["net_policy"][0], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(r["net_wdl"], want["net_wdl"][0], rtol=1e-5, atol=1e-7)
