"""The Evaluator's host-side pieces, alone (CPU): its futures and minibatches
(``lc0/requests.py``), the batch decode (``policy.decode_arrays``), the batch's transport to
the host workers (``hostwork.pack``) and the JSON lines written from a batch's arrays.

Each is held to the plain thing it replaces: a ``concurrent.futures.Future`` of its own per
position, a softmax and a stable sort per position, a list of positions, ``json.dumps`` of
each record."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import threading

import numpy as np
import pytest

from fusedenc.lc0 import hostwork, requests
from fusedenc.lc0.evaluate import Evaluation, json_lines
from fusedenc.lc0.policy import decode_arrays
from fusedenc.lc0.positions import Position

# ------------------------------------------------------------ futures ----


@pytest.fixture(params=["light", "plain"])
def futures_kind(request, monkeypatch):
    """Both ways a Submission makes its futures: sharing a condition (this Python), and plain
    futures with their public calls (a Python whose Future is laid out otherwise)."""
    if request.param == "plain":
        monkeypatch.setattr(requests, "FAST", False)
    return request.param


def test_submission_futures_are_futures(futures_kind):
    sub = requests.Submission(list(range(10)))
    fs = sub.futures
    assert all(isinstance(f, cf.Future) for f in fs)
    assert isinstance(fs[0], requests.PositionFuture) == (futures_kind == "light")
    seen = []
    fs[3].add_done_callback(lambda f: seen.append(f.result()))
    assert fs[9].cancel() and fs[9].cancelled()
    with pytest.raises(cf.TimeoutError):
        fs[0].result(timeout=0.01)
    with pytest.raises(cf.TimeoutError):
        fs[0].exception(timeout=0.01)

    waiting = {}

    def wait(i):  # threads waiting on siblings: each wake-up of the shared condition is checked
        try:
            waiting[i] = fs[i].result(timeout=30)
        except ValueError as exc:
            waiting[i] = exc

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    first = sub.start(0, 4)
    assert first is not None and first.positions == [0, 1, 2, 3] and all(f.running() for f in fs[:4])
    rest = sub.start(4, 10)  # the cancelled one is dropped
    assert rest.positions == [4, 5, 6, 7, 8] and len(rest) == 5
    first.finish(["r0", "r1", "r2", "r3"])
    rest.fail_one(1, ValueError("bad five"))
    rest.finish(["r4", None, "r6", "r7", "r8"])
    for t in threads[:5] + threads[6:]:
        t.join(timeout=30)
    assert seen == ["r3"]
    assert [fs[i].result() for i in (0, 4, 8)] == ["r0", "r4", "r8"]
    assert isinstance(fs[5].exception(), ValueError)
    with pytest.raises(ValueError, match="bad five"):
        fs[5].result()
    threads[5].join(timeout=30)
    assert {i: waiting[i] for i in (0, 3, 7)} == {0: "r0", 3: "r3", 7: "r7"} and isinstance(waiting[5], ValueError)
    with pytest.raises(cf.CancelledError):
        fs[9].result()
    done, not_done = cf.wait(fs, timeout=1)
    assert len(done) == 10 and not not_done
    assert len(list(cf.as_completed(fs, timeout=1))) == 10
    assert not fs[0].cancel()  # finished: too late


def test_submission_fail_and_cancel_rest(futures_kind):
    sub = requests.Submission(["a", "b", "c", "d"])
    part = sub.start(0, 2)
    sub.taken = 2
    assert part.fail(RuntimeError("boom")) == 2
    assert part.fail(RuntimeError("again")) == 0  # already answered
    sub.cancel_rest()
    assert [f.cancelled() for f in sub.futures] == [False, False, True, True]
    assert sub.start(2, 4) is None  # all of them cancelled
    with pytest.raises(RuntimeError, match="boom"):
        sub.futures[0].result()


def test_futures_of_a_submission_under_asyncio_and_as_completed():
    sub = requests.Submission([1, 2, 3])
    part = sub.start(0, 3)

    async def main():
        wrapped = [asyncio.wrap_future(f) for f in sub.futures]
        asyncio.get_running_loop().call_soon_threadsafe(lambda: None)
        threading.Timer(0.05, lambda: part.finish(["x", "y", "z"])).start()
        return await asyncio.gather(*wrapped)

    assert asyncio.run(main()) == ["x", "y", "z"]


def test_minibatch_parts():
    mb = requests.Minibatch(list("abcdef"))
    first, second = mb.start(0, 4), mb.start(4, 6)
    second.finish(["E", "F"])
    assert not mb.future.done()
    first.finish(["A", "B", "C", "D"])
    assert mb.future.result() == list("ABCDEF")

    mb = requests.Minibatch(list("abc"))
    part = mb.start(0, 3)
    part.fail_one(1, ValueError("bad b"))
    part.finish(["A", None, "C"])  # the rest still comes back, the future keeps its error
    with pytest.raises(ValueError, match="bad b"):
        mb.future.result()
    assert part.fail(RuntimeError("late")) == 0

    mb = requests.Minibatch(list("ab"))
    assert mb.future.cancel()
    assert mb.start(0, 2) is None
    empty = requests.Minibatch([])
    assert empty.future.result() == []


def test_locate():
    parts = [requests.Part(None, 0, [1, 2, 3], None), requests.Part(None, 0, [4], None),
             requests.Part(None, 0, [5, 6], None)]
    where = requests.locate(parts)
    assert [(parts.index(p), j) for p, j in map(where, range(6))] == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]


# ------------------------------------------------------------ decode ----


def _plain_decode(logits, moves, indices, counts, temperature):
    """Per position: a float64 softmax over its moves' logits, most probable first (a stable
    sort: equal probabilities keep their order)."""
    out, s = [], 0
    for b, c in enumerate(counts.tolist()):
        x = logits[b, indices[s:s + c]].astype(np.float64) / temperature
        p = (np.exp(x - x.max()) / np.exp(x - x.max()).sum()).astype(np.float32) if c else x.astype(np.float32)
        order = np.argsort(-p, kind="stable")
        out.append((moves[s:s + c][order], p[order], indices[s:s + c][order]))
        s += c
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_decode_arrays_matches_a_plain_softmax_and_sort(temperature):
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 60, 300).astype(np.int32)
    counts[[0, 17, -1]] = 0  # mates and stalemates, first and last too
    counts[5] = 218  # the most legal moves a chess position has
    total = int(counts.sum())
    indices = np.concatenate([rng.choice(1858, c, replace=False) for c in counts]).astype(np.int16)
    moves = rng.integers(0, 1 << 14, total).astype(np.int32)
    wide = rng.standard_normal((len(counts), 1863)).astype(np.float32) * 3
    wide[3, :] = 0.0  # every logit equal: ties everywhere, kept in their order
    wide[4, :] = np.round(wide[4, :])  # many ties
    logits = wide[:, :1858]  # a view of a wider array, as the Evaluator's packed heads are
    got = decode_arrays(logits, moves, indices, counts, temperature)
    same = decode_arrays(np.ascontiguousarray(logits), moves, indices, counts, temperature)
    want = _plain_decode(np.ascontiguousarray(logits), moves, indices, counts, temperature)
    assert len(got) == len(counts)
    for b, (m, p, i) in enumerate(want):
        for decoded in (got, same):
            s, c = int(decoded.starts[b]), int(decoded.counts[b])
            np.testing.assert_array_equal(decoded.moves[s:s + c], m)
            np.testing.assert_array_equal(decoded.indices[s:s + c], i)
            np.testing.assert_allclose(decoded.probs[s:s + c], p, rtol=1e-6, atol=1e-9)
    empty = decode_arrays(np.zeros((2, 1858), np.float32), moves[:0], indices[:0], np.zeros(2, np.int32))
    assert [len(p) for p in empty] == [0, 0]
    bad = np.ascontiguousarray(logits)
    bad[7, :] = -np.nan  # a NaN (its sign bit set) spoils its own position only
    nan = decode_arrays(bad, moves, indices, counts, temperature)
    for b in (6, 8, 9):
        np.testing.assert_array_equal(nan[b].probs, got[b].probs)
        assert nan[b].moves == got[b].moves
    assert np.isnan(nan[7].probs).all() and sorted(nan[7].moves) == sorted(got[7].moves)


# ------------------------------------------------------------ pack ----


def test_pack_round_trip_and_fallbacks():
    fen = "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq e3 0 1"
    plain = ["startpos", (fen, ["e7e5", "g1f3"]), ("startpos", []), ("startpos", ("d2d4",)), fen]
    text = hostwork.pack(plain)
    assert isinstance(text, str)
    assert hostwork.unpack(text) == ["startpos", (fen, ["e7e5", "g1f3"]), ("startpos", []), ("startpos", ["d2d4"]), fen]
    pos = Position.from_fen("startpos")
    for odd in ([pos], [["startpos", ["e2e4"]]], [("startpos", ["e2 e4"])], [("startpos", ["e2e4"], 1)],
                [("startpos", [1])], ["start\tpos"], ["a\nb"], [("startpos", "e2e4")], [42]):
        packed = hostwork.pack(["startpos"] + odd)
        assert isinstance(packed, list) and packed[1:] == [hostwork.portable(p) for p in odd], odd


# ------------------------------------------------------------ JSON lines ----


def test_json_lines_of_batches_with_mixed_move_counts():
    """Positions of one batch with different numbers of moves (fewer legal moves than
    ``top``, none at all, ``top`` 0) are written by several format strings; every line is
    still ``json.dumps`` of its record."""
    rng = np.random.default_rng(3)
    counts = np.array([0, 1, 2, 5, 7, 3, 0, 30, 2, 1], np.int32)
    total = int(counts.sum())
    indices = np.concatenate([rng.choice(1858, c, replace=False) for c in counts]).astype(np.int16)
    moves = rng.integers(0, 1 << 12, total).astype(np.int32)
    logits = rng.standard_normal((len(counts), 1858)).astype(np.float32)
    policies = decode_arrays(logits, moves, indices, counts)
    from fusedenc.lc0.evaluate import evaluations

    wdl = rng.dirichlet([1, 1, 1], len(counts)).astype(np.float32)
    evs = evaluations({"wdl": wdl, "moves_left": rng.random((len(counts), 1)).astype(np.float32) * 80}, policies)
    eager = [Evaluation(e.moves, e.probs, e.q, e.wdl, e.moves_left, e.policy_indices) for e in evs]
    prefixes = [json.dumps({"index": i})[:-1] if i % 3 else "{" for i in range(len(evs))]
    for top in (None, 0, 1, 3, 5):
        want = [json.dumps({**json.loads(p + "}"), "best_move": e.best_move, **e.to_dict(top)})
                for p, e in zip(prefixes, evs, strict=True)]
        got = json_lines(evs, prefixes, top)
        assert [json.loads(line) for line in got] == [json.loads(line) for line in want], top
        assert json_lines(eager, prefixes, top) == got  # stand-alone evaluations: the same text
        assert json_lines(evs[::-1], prefixes[::-1], top) == got[::-1]  # any order of one batch
