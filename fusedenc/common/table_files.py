"""What every measured table file shares: where it lives, how it opens, how it is written.

Two kinds of files are measured on the user's machine by ``python -m
fusedenc.tune``: GEMM tuning files (``core/gemm_tuning.py``) and attention tables
(``attention/tables.py``).  Both live in ``$FUSEDENC_CONFIG_DIR`` (default
``~/.cache/fusedenc``), open with the same header (a schema tag, the GPU
architecture, what they were measured with), are written atomically, and are
ignored with one warning per file and process when they do not fit this machine.
"""

from __future__ import annotations

import datetime
import json
import os
import warnings
from typing import Any, Callable, Optional

__all__ = [
    "CONFIG_DIR_ENV",
    "config_dir",
    "entries_to_keep",
    "measured_by",
    "metadata_differences",
    "parse_file_header",
    "warn_once_per_file",
    "write_json_atomically",
]

#: Directory of user tuning files and attention tables.
CONFIG_DIR_ENV = "FUSEDENC_CONFIG_DIR"


def config_dir() -> str:
    return os.environ.get(CONFIG_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fusedenc")


def parse_file_header(
    text: str,
    schema: str,
    arches: tuple[str, ...],
    device_arch: str,
    measured_keys: tuple[str, ...],
    error: type[Exception],
    measured_optional: bool,
) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(the file's JSON object, its ``measured_with``) after the checks every table file shares.

    A JSON object with ``schema``, an ``arch`` among ``arches`` and ``measured_with``, an
    object holding ``measured_keys`` (or null, where ``measured_optional``: the shipped
    attention tables are not measured on the user's machine).  Raises ``error`` saying what
    is wrong.
    """
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise error(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise error("top level is not a JSON object")
    if obj.get("schema") != schema:
        raise error(f"schema is {obj.get('schema')!r}, expected {schema!r}")
    if obj.get("arch") not in arches:
        raise error(f"arch is {obj.get('arch')!r}, this device is {device_arch!r}")
    measured = obj.get("measured_with")
    if measured is None and measured_optional:
        return obj, None
    if not (isinstance(measured, dict) and all(k in measured for k in measured_keys)):
        null = "null or " if measured_optional else ""
        raise error(f"measured_with must be {null}an object with keys {list(measured_keys)}")
    return obj, measured


def metadata_differences(measured: dict[str, Any], here: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """``key: file X, here Y`` for each of ``keys`` where a file's ``measured_with`` differs from this machine."""
    return [f"{k}: file {measured.get(k)!r}, here {here.get(k)!r}" for k in keys if measured.get(k) != here.get(k)]


def warn_once_per_file(seen: set[str], path: str, message: str, category: type[Warning], stacklevel: int) -> None:
    """Warn about a user file once per process (``seen`` holds the paths already reported)."""
    if path in seen:
        return
    seen.add(path)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def entries_to_keep(
    path: str,
    *,
    replace: bool,
    parse: Callable[[str], tuple[Optional[dict[str, Any]], list]],
    here: dict[str, Any],
    keys: tuple[str, ...],
) -> list:
    """What a tuner's new file keeps of the file already at ``path``: its entries
    (``parse(text) -> (measured_with, entries)``) when it parses and was measured on this
    setup (``here`` on ``keys``), as the loader would judge it; none with ``replace``, when
    the file is absent, or when it does not fit.  The caller drops the problems it re-measured."""
    if replace or not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            measured, entries = parse(f.read())
    except (OSError, ValueError):
        return []
    if measured is None or metadata_differences(measured, here, keys):
        return []
    return entries


def write_json_atomically(path: str, obj: dict) -> None:
    """Write a table so that a reader (another process starting) never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def measured_by(subcommand: str) -> str:
    """The ``source`` line of a file written by ``python -m fusedenc.tune <subcommand>``."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"measured by `python -m fusedenc.tune {subcommand}` on {now}"
