"""JSONL and Parquet readers for the layouts of `layouts.py`.

    examples = lookup("dataset", "parquet")(path="dapo-math-17k.parquet", layout="dapo_math")

`layout="auto"` picks the layout from the field names (see
`layouts.detect_layout`). Every error names the file, the line or row, and
the missing field.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator, Mapping

from grpo_jax.data.example import Example
from grpo_jax.errors import DataError
from grpo_jax.data.layouts import detect_layout, missing_fields
from grpo_jax.registry import lookup, register


def _check_exists(path: str) -> None:
  if not os.path.isfile(path):
    raise DataError(f"{path}: no such file")


def _json_records(path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
  """(where, record) for each non-blank line of a JSONL file."""
  with open(path, encoding="utf-8") as f:
    for line_number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{path} line {line_number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None
      if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
      yield where, record


def _parse(records: Iterator[tuple[str, Mapping[str, Any]]], layout: str,
           limit: int | None, layout_options: dict[str, Any]) -> list[Example]:
  """Maps (where, record) pairs to Examples, the layout fixed by the first record."""
  examples, parse = [], None
  for where, record in records:
    if limit is not None and len(examples) >= limit:
      break
    if parse is None:
      name = detect_layout(record, where) if layout == "auto" else layout
      parse = lookup("layout", name)
    examples.append(parse(record, where, **layout_options))
  return examples


@register("dataset", "jsonl")
def read_jsonl(path: str, layout: str = "auto", limit: int | None = None,
               **layout_options: Any) -> list[Example]:
  """Examples from a JSON-lines file, one object a line, blank lines skipped.

  Args:
    path: the file.
    layout: a name registered under kind "layout" ("dapo_math", "aime",
      "gsm8k", "math", "question_answer"), or "auto" to detect it.
    limit: read at most this many examples.
    **layout_options: passed to the layout (e.g. `strip_instructions=False`).
  """
  _check_exists(path)
  return _parse(_json_records(path), layout, limit, layout_options)


def _parquet_records(path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
  """(where, record) per row, read a record batch at a time."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  (heavy, only here)

  row = 0
  for batch in pq.ParquetFile(path).iter_batches():
    for record in batch.to_pylist():
      yield f"{path} row {row}", record
      row += 1


@register("dataset", "parquet")
def read_parquet(path: str, layout: str = "auto", limit: int | None = None,
                 **layout_options: Any) -> list[Example]:
  """Examples from a Parquet file (verl/DAPO, AIME, GSM8K or MATH columns).

  The schema is checked before any row is read: a missing column fails
  naming the file and the column. Arguments as in `read_jsonl`.
  """
  import pyarrow  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

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
  return _parse(_parquet_records(path), name, limit, layout_options)
