"""Embedding a list of texts the fast way: tokenized in chunks on a worker thread while the
chunks before run, sorted by length, cut into batches by a token budget (so a batch of short
sentences holds many and a batch of passages few), each batch handed over as host tensors to
``sentence_embeddings`` (one copy from pinned memory, the pooling inside the patched model's
graph), each batch's result copied back as it is launched (into pinned memory, without
waiting: the GPU never idles for a copy back) and put in place once the copy is done.
``encode`` is the Python API; ``python -m fusedenc embed`` (``cli.py``) runs it over a file."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..hf import fast_ids, real_models
from ..hf.patch import patch_hf
from ..hf.sentences import sentence_embeddings
from ..hf.token_batches import TOKENIZE_CHUNK, PackedIds, padded_batch, stream_batches, tokenized_chunks
from . import st_folder
from .texts import InputError

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "EncodeStats", "Model", "encode", "load_model"]

#: Padded tokens a batch may hold (batch size x its longest sequence), TEI's default; the
#: number of sequences a batch may hold is capped by the graphs' largest batch bucket.
DEFAULT_MAX_BATCH_TOKENS = 16384
#: Batches whose copies back may be in flight before the oldest is waited for: the GPU's queue
#: is held to a few batches by the pinned input staging anyway (``graphs.feeds``); this bounds
#: the pinned memory where it is not.
_COPIES_IN_FLIGHT = 64


@dataclass
class Model:
    """A model ready to embed: the (patched) module, its fast tokenizer, the longest sequence
    it takes, a label for reports, and how a Hugging Face module's last hidden states become an
    embedding: ``pooling`` (sentence-transformers' modes: mean, cls, max, mean_sqrt_len_tokens;
    None for a ``SentenceTransformer`` module, whose own modules pool) and ``normalize``."""

    module: nn.Module
    tokenizer: Any
    max_length: int
    label: str
    device: torch.device
    dtype: torch.dtype
    pooling: Optional[str] = "mean"
    normalize: bool = True


def load_model(spec: str, *, device: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> Model:
    """``spec``: ``"minilm"`` (the real-models extra's all-MiniLM-L6-v2), a sentence-transformers
    folder (with ``modules.json``: its pooling and normalization; read by ``st_folder`` where its
    layout is the common one, else loaded by sentence-transformers, which must then be
    installed) or a Hugging Face model folder (mean pooling, normalized).
    ``device``: default the GPU if there is one; ``dtype``: default float16 on a GPU, float32
    on a CPU.  The model is patched (``patch_hf``); one that is not BERT-family is refused."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {dev}: no GPU visible to PyTorch ({torch.__version__})")
    dt = dtype if dtype is not None else (torch.float16 if dev.type == "cuda" else torch.float32)
    if spec == "minilm":
        try:
            folder = real_models.minilm_dir()
        except real_models.RealModelMissing as exc:
            raise InputError(str(exc)) from None
    else:
        folder = Path(spec)
        if not folder.is_dir() or not ((folder / "config.json").is_file() or st_folder.is_sentence_folder(folder)):
            raise InputError(f"{spec}: not a model folder (a Hugging Face folder holding config.json or a "
                             f"sentence-transformers folder holding modules.json), nor 'minilm'")  # fmt: skip
    try:
        import transformers
    except ImportError:
        raise InputError("embedding needs transformers: pip install transformers") from None
    # transformers' loading progress bars and notices would bury the command's own lines
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        module, tokenizer, max_length, pooling, normalize = _load(folder, dev, dt, transformers)
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(f"{spec}: its tokenizer is not a fast (Rust) tokenizer; fusedenc embeds with fast ones")
    try:
        patch_hf(module)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{spec}: fusedenc embeds BERT-family models (BERT, RoBERTa, XLM-R, ...): {exc}") from None
    return Model(module, tokenizer, max_length, spec, dev, dt, pooling, normalize)


def _load(folder: Path, dev: torch.device, dt: torch.dtype,
          transformers: Any) -> tuple[nn.Module, Any, int, Optional[str], bool]:  # fmt: skip
    """(module, tokenizer, longest sequence, pooling, normalize) of a sentence-transformers or
    Hugging Face folder (pooling None: a ``SentenceTransformer`` module that pools itself)."""
    if st_folder.is_sentence_folder(folder):
        try:
            layout = st_folder.read_sentence_folder(folder)
        except st_folder.Unsupported as why:
            if not _has_sentence_transformers():
                raise InputError(f"{folder}: {why}: running it needs sentence-transformers "
                                 f"(pip install sentence-transformers)") from None  # fmt: skip
            from sentence_transformers import SentenceTransformer

            module = SentenceTransformer(str(folder), device=str(dev), local_files_only=True)
            module.to(dt)
            tokenizer = module.tokenizer
            return module, tokenizer, int(module.max_seq_length or tokenizer.model_max_length), None, True
        module, tokenizer = _hf_model(layout.transformer, dev, dt, transformers)
        # The reader checked the folder's max_seq_length; _max_length reads it (or the tokenizer's).
        return module, tokenizer, _max_length(module, tokenizer, layout.transformer), layout.pooling, layout.normalize
    module, tokenizer = _hf_model(folder, dev, dt, transformers)
    return module, tokenizer, _max_length(module, tokenizer, folder), "mean", True


def _hf_model(folder: Path, dev: torch.device, dt: torch.dtype, transformers: Any) -> tuple[nn.Module, Any]:
    module = transformers.AutoModel.from_pretrained(str(folder), local_files_only=True)
    module = module.to(device=dev, dtype=dt).eval()
    return module, transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _has_sentence_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("sentence_transformers") is not None


def _max_length(model: nn.Module, tokenizer: Any, folder: Path) -> int:
    """The longest sequence: sentence-transformers' setting where the folder has one, else the
    smaller of the tokenizer's and the position table's (RoBERTa's table starts past its pad)."""
    import json

    st_config = folder / "sentence_bert_config.json"  # sentence-transformers 6 keeps the length in the tokenizer
    setting = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
    if setting is not None:
        return int(setting)
    positions = int(getattr(model.config, "max_position_embeddings", 512))
    if getattr(model.config, "model_type", "") in ("roberta", "xlm-roberta", "camembert", "data2vec-text"):
        positions -= int(getattr(model.config, "pad_token_id", 1) or 1) + 1
    return min(positions, int(tokenizer.model_max_length) if tokenizer.model_max_length < 10**6 else positions)


@dataclass
class EncodeStats:
    """What an ``encode`` call did, and where its time went on the calling thread:
    ``tokenizer_wait_s`` waiting for tokenized texts (the first chunk, tokenized on this thread,
    included), ``model_s`` in the model's calls and the copies back (waits for the GPU
    included), the rest batching and padding.  A large ``tokenizer_wait_s`` means the host's
    cores bound the run."""

    texts: int = 0
    tokens: int = 0
    truncated: int = 0
    batches: int = 0
    seconds: float = 0.0
    tokenizer_wait_s: float = 0.0
    model_s: float = 0.0

    @property
    def texts_per_s(self) -> float:
        return self.texts / self.seconds if self.seconds > 0 else float("inf")


def encode(model: Model, texts: Sequence[str], *, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
           truncate: bool = True, row_name: Optional[Callable[[int], Any]] = None,
           progress: Optional[Callable[[int], None]] = None, workers: Optional[int] = None,
           texts_per_chunk: int = TOKENIZE_CHUNK) -> tuple[np.ndarray, EncodeStats]:  # fmt: skip
    """Float32 ``[len(texts), D]`` embeddings of ``texts`` in their order, and what it took.
    ``row_name(i)`` names text ``i`` in errors; ``progress(n)`` is told of every ``n`` texts done.

    The texts are tokenized in chunks of ``texts_per_chunk`` on ``workers`` threads while the chunks before run
    (``hf.token_batches.tokenized_chunks``; default one, the fast tokenizer spreading each
    chunk over the cores itself: ``tokenizer_threads``), and cut into batches across chunks
    (``stream_batches``); a text longer than the model takes is truncated
    (its closing special token kept) and counted, or, with ``truncate=False``, refused before
    anything runs (every chunk is then tokenized first)."""
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    if texts_per_chunk < 1:
        raise ValueError(f"texts_per_chunk must be >= 1, got {texts_per_chunk}")
    t0 = time.perf_counter()
    stats = EncodeStats(texts=len(texts))
    first_row = row_name or (lambda i: f"text {i}")
    tok = model.tokenizer

    def tokenize(chunk: list) -> list:
        return tok(chunk, add_special_tokens=True, truncation=False, return_attention_mask=False,
                   return_token_type_ids=False, verbose=False)["input_ids"]  # fmt: skip

    # The backend's ids where a sample of these texts shows them equal to the call's: the call's
    # Python half costs as much host time as the tokenizing (``hf.fast_ids``).
    tokenize = fast_ids.checked(texts, fast_ids.backend_ids(tok), tokenize, model.max_length)
    chunks = tokenized_chunks(texts, lambda chunk: PackedIds.pack(tokenize(chunk)), texts_per_chunk, workers)
    if not truncate:  # every text checked before anything runs
        t = time.perf_counter()
        chunks = list(chunks)
        stats.tokenizer_wait_s += time.perf_counter() - t
        long = {int(rows[i]): int(ids.lengths[i]) for rows, ids in chunks
                for i in np.flatnonzero(ids.lengths > model.max_length)}  # fmt: skip
        if long:
            where = min(long)
            raise InputError(f"{first_row(where)}: {long[where]} tokens, more than the model's {model.max_length} "
                             f"({len(long)} such texts; without --no-truncate they are truncated)")  # fmt: skip
    pad = tok.pad_token_id or 0
    pooled_as = {} if model.pooling is None else {"pooling": model.pooling, "normalize": model.normalize}
    out: Optional[np.ndarray] = None
    # (rows, host embeddings, the event of their copy or None): copied back, not yet in place
    in_flight: deque = deque()

    def place(keep: int) -> None:
        """Put in place the batches whose copy back is done, and wait for the oldest until at
        most ``keep`` are left in flight."""
        nonlocal out
        while in_flight and (len(in_flight) > keep or in_flight[0][2] is None or in_flight[0][2].query()):
            rows, host, copied = in_flight.popleft()
            if copied is not None:
                t = time.perf_counter()
                copied.synchronize()
                stats.model_s += time.perf_counter() - t
            done = host.numpy()
            if out is None:
                out = np.empty((len(texts), done.shape[1]), dtype=np.float32)
            out[rows] = done
            if progress is not None:
                progress(done.shape[0])

    def copy_back(rows: np.ndarray, emb: torch.Tensor) -> None:
        """Start ``emb``'s copy to the host behind the batch's work on the GPU's stream."""
        emb = emb.float()
        if emb.device.type != "cuda":
            in_flight.append((rows, emb, None))
            return
        host = torch.empty(emb.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(emb, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(emb.device))
        in_flight.append((rows, host, copied))

    def waited(tokenized):  # each chunk, with the time spent waiting for it counted
        it = iter(tokenized)
        while True:
            t = time.perf_counter()
            item = next(it, None)
            stats.tokenizer_wait_s += time.perf_counter() - t
            if item is None:
                return
            yield item

    def truncated(tokenized):
        for rows, ids in waited(tokenized):
            over = np.flatnonzero(ids.lengths > model.max_length)
            if len(over):  # keep the closing special token: the model saw [CLS] ... [SEP]
                starts = ids.starts[over]
                ids.flat[starts + model.max_length - 1] = ids.flat[starts + ids.lengths[over] - 1]
                ids.lengths[over] = model.max_length
                stats.truncated += len(over)
            stats.tokens += int(ids.lengths.sum())
            yield rows, ids, None

    with torch.inference_mode():
        for rows, ids, _, _ in stream_batches(truncated(chunks), max_batch_tokens):
            batch, mask = padded_batch(ids, pad)
            # No token types: each text is one segment, all type 0, which is what the model
            # takes without them (and the ids go over alone).
            t = time.perf_counter()
            emb = sentence_embeddings(model.module, torch.from_numpy(batch), torch.from_numpy(mask), **pooled_as)
            copy_back(rows, emb)
            stats.model_s += time.perf_counter() - t
            stats.batches += 1
            place(keep=_COPIES_IN_FLIGHT)
        place(keep=0)
    stats.seconds = time.perf_counter() - t0
    return out, stats
