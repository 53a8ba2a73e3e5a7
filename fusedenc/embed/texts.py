"""Reading a corpus: one text a line (``.txt``), a field of JSON lines (``.jsonl``) or a
column of a Parquet file (``.parquet``), each text with its row id.  Every problem is an
``InputError`` naming the file and the row, raised before anything is embedded; nothing is
dropped without a count in ``Corpus.notes``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

__all__ = ["FORMATS", "Corpus", "InputError", "read_corpus"]

FORMATS = (".txt", ".jsonl", ".parquet")


class InputError(ValueError):
    """A corpus, model or output the embedding command cannot take (its message names which)."""


@dataclass
class Corpus:
    """The texts of a file in input order, with their ids (the line number of a text file or a
    JSON-lines file, starting at 1, or the row number of a Parquet file, starting at 0, unless
    an id field or column is named)."""

    path: Path
    ids: list
    texts: list[str]
    notes: list[str] = field(default_factory=list)


def read_corpus(path: str | Path, *, field: str = "text", id_field: Optional[str] = None,
                empty: str = "error") -> Corpus:  # fmt: skip
    """The texts of ``path``.  ``field``: the JSON field or Parquet column holding the text
    (a ``.txt`` file is one text a line); ``id_field``: one holding each row's id.  ``empty``:
    what an empty text does, ``"error"`` (refused, naming the row) or ``"skip"`` (left out and
    counted in ``notes``)."""
    path = Path(path)
    if empty not in ("error", "skip"):
        raise ValueError(f"empty must be 'error' or 'skip', got {empty!r}")
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise InputError(f"{path}: unknown input format {suffix or '(no suffix)'!r}: use one of {', '.join(FORMATS)}")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if suffix == ".parquet":
        ids, texts = _parquet(path, field, id_field)
    else:
        ids, texts = _lines(path, suffix == ".jsonl", field, id_field)
    keep = [i for i, t in enumerate(texts) if t.strip()]
    notes = []
    if len(keep) < len(texts):
        where = "line" if suffix != ".parquet" else "row"
        first = ids[next(i for i, t in enumerate(texts) if not t.strip())]
        if empty == "error":
            raise InputError(f"{path}: {where} {first}: empty text ({len(texts) - len(keep)} in all; "
                             f"--empty skip leaves them out)")  # fmt: skip
        notes.append(f"{len(texts) - len(keep)} empty texts left out (the first: {where} {first})")
        ids, texts = [ids[i] for i in keep], [texts[i] for i in keep]
    if not texts:
        raise InputError(f"{path}: no texts")
    return Corpus(path, ids, texts, notes)


def _lines(path: Path, jsonl: bool, field: str, id_field: Optional[str]) -> tuple[list, list[str]]:
    ids, texts = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}: line {number}: not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None
            line = line.rstrip("\r\n")
            if not jsonl:
                ids.append(number)
                texts.append(line)
                continue
            if not line.strip():
                continue  # blank lines between JSON records
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}: line {number}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise InputError(f"{path}: line {number}: no field {field!r} (--field names the text's field)")
            text = record[field]
            if not isinstance(text, str):
                raise InputError(f"{path}: line {number}: field {field!r} is {type(text).__name__}, not a string")
            if id_field is not None and id_field not in record:
                raise InputError(f"{path}: line {number}: no id field {id_field!r}")
            ids.append(record[id_field] if id_field is not None else number)
            texts.append(text)
    return ids, texts


def _parquet(path: Path, column: str, id_column: Optional[str]) -> tuple[list, list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors have no common base: one message
        raise InputError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    for name, option in ((column, "--column"), (id_column, "--id-column")):
        if name is not None and name not in table.column_names:
            raise InputError(f"{path}: no column {name!r} (columns: {', '.join(table.column_names)}; "
                             f"{option} names it)")  # fmt: skip
    texts = table.column(column).to_pylist()
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputError(f"{path}: row {row}: column {column!r} holds {type(text).__name__}, not a string")
    ids = table.column(id_column).to_pylist() if id_column else list(range(len(texts)))
    return ids, texts
