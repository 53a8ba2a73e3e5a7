"""``Evaluator``: many threads ask for positions, one batch per GPU answers them.

A chess engine's search threads each want one position evaluated now; a GPU wants a
thousand at once.  The ``Evaluator`` sits between them, the way lc0's ``multiplexing``
backend does: every ``submit(position)`` joins one queue and returns a
``concurrent.futures.Future``; per device, a replica of the network and its workers take
what is queued (up to ``max_batch`` positions, waiting at most ``max_wait_ms`` for a batch
to fill), evaluate it and set each request's future to its ``Evaluation``.  Every device
pulls from the same queue, so a faster or less loaded GPU simply takes more batches (lc0's
``demux`` splits each batch across backends instead; pulling balances without knowing the
devices' speeds).

Per device the work is a three-stage pipeline, each stage a thread, so that the host work
of one batch overlaps the GPU work of another:

1. *gather* (host): take requests from the queue and hand them to a host worker
   (``hostwork.prepare_batch``: parse, check, replay histories, encode lc0's compact planes,
   list the legal moves with their policy indices).  With a GPU the workers are processes
   (``host_workers``, ``hostwork.Workers``: this numpy work holds the GIL too much for
   threads to share; three fed a T82 net at 7-13k positions/s where the GPU does 34k);
2. *launch* (GPU): wait for the batch's host work, then one copy of its packed encoding to
   the device, one CUDA graph replay (expansion to planes, the network, the heads packed:
   ``encoded.EncodedRunner``), one copy of the packed heads back into pinned host memory,
   and an event; nothing here waits for the GPU;
3. *finish* (host): wait for that event, softmax the legal moves' logits and set the
   futures.

The stages hand each other *slots* (a pinned buffer of the packed encoding, one of the
packed heads, and an event); ``pipeline_depth`` slots per device (default two per host
worker and two more: a batch's trip through the hand-overs takes a few times its host work)
bound the batches in flight.  A slot goes back to the gather stage only after its batch is
decoded, so no buffer is overwritten while a copy or a decode still reads it.  torch
releases the GIL in copies, graph replays and event waits, which lets the three threads
overlap; each such call must take the GIL back, so the launch stage makes as few as it can
(three a batch).  On a CPU device (tests, machines without a GPU) the same stages run with
a plain forward.

Everything this process does per position (under one GIL, across its threads) must cost far
less than the ~30 us a position that a GPU evaluating 34,000 positions a second leaves it, or
the GPU waits.  So the queue holds whole calls (``requests.Submission``: ``submit_many``'s
positions and their futures, which share one condition; ``requests.Minibatch``), a batch
takes and answers them a slice at a time, the policy is decoded for the whole batch by array
operations (``policy.decode_arrays``; each ``Evaluation`` reads its move list when asked) and
the workers write the encoding into shared memory.  Measured with an instant stand-in for
the network on a 2-core host: 9-10 us a position with ``submit_many`` at 256 positions a batch,
7.5 us with ``submit_batch`` (5-7 us at 1024), where a future of its own per position and the
encoding sent back pickled cost 17-20 us.

A bad position (a FEN that does not parse, an illegal move in its history) fails its own
future only: when ``prepare`` refuses a batch, the host worker splits it in halves until the
bad ones are found, and the rest are evaluated.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from ..common.device import DeviceSpec, check_dtype, parse_devices
from . import hostwork
from .encoded import ROW_BYTES, EncodedRunner, input_views
from .encoding import resolve_input_format
from .evalstats import EvaluatorStats, Trips
from .evaluate import Evaluation, evaluations
from .netfile import NetFile, read_net
from .network import Lc0Network
from .policy import decode_arrays
from .requests import Minibatch, Part, Submission, locate
from .switch_interval import SWITCH_INTERVAL as _SWITCH_INTERVAL
from .switch_interval import SwitchInterval as _SwitchInterval  # noqa: F401 - tests reach it here

__all__ = ["DEFAULT_BATCH_SIZES", "Evaluator"]

#: The CUDA-graph buckets by default (those above ``max_batch`` are dropped and ``max_batch``
#: is added): a batch replays the smallest bucket that holds it, so the steps stay within 2x.
DEFAULT_BATCH_SIZES = (1, 8, 32, 64, 128, 256, 512, 1024)

class _Slot:
    """One batch's buffers on one device (see the module doc).  The host stage writes lc0's
    compact encoding (a 64-bit mask and a value per plane: ``encoding.encode_masks``) into a
    pinned buffer, one row of ``ROW_BYTES`` a position; the planes are expanded on the device,
    which moves 1.3 KB a position instead of 14 KB and spares the host the expansion (on a
    2-core host, 50-80 ms for 1024 positions: more than the GPU needs for the network).  The
    heads come back packed, one row of ``width`` values a position."""

    def __init__(self, device: torch.device, rows: int, width: int, shared: Optional[tuple[int, int]] = None) -> None:
        cuda = device.type == "cuda"
        self.inputs = torch.empty((rows, ROW_BYTES), dtype=torch.uint8, pin_memory=cuda)
        self.input_rows = self.inputs.numpy()
        self.input_arrays = input_views(self.input_rows)
        # With forked host workers, the rows they write the batch's encoding into
        # (hostwork.SharedRows), as (token, index), and those rows here.
        self.shared = shared
        self.outputs = torch.empty((rows, width), dtype=torch.float32, pin_memory=cuda)  # heads are float32
        self.output_array = self.outputs.numpy()  # decoded as arrays: torch calls cost ~10 us each
        self.event = torch.cuda.Event() if cuda else None
        # Filled per batch:
        self.parts: list[Part] = []  # the positions of each call (submit_many's, submit_batch's) it holds
        self.n = 0  # positions in the batch
        self.job: Any = None  # the batch's host work: result() gives its hostwork.HostBatch
        self.host: Optional[hostwork.HostBatch] = None
        self.error: Optional[BaseException] = None
        self.sent = self.read = self.launched = 0.0  # time.perf_counter() at those hand-overs (evalstats.Trips)


class _Replica:
    """One device's network, runner, slots and three threads."""

    def __init__(self, owner: "Evaluator", file: NetFile, net: Optional[Lc0Network], device: torch.device,
                 workers: Optional[hostwork.Workers]) -> None:
        self.owner, self.device, self.workers = owner, device, workers
        self.stats = EvaluatorStats()
        # Wall seconds per stage, to see which one limits: gather waiting for a free slot and for
        # positions, launch waiting for the host workers and issuing the GPU work, finish
        # waiting for the GPU and decoding (softmax, Evaluations, futures).
        self.seconds = {"slot_wait": 0.0, "queue_wait": 0.0, "host_wait": 0.0, "launch": 0.0, "gpu_wait": 0.0,
                        "decode": 0.0}
        self.trips = Trips()  # and where each batch's trip waits
        dtype = owner.dtype
        if net is None:
            net = Lc0Network(file, dtype=dtype, device=device)
        self.net = net
        self.stream = None
        self.run = EncodedRunner(net, owner.batch_sizes, graphs=owner.graphs)
        if device.type == "cuda":
            with torch.cuda.device(device):
                self.stream = torch.cuda.Stream(device)
                if owner.graphs:
                    self.run.capture_all()  # now: the first batches are not slowed by it
        self.free: "queue.Queue[_Slot]" = queue.Queue()
        for _ in range(owner.pipeline_depth):
            self.free.put(_Slot(device, owner.max_batch, self.run.width, owner._shared_rows()))
        self.launch_q: "queue.Queue[Optional[_Slot]]" = queue.Queue()
        self.finish_q: "queue.Queue[Optional[_Slot]]" = queue.Queue()
        name = f"fusedenc-eval-{device}"
        self.threads = [
            threading.Thread(target=self._gather_loop, name=f"{name}-gather", daemon=True),
            threading.Thread(target=self._launch_loop, name=f"{name}-launch", daemon=True),
            threading.Thread(target=self._finish_loop, name=f"{name}-finish", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def release(self) -> None:
        """After ``join``: drop the network, its graphs, the buffers and the link to the owner,
        so that they are freed now, by reference counting.  Left in a reference cycle they
        would wait for Python's cycle collector, which can run at any allocation, also while
        another runner captures a CUDA graph; destroying a graph then breaks that capture
        (seen on an H200: CUBLAS_STATUS_EXECUTION_FAILED inside a later Evaluator's capture)."""
        self.run = self.net = None
        self.free = self.launch_q = self.finish_q = None
        self.owner = None
    # -- stage 1: gather (host): requests to a host worker --
    def _gather_loop(self) -> None:
        owner, seconds = self.owner, self.seconds
        try:
            while True:
                t0 = time.perf_counter()
                slot = self.free.get()
                t1 = time.perf_counter()
                parts = owner._take(owner.max_batch)
                seconds["slot_wait"] += t1 - t0
                seconds["queue_wait"] += time.perf_counter() - t1
                if parts is None:  # closed and drained
                    self.free.put(slot)
                    break
                if not parts:  # every position taken had been cancelled
                    self.free.put(slot)
                    continue
                slot.parts, slot.host, slot.error = parts, None, None
                positions = parts[0].positions if len(parts) == 1 else [p for part in parts for p in part.positions]
                slot.n = len(positions)
                slot.sent = time.perf_counter()
                slot.job = owner._host_job(positions, slot.shared, self.workers)
                self.launch_q.put(slot)
        finally:
            self.launch_q.put(None)

    def _take_host_batch(self, slot: _Slot) -> None:
        """Wait for the slot's host work; fail the refused positions, keep the others."""
        owner = self.owner
        host = slot.job.result()
        if host.errors:
            where = locate(slot.parts)
            for i, exc in host.errors:
                part, j = where(i)
                part.fail_one(j, exc)
            owner._count(self.stats, failed=len(host.errors))
        slot.host = host
        n = len(host.kept)
        if n and host.masks is None:  # written into the slot's shared rows by the worker
            slot.input_rows[:n] = owner._shared.buffers[slot.shared[1]][:n]
        elif n:  # numpy copies: torch's would wake its thread pool, which spins on the host's cores
            masks, values, turns = slot.input_arrays
            masks[:n] = host.masks
            values[:n] = host.values
            turns[:n] = host.transforms

    # -- stage 2: launch (GPU; nothing here waits for it) --
    def _launch_loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)  # this thread's current stream, once
        while True:
            slot = self.launch_q.get()
            if slot is None:
                break
            try:
                t0 = time.perf_counter()
                self._take_host_batch(slot)
                slot.read = t1 = time.perf_counter()
                if len(slot.host.kept):
                    self._launch(slot)
                slot.launched = time.perf_counter()
                self.seconds["host_wait"] += t1 - t0
                self.seconds["launch"] += slot.launched - t1
            except BaseException as exc:  # noqa: BLE001 - goes to the batch's futures
                slot.error = exc
            self.finish_q.put(slot)
        self.finish_q.put(None)

    @torch.no_grad()
    def _launch(self, slot: _Slot) -> None:
        # On a GPU: a copy in, a replay, a copy out (queued before the next replay overwrites
        # the graph's output) and the event; on the CPU the forward runs here, synchronously.
        self.run.launch(slot.inputs, slot.outputs, len(slot.host.kept))
        if slot.event is not None:
            slot.event.record(self.stream)

    # -- stage 3: finish (host): wait, decode, set the futures --
    def _finish_loop(self) -> None:
        while True:
            slot = self.finish_q.get()
            if slot is None:
                break
            try:
                self._finish(slot)
            finally:
                slot.parts, slot.job, slot.host = [], None, None
                self.free.put(slot)

    def _finish(self, slot: _Slot) -> None:
        owner, parts = self.owner, slot.parts
        if slot.error is None and not len(slot.host.kept):
            return
        if slot.error is None:
            try:
                t0 = time.perf_counter()
                if slot.event is not None:
                    slot.event.synchronize()
                t1 = time.perf_counter()
                self.seconds["gpu_wait"] += t1 - t0
                host = slot.host
                n = len(host.kept)
                packed = slot.output_array[:n]  # pinned host memory: views, no copies
                heads = {name: packed[:, c:c + w] for name, (c, w) in self.run.layout.items()}
                policies = decode_arrays(heads["policy"], host.moves, host.indices, host.counts, owner.temperature)
                results = evaluations(heads, policies)
                if n < slot.n:  # some positions were refused: theirs are None
                    full: list[Any] = [None] * slot.n
                    for b, r in zip(host.kept.tolist(), results):
                        full[b] = r
                    results = full
                lo = 0
                for part in parts:
                    k = len(part)
                    part.finish(results if k == len(results) else results[lo:lo + k])
                    lo += k
            except BaseException as exc:  # noqa: BLE001 - goes to the batch's futures
                slot.error = exc
        if slot.error is not None:
            failed = sum(part.fail(slot.error) for part in parts)
            owner._count(self.stats, failed=failed)
            return
        decoded = time.perf_counter()
        self.seconds["decode"] += decoded - t1
        self.trips.record(slot.sent, *slot.host.work, slot.read, slot.launched, t1, decoded)
        owner._count(self.stats, positions=n, batches=1)


class Evaluator:
    """Evaluates positions for many threads at once, batching them on one or more devices.

    ``Evaluator(net, devices=None, dtype=None, ...)``; ``net`` is an lc0 file path, a
    ``NetFile`` (one replica is built per device from it, in ``dtype``: torch.float16 by
    default, torch.bfloat16 or torch.float32), or an ``Lc0Network`` (used as it is, on its own
    device and in its own dtype: one device only).

    * ``submit(position) -> Future[Evaluation]``: a FEN, a ``(start_fen, [uci moves])`` pair,
      a ``Position`` or a python-chess board (whatever ``prepare`` takes); thread-safe;
    * ``submit_many(positions) -> list[Future]``: the same under one lock;
    * ``submit_batch(positions) -> Future[list[Evaluation]]``: a minibatch, one future for the
      list (what an engine that gathers minibatches should use: no future per position);
    * ``evaluate(positions) -> list[Evaluation]``: blocking; raises the first failure;
    * ``close()`` (or leaving a ``with`` block): no more submissions (``submit`` then raises
      ``RuntimeError``); what was submitted is finished first (``cancel_pending=True``
      cancels what has not started instead); the threads end.
    * ``stats()``: positions evaluated and failed, batches, mean batch size, total and per
      device.

    ``devices``: None (the current GPU), ``"cpu"``, ``"cuda:0,cuda:1"``, an int, a device or
    a list of them.  ``batch_sizes``: the CUDA-graph buckets (``DEFAULT_BATCH_SIZES`` up to
    ``max_batch``); ``graphs=False`` runs the network eagerly instead.  ``max_batch``: the
    most positions one batch takes; ``max_wait_ms``: how long a worker that has some
    requests waits for more before it runs a smaller batch (the latency an engine pays when
    the load is light).  ``temperature``: the policy softmax's.  ``host_workers``: processes
    for the host work (parsing, encoding, legal moves; default: with a GPU, up to 8 per GPU,
    leaving two cores and two a GPU to this process; 0 on a CPU, where it runs in this
    process), divided among the devices (each replica its own, at least one); a worker prepares
    ~10k positions/s with histories on an H100 host's core.  ``pipeline_depth``:
    batches in flight per device (default: twice its share of the host workers, plus two).
    ``switch_interval``: while an Evaluator with a GPU runs, Python's thread switch interval
    is at most this (seconds; restored by ``close``).  None, the default, leaves it alone: the
    launch stage makes only three calls a batch that wait for the GIL, and a shorter interval
    makes every thread of the process switch more often (measured on an H100, T82 at 256
    positions: 0.2 ms kept the GPU 82% busy, Python's 5 ms 100%).  Applications with big
    Python heaps may also want ``gc.freeze()`` once their long-lived data is built: a full
    collection stops every thread, the Evaluator's too, for tens of milliseconds.
    """

    def __init__(
        self,
        net: Union[str, "os.PathLike[str]", NetFile, Lc0Network],
        *,
        devices: DeviceSpec = None,
        dtype: Optional[torch.dtype] = None,
        batch_sizes: Optional[Sequence[int]] = None,
        max_batch: int = 1024,
        max_wait_ms: float = 1.0,
        temperature: float = 1.0,
        pipeline_depth: Optional[int] = None,
        graphs: bool = True,
        host_workers: Optional[int] = None,
        switch_interval: Optional[float] = None,
    ) -> None:
        if dtype is not None:
            dtype = check_dtype(dtype)  # before anything starts: the slots' buffers are made in it
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch <= 0:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        if not isinstance(max_wait_ms, (int, float)) or isinstance(max_wait_ms, bool) or not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be a number >= 0, got {max_wait_ms!r}")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        if pipeline_depth is not None and (isinstance(pipeline_depth, bool) or not isinstance(pipeline_depth, int)
                                           or pipeline_depth < 1):
            raise ValueError(f"pipeline_depth must be an int >= 1, got {pipeline_depth!r}")
        if host_workers is not None and (isinstance(host_workers, bool) or not isinstance(host_workers, int)
                                         or host_workers < 0):
            raise ValueError(f"host_workers must be an int >= 0, got {host_workers!r}")
        if switch_interval is not None and (isinstance(switch_interval, bool) or not isinstance(switch_interval, (int, float))
                                            or not switch_interval > 0):
            raise ValueError(f"switch_interval must be a number of seconds > 0 or None, got {switch_interval!r}")
        if batch_sizes is None:
            batch_sizes = [b for b in DEFAULT_BATCH_SIZES if b < max_batch] + [max_batch]
        sizes = sorted(set(batch_sizes))
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in sizes):
            raise ValueError(f"batch_sizes must be positive ints, got {batch_sizes!r}")
        self.batch_sizes = tuple(sizes)
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000.0
        self.temperature, self.graphs = float(temperature), bool(graphs)

        given: Optional[Lc0Network] = None
        if isinstance(net, Lc0Network):
            given = net
            p = net.preproc.weight
            self.devices = [p.device] if devices is None else parse_devices(devices)
            if self.devices != [p.device]:
                raise ValueError(f"an Lc0Network runs on its own device ({p.device}); pass the net file to run on "
                                 f"{', '.join(map(str, self.devices))}")  # fmt: skip
            if dtype is not None and dtype != p.dtype:
                raise ValueError(f"dtype={dtype}, but the network given is {p.dtype}: leave dtype out, or pass the "
                                 "net file to build a replica in that dtype")  # fmt: skip
            dtype = p.dtype
            file = None
            self.input_format = resolve_input_format(net.input_format)
            self.source = net.source
        else:
            file = net if isinstance(net, NetFile) else read_net(net)
            self.devices = parse_devices(devices)
            self.input_format = resolve_input_format(file.input_format)  # Lc0FormatError if not encoded here
            self.source = file.source
            dtype = torch.float16 if dtype is None else dtype
        self.dtype = dtype
        if host_workers is None:  # processes only where a GPU must be fed; tests on a CPU stay in-process
            gpus = sum(d.type == "cuda" for d in self.devices)
            host_workers = min(8 * gpus, max(1, (os.cpu_count() or 2) - 2 - 2 * len(self.devices))) if gpus else 0
        self.host_workers = host_workers
        per_device = -(-host_workers // len(self.devices))  # each replica its own workers
        if pipeline_depth is None:
            pipeline_depth = max(3, 2 * per_device + 2)
        self.pipeline_depth = pipeline_depth
        self._workers: list[hostwork.Workers] = []  # one set a replica: each waits on its own in order
        self._shared: Optional[hostwork.SharedRows] = None  # made before the workers are forked
        self._shared_next = 0
        if host_workers:
            if hostwork.forked():
                self._shared = hostwork.SharedRows(pipeline_depth * len(self.devices), max_batch)
            try:
                for _ in self.devices:
                    self._workers.append(hostwork.Workers(per_device))
            except BaseException:
                self._stop_workers()
                raise
            self.host_workers = sum(len(w) for w in self._workers)

        self._lock = threading.Condition()
        # Submissions and Minibatches (requests.py), each with the count of its positions taken.
        self._queue: "collections.deque[Any]" = collections.deque()
        self._queued = 0  # positions in the queue, not yet taken
        self._closed = False
        self._stats = EvaluatorStats()
        self._replicas: list[_Replica] = []
        try:
            for i, d in enumerate(self.devices):
                self._replicas.append(_Replica(self, file, given, d, self._workers[i] if self._workers else None))
        except BaseException:
            self._replicas = []
            self._stop_workers()
            raise
        self._switch = switch_interval is not None and any(d.type == "cuda" for d in self.devices)
        if self._switch:
            _SWITCH_INTERVAL.shorten(float(switch_interval))
        for r in self._replicas:
            r.start()

    # -- submission --
    def _queue_group(self, group: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("this Evaluator is closed")
            if group.positions:
                self._queue.append(group)
                self._queued += len(group.positions)
                if len(group.positions) == 1:
                    self._lock.notify()
                else:
                    self._lock.notify_all()

    def submit(self, position: Any) -> "Future[Evaluation]":
        """Queue one position; its future's result is the ``Evaluation`` (or the exception
        that position raised: a bad FEN, an illegal move).  RuntimeError after ``close()``."""
        group = Submission([position])
        self._queue_group(group)
        return group.futures[0]

    def submit_many(self, positions: Iterable[Any]) -> "list[Future[Evaluation]]":
        """Queue several positions at once (one lock, one wake-up); their futures in order
        (``concurrent.futures.Future``s that share one condition: lighter to make and set)."""
        group = Submission(list(positions))
        self._queue_group(group)
        return list(group.futures)

    def submit_batch(self, positions: Iterable[Any]) -> "Future[list[Evaluation]]":
        """Queue a minibatch: one future whose result is the list of the positions'
        ``Evaluation``s in order (or the first exception one of them raised; the others are
        still evaluated).  The positions are batched with everyone else's like ``submit``'s,
        but cost one future instead of one each: for an engine whose search gathers its
        positions into minibatches, as lc0's does."""
        batch = Minibatch(list(positions))
        if batch.positions:
            self._queue_group(batch)
        return batch.future

    def evaluate(self, positions: Iterable[Any]) -> list[Evaluation]:
        """Evaluate positions and wait: the ``Evaluation``s in order; raises the exception of
        the first position that failed (the others are still evaluated)."""
        return [f.result() for f in self.submit_many(positions)]

    # -- worker side --
    def _take(self, n: int) -> Optional[list[Part]]:
        """Up to ``n`` positions for a batch, as the parts of the calls that submitted them:
        waits for the first, then up to ``max_wait`` for the batch to fill; None once closed
        and the queue is empty."""
        spans = []
        with self._lock:
            while not self._queue:
                if self._closed:
                    return None
                self._lock.wait()
            if self._queued < n and self.max_wait > 0 and not self._closed:
                deadline = time.monotonic() + self.max_wait
                while self._queued < n and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(left)
            k, queue = 0, self._queue
            while queue and k < n:
                group = queue[0]
                lo = group.taken
                hi = min(len(group.positions), lo + n - k)
                group.taken = hi
                k += hi - lo
                spans.append((group, lo, hi))
                if hi == len(group.positions):
                    queue.popleft()
            self._queued -= k
            if queue:
                self._lock.notify()  # more work left: another worker may take it
        # Futures cancelled by their caller are dropped here; the others can no longer be.
        return [part for part in (g.start(lo, hi) for g, lo, hi in spans) if part is not None]

    def _shared_rows(self) -> Optional[tuple[int, int]]:
        """The next slot's ``(token, index)`` of shared rows (None without them)."""
        if self._shared is None:
            return None
        self._shared_next += 1
        return self._shared.token, self._shared_next - 1

    def _host_job(self, positions: list[Any], rows: Optional[tuple[int, int]], workers: Optional[hostwork.Workers]):
        """The host work of one batch (something with ``result()``): in one of ``workers``
        (writing the encoding into the slot's shared ``rows`` where it has them), or here."""
        if workers is not None:
            return workers.submit(hostwork.pack(positions), self.input_format, rows)
        return hostwork.Job.here(positions, self.input_format)

    def _count(self, stats: EvaluatorStats, positions: int = 0, failed: int = 0, batches: int = 0) -> None:
        with self._lock:
            for s in (stats, self._stats):
                s.positions += positions
                s.failed += failed
                s.batches += batches

    # -- life cycle --
    def close(self, cancel_pending: bool = False) -> None:
        """Stop taking submissions, finish (or with ``cancel_pending``, cancel) what is queued,
        and end the worker threads.  Idempotent."""
        with self._lock:
            self._closed = True
            if cancel_pending:
                while self._queue:
                    self._queue.popleft().cancel_rest()
                self._queued = 0
            self._lock.notify_all()
        for r in self._replicas:
            r.join()
        for r in self._replicas:
            r.release()
        self._stop_workers()
        if self._switch:
            self._switch = False
            _SWITCH_INTERVAL.restore()

    def _stop_workers(self) -> None:
        for workers in self._workers:
            workers.close()
        self._workers.clear()
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def batches_in_flight(self) -> int:
        """Full batches to keep submitted and unanswered so that no device waits: each device's
        slots and 4 queued behind them (fewer expose the host workers' latency)."""
        return (self.pipeline_depth + 4) * len(self.devices)

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """``{"positions", "failed", "batches", "mean_batch", "host_worker_restarts" (workers that
        died and were replaced, their batches run again), "devices": {device: the same, and
        "seconds": wall time per stage (slot_wait and queue_wait: the gather thread waiting for
        a free slot and for positions; host_wait, launch, gpu_wait, decode), "trip_ms": where a
        batch's trip waits (``evalstats.Trips.medians_ms``)}}``: a stage busy for most of the wall
        time is the one that limits."""
        with self._lock:
            out = self._stats.as_dict()
            # Host workers that died (killed, out of memory) and were replaced; their batches ran again.
            out["host_worker_restarts"] = sum(w.restarts for w in self._workers)
            out["devices"] = {str(r.device): {**r.stats.as_dict(), "seconds": dict(r.seconds),
                                              "trip_ms": r.trips.medians_ms()} for r in self._replicas}
        return out

    def __repr__(self) -> str:
        return (f"Evaluator({self.source!r}, devices={[str(d) for d in self.devices]}, dtype={self.dtype}, "
                f"max_batch={self.max_batch}, max_wait_ms={self.max_wait * 1000:g}, closed={self._closed})")

