"""The classes Ray Data makes one of per actor (``map_batches``): each loads its model once and
then turns blocks of rows (numpy batches: a dict of column arrays) into the same rows with
the results added.  Plain classes: nothing here imports Ray, so they run (and are tested)
without it too."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..common.dtypes import CLI_NAMES
from ..embed import embedding


def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in CLI_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(CLI_NAMES)}, got {name!r}")
    return CLI_NAMES[name]


def _load_net(net: str, device: Optional[str], dtype: Optional[str]):
    """The net on ``device`` (default the GPU if there is one) in ``dtype`` (default fp16 on
    a GPU, fp32 on a CPU), as the Lc0 CLI picks them."""
    from ..lc0 import load_network

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return load_network(net, device=dev, dtype=_dtype(dtype) or (torch.float16 if dev.startswith("cuda") else torch.float32))


def _column(batch: dict, name: str) -> np.ndarray:
    if name not in batch:
        raise KeyError(f"the dataset has no column {name!r} (it has {', '.join(batch)})")
    return batch[name]


class Embedder:
    """Sentence embeddings of a text column (``fusedenc.distributed.embed``)."""

    def __init__(self, model: str, text_column: str = "text", output_column: str = "embedding",
                 device: Optional[str] = None, dtype: Optional[str] = None, max_batch_tokens: Optional[int] = None,
                 truncate: bool = True) -> None:  # fmt: skip
        self.model = embedding.load_model(model, device=device, dtype=_dtype(dtype))
        self.text_column, self.output_column = text_column, output_column
        self.max_batch_tokens = max_batch_tokens or embedding.DEFAULT_MAX_BATCH_TOKENS
        self.truncate = truncate
        # One text now: the width every block's column has (a block of failed rows too), and
        # the model's first call (planning, a graph) before the first block.
        self.width = embedding.encode(self.model, ["fusedenc"])[0].shape[1]

    def __call__(self, batch: dict) -> dict:
        texts = _column(batch, self.text_column)
        errors: list[Optional[str]] = [None] * len(texts)
        good = []
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                errors[i] = f"not a text: {type(t).__name__}"
            elif not t.strip():
                errors[i] = "empty text"
            else:
                good.append(i)
        emb = None
        if good:
            try:
                emb, _ = embedding.encode(self.model, [texts[i] for i in good], max_batch_tokens=self.max_batch_tokens,
                                          truncate=self.truncate, row_name=lambda j: f"row {good[j]} of the block")  # fmt: skip
            except embedding.InputError as exc:  # --no-truncate: the whole block's texts one by one
                emb = self._one_by_one([texts[i] for i in good], good, errors, exc)
        out = np.full((len(texts), self.width), np.nan, dtype=np.float32)
        if emb is not None and len(good):
            out[good] = emb
        batch[self.output_column] = out
        batch["error"] = np.array(errors, dtype=object)
        return batch

    def _one_by_one(self, texts, good, errors, first: Exception) -> Optional[np.ndarray]:
        """A block where a text is refused (too long with ``truncate=False``): each text alone,
        so that only the refused ones get an error."""
        rows, kept = [], []
        for text, i in zip(texts, good):
            try:
                e, _ = embedding.encode(self.model, [text], truncate=self.truncate)
            except embedding.InputError as exc:
                errors[i] = str(exc).split(": ", 1)[-1]
                continue
            rows.append(e[0])
            kept.append(i)
        if not rows:
            return None
        out = np.full((len(good), self.width), np.nan, dtype=np.float32)
        where = {i: k for k, i in enumerate(good)}
        for i, r in zip(kept, rows):
            out[where[i]] = r
        return out


class PositionEvaluator:
    """An Lc0 net's evaluation of a column of FENs (``fusedenc.distributed.evaluate_positions``)."""

    def __init__(self, net: str, fen_column: str = "fen", moves_column: Optional[str] = None,
                 device: Optional[str] = None, dtype: Optional[str] = None, temperature: float = 1.0,
                 top: Optional[int] = None) -> None:  # fmt: skip
        self.net = _load_net(net, device, dtype)
        self.fen_column, self.moves_column = fen_column, moves_column
        self.temperature, self.top = temperature, top

    def __call__(self, batch: dict) -> dict:
        from ..lc0 import prepare

        fens = _column(batch, self.fen_column)
        moves = _column(batch, self.moves_column) if self.moves_column else [None] * len(fens)
        n = len(fens)
        errors: list[Optional[str]] = [None] * n
        positions, good = [], []
        for i, (fen, played) in enumerate(zip(fens, moves)):
            played = played.split() if isinstance(played, str) else list(played) if played is not None else []
            position = (fen, played) if played else fen
            try:
                prepare([position])  # each row checked alone: a bad one fails only itself
            except (ValueError, TypeError) as exc:
                errors[i] = str(exc).removeprefix("position 0 ")
                continue
            positions.append(position)
            good.append(i)
        evaluations = self.net.evaluate(positions, temperature=self.temperature) if positions else []
        best = np.full(n, None, dtype=object)
        move_lists, prob_lists = np.full(n, None, dtype=object), np.full(n, None, dtype=object)
        wdl = np.full((n, 3), np.nan, dtype=np.float32)
        q = np.full(n, np.nan, dtype=np.float32)
        left = np.full(n, np.nan, dtype=np.float32)
        k = self.top
        for i, ev in zip(good, evaluations):
            best[i] = ev.best_move
            move_lists[i] = list(ev.moves[:k])
            # Python lists, not arrays: every block then gives Arrow the same list<float> column
            # (arrays make a tensor column in some blocks and a list in others, which Ray cannot
            # join into one Parquet file).
            prob_lists[i] = [float(p) for p in ev.probs[:k]]
            q[i] = ev.q
            if ev.wdl is not None:
                wdl[i] = ev.wdl
            if ev.moves_left is not None:
                left[i] = ev.moves_left
        batch.update(best_move=best, moves=move_lists, probs=prob_lists, wdl=wdl, q=q, moves_left=left,
                     error=np.array(errors, dtype=object))  # fmt: skip
        return batch


class FrameEvaluator:
    """An Lc0 net's evaluation of lc0 training frames (``fusedenc.distributed.relabel``): the
    planes taken as the frame stores them, the net's policy (softmax over the moves the frame
    marks legal: probabilities >= 0) beside the frame's own policy and result.  A row of no
    frame (a file ``training_frames`` could not read) or of a frame of no known size keeps its
    ``error`` and gets NaN (zeros for integers) in the new columns."""

    def __init__(self, net: str, device: Optional[str] = None, dtype: Optional[str] = None) -> None:
        from ..lc0 import trainingdata

        self.net = _load_net(net, device, dtype)
        param = next(self.net.parameters())
        self.device, self.dtype = param.device, param.dtype
        # The new columns' names, shapes and dtypes, from an empty frame of the net's format: a
        # block whose rows all failed still gets every column (Ray joins blocks by schema).
        blank = np.zeros(1, dtype=trainingdata.FRAME_DTYPES[6])
        blank["version"], blank["input_format"] = 6, int(self.net.input_format)
        self.columns = {name: (v.shape[1:], v.dtype) for name, v in self._evaluate(blank).items()}

    def __call__(self, batch: dict) -> dict:
        from ..lc0 import trainingdata

        raw = [bytes(f) for f in _column(batch, "frame")]
        n = len(raw)
        # A column of errors that are all None reaches a block as NaNs (Ray's numpy batches)
        given = _column(batch, "error") if "error" in batch else [None] * n
        errors: list[Optional[str]] = [e if isinstance(e, str) and e else None for e in given]
        sizes = {d.itemsize: v for v, d in trainingdata.FRAME_DTYPES.items()}
        groups: dict[int, list[int]] = {}
        for i, f in enumerate(raw):  # a block may hold V6 and V7 files' frames: one group a size
            if errors[i] is not None:
                continue  # a file that could not be read (training_frames): its row says why
            if len(f) not in sizes:
                errors[i] = f"a frame of {len(f)} bytes: lc0's training frames are {sorted(sizes)} bytes"
                continue
            groups.setdefault(len(f), []).append(i)
        out = {name: np.full((n, *shape), np.nan if np.issubdtype(dtype, np.floating) else 0, dtype=dtype)
               for name, (shape, dtype) in self.columns.items()}  # fmt: skip
        for size, rows in groups.items():
            frames = np.frombuffer(b"".join(raw[i] for i in rows), dtype=trainingdata.FRAME_DTYPES[sizes[size]])
            for name, values in self._evaluate(frames).items():
                out[name][rows] = values
        batch.update(out)
        batch["error"] = np.array(errors, dtype=object)
        return batch

    def _evaluate(self, frames: np.ndarray) -> dict:
        """The new columns for frames of one version."""
        from ..lc0 import trainingdata

        targets = trainingdata.frame_targets(frames)
        planes = torch.from_numpy(trainingdata.frames_to_planes(frames)).to(self.device, self.dtype)
        with torch.inference_mode():
            heads = self.net(planes)
        legal = targets["probabilities"] >= 0
        logits = heads["policy"].float().cpu().numpy()
        logits = np.where(legal, logits, -np.inf)
        logits -= logits.max(axis=1, keepdims=True)
        policy = np.exp(logits)
        policy /= policy.sum(axis=1, keepdims=True)
        out = {"net_policy": policy.astype(np.float32)}
        if "wdl" in heads:  # already probabilities
            out["net_wdl"] = heads["wdl"].float().cpu().numpy()
        if "moves_left" in heads:
            out["net_moves_left"] = heads["moves_left"].float().reshape(-1).cpu().numpy()
        out.update(frame_policy=targets["probabilities"], frame_result_wdl=targets["result_wdl"],
                   frame_best_q=targets["best_q"], frame_played_idx=targets["played_idx"])  # fmt: skip
        return out
