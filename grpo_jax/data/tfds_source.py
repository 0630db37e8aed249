"""TFDS data sets (`gsm8k`, `math_dataset/<module>`) read without TensorFlow.

Reading goes through `tfds.builder(...).as_data_source()` (what
`tfds.data_source` does), TFDS's random-access path over ArrayRecord files:
no TensorFlow, and each record is decoded only when it is indexed, so a host
that serves a slice of the data reads only that slice.

The copy must be prepared in the `array_record` format, once, on a machine
with network access:

    tfds build gsm8k --file_format=array_record --data_dir=DIR
    # or: grpo_jax.data.prepare_tfds("gsm8k", DIR)

Preparing `gsm8k` needs no TensorFlow; preparing `math_dataset` does (its
builder calls `tf.io.gfile`; TFDS asks for tensorflow>=2.1). A copy prepared
in the default `tfrecord` format can only be read through TensorFlow's
`tfds.load`; this source refuses it with a message saying how to re-prepare.

As the file readers, a record over `max_record_bytes` or with an empty gold
answer is refused when it is read (with `on_empty_answer="drop"`, every
record is read once up front and those with an empty answer are left out).
"""
from __future__ import annotations

import collections.abc
import importlib
import logging
from typing import Any, Callable, Mapping, Sequence

from grpo_jax.data.example import Example
from grpo_jax.data.files import MAX_RECORD_BYTES, check_reading_options, too_long
from grpo_jax.data.layouts import empty_answer_error
from grpo_jax.errors import DataError
from grpo_jax.registry import lookup, register

# The layout of each TFDS data set (by the name before any "/config").
TFDS_LAYOUTS = {"gsm8k": "gsm8k", "math_dataset": "question_answer"}
# Builders that `import tensorflow_datasets` does not register until imported.
_BUILDER_MODULES = {"gsm8k": "tensorflow_datasets.text.gsm8k.gsm8k"}


def _decoded(record: Mapping[str, Any]) -> dict[str, Any]:
  """A TFDS record with its Text features (bytes) as str."""
  return {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in record.items()}


class TfdsExamples(collections.abc.Sequence):
  """A lazy sequence of Examples over a TFDS data source (decoded on access)."""

  def __init__(self, source: Any, parse: Callable[..., Example], where: str,
               size: int, layout_options: Mapping[str, Any], layout: str = "",
               max_record_bytes: int = MAX_RECORD_BYTES):
    self._source, self._parse, self._where = source, parse, where
    self._size, self._layout_options = size, dict(layout_options)
    self._layout, self._bound = layout, max_record_bytes
    self._indices: Sequence[int] | None = None   # the records kept (None: all)

  def __len__(self) -> int:
    return self._size

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(self._size))]
    if not -self._size <= index < self._size:
      raise IndexError(f"{self._where}: index {index} out of range for {self._size} examples")
    index %= self._size
    index = index if self._indices is None else self._indices[index]
    example = self.read(index)
    if not example.answer.strip():
      raise empty_answer_error(f"{self._where} record {index}", self._layout)
    return example

  def read(self, index: int) -> Example:
    """Record `index` of the source, its size checked, parsed."""
    raw, where = self._source[index], f"{self._where} record {index}"
    size = sum(len(v) for v in raw.values() if isinstance(v, (bytes, str)))
    if size > self._bound:
      raise too_long(where, size, self._bound)
    return self._parse(_decoded(raw), where, **self._layout_options)

  def keep_answered(self, limit: int | None) -> "TfdsExamples":
    """Only the records whose gold answer is not empty (each read once now),
    at most `limit`; one warning counts those left out."""
    kept, dropped = [], 0
    for index in range(self._size):
      if limit is not None and len(kept) >= limit:
        break
      if self.read(index).answer.strip():
        kept.append(index)
      else:
        dropped += 1
    if dropped:
      logging.warning("%s: dropped %d record(s) whose gold answer is empty "
                      "(on_empty_answer='drop')", self._where, dropped)
    self._indices, self._size = kept, len(kept)
    return self


def _layout_for(name: str, layout: str | None) -> str:
  if layout is not None:
    return layout
  base = name.split("/")[0].split(":")[0]
  if base not in TFDS_LAYOUTS:
    raise DataError(f"tfds {name!r}: no default layout; pass layout= one of the registered "
                    f"layouts (defaults exist for {sorted(TFDS_LAYOUTS)})")
  return TFDS_LAYOUTS[base]


def _not_prepared(name: str, split: str, data_dir: str | None, cause: str) -> DataError:
  return DataError(
      f"tfds {name!r} split {split!r}: no prepared copy under data_dir={data_dir!r} ({cause}). "
      f"Prepare it once where there is network: `tfds build {name} --file_format=array_record "
      f"--data_dir=DIR` or grpo_jax.data.prepare_tfds({name!r}, DIR).")


@register("dataset", "tfds")
def read_tfds(name: str, split: str = "train", data_dir: str | None = None,
              layout: str | None = None, limit: int | None = None,
              on_empty_answer: str = "error", max_record_bytes: int = MAX_RECORD_BYTES,
              **layout_options: Any) -> TfdsExamples:
  """Examples of a prepared TFDS data set, e.g. `name="gsm8k", split="test"`.

  Args:
    name: the TFDS name, with config if any ("math_dataset/arithmetic__mul").
    split: a TFDS split ("train", "test").
    data_dir: where the copy was prepared (TFDS's default when None).
    layout: the record layout; by default "gsm8k" for gsm8k and
      "question_answer" for math_dataset.
    limit: keep at most this many examples.
    on_empty_answer: "error" refuses a record with an empty gold answer
      when it is read; "drop" reads every record once now and leaves those
      out, with one warning that counts them.
    max_record_bytes: a longer record is refused when it is read.
    **layout_options: passed to the layout.

  Returns:
    A lazy Sequence of Examples (len, indexing and slicing).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (slow import)

  check_reading_options(on_empty_answer, max_record_bytes)
  layout = _layout_for(name, layout)
  parse = lookup("layout", layout)
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise _not_prepared(name, split, data_dir, "no such data set there") from None
  if not builder.is_prepared():
    raise _not_prepared(name, split, data_dir, "not prepared")
  try:
    source = builder.as_data_source(split=split)
  except NotImplementedError:
    raise DataError(
        f"tfds {name!r}: the copy under data_dir={data_dir!r} is not in a random-access "
        f"format (it was probably prepared as tfrecord, which only TensorFlow reads). "
        f"Re-prepare it with --file_format=array_record.") from None
  where = f"tfds {name}:{split}"
  if on_empty_answer == "drop":
    return TfdsExamples(source, parse, where, len(source), layout_options, layout,
                        max_record_bytes).keep_answered(limit)
  size = len(source) if limit is None else min(limit, len(source))
  return TfdsExamples(source, parse, where, size, layout_options, layout,
                      max_record_bytes)


def prepare_tfds(name: str, data_dir: str) -> str:
  """Runs the TFDS builder of `name` into `data_dir` as ArrayRecord; returns its folder.

  Downloads the raw files, so it needs network access (or a populated TFDS
  download cache). `math_dataset` additionally needs TensorFlow.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  module = _BUILDER_MODULES.get(name.split("/")[0])
  if module:
    importlib.import_module(module)
  tfds.disable_progress_bar()
  builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare()
  return str(builder.data_dir)
