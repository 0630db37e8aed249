r"""Plots runs side by side from their metrics.jsonl and prints their numbers.

  python experiments/plot_runs.py --out=docs/process_vs_outcome.png \
      process=workdirs/grpo_process_local outcome=workdirs/grpo_outcome_local \
      --keys=accuracy,eval/greedy_accuracy

Runs are `label=workdir` (a bare workdir is its own label; a label given
twice is refused). One panel per metric against the training step; the table gives each
metric's first and last value and its mean over the steps that logged it.
"""
from __future__ import annotations

import os
import sys

from absl import app, flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

# pylint: disable=wrong-import-position
import difflib

from grpo_jax import errors
from grpo_jax.harness import cli, outdir
from grpo_jax.harness import metrics as metrics_lib

_OUT = flags.DEFINE_string("out", "", "PNG to write (none: table only).")
_KEYS = flags.DEFINE_list("keys", ["reward/mean", "eval/greedy_accuracy"],
                          "Metrics to plot and tabulate.")
_TITLE = flags.DEFINE_string("title", "", "Figure title.")


def load(runs: dict[str, str]) -> dict[str, list[dict]]:
  out = {}
  for label, workdir in runs.items():
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
      raise errors.ArgumentError(f"{label}={workdir}: no {path}")
    try:
      out[label] = metrics_lib.read_jsonl(path)
    except ValueError as e:   # a line that is not JSON, named
      raise errors.ArgumentError(str(e)) from None
  return out


def check_keys(histories: dict[str, list[dict]], keys) -> None:
  """Every key is logged by some run; a misspelt one names the nearest and
  lists the keys that exist."""
  logged = sorted(set().union(*(r.keys() for rows in histories.values() for r in rows))
                  - {"step"})
  for key in keys:
    if not any(key in r for rows in histories.values() for r in rows):
      close = difflib.get_close_matches(key, logged, n=3, cutoff=0.6)
      hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
      raise errors.ArgumentError(f"--keys: no run logged {key!r}; {hint}the keys "
                                 f"logged: {', '.join(logged)}")


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
  return [(r["step"], float(r[key])) for r in rows if key in r]


def table(histories: dict[str, list[dict]], keys) -> str:
  lines = ["| run | metric | first | last | mean over steps |",
           "| --- | --- | --- | --- | --- |"]
  for label, rows in histories.items():
    for key in keys:
      pts = series(rows, key)
      if pts:
        values = [v for _, v in pts]
        lines.append(f"| {label} | {key} | {values[0]:.4g} | {values[-1]:.4g}"
                     f" | {sum(values) / len(values):.4g} |")
  return "\n".join(lines)


def plot(histories: dict[str, list[dict]], keys, png_path: str,
         title: str = "") -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, len(keys), figsize=(3.8 * len(keys), 3.1),
                           squeeze=False)
  for ax, key in zip(axes[0], keys):
    for label, rows in histories.items():
      pts = series(rows, key)
      if pts:
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[0][0].legend()
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)


def parse_runs(args) -> dict[str, str]:
  """{label: workdir} of `label=workdir` arguments; a bare `workdir` is
  labelled by itself. A label given twice is refused (the second would
  hide the first)."""
  runs: dict[str, str] = {}
  for arg in args:
    label, sep, workdir = arg.partition("=")
    if not sep:
      label, workdir = arg, arg
    if not label or not workdir:
      raise errors.ArgumentError(f"{arg!r}: give runs as label=workdir (or a workdir)")
    if label in runs:
      raise errors.ArgumentError(
          f"the label {label!r} names two runs ({runs[label]} and {workdir}): give "
          "each run its own label")
    runs[label] = os.path.expanduser(workdir)
  return runs


def main(argv):
  if len(argv) < 2:
    raise app.UsageError("give runs as label=workdir ...")
  with cli.user_errors():
    runs = parse_runs(argv[1:])
    if _OUT.value:   # before any work
      if os.path.isdir(_OUT.value):
        raise errors.ArgumentError(f"--out {_OUT.value} is a directory; give a .png file")
      outdir.check_writable(os.path.dirname(os.path.abspath(_OUT.value)),
                            "the directory of --out")
    histories = load(runs)
    check_keys(histories, _KEYS.value)
    print(table(histories, _KEYS.value))
    if _OUT.value:
      plot(histories, _KEYS.value, _OUT.value, _TITLE.value)
      print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
