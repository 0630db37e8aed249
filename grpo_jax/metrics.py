"""Metrics out: JSONL and TensorBoard in the workdir, a progress bar, a PNG.

In a multi-process run every host runs the same loop; only process 0 writes
(`is_primary`), so each file has one writer and each row appears once.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import jax
import numpy as np


def is_primary() -> bool:
  """Whether this process writes the run's host-side files: process 0.
  (Call after `sharding.initialize_distributed`.)"""
  return jax.process_index() == 0


def _scalar(v: Any) -> float | None:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f if math.isfinite(f) else None


class MetricWriter:
  """Appends one JSON line per step to metrics.jsonl and mirrors every scalar
  to TensorBoard (tensorboardX event files under workdir/tensorboard).

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
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    clean = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
    if not self.enabled:
      return clean
    self._file.write(json.dumps({"step": int(step), **clean}) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in clean.items():
        self._tb.add_scalar(k, v, int(step))
    return clean

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


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
