"""fusedenc.lc0.evaluator.Evaluator: batching many callers' positions onto the network.

The oracle is ``Lc0Network.evaluate`` on the same positions, one call for the whole list:
on the CPU in fp32 the Evaluator's batches (other sizes, other groupings, the planes
expanded from the same encoding) must give the same moves with the same probabilities,
WDL, Q and moves left up to float32 rounding (the CPU GEMMs round differently at another
batch size: ~1e-8 seen).  On a GPU, fp16 and the graph runner's buckets (other GEMM
shapes) make the tolerance that of fp16.
"""

from __future__ import annotations

import random
import sys
import threading
from concurrent.futures import CancelledError

import numpy as np
import pytest
import torch
from lc0_writer import write_preset

from fusedenc.lc0 import Lc0Network, read_net
from fusedenc.lc0.encoding import encode_masks, expand_planes
from fusedenc.lc0.evaluator import Evaluator
from fusedenc.lc0.positions import Position
from fusedenc.lc0.schema import InputFormat

KIWIPETE = "r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R w KQkq - 0 1"
MATED = "rnb1kbnr/pppp1ppp/8/4p3/6Pq/5P2/PPPPP2P/RNBQKBNR w KQkq - 1 3"  # fool's mate: no legal moves


def _positions(n: int, seed: int) -> list:
    """``n`` varied positions: FENs, (fen, moves) pairs with histories, Position objects."""
    rng = random.Random(seed)
    base = ["startpos", KIWIPETE, MATED, "8/P7/8/8/8/8/6k1/K7 w - - 0 1", "4k3/8/8/3pP3/8/8/8/4K3 w - d6 0 1"]
    out: list = []
    while len(out) < n:
        start = rng.choice(base)
        pos = Position.from_fen(start)
        moves = []
        for _ in range(rng.randrange(0, 10)):
            legal = pos.legal_moves()
            if not legal:
                break
            m = rng.choice(legal)
            moves.append(m)
            pos = pos.push(m)
        kind = rng.randrange(3)
        out.append(pos if kind == 0 else (start, moves) if kind == 1 or moves else start)
    return out


@pytest.fixture(scope="module")
def net_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("evaluator") / "tiny.pb.gz"
    write_preset(str(path), "tiny", seed=3)
    return read_net(str(path))


@pytest.fixture(scope="module")
def cpu_net(net_file):
    return Lc0Network(net_file, dtype=torch.float32, device="cpu")


def _same(a, b, atol: float = 1e-6) -> None:
    """The same evaluation up to float32 rounding: the same moves, each with its probability."""
    assert sorted(a.moves) == sorted(b.moves) and len(a.moves) == len(set(a.moves))
    pa, pb = dict(zip(a.moves, a.probs, strict=True)), dict(zip(b.moves, b.probs, strict=True))
    assert max((abs(float(pa[m]) - float(pb[m])) for m in pa), default=0.0) <= atol
    assert list(a.probs) == sorted(a.probs, reverse=True)
    np.testing.assert_allclose(a.wdl, b.wdl, rtol=0, atol=atol)
    assert abs(a.q - b.q) <= 2 * atol and abs(a.moves_left - b.moves_left) <= 1e-4


def test_matches_net_evaluate(net_file, cpu_net):
    positions = _positions(70, seed=1)
    ref = cpu_net.evaluate(positions)
    with Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=16, max_wait_ms=0) as ev:
        got = ev.evaluate(positions)
        stats = ev.stats()
    assert len(got) == len(ref) == 70
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        try:
            _same(a, b)
        except AssertionError as exc:
            raise AssertionError(f"position {i} ({positions[i]!r}): {exc}") from None
    assert any(not e.moves for e in got)  # the mated position: no moves, still a value
    assert stats["positions"] == 70 and stats["failed"] == 0
    assert stats["batches"] >= 5 and stats["mean_batch"] <= 16  # max_batch 16: at least ceil(70/16) batches
    assert stats["devices"]["cpu"]["positions"] == 70
    seconds = stats["devices"]["cpu"]["seconds"]
    assert set(seconds) == {"slot_wait", "queue_wait", "host_wait", "launch", "gpu_wait", "decode"}
    assert seconds["launch"] > 0
    assert all(v >= 0 for v in seconds.values())
    _check_trips(stats["devices"]["cpu"]["trip_ms"], stats["batches"])


def _check_trips(trip: dict, batches: int) -> None:
    """Every batch's trip was stamped at each hand-over, in order (a hop of negative length
    would be stamps out of order, or clocks that differ between processes)."""
    from fusedenc.lc0.evalstats import HOPS

    assert set(trip) == {*HOPS, "trip", "batches"} and trip["batches"] == batches
    assert all(trip[h] >= 0 for h in HOPS), trip
    assert trip["worker"] > 0 and trip["launch"] > 0 and trip["trip"] >= max(trip[h] for h in HOPS), trip


def test_given_network_and_temperature(cpu_net):
    positions = _positions(20, seed=2)
    ref = cpu_net.evaluate(positions, temperature=2.5)
    with Evaluator(cpu_net, temperature=2.5, max_batch=8) as ev:
        assert ev.devices == [torch.device("cpu")] and ev.dtype == torch.float32
        got = ev.evaluate(positions)
    for a, b in zip(got, ref, strict=True):
        _same(a, b)
    flat = cpu_net.evaluate(positions[:1])[0]
    assert flat.probs[0] > ref[0].probs[0]  # a higher temperature flattens the policy


def test_many_threads(net_file, cpu_net):
    positions = _positions(96, seed=3)
    ref = cpu_net.evaluate(positions)
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    with Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=32, max_wait_ms=2) as ev:

        def worker(k: int) -> None:
            try:
                for i in range(k, len(positions), 8):  # each thread submits one at a time and waits
                    results[i] = ev.submit(positions[i]).result(timeout=120)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = ev.stats()
    assert not errors, errors
    assert sorted(results) == list(range(len(positions)))
    for i, r in results.items():
        _same(r, ref[i])
    assert stats["positions"] == len(positions)


def test_bad_position_fails_only_its_future(net_file, cpu_net):
    good = _positions(30, seed=4)
    bad = {3: "not a fen", 11: ("startpos", ["e2e5"]), 12: "8/8/8/8/8/8/8/8 w - - 0 1", 29: 42}
    mixed = list(good)
    for i, p in bad.items():
        mixed[i] = p
    ref = cpu_net.evaluate([p for i, p in enumerate(good) if i not in bad])
    with Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=64, max_wait_ms=0) as ev:
        futures = ev.submit_many(mixed)
        k = 0
        for i, f in enumerate(futures):
            if i in bad:
                with pytest.raises(ValueError):
                    f.result(timeout=120)
            else:
                _same(f.result(timeout=120), ref[k])
                k += 1
        with pytest.raises(ValueError, match="e2e5"):
            ev.evaluate([good[0], ("startpos", ["e2e5"])])
        stats = ev.stats()
    assert stats["failed"] == len(bad) + 1 and stats["positions"] == len(good) - len(bad) + 1


def test_submit_batch(net_file, cpu_net):
    """A minibatch: one future for the list, in order, batched with single submissions (other
    groupings, the same evaluations); a bad position fails the minibatch's future with its own
    error while the rest is still evaluated; an empty one is done at once."""
    positions = _positions(70, seed=31)
    ref = cpu_net.evaluate(positions)
    with Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=16, max_wait_ms=0) as ev:
        singles = ev.submit_many(positions[:5])
        whole = ev.submit_batch(positions)
        tail = ev.submit_batch(p for p in positions[60:])  # any iterable
        empty = ev.submit_batch([])
        assert empty.done() and empty.result() == []
        got = whole.result(timeout=120)
        assert isinstance(got, list) and len(got) == 70
        for a, b in zip(got, ref, strict=True):
            _same(a, b)
        for a, b in zip(tail.result(timeout=120), ref[60:], strict=True):
            _same(a, b)
        for f, b in zip(singles, ref[:5], strict=True):
            _same(f.result(timeout=120), b)
        bad = ev.submit_batch([positions[0], ("startpos", ["e2e5"]), positions[1]])
        with pytest.raises(ValueError, match="e2e5"):
            bad.result(timeout=120)  # as soon as that position is refused
    stats = ev.stats()  # after close(): the bad minibatch's other two were still evaluated
    assert stats["positions"] == 5 + 70 + 10 + 2 and stats["failed"] == 1


def test_submit_batch_cancelled_or_closed(net_file):
    """A minibatch cancelled before any of it ran is dropped; one cut short by
    ``close(cancel_pending=True)`` fails with CancelledError instead of hanging."""
    ev = Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=1, pipeline_depth=1)
    first = ev.submit_batch(_positions(100, seed=32))
    second = ev.submit_batch(_positions(20, seed=33))
    assert second.cancel()  # nothing of it can have run: the first's 100 come before
    ev.close(cancel_pending=True)
    assert second.cancelled()
    assert first.done() and not first.cancelled()
    with pytest.raises(CancelledError):
        first.result()  # some of its 100 one-position batches ran, the rest were dropped
    assert ev.stats()["positions"] < 100
    with pytest.raises(RuntimeError, match="closed"):
        ev.submit_batch(["startpos"])


def test_close(net_file):
    ev = Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=4)
    futures = ev.submit_many(_positions(12, seed=5))
    ev.close()  # what was submitted is finished first
    assert ev.closed and all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        ev.submit("startpos")
    with pytest.raises(RuntimeError, match="closed"):
        ev.submit_many(["startpos"])
    ev.close()  # idempotent
    assert all(not t.is_alive() for r in ev._replicas for t in r.threads)


def test_close_cancel_pending(net_file):
    ev = Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=1, pipeline_depth=1)
    futures = ev.submit_many(_positions(200, seed=6))
    ev.close(cancel_pending=True)
    done = [f for f in futures if not f.cancelled()]
    cancelled = [f for f in futures if f.cancelled()]
    assert all(f.done() for f in futures)
    assert cancelled, "200 single-position batches cannot all have run before close()"
    for f in done:
        assert f.exception() is None
    with pytest.raises(CancelledError):
        cancelled[0].result()


def test_arguments(net_file, cpu_net):
    with pytest.raises(ValueError, match="devices"):
        Evaluator(net_file, devices="tpu")
    with pytest.raises(ValueError, match="max_batch"):
        Evaluator(net_file, devices="cpu", max_batch=0)
    with pytest.raises(ValueError, match="temperature"):
        Evaluator(net_file, devices="cpu", temperature=0)
    with pytest.raises(ValueError, match="pipeline_depth"):
        Evaluator(net_file, devices="cpu", pipeline_depth=0)
    with pytest.raises(ValueError, match="cpu, cpu|named twice"):
        Evaluator(net_file, devices="cpu,cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU"):
            Evaluator(net_file)
        with pytest.raises(ValueError, match="GPU"):
            Evaluator(net_file, devices="cuda:0")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="own device"):
            Evaluator(cpu_net, devices="cuda:0")
    # dtype: refused in fusedenc's words before anything starts; a given network keeps its own
    with pytest.raises(TypeError, match=r"dtype='fp16' is a string: pass a torch.dtype \(dtype=torch.float16\)"):
        Evaluator(net_file, devices="cpu", dtype="fp16")
    with pytest.raises(TypeError, match="not supported"):
        Evaluator(net_file, devices="cpu", dtype=torch.int32)
    with pytest.raises(ValueError, match="the network given is torch.float32"):
        Evaluator(cpu_net, dtype=torch.float16)


@pytest.mark.parametrize("fmt", [InputFormat.CLASSICAL_112_PLANE, InputFormat.WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON,
                                 InputFormat.WITH_CANONICALIZATION_V2])
def test_tensor_expansion_matches_the_numpy_one(fmt):
    """``expand_planes`` on tensors (the path the launch stage takes on a GPU, where nothing
    may wait for the device) gives the numpy path's planes."""
    positions = _positions(200, seed=11) + ["8/8/8/4k3/8/8/8/K7 w - - 37 80", "4k3/8/8/8/8/8/8/R3K3 w - - 3 40"]
    masks, values, transforms = encode_masks(positions, fmt)
    if fmt != InputFormat.CLASSICAL_112_PLANE:
        assert (transforms != 0).any()  # the canonical turn is exercised
    ref = expand_planes(masks, values, transforms)
    out = torch.full(ref.shape, float("nan"))
    got = expand_planes(torch.from_numpy(masks.view(np.int64)), torch.from_numpy(values), torch.from_numpy(transforms),
                        out=out)  # fmt: skip
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_host_worker_processes(net_file, cpu_net):
    """The host work in worker processes (as with a GPU) gives the same evaluations, and a
    bad position sent to a worker still fails only its own future."""
    positions = _positions(150, seed=21)
    expected = cpu_net.evaluate(positions)
    with Evaluator(net_file, devices="cpu", dtype=torch.float32, host_workers=2, max_batch=32) as ev:
        assert ev.host_workers == 2 and ev.pipeline_depth >= 3
        futures = ev.submit_many(positions[:70] + ["not a fen", ("startpos", ["e2e5"])] + positions[70:])
        results = [f.result() if i not in (70, 71) else f.exception() for i, f in enumerate(futures)]
        stats = ev.stats()
    _check_trips(stats["devices"]["cpu"]["trip_ms"], stats["batches"])  # stamps from the workers' processes too
    assert isinstance(results[70], ValueError) and "FEN" in str(results[70])
    assert isinstance(results[71], ValueError) and "e2e5" in str(results[71])
    for got, want in zip(results[:70] + results[72:], expected, strict=True):
        _same(got, want)


def test_a_killed_host_worker_fails_no_future(net_file, cpu_net):
    """A host worker killed (SIGKILL, as the OOM killer does) while thousands of positions are
    queued: a new one takes its place, every position is answered as without the kill, no
    future fails, later submits work, and ``stats()`` counts the restart."""
    import os
    import signal

    positions = _positions(400, seed=5) * 6  # 2,400 queued
    expected = cpu_net.evaluate(positions[:400])
    with Evaluator(net_file, devices="cpu", dtype=torch.float32, host_workers=2, max_batch=64) as ev:
        futures = ev.submit_many(positions)
        os.kill(ev._workers[0]._procs[0].pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
        later = ev.submit(positions[3]).result(timeout=60)
        stats = ev.stats()
    assert stats["host_worker_restarts"] >= 1 and stats["failed"] == 0
    for i, got in enumerate(results):
        _same(got, expected[i % 400])
    _same(later, expected[3])


def test_lazy_evaluations_equal_eager_ones(net_file):
    """The Evaluator's evaluations read their batch's arrays when asked: every field, ``repr``,
    ``to_dict``, ``top`` and the JSON lines equal those of an ``Evaluation`` made eagerly from
    the same values, on fresh positions (random games), some with histories."""
    from fusedenc.lc0.evaluate import Evaluation, json_lines

    rng = random.Random()
    seed = rng.randrange(1 << 30)
    positions = _positions(90, seed=seed)
    with Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=32, max_wait_ms=0) as ev:
        got = ev.evaluate(positions) + ev.submit_batch(positions[:40]).result(timeout=120)
    for i, e in enumerate(got):
        eager = Evaluation(list(e.moves), np.array(e.probs), e.q, np.array(e.wdl), e.moves_left, np.array(e.policy_indices))
        assert (e.moves, e.best_move, e.top(3), e.to_dict(), e.to_dict(top=2), repr(e)) == (
            eager.moves, eager.best_move, eager.top(3), eager.to_dict(), eager.to_dict(top=2), repr(eager)), (seed, i)
        np.testing.assert_array_equal(e.probs, eager.probs)
        np.testing.assert_array_equal(e.policy_indices, eager.policy_indices)
        assert len(e.moves) == len(e.probs) == len(set(e.moves)) and list(e.probs) == sorted(e.probs, reverse=True)
    prefixes = [f'{{"i": {i}' for i in range(len(got))]
    for top in (None, 5):
        lazy = json_lines(got, prefixes, top)
        eager_lines = json_lines([Evaluation(e.moves, e.probs, e.q, e.wdl, e.moves_left, e.policy_indices)
                                  for e in got], prefixes, top)
        assert lazy == eager_lines, seed


def test_submissions_split_across_batches_and_cancelled_in_the_queue(net_file, cpu_net):
    """One submit_many call spread over many batches (max_batch 3), single submissions and a
    minibatch between its positions; futures cancelled while queued are dropped, the rest
    answered in order."""
    positions = _positions(40, seed=41)
    ref = cpu_net.evaluate(positions)
    with Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=3, pipeline_depth=1) as ev:
        many = ev.submit_many(positions[:30])
        single = ev.submit(positions[30])
        batch = ev.submit_batch(positions[31:])
        cancelled = [f for f in many[20:] if f.cancel()]
        for i, f in enumerate(many):
            if not f.cancelled():
                _same(f.result(timeout=120), ref[i])
        _same(single.result(timeout=120), ref[30])
        for a, b in zip(batch.result(timeout=120), ref[31:], strict=True):
            _same(a, b)
        stats = ev.stats()
    assert cancelled and all(f.cancelled() for f in cancelled)
    assert stats["positions"] == 40 - len(cancelled) and stats["failed"] == 0


def test_forked_host_workers_write_into_shared_rows(net_file, cpu_net):
    """With forked host workers the encoding comes back through shared memory (not pickled):
    the same evaluations as in-process host work, bad positions still failing their own."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork here: the workers send the encoding back pickled")
    positions = _positions(120, seed=43)
    expected = cpu_net.evaluate(positions)
    with Evaluator(net_file, devices="cpu", dtype=torch.float32, host_workers=2, max_batch=16) as ev:
        assert ev._shared is not None and len(ev._shared.buffers) == ev.pipeline_depth
        futures = ev.submit_many(positions[:50] + ["not a fen"] + positions[50:])
        bad = ev.submit_batch([positions[0], ("startpos", ["e2e5"])])
        results = [f.result(timeout=120) if i != 50 else f.exception(timeout=120) for i, f in enumerate(futures)]
        with pytest.raises(ValueError, match="e2e5"):
            bad.result(timeout=120)
    assert ev._shared is None  # closed: the shared memory is let go
    assert isinstance(results[50], ValueError)
    for got, want in zip(results[:50] + results[51:], expected, strict=True):
        _same(got, want)


def test_empty_evaluate(net_file):
    with Evaluator(net_file, devices="cpu", dtype=torch.float32) as ev:
        assert ev.evaluate([]) == []
        assert ev.stats()["batches"] == 0


# ------------------------------------------------------------------ GPU ----


def _close(a, b, atol: float) -> None:
    assert set(a.moves) == set(b.moves)
    pa, pb = dict(zip(a.moves, a.probs, strict=True)), dict(zip(b.moves, b.probs, strict=True))
    assert max((abs(pa[m] - pb[m]) for m in pa), default=0.0) <= atol
    np.testing.assert_allclose(a.wdl, b.wdl, atol=atol)
    assert abs(a.q - b.q) <= 2 * atol


@pytest.fixture(scope="module")
def canonical_net_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("evaluator") / "tiny-canonical.pb.gz"
    write_preset(str(path), "tiny", seed=4, input_format=InputFormat.WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON)
    return read_net(str(path))


@pytest.mark.gpu
@pytest.mark.parametrize("graphs, canonical", [(True, False), (False, False), (True, True)])
def test_gpu_matches_net_evaluate(net_file, canonical_net_file, graphs, canonical):
    net_file = canonical_net_file if canonical else net_file
    device = torch.device("cuda", torch.cuda.current_device())
    net = Lc0Network(net_file, dtype=torch.float16, device=device)
    positions = _positions(300, seed=7)
    ref = net.evaluate(positions)
    ref32 = Lc0Network(net_file, dtype=torch.float32, device=device).evaluate(positions)
    with Evaluator(net_file, devices=device, dtype=torch.float16, max_batch=64, graphs=graphs) as ev:
        got = ev.evaluate(positions)
        stats = ev.stats()
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        try:
            _close(a, b, atol=2e-2)
            _close(a, ref32[i], atol=3e-2)
        except AssertionError as exc:
            raise AssertionError(f"position {i} ({positions[i]!r}): {exc}") from None
    assert stats["positions"] == 300 and stats["batches"] >= 5


@pytest.mark.gpu
def test_gpu_many_threads_and_bad_positions(net_file):
    device = torch.device("cuda", torch.cuda.current_device())
    positions = _positions(200, seed=8)
    ref = Lc0Network(net_file, dtype=torch.float16, device=device).evaluate(positions)
    out: dict[int, object] = {}
    with Evaluator(net_file, dtype=torch.float16, max_batch=32) as ev:
        bad = ev.submit("rnbqkbnr/pppppppp/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1")  # 7 ranks

        def worker(k: int) -> None:
            for i in range(k, len(positions), 16):
                out[i] = ev.submit(positions[i]).result(timeout=300)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with pytest.raises(ValueError):
            bad.result(timeout=60)
    assert sorted(out) == list(range(len(positions)))
    for i, r in out.items():
        _close(r, ref[i], atol=2e-2)


@pytest.mark.gpu
def test_two_gpus(net_file):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    positions = _positions(600, seed=9)
    ref = Lc0Network(net_file, dtype=torch.float16, device="cuda:0").evaluate(positions)
    with Evaluator(net_file, devices="cuda:0,cuda:1", dtype=torch.float16, max_batch=16) as ev:
        got = ev.evaluate(positions)
        stats = ev.stats()
    for a, b in zip(got, ref, strict=True):
        _close(a, b, atol=2e-2)
    per = stats["devices"]
    assert set(per) == {"cuda:0", "cuda:1"}
    assert per["cuda:0"]["positions"] + per["cuda:1"]["positions"] == 600
    assert per["cuda:0"]["batches"] > 0 and per["cuda:1"]["batches"] > 0  # both pulled from the queue


@pytest.mark.gpu
def test_captures_survive_cycle_collections_of_other_graphs(net_file):
    """Graph runners left in reference cycles are garbage the collector may free at any
    allocation; with collections forced at almost every allocation, the Evaluator's captures
    (one per replica, on every GPU there is) still succeed: none runs inside a capture
    (``graphs.no_cycle_collection``).  Without that, freeing a graph inside the capture broke
    it (seen on the second of two H200s: "operation not permitted when stream is capturing")."""
    import gc

    devices = [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]
    positions = _positions(100, seed=12)
    ref = Lc0Network(net_file, dtype=torch.float16, device=devices[0]).evaluate(positions)
    for d in devices:  # garbage: captured runners in cycles
        for _ in range(2):
            runner = Lc0Network(net_file, dtype=torch.float16, device=d).graph_runner((8, 16))
            runner.capture_all()
            runner.cycle = [runner]
    del runner
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        with Evaluator(net_file, devices=devices, dtype=torch.float16, max_batch=16) as ev:
            got = ev.evaluate(positions)
    finally:
        gc.set_threshold(*old)
    for a, b in zip(got, ref, strict=True):
        _close(a, b, atol=2e-2)


def test_switch_interval_is_shortened_while_used_and_restored():
    from fusedenc.lc0.evaluator import _SwitchInterval

    before = sys.getswitchinterval()
    s = _SwitchInterval()
    s.shorten(before / 10)
    s.shorten(before / 10)  # a second Evaluator
    assert abs(sys.getswitchinterval() - before / 10) < 1e-9
    s.restore()
    assert abs(sys.getswitchinterval() - before / 10) < 1e-9  # the first still runs
    s.restore()
    assert sys.getswitchinterval() == before


def test_switch_interval_argument(net_file):
    with pytest.raises(ValueError, match="switch_interval"):
        Evaluator(net_file, devices="cpu", dtype=torch.float32, switch_interval=0)
    before = sys.getswitchinterval()
    with Evaluator(net_file, devices="cpu", dtype=torch.float32):
        assert sys.getswitchinterval() == before  # only an Evaluator with a GPU changes it


def test_a_closed_evaluator_is_freed_without_the_cycle_collector(net_file):
    """Its network, runner and buffers go by reference counting when it closes: left in a
    reference cycle they would be freed by whichever collection comes next, on any thread,
    also inside another runner's CUDA graph capture, which that breaks (seen with two GPUs)."""
    import gc
    import weakref

    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with Evaluator(net_file, devices="cpu", dtype=torch.float32, max_batch=8, host_workers=0) as ev:
            ev.evaluate(_positions(20, seed=11))
            replica = ev._replicas[0]
            refs = [weakref.ref(replica.run), weakref.ref(replica.net)]
            del replica
        del ev
        assert [r() for r in refs] == [None, None]
    finally:
        if was:
            gc.enable()
