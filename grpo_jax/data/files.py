"""JSONL and Parquet readers for the layouts of `layouts.py`.

    examples = lookup("dataset", "parquet")(path="dapo-math-17k.parquet", layout="dapo_math")

`layout="auto"` picks the layout from the field names (see
`layouts.detect_layout`). Every error names the file, the line or row, and
the missing field.

Reading is bounded: a record over `max_record_bytes` (default 1 MiB; the
longest DAPO-Math-17k row is a few KB) is refused naming its file, line or
row and size before it is decoded or parsed, holding at most the bound of it
in memory (JSONL; Parquet sizes each row from its Arrow buffers before any
Python object is made). A record whose gold answer is empty or blank is
refused too, or dropped with one warning that counts them with
`on_empty_answer="drop"`.
"""
from __future__ import annotations

import codecs
import json
import logging
import os
from typing import Any, Iterator, Mapping

from grpo_jax.data.example import Example
from grpo_jax.data.layouts import ON_EMPTY_ANSWER, detect_layout, empty_answer_error, missing_fields
from grpo_jax.errors import ConfigError, DataError
from grpo_jax.registry import lookup, register

MAX_RECORD_BYTES = 1 << 20
_CHUNK = 1 << 16   # how much of an over-long line is held while it is measured


def check_reading_options(on_empty_answer: str, max_record_bytes: int) -> None:
  """Raises ConfigError unless the two reading options are allowed values."""
  if on_empty_answer not in ON_EMPTY_ANSWER:
    raise ConfigError(f"data kwarg on_empty_answer = {on_empty_answer!r}; "
                      f"allowed: {ON_EMPTY_ANSWER}")
  if (isinstance(max_record_bytes, bool) or not isinstance(max_record_bytes, int)
      or max_record_bytes < 1):
    raise ConfigError(f"data kwarg max_record_bytes = {max_record_bytes!r} must be "
                      "an integer >= 1 (bytes per record)")


def _check_exists(path: str) -> None:
  if not os.path.isfile(path):
    raise DataError(f"{path}: no such file")


def too_long(where: str, size: int, bound: int) -> DataError:
  return DataError(
      f"{where}: a record of {size} bytes ({size / 2**20:.1f} MiB) is over the bound of "
      f"{bound} bytes per record; shorten or remove it, or raise max_record_bytes in "
      "the data kwargs")


def _lines(path: str, bound: int) -> Iterator[tuple[int, bytes]]:
  """(line number, bytes) of each line, read in binary at most `bound` + 1
  bytes at a time: a longer line is measured a chunk at a time and refused."""
  with open(path, "rb") as f:
    number = 0
    while line := f.readline(bound + 1):
      number += 1
      if len(line) > bound and not line.endswith(b"\n"):
        size, line = len(line), None
        while (chunk := f.readline(_CHUNK)) and not chunk.endswith(b"\n"):
          size += len(chunk)
        size += len(chunk.rstrip(b"\n"))
        raise too_long(f"{path} line {number}", size, bound)
      yield number, line


def _json_records(path: str, bound: int) -> Iterator[tuple[str, Mapping[str, Any]]]:
  """(where, record) for each non-blank line of a JSONL file."""
  for number, line in _lines(path, bound):
    if not line.strip():
      continue
    where = f"{path} line {number}"
    if number == 1 and line.startswith(codecs.BOM_UTF8):
      line = line[len(codecs.BOM_UTF8):]
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DataError(f"{where}: not UTF-8 text (byte 0x{line[e.start]:02x} at byte "
                      f"{e.start + 1} of the line); save the file as UTF-8") from None
    try:
      record = json.loads(text)
    except json.JSONDecodeError as e:
      raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
      raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    yield where, record


def _parse(records: Iterator[tuple[str, Mapping[str, Any]]], layout: str,
           limit: int | None, layout_options: dict[str, Any], path: str,
           on_empty_answer: str) -> list[Example]:
  """Maps (where, record) pairs to Examples, the layout fixed by the first
  record; an empty gold answer raises, or is dropped and counted."""
  examples, parse, dropped = [], None, []
  for where, record in records:
    if limit is not None and len(examples) >= limit:
      break
    if parse is None:
      name = detect_layout(record, where) if layout == "auto" else layout
      parse = lookup("layout", name)
    example = parse(record, where, **layout_options)
    if example.answer.strip():
      examples.append(example)
    elif on_empty_answer == "drop":
      dropped.append(where[len(path) + 1:])
    else:
      raise empty_answer_error(where, name)
  if dropped:
    shown = ", ".join(dropped[:5]) + (", ..." if len(dropped) > 5 else "")
    logging.warning("%s: dropped %d record(s) whose gold answer is empty "
                    "(on_empty_answer='drop'): %s", path, len(dropped), shown)
  return examples


@register("dataset", "jsonl")
def read_jsonl(path: str, layout: str = "auto", limit: int | None = None,
               on_empty_answer: str = "error", max_record_bytes: int = MAX_RECORD_BYTES,
               **layout_options: Any) -> list[Example]:
  """Examples from a JSON-lines file, one object a line, blank lines skipped.

  Args:
    path: the file.
    layout: a name registered under kind "layout" ("dapo_math", "aime",
      "gsm8k", "math", "question_answer"), or "auto" to detect it.
    limit: read at most this many examples.
    on_empty_answer: "error" (default) refuses a record whose gold answer is
      empty or blank, naming it; "drop" skips such records with one warning.
    max_record_bytes: a longer line is refused, naming it and its size.
    **layout_options: passed to the layout (e.g. `strip_instructions=False`).
  """
  check_reading_options(on_empty_answer, max_record_bytes)
  _check_exists(path)
  return _parse(_json_records(path, max_record_bytes), layout, limit, layout_options,
                path, on_empty_answer)


def _parquet_records(path: str, bound: int) -> Iterator[tuple[str, Mapping[str, Any]]]:
  """(where, record) per row, read a record batch at a time; every row of a
  batch is sized (`row_bytes`) before any becomes a Python object."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  (heavy, only here)

  row = 0
  for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
    sizes = sum(row_bytes(column) for column in batch.columns)
    over = [i for i, size in enumerate(sizes) if size > bound]
    if over:
      raise too_long(f"{path} row {row + over[0]}", int(sizes[over[0]]), bound)
    for record in batch.to_pylist():
      yield f"{path} row {row}", record
      row += 1


def row_bytes(array) -> "np.ndarray":
  """The bytes of each row of an Arrow array: string and binary lengths and
  fixed-width values, summed through lists, structs and maps."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.compute as pc  # pylint: disable=g-import-not-at-top

  kind = array.type
  if pa.types.is_dictionary(kind):
    return row_bytes(array.dictionary)[array.indices.fill_null(0).to_numpy()]
  if pa.types.is_struct(kind):
    return sum((row_bytes(field) for field in array.flatten()),
               np.zeros(len(array), np.int64))
  if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
    total = np.concatenate([[0], np.cumsum(row_bytes(array.values))])
    offsets = array.offsets.to_numpy()
    return total[offsets[1:]] - total[offsets[:-1]]
  if (pa.types.is_string(kind) or pa.types.is_large_string(kind)
      or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
    return pc.binary_length(array).fill_null(0).to_numpy().astype(np.int64)
  try:   # a fixed-width value (a number, a date); null and others: 0
    width = max(kind.bit_width // 8, 1)
  except ValueError:
    width = 0
  return np.full(len(array), width, np.int64)


@register("dataset", "parquet")
def read_parquet(path: str, layout: str = "auto", limit: int | None = None,
                 on_empty_answer: str = "error", max_record_bytes: int = MAX_RECORD_BYTES,
                 **layout_options: Any) -> list[Example]:
  """Examples from a Parquet file (verl/DAPO, AIME, GSM8K or MATH columns).

  The schema is checked before any row is read: a missing column fails
  naming the file and the column. Arguments as in `read_jsonl`.
  """
  import pyarrow  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  check_reading_options(on_empty_answer, max_record_bytes)
  _check_exists(path)
  try:
    fields = pq.read_schema(path).names
  except pyarrow.ArrowInvalid as e:
    raise DataError(f"{path}: not a readable Parquet file ({e})") from None
  name = detect_layout(fields, path) if layout == "auto" else layout
  lookup("layout", name)  # An unknown layout fails here, listing the known ones.
  missing = missing_fields(name, fields)
  if missing:
    raise DataError(f"{path}: missing column {missing[0]!r} (the {name} layout needs it); "
                    f"columns present: {sorted(fields)}")
  return _parse(_parquet_records(path, max_record_bytes), name, limit, layout_options,
                path, on_empty_answer)
