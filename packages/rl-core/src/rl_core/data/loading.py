"""Reading rows from local data files, each row remembering where it came from.

Owns: .jsonl, .json (a list of objects, or ``{"split": [...]}``), .parquet, folders
written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, and
comma-separated lists of those (concatenated in order). Every row is a :class:`Row`,
a ``dict`` that also carries its file and 1-based line (JSONL) or row number, so a
problem found later, while tokenizing, can point at the exact record.

Leaves out: hub downloads (a name that is not a local path is an error), streaming,
mixing datasets by probability (:mod:`rl_core.data.blending`), and anything about columns'
meaning (:mod:`rl_core.data.datasets`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

VALID_FORMATS = ".jsonl, .json, .parquet, or a folder written by datasets' save_to_disk"


class DataError(ValueError):
    """A data file or row is malformed; the message names the place and the fix."""


class MissingDataFile(DataError, FileNotFoundError):
    """A dataset path that does not exist (both a DataError and a FileNotFoundError)."""


class Row(dict):
    """One record: a plain ``dict`` of its columns, plus ``source`` (the file) and
    ``number`` (1-based; the line number for JSONL, the row number otherwise)."""

    __slots__ = ("source", "number", "unit")

    def __init__(self, data: dict, source: str, number: int, unit: str = "row") -> None:
        super().__init__(data)
        self.source = source
        self.number = number
        self.unit = unit

    @property
    def where(self) -> str:
        return f"{self.source} {self.unit} {self.number}"


def where_of(row: object, index: int) -> str:
    """Where ``row`` (the ``index``-th, 0-based, of a list) came from, for error messages."""
    if isinstance(row, Row):
        return row.where
    return f"rows[{index}] (row {index + 1})"


def load_rows(
    path: str | os.PathLike, split: str = "train", max_samples: int | None = None, *, skip_bad: bool = False
) -> list[Row]:
    """All rows of ``path`` (see the module docstring for formats), at most ``max_samples``.

    ``split`` picks the split of a ``{"split": [...]}`` JSON file or a saved DatasetDict.
    Raises :class:`DataError` for unreadable or malformed data, naming file and line (and the byte offset of
    bytes that are not UTF-8). ``skip_bad`` (``--skip_bad_rows``): a JSON Lines line that is not UTF-8 or not
    JSON is skipped instead, and the skipped lines are counted in one warning per file.
    """
    if max_samples is not None and (
        isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples <= 0
    ):
        raise ValueError(f"max_samples must be a positive row count or None, got {max_samples!r}")
    rows: list[Row] = []
    for p in _split_paths(path):
        limit = None if max_samples is None else max_samples - len(rows)
        rows.extend(_read_one(p, split, limit, skip_bad))
        if max_samples is not None and len(rows) >= max_samples:
            break
    if not rows:
        raise DataError(f"no rows in {os.fspath(path)!r} (split {split!r}); check the path and --split")
    return rows[:max_samples] if max_samples is not None else rows


def _split_paths(path: str | os.PathLike) -> list[Path]:
    text = os.fspath(path)
    if Path(text).exists() or "," not in text:
        return [Path(text)]
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise DataError(f"dataset path {text!r} names no file")
    return [Path(p) for p in parts]


def _read_one(path: Path, split: str, limit: int | None, skip_bad: bool = False) -> list[Row]:
    if not path.exists():
        raise MissingDataFile(
            f"dataset path {str(path)!r} does not exist (cwd {os.getcwd()}); "
            f"give a local {VALID_FORMATS}; hub names are not downloaded"
        )
    if path.is_dir():
        return _read_saved(path, split)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, limit, skip_bad=skip_bad)
    if suffix == ".json":
        return _read_json(path, split, limit, skip_bad)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(f"{str(path)!r} has unknown extension {suffix or '(none)'!r}; valid: {VALID_FORMATS}")


def _as_rows(records: list, source: Path, unit: str = "row", numbers: list[int] | None = None) -> list[Row]:
    out = []
    for i, rec in enumerate(records):
        number = numbers[i] if numbers is not None else i + 1
        if not isinstance(rec, dict):
            raise DataError(
                f"{source} {unit} {number}: expected a JSON object (column -> value), got {type(rec).__name__}"
            )
        out.append(Row(rec, str(source), number, unit))
    return out


def _not_utf8(path: Path, e: UnicodeDecodeError, offset: int, lineno: int) -> str:
    return (
        f"{path} line {lineno}: byte {offset + e.start:,} of the file ({e.object[e.start : e.start + 1]!r}) is not "
        f"UTF-8 ({e.reason}); re-encode the file as UTF-8 (iconv -f LATIN1 -t UTF-8), or skip such lines with "
        f"--skip_bad_rows"
    )


def _read_jsonl(path: Path, limit: int | None, data: bytes | None = None, *, skip_bad: bool = False) -> list[Row]:
    if data is None:
        data = path.read_bytes()
    records: list[Row] = []
    numbers, skipped = [], []
    offset = 0
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        if limit is not None and len(records) >= limit:
            break
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if not skip_bad:
                raise DataError(_not_utf8(path, e, start, lineno)) from None
            skipped.append(f"line {lineno}: byte {start + e.start:,} is not UTF-8")
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if not skip_bad:
                raise DataError(
                    f"{path} line {lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                    "each line of a JSON Lines file must be one complete JSON object (or skip such lines with "
                    "--skip_bad_rows)"
                ) from None
            skipped.append(f"line {lineno}: invalid JSON ({e.msg} at column {e.colno})")
            continue
        numbers.append(lineno)
    if skipped:
        logger.warning(
            "%s: skipped %d bad lines (skip_bad_rows); first: %s", path, len(skipped), "; ".join(skipped[:5])
        )
    return _as_rows(records, path, "line", numbers)


def _read_json(path: Path, split: str, limit: int | None, skip_bad: bool = False) -> list[Row]:
    data_bytes = path.read_bytes()
    try:
        text = data_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        if data_bytes.lstrip()[:1] == b"{" and b"\n{" in data_bytes:  # JSON Lines in a .json file: line by line
            return _read_jsonl(path, limit, data_bytes, skip_bad=skip_bad)
        raise DataError(
            _not_utf8(path, e, 0, data_bytes.count(b"\n", 0, e.start) + 1).replace(
                ", or skip such lines with --skip_bad_rows", ""
            )
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # many ``.json`` files are really JSON Lines
            return _read_jsonl(path, limit, data_bytes, skip_bad=skip_bad)
        raise DataError(f"{path} line {e.lineno} column {e.colno}: invalid JSON ({e.msg})") from None
    if isinstance(data, dict):
        if split not in data:
            raise DataError(
                f"{path} is a JSON object without split {split!r} (top-level keys: {', '.join(map(str, data)) or 'none'}); "
                "set --split to one of them, or store a list of row objects"
            )
        data = data[split]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of row objects, got {type(data).__name__}")
    return _as_rows(data[:limit] if limit is not None else data, path)


def _read_parquet(path: Path) -> list[Row]:
    # lazy: pyarrow only for parquet files
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    return _as_rows(table.to_pylist(), path)


def _read_saved(path: Path, split: str) -> list[Row]:
    if not ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        raise DataError(
            f"{path} is a folder but not one written by save_to_disk (no state.json or dataset_dict.json); "
            f"pass its data files instead, comma-separated ({VALID_FORMATS})"
        )
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path} has no split {split!r} (splits: {', '.join(ds)}); set --split to one of them")
        ds = ds[split]
    return _as_rows(ds.to_list(), path)
