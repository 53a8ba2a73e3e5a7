"""Attention tables: which backend to prefer for a call, by architecture and call shape.

``fusedenc/configs/attention_<arch>.json`` ships with the package (else
``attention_default.json``); ``python -m fusedenc.tune attention`` writes a
measured user table to ``$FUSEDENC_CONFIG_DIR/attention_<arch>.json``, whose
rules are tried before the shipped ones.  A user table measured on another
device or library version, or one that does not parse, is ignored with one
``AttentionTableWarning`` per file and process.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import threading
from typing import Optional

import torch

from ..common import dtypes, table_files
from ..common.device import device_arch, device_metadata
from .backends import BACKENDS
from .call import BATCH_HEADS_BUCKET_NAMES, EXTRAS, SEQ_BUCKET_NAMES, AttentionCall

__all__ = [
    "METADATA_KEYS",
    "TABLE_SCHEMA",
    "AttentionTableWarning",
    "Table",
    "TableError",
    "clear_tables",
    "load_shipped",
    "load_user",
    "parse_table",
    "tables_for",
    "user_table_path",
]

#: Schema tag of every table file; a file with another tag is ignored.
TABLE_SCHEMA = "fusedenc.attention-table/1"
#: What a user table's ``measured_with`` must match on this machine.
METADATA_KEYS = ("device_name", "multiprocessor_count", "torch", "cuda", "hip", "cudnn")


class AttentionTableWarning(UserWarning):
    """A user attention table was ignored (other device/library, or unreadable)."""


def user_table_path(device: torch.device | str = "cuda") -> str:
    """Where the tuner writes, and the loader reads, the user table of ``device``'s architecture."""
    return _user_table_file(device_arch(device))


def _user_table_file(arch: str) -> str:
    return os.path.join(table_files.config_dir(), f"attention_{arch}.json")


_MATCH_FIELDS = ("dtype", "head_dim", "seq", "batch_heads", "extras")


class TableError(ValueError):
    """What is wrong with an attention table."""


@dataclasses.dataclass(frozen=True)
class Table:
    """A parsed table: its rules, tried in order; the first that matches a key wins."""

    path: str
    kind: str  # "user" or "shipped"
    source: str
    rules: tuple[dict, ...]

    def match(self, key: dict) -> Optional[dict]:
        for rule in self.rules:
            m = rule.get("match", {})
            if all(m.get(field, "*") in ("*", key[field]) for field in _MATCH_FIELDS):
                return rule
        return None


def parse_table(text: str, path: str, kind: str, arch: str) -> tuple[Table, Optional[dict]]:
    obj, measured = table_files.parse_file_header(
        text, TABLE_SCHEMA, (arch, "*"), arch, METADATA_KEYS, TableError, measured_optional=True
    )
    if kind == "user" and measured is None:
        raise TableError("a user table must say what it was measured with (measured_with)")
    rules = obj.get("rules")
    if not isinstance(rules, list):
        raise TableError("rules must be a list")
    allowed = {
        "dtype": set(dtypes.BY_NAME),
        "seq": set(SEQ_BUCKET_NAMES),
        "batch_heads": set(BATCH_HEADS_BUCKET_NAMES),
        "extras": set(EXTRAS),
    }
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or not isinstance(rule.get("match", {}), dict):
            raise TableError(f"rules[{i}] must be an object with a 'match' object")
        for field, value in rule.get("match", {}).items():
            if value == "*":
                continue
            if field == "head_dim":
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise TableError(f"rules[{i}].match.head_dim={value!r} is not a positive int or '*'")
            elif field not in allowed:
                raise TableError(f"rules[{i}].match has unknown field {field!r}")
            elif value not in allowed[field]:
                raise TableError(f"rules[{i}].match.{field}={value!r} is not one of {sorted(allowed[field])}")
        names = rule.get("backends")
        if not isinstance(names, list) or not names or not all(n in BACKENDS for n in names):
            raise TableError(f"rules[{i}].backends must be a non-empty list of names from {sorted(BACKENDS)}")
    return Table(path, kind, str(obj.get("source", "")), tuple(rules)), measured


_warned_paths: set[str] = set()


def _warn_ignored(path: str, why: str) -> None:
    table_files.warn_once_per_file(
        _warned_paths, path,
        f"fusedenc: ignoring attention table {path}: {why}. Re-run `python -m fusedenc.tune attention` "
        "on this machine to measure a new one; until then the shipped table is used.",
        AttentionTableWarning,
        stacklevel=8,  # the caller of attention()
    )  # fmt: skip


def load_shipped(arch: str) -> Optional[Table]:
    """The shipped table of ``arch`` (``configs/attention_<arch>.json``, else the default one)."""
    root = importlib.resources.files("fusedenc.configs")
    for name in (f"attention_{arch}.json", "attention_default.json"):
        res = root / name
        if res.is_file():
            wanted = "*" if name == "attention_default.json" else arch
            table, _ = parse_table(res.read_text(encoding="utf-8"), str(res), "shipped", wanted)
            return table
    return None


def load_user(arch: str, device: torch.device) -> Optional[Table]:
    """The user table of ``arch`` when it exists, parses and was measured on this setup; else None
    (with one ``AttentionTableWarning`` per file and process, unless it is simply absent)."""
    path = _user_table_file(arch)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn_ignored(path, f"cannot be read ({exc})")
        return None
    try:
        table, measured = parse_table(text, path, "user", arch)
    except TableError as exc:
        _warn_ignored(path, str(exc))
        return None
    diffs = table_files.metadata_differences(measured, device_metadata(device), METADATA_KEYS)
    if diffs:
        _warn_ignored(path, "measured on another device or library version (" + "; ".join(diffs) + ")")
        return None
    return table


_tables: dict[tuple[str, int], tuple[Optional[Table], Optional[Table]]] = {}
_lock = threading.Lock()


def tables_for(call: AttentionCall) -> tuple[Optional[Table], Optional[Table]]:
    """(user table, shipped table) of the call's device, each loaded once."""
    key = (call.device_type, call.device_index)
    found = _tables.get(key)
    if found is None:
        with _lock:
            found = _tables.get(key)
            if found is None:
                dev = torch.device(call.device_type, call.device_index)
                found = (load_user(call.arch, dev), load_shipped(call.arch))
                _tables[key] = found
    return found


def clear_tables() -> None:
    """Forget the loaded tables (they are read again at the next plan)."""
    with _lock:
        _tables.clear()
