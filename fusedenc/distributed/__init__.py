"""fusedenc on a Ray cluster: sentence embeddings and Lc0 position evaluation over a
``ray.data.Dataset``, one model per actor (one actor per GPU by default), each actor running
the single-machine code (``fusedenc.embed.encode``: sorted, token-budget batches on the
patched model's graph; ``Lc0Network.evaluate``: the Evaluator's encoding and decoding).

Ray is imported only when a function here runs: ``pip install "fusedenc[ray]"``.  Actors that
die (a killed process, a lost node) are restarted and their blocks run again, so every input
row appears exactly once in the output; a row that cannot be computed (an empty text, an
illegal FEN) gets its ``error`` column set and the job goes on.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["embed", "evaluate_positions", "ray_or_exit", "relabel", "training_frames"]

#: Positions a block hands an actor at once: enough for full batches, small enough that a
#: restarted actor redoes little.
BLOCK_ROWS = 4096
#: Texts a block hands an embedding actor at once.  An H200 actor embeds 4,096 sentences in
#: 47-75 ms (MiniLM, bert-base), about what Ray costs a block (~40 ms, measured on a CPU);
#: 16,384 make that cost a fifth or less and ran 1.07-1.15x 4,096's rate in the actor alone.
#: A restarted actor then redoes ~0.2-0.3 s of work.
EMBED_BLOCK_ROWS = 16384


def ray_or_exit() -> Any:
    """The ``ray`` module, or ``ImportError`` saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ImportError('fusedenc.distributed needs Ray Data: pip install "fusedenc[ray]"') from None
    return ray


def _actor_options(ray: Any, num_gpus: Optional[float]) -> tuple[float, int]:
    """(GPUs an actor takes, how many actors): one a GPU where the cluster has GPUs, else one
    CPU actor."""
    gpus = float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0
    if num_gpus is None:
        num_gpus = 1.0 if gpus else 0.0
    count = max(1, int(gpus // num_gpus)) if num_gpus else 1
    return num_gpus, count


#: Ray's own retries: an actor restarted without limit, a task run again on the new one.
_RETRIES = {"max_restarts": -1, "max_task_retries": -1}


def embed(dataset: Any, model: str, *, text_column: str = "text", output_column: str = "embedding",
          concurrency: Optional[int] = None, num_gpus: Optional[float] = None, device: Optional[str] = None,
          dtype: Optional[str] = None, max_batch_tokens: Optional[int] = None, truncate: bool = True,
          block_rows: int = EMBED_BLOCK_ROWS) -> Any:  # fmt: skip
    """``dataset`` with ``output_column`` (float32 ``[D]`` a row, NaN for a row that failed) and
    ``error`` (None, or why the row has no embedding) added.  ``model``: what
    ``fusedenc.embed.load_model`` takes (a folder on every node, or ``"minilm"``).
    ``concurrency``: actors (default one a GPU, or one); ``num_gpus``: GPUs an actor takes
    (default 1 where the cluster has GPUs, else 0: CPU actors)."""
    ray = ray_or_exit()
    gpus, actors = _actor_options(ray, num_gpus)
    from .actors import Embedder

    return dataset.map_batches(
        Embedder, batch_format="numpy", batch_size=block_rows, concurrency=concurrency or actors, num_gpus=gpus,
        fn_constructor_kwargs=dict(model=model, text_column=text_column, output_column=output_column,
                                   device=device, dtype=dtype, max_batch_tokens=max_batch_tokens, truncate=truncate),
        **_RETRIES)  # fmt: skip


def evaluate_positions(dataset: Any, net: str, *, fen_column: str = "fen", moves_column: Optional[str] = None,
                       concurrency: Optional[int] = None, num_gpus: Optional[float] = None,
                       device: Optional[str] = None, dtype: Optional[str] = None, temperature: float = 1.0,
                       top: Optional[int] = None, block_rows: int = BLOCK_ROWS) -> Any:  # fmt: skip
    """``dataset`` with the net's evaluation of each position added: ``best_move``, ``moves``
    and ``probs`` (every legal move, or the ``top`` most probable, most probable first),
    ``wdl``, ``q``, ``moves_left`` and ``error`` (None, or why the row has no evaluation).
    ``fen_column``: a FEN (or "startpos") a row; ``moves_column``: the UCI moves played since,
    a list or a space-separated string.  ``net``: an lc0 net file on every node."""
    ray = ray_or_exit()
    gpus, actors = _actor_options(ray, num_gpus)
    from .actors import PositionEvaluator

    return dataset.map_batches(
        PositionEvaluator, batch_format="numpy", batch_size=block_rows, concurrency=concurrency or actors,
        num_gpus=gpus, fn_constructor_kwargs=dict(net=net, fen_column=fen_column, moves_column=moves_column,
                                                  device=device, dtype=dtype, temperature=temperature, top=top),
        **_RETRIES)  # fmt: skip


def training_frames(paths: Any, *, max_bytes: Optional[int] = None) -> Any:
    """A dataset of lc0 training frames, one row a position: ``source`` (the file, and the tar
    member), ``index`` (the frame's place in it), ``version``, ``frame`` (its bytes, as lc0
    wrote them) and ``error`` (None; a file that cannot be read, truncated or not lc0's, is one
    row with ``index`` -1, no frame and the reason, and the job goes on).  ``paths``: a file or a list of ``.gz``, plain or ``.tar`` files of frames
    (``fusedenc.lc0.trainingdata.read_frames``), each read by the cluster."""
    ray = ray_or_exit()
    files = [paths] if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__") else list(paths)

    def rows_of(item: dict) -> list[dict]:
        from ..lc0 import trainingdata

        try:
            read = trainingdata.read_frames(item["path"], max_bytes=max_bytes)
            chunks = [read] if isinstance(read, trainingdata.FrameChunk) else list(read)
        except (trainingdata.Lc0FileError, OSError) as exc:  # the file's one row says why; the job goes on
            return [{"source": item["path"], "index": -1, "version": 0, "frame": b"", "error": str(exc)}]
        return [{"source": c.source, "index": i, "version": c.version, "frame": c.frames[i].tobytes(), "error": None}
                for c in chunks for i in range(len(c))]  # fmt: skip

    return ray.data.from_items([{"path": str(p)} for p in files]).flat_map(rows_of)


def relabel(dataset: Any, net: str, *, concurrency: Optional[int] = None, num_gpus: Optional[float] = None,
            device: Optional[str] = None, dtype: Optional[str] = None, block_rows: int = BLOCK_ROWS) -> Any:  # fmt: skip
    """``dataset`` of training frames (``training_frames``) with the net's evaluation beside
    the frame's own: ``net_policy`` (``[1858]``, softmax over the moves the frame marks legal),
    ``net_wdl``, ``net_moves_left`` (where the net has those heads), ``frame_policy``,
    ``frame_result_wdl``, ``frame_best_q``, ``frame_played_idx``.  The planes are the frame's,
    taken as they are."""
    ray = ray_or_exit()
    gpus, actors = _actor_options(ray, num_gpus)
    from .actors import FrameEvaluator

    return dataset.map_batches(FrameEvaluator, batch_format="numpy", batch_size=block_rows,
                               concurrency=concurrency or actors, num_gpus=gpus,
                               fn_constructor_kwargs=dict(net=net, device=device, dtype=dtype), **_RETRIES)  # fmt: skip
