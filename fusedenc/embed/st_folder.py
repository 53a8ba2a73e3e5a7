"""What a sentence-transformers model folder computes, read from its files without importing
sentence-transformers.

A saved ``SentenceTransformer`` is a folder with ``modules.json`` listing its modules in order,
each in a subfolder with its own config.  The layout fusedenc runs by itself is the common one:
a ``Transformer`` (a Hugging Face model folder, often the folder itself), a ``Pooling`` with one
mode the patched model's graph computes (mean, CLS, max, mean-sqrt-length), optionally a
``Normalize``, and no default prompt.  Read here, the embedding command needs neither
sentence-transformers nor its import time (several seconds: it imports scikit-learn) for such a
folder, and pools as the folder says even where sentence-transformers is not installed (a
CLS-pooled model must not be mean-pooled).  Any other layout (a ``Dense`` module, weighted-mean
or last-token pooling, lower-casing done by sentence-transformers, a default prompt, settings
this reader does not know) is ``Unsupported``, with the reason: sentence-transformers' own
modules must run it.

Both config spellings are read: the ``pooling_mode_*`` flags and ``sentence_bert_config.json``
with ``max_seq_length`` of releases before 6, and the ``pooling_mode`` name of 6 on (which
keeps the longest sequence in the tokenizer's ``model_max_length``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..hf.embedded import POOLING_MODES

__all__ = ["SentenceFolder", "Unsupported", "is_sentence_folder", "read_sentence_folder"]

#: Legacy ``Pooling`` flags (sentence-transformers < 6) and the mode each one names.
_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
#: ``sentence_bert_config.json`` settings that leave the Transformer module a plain HF forward
#: returning the last hidden state, with the values that do.
_PLAIN_TRANSFORMER = {
    "transformer_task": "feature-extraction",
    "module_output_name": "token_embeddings",
    "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
    "do_lower_case": False,
}


class Unsupported(Exception):
    """A sentence-transformers folder that only sentence-transformers' own modules compute."""


@dataclass(frozen=True)
class SentenceFolder:
    """A sentence-transformers folder fusedenc runs by itself."""

    transformer: Path  # the Hugging Face model folder (config.json, weights, tokenizer)
    pooling: str  # one of hf.embedded.POOLING_MODES
    normalize: bool  # a Normalize module follows the pooling


def is_sentence_folder(folder: Path) -> bool:
    return (Path(folder) / "modules.json").is_file()


def read_sentence_folder(folder: Path) -> SentenceFolder:
    """``folder``'s modules as fusedenc runs them; ``Unsupported`` (with the reason) for a layout
    only sentence-transformers computes, or for files that cannot be read as sentence-transformers
    writes them."""
    folder = Path(folder)
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                for m in modules):  # fmt: skip
        raise Unsupported("modules.json is not a list of modules with a type each")
    kinds = [_kind(m["type"]) for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or kinds[2:] not in ([], ["Normalize"]):
        raise Unsupported(f"its modules are {', '.join(m['type'] for m in modules)}; fusedenc runs Transformer, "
                          f"Pooling and optionally Normalize by itself")  # fmt: skip
    transformer = folder / str(modules[0].get("path", ""))
    if not (transformer / "config.json").is_file():
        raise Unsupported(f"its Transformer module's folder {transformer} holds no config.json")
    settings = _json(transformer / "sentence_bert_config.json", missing={})
    if not isinstance(settings, dict):
        raise Unsupported("sentence_bert_config.json is not a JSON object")
    max_seq_length = settings.get("max_seq_length")
    for key, value in settings.items():
        if key != "max_seq_length" and _PLAIN_TRANSFORMER.get(key, object()) != value:
            raise Unsupported(f"its Transformer module sets {key}={value!r} (sentence_bert_config.json)")
    if max_seq_length is not None and (isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int)
                                       or max_seq_length < 2):  # fmt: skip
        raise Unsupported(f"max_seq_length {max_seq_length!r} in sentence_bert_config.json is not a length")
    pooling = _pooling_mode(_json(folder / str(modules[1].get("path", "")) / "config.json"))
    options = _json(folder / "config_sentence_transformers.json", missing={})
    if not isinstance(options, dict):
        raise Unsupported("config_sentence_transformers.json is not a JSON object")
    prompt = options.get("default_prompt_name")
    if prompt and (options.get("prompts") or {}).get(prompt):
        raise Unsupported(f"its default prompt {prompt!r} is added to every text (config_sentence_transformers.json)")
    return SentenceFolder(transformer, pooling, kinds[2:] == ["Normalize"])


def _kind(type_name: str) -> str:
    """``Transformer``, ``Pooling`` or ``Normalize`` for sentence-transformers' own modules
    (``sentence_transformers.models.Pooling`` before 6, ``....modules.pooling.Pooling`` since),
    else the full type name (a module of another package)."""
    package, _, name = type_name.rpartition(".")
    return name if package.split(".")[0] == "sentence_transformers" else type_name


def _pooling_mode(config: Any) -> str:
    if not isinstance(config, dict):
        raise Unsupported("its Pooling config is not a JSON object")
    mode = config.get("pooling_mode")
    if mode is None:  # releases before 6: one flag a mode, none set means mean
        modes = [name for flag, name in _LEGACY_FLAGS.items() if config.get(flag)]
        mode = modes[0] if len(modes) == 1 else (modes or "mean")
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str):
        raise Unsupported(f"its Pooling concatenates the modes {mode}")
    if mode not in POOLING_MODES:
        raise Unsupported(f"its Pooling mode is {mode!r}; fusedenc pools {', '.join(POOLING_MODES)}")
    return mode


def _json(path: Path, missing: Any = None) -> Any:
    if not path.is_file():
        if missing is not None:
            return missing
        raise Unsupported(f"{path.name} is missing from {path.parent}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Unsupported(f"{path} is not JSON ({exc})") from None
