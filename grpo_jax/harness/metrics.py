"""Metrics out: JSONL and TensorBoard in the workdir, one log line per step
(`step_line`), a progress bar on a terminal (`progress_bar`), a PNG.

In a multi-process run every host runs the same loop; only process 0 writes
(`is_primary`), so each file has one writer and each row appears once.
"""
from __future__ import annotations

import functools
import glob
import importlib
import json
import logging
import math
import os
import struct
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np


def is_primary() -> bool:
  """Whether this process writes the run's host-side files: process 0.
  (Call after `distributed.initialize_distributed`.)"""
  return jax.process_index() == 0


def _scalar(v: Any) -> float | None:
  try:
    return float(np.asarray(v))
  except (TypeError, ValueError):
    return None


def _tensorboardx() -> None:
  """Imports tensorboardX without torch (callers then import its
  submodules). Where torch is installed (the test requirements: it is the
  logits reference) tensorboardX imports it, only to accept torch tensors,
  which this code never passes: 1.7 s of every process's start
  (`import jax, tensorboardX` 4.9-5.6 s, 3.2-3.7 s without torch). Torch
  stays importable afterwards."""
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    return
  sys.modules["torch"] = None   # `import torch` raises ImportError
  try:
    importlib.import_module("tensorboardX")
  finally:
    del sys.modules["torch"]


def _event(step: int, clean: Mapping[str, float]):
  """One TensorBoard event with every scalar of a `write` (a non-finite
  one as `nonfinite/<key>` = 1)."""
  _tensorboardx()
  from tensorboardX import summary  # pylint: disable=import-outside-toplevel
  from tensorboardX.proto import event_pb2, summary_pb2  # pylint: disable=import-outside-toplevel
  values = [summary.scalar(k, v).value[0] if math.isfinite(v)
            else summary.scalar(f"nonfinite/{k}", 1.0).value[0]
            for k, v in clean.items()]
  return event_pb2.Event(wall_time=time.time(), step=int(step),
                         summary=summary_pb2.Summary(value=values))


class MetricWriter:
  """Appends one JSON line per step to metrics.jsonl and mirrors every scalar
  to TensorBoard (tensorboardX event files under workdir/tensorboard).

  A non-finite value is written as it is, never dropped: in the JSONL as
  Python's json writes it (`NaN`, `Infinity`, `-Infinity`, which json.loads
  and `read_jsonl` read back as floats); in TensorBoard, which plots no NaN,
  as `nonfinite/<key>` = 1 in place of the value.

  Both are on disk when `write` returns, before the step's checkpoint: a
  run killed after that checkpoint must not lose the step's scalars, which
  the resumed run will not write again. So TensorBoard's file is written
  here, one event per `write` (a kill mid-write tears only that record,
  which readers drop), not by tensorboardX's SummaryWriter, whose flush
  leaves events still queued for its writer thread unwritten.

  Writes only where `enabled` (default: on process 0); elsewhere `write`
  just returns the cleaned scalars."""

  def __init__(self, workdir: str, tensorboard: bool = True,
               enabled: bool | None = None):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = is_primary() if enabled is None else enabled
    self._file = self._tb = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      _tensorboardx()
      from tensorboardX.event_file_writer import EventsWriter  # pylint: disable=import-outside-toplevel
      logdir = os.path.join(workdir, "tensorboard")
      os.makedirs(logdir, exist_ok=True)
      # tensorboardX names the file by the second and host only: a suffix
      # keeps a writer opened within the same second from truncating it.
      self._tb = EventsWriter(os.path.join(logdir, "events"),
                              f".{os.getpid()}.{time.time_ns()}")

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    clean = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
    if not self.enabled:
      return clean
    self._file.write(json.dumps({"step": int(step), **clean}) + "\n")
    self._file.flush()
    if self._tb is not None:
      self._tb.write_event(_event(step, clean))
      self._tb.flush()   # and fsync: on disk before the step's checkpoint
    return clean

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()


# ----------------------------------------------------------------------------
# The per-step log line and the progress bar.
# ----------------------------------------------------------------------------

# (metric key, label, format) of a step's log line, in order; a key the
# step's metrics lack is left out of the line.
RL_LINE = (("reward/mean", "reward", ".3f"), ("accuracy", "acc", ".3f"),
           ("response_length/mean", "len", ".1f"), ("kl", "kl", ".4f"),
           ("entropy", "entropy", ".3f"))
# (metric key, label): where the step's seconds went.
RL_TIMES = (("time/sample", "sample"), ("time/update", "update"),
            ("time/step", "total"))
EVAL_LINE = (("eval/greedy_accuracy", "eval greedy acc", ".3f"),
             ("eval/response_length", "len", ".1f"))
EVAL_TIMES = (("eval/seconds", "eval"),)
STAR_LINE = (("eval/greedy_accuracy", "eval greedy acc", ".3f"),
             ("star/train_accuracy", "train acc", ".3f"),
             ("star/kept_direct", "kept", "g"),
             ("star/kept_rationalized", "rationalized", "g"),
             ("sft/steps", "sft steps", "g"),
             ("sft/loss_last", "sft loss", ".4f"))
STAR_TIMES = (("time/sample", "sample"), ("time/finetune", "finetune"),
              ("eval/seconds", "eval"))


def step_line(step: int, total: int, metrics: Mapping[str, Any],
              fields: Sequence[tuple[str, str, str]] = RL_LINE,
              times: Sequence[tuple[str, str]] = RL_TIMES,
              unit: str = "step") -> str:
  """One log line for a step's metrics, e.g.

      step 2/3  reward 0.125  acc 0.250  len 7.8  entropy 5.527
        |  sample 0.41s  update 0.20s  total 0.63s      (on one line)

  `fields` and `times` name the keys shown (RL_LINE / RL_TIMES: the RL
  loop's; EVAL_*: a held-out evaluation's; STAR_*: a STaR iteration's); a key
  missing from `metrics` is left out, a NaN prints as nan."""
  parts = [f"{unit} {step}/{total}"]
  parts += [f"{label} {float(metrics[key]):{spec}}"
            for key, label, spec in fields if key in metrics]
  seconds = [f"{label} {float(metrics[key]):.2f}s"
             for key, label in times if key in metrics]
  return "  ".join(parts + (["|", *seconds] if seconds else []))


class _NoBar:
  """What `progress_bar` gives where there is no terminal: does nothing."""

  def update(self, n: int = 1) -> None:
    del n

  def set_postfix(self, **kwargs) -> None:
    del kwargs

  def close(self) -> None:
    pass


class _Bar:
  """tqdm's bar on stderr; while it is open, log records are written above
  it (the bar is cleared before each record and redrawn after), so a log
  line never runs into the bar."""

  def __init__(self, **kwargs):
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    self._tqdm = tqdm(file=sys.stderr, **kwargs)
    self._handlers = [h for h in logging.getLogger().handlers
                      if "emit" not in vars(h)]
    for handler in self._handlers:
      handler.emit = functools.partial(_emit_above, tqdm, handler.emit)

  def update(self, n: int = 1) -> None:
    self._tqdm.update(n)

  def set_postfix(self, **kwargs) -> None:
    self._tqdm.set_postfix(**kwargs)

  def close(self) -> None:
    for handler in self._handlers:
      vars(handler).pop("emit", None)
    self._handlers = []
    self._tqdm.close()


def _emit_above(tqdm_class, emit: Callable[[logging.LogRecord], None],
                record: logging.LogRecord) -> None:
  with tqdm_class.external_write_mode(file=sys.stderr):
    emit(record)


def progress_bar(total: int, enabled: bool = True, initial: int = 0,
                 desc: str = "train", unit: str = "step") -> _Bar | _NoBar:
  """A progress bar (`update(n)`, `set_postfix(...)`, `close()`): tqdm's
  where `enabled` and stderr is a terminal, with log lines printed above it;
  elsewhere (a log file, a pipe, CI) one that does nothing, as the per-step
  log line says the same."""
  if not (enabled and sys.stderr.isatty()):
    return _NoBar()
  return _Bar(total=total, initial=initial, desc=desc, unit=unit)


def read_jsonl(path: str) -> list[dict]:
  """The rows of a metrics.jsonl. A torn last line (the process died inside
  a write) is dropped with a warning; a damaged line elsewhere raises
  ValueError naming the file and line."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  rows = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except ValueError as e:
      if not any(l.strip() for l in lines[number:]):   # the last line
        logging.warning("%s: dropped its torn last line %d (%r...): a run "
                        "stopped while writing it", path, number, line[:60])
        break
      raise ValueError(f"{path} line {number} is not JSON ({e}); move the file "
                       "aside (or delete that line) to resume") from None
  return rows


def is_eval_row(row: Mapping[str, Any]) -> bool:
  """A held-out evaluation row: every metric is an eval/ one."""
  return all(k == "step" or k.startswith("eval/") for k in row)


def truncate(workdir: str, last_step: int, drop_eval_at_last: bool = False
             ) -> None:
  """On resume from checkpoint `last_step`: drops the metric rows (JSONL and
  TensorBoard) written after it, as they are recomputed, so the logs read
  like one uninterrupted run. `drop_eval_at_last`: the evaluation rows at
  `last_step` are recomputed too (the evaluation before training, or after
  the last step, happens after that checkpoint)."""
  def keep(step: int, is_eval: bool) -> bool:
    return step < last_step or (step == last_step and not (
        drop_eval_at_last and is_eval))
  path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(path):
    rows = [r for r in read_jsonl(path) if keep(r["step"], is_eval_row(r))]
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  truncate_tensorboard(os.path.join(workdir, "tensorboard"),
                       lambda step, tag: keep(step, tag.removeprefix(
                           "nonfinite/").startswith("eval/")))


# TensorBoard event files are TFRecords: length (uint64), its masked CRC
# (uint32), the Event proto, its masked CRC. Records are copied verbatim.
def _records(path: str) -> Iterator[bytes]:
  with open(path, "rb") as f:
    data = f.read()
  i = 0
  while i + 12 <= len(data):
    (length,) = struct.unpack("<Q", data[i:i + 8])
    end = i + 12 + length + 4
    if end > len(data):   # a torn last record
      return
    yield data[i:end]
    i = end


def read_tensorboard(logdir: str) -> list[tuple[int, str, float]]:
  """(step, tag, value) of every scalar in the event files under `logdir`."""
  _tensorboardx()
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  out = []
  for path in sorted(glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"),
                               recursive=True)):
    for record in _records(path):
      event = event_pb2.Event.FromString(record[12:-4])
      out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
  return out


def truncate_tensorboard(logdir: str, keep: Callable[[int, str], bool]) -> None:
  """Rewrites the event files under `logdir` without the scalars that
  `keep(step, tag)` rejects, so a resumed run shows each step once (the
  discarded steps of a killed run do not sit beside the recomputed ones)."""
  _tensorboardx()
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  for path in glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"),
                        recursive=True):
    kept = []
    for record in _records(path):
      event = event_pb2.Event.FromString(record[12:-4])
      tags = [v.tag for v in event.summary.value]
      if not tags or all(keep(event.step, t) for t in tags):
        kept.append(record)
    with open(path + ".tmp", "wb") as f:
      f.write(b"".join(kept))
    os.replace(path + ".tmp", path)


DEFAULT_CURVES = ("reward/mean", "accuracy", "eval/greedy_accuracy",
                  "groups/mixed_fraction", "response_length/mean", "entropy")


def plot_curves(rows: list[dict], png_path: str,
                keys=DEFAULT_CURVES, title: str = "") -> str:
  """One panel per metric against the step; returns the PNG path."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  keys = [k for k in keys if any(k in r for r in rows)]
  cols = min(3, max(len(keys), 1))
  nrows = max(1, math.ceil(len(keys) / cols))
  fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows),
                           squeeze=False)
  for ax, key in zip(axes.ravel(), keys):
    pts = [(r["step"], r[key]) for r in rows if key in r]
    xs, ys = zip(*pts)
    ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3)
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  for ax in axes.ravel()[len(keys):]:
    ax.axis("off")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return png_path
