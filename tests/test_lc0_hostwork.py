"""``hostwork.Workers``: the Evaluator's host worker processes, each behind its own pipe.

The oracle is ``prepare_batch`` run in this process on the same positions: a worker's
answer must be the same arrays; an exception raised in a worker comes back as that
exception; a worker that dies fails the batches it held with a clear error, instead of
leaving a caller waiting forever, and ``close`` still returns.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from fusedenc.lc0 import Lc0FormatError, hostwork
from fusedenc.lc0.schema import InputFormat

FORMAT = InputFormat.CLASSICAL_112_PLANE
POSITIONS = ["startpos", ("startpos", ["e2e4", "e7e5", "g1f3"]), "8/P7/8/8/8/8/6k1/K7 w - - 0 1",
             "r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R w KQkq - 0 1"]


def _same(a: hostwork.HostBatch, b: hostwork.HostBatch) -> None:
    for name in ("kept", "masks", "values", "transforms", "moves", "indices", "counts"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)
    assert [(i, str(e)) for i, e in a.errors] == [(i, str(e)) for i, e in b.errors]


def test_answers_come_back_in_order_and_equal_the_in_process_work():
    batches = [POSITIONS[k:] + POSITIONS[:k] + ["not a fen"] * (k % 2) for k in range(len(POSITIONS))] * 2
    workers = hostwork.Workers(2)
    try:
        assert len(workers) == 2
        jobs = [workers.submit(hostwork.pack(b), FORMAT, None) for b in batches]  # several queued on each worker
        for job, batch in zip(jobs, batches, strict=True):
            _same(job.result(), hostwork.prepare_batch(batch, FORMAT))
        assert jobs[0].result() is jobs[0].result()  # answered once, kept
    finally:
        workers.close()


def test_an_exception_in_a_worker_is_raised_by_result():
    workers = hostwork.Workers(1)
    try:
        with pytest.raises(Exception) as raised:
            workers.submit(hostwork.pack(POSITIONS), "no such format", None).result()
        with pytest.raises(type(raised.value)):
            hostwork.prepare_batch(POSITIONS, "no such format")
        _same(workers.submit(hostwork.pack(POSITIONS), FORMAT, None).result(),
              hostwork.prepare_batch(POSITIONS, FORMAT))  # the worker lives on
    finally:
        workers.close()


def test_a_killed_worker_is_replaced_and_its_batches_run_again():
    """A worker killed (SIGKILL: what the OOM killer sends) with batches queued on it: a new
    worker takes its place, gets every batch it held again, in order, and no batch fails;
    ``restarts`` counts it.  Then it dies again while holding batches: the same."""
    workers = hostwork.Workers(2)
    try:
        for round_ in (1, 2):
            os.kill(workers._procs[0].pid, signal.SIGKILL)
            workers._procs[0].join(timeout=10)
            batches = [POSITIONS[i:] + POSITIONS[:i] for i in range(6)]
            jobs = [workers.submit(hostwork.pack(b), FORMAT, None) for b in batches]  # dealt 0, 1, 0, 1, ...
            for job, batch in zip(jobs, batches, strict=True):
                _same(job.result(), hostwork.prepare_batch(batch, FORMAT))
            assert workers.restarts == round_
    finally:
        t0 = time.monotonic()
        workers.close()
        assert time.monotonic() - t0 < 15
    assert len(workers) == 0


def test_a_batch_that_kills_every_worker_fails_alone(monkeypatch):
    """A batch during which workers die again and again (here each worker kills itself when it
    gets it) fails after ``MAX_DEATHS_IN_A_ROW`` deaths with the reason; the batches behind it
    on the same worker still run."""
    if not hostwork.forked():
        pytest.skip("the patched task reaches the workers only where they are forked")
    real = hostwork._TASKS["prepare_batch"]

    def deadly(positions, *args):
        if hostwork.unpack(positions)[0] == "deadly":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(positions, *args)

    monkeypatch.setitem(hostwork._TASKS, "prepare_batch", deadly)  # in every worker forked from here on
    workers = hostwork.Workers(1)
    try:
        good = workers.submit(hostwork.pack(POSITIONS), FORMAT, None)
        bad = workers.submit(hostwork.pack(["deadly"]), FORMAT, None)
        after = workers.submit(hostwork.pack(POSITIONS[1:]), FORMAT, None)
        _same(good.result(), hostwork.prepare_batch(POSITIONS, FORMAT))
        with pytest.raises(RuntimeError, match=r"host worker 0 died 3 times in a row on this batch \(last exit code -9"):
            bad.result()
        _same(after.result(), hostwork.prepare_batch(POSITIONS[1:], FORMAT))
        assert workers.restarts == 3
    finally:
        workers.close()


def test_in_process_jobs_and_bad_counts():
    _same(hostwork.Job.here(POSITIONS, FORMAT).result(), hostwork.prepare_batch(POSITIONS, FORMAT))
    with pytest.raises(Lc0FormatError, match="'no such format' is not one of lc0's"):
        hostwork.Job.here(POSITIONS, "no such format").result()
    with pytest.raises(ValueError, match="count must be >= 1"):
        hostwork.Workers(0)


def test_a_worker_that_cannot_start_fails_the_start(monkeypatch):
    """The warm-up's answer is checked: a worker that fails it raises in ``Workers()`` (and
    every worker started is stopped), not later in a batch."""
    if not hostwork.forked():
        pytest.skip("the patched warm-up reaches the workers only where they are forked")

    def broken() -> int:
        raise ImportError("no numpy in this worker")

    monkeypatch.setitem(hostwork._TASKS, "warm_up", broken)
    with pytest.raises(ImportError, match="no numpy in this worker"):
        hostwork.Workers(2)
