"""The record of every run, in one SQLite file, and the list of named experiments.

The store lives in `<root>/runs.sqlite`; the root is `$GRPO_JAX_RUNS`, else
`./runs`. One row per run: name, config (JSON), git commit, start and end
time, status, final metrics (JSON), workdir and checkpoint path.

    store = RunStore()
    with store.record("dapo_aime:local", config, workdir) as run:
      run.metrics = train.run(config, workdir)
      run.checkpoint = checkpoint.latest_checkpoint(workdir)

A run stopped by SIGTERM or Ctrl-C (after saving a checkpoint: see
interrupts.py) is recorded "preempted"; a second Ctrl-C, "killed". A run
whose process was SIGKILLed stays "running" in the store (nothing was left
to write its end); `observed` shows it "died", from its workdir's lock. On
several hosts only process 0 should record.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import socket
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from grpo_jax.config import flat_fields
from grpo_jax.errors import RunStoreError, UnwritableDirectoryError
from grpo_jax.harness import interrupts, outdir, workdir_lock
from grpo_jax.harness.catalog import (  # noqa: F401  (runs' API: the named experiments)
  config_variants,
  experiment_description,
  list_experiments,
)

STATUSES = ("running", "finished", "failed", "killed", "preempted")
# What `observed` may show besides: a "running" row whose process is gone.
SHOWN_STATUSES = STATUSES + ("died",)
DB_NAME = "runs.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  name TEXT NOT NULL,
  status TEXT NOT NULL,
  config TEXT NOT NULL,
  git_commit TEXT,
  start_time REAL NOT NULL,
  end_time REAL,
  metrics TEXT,
  workdir TEXT,
  checkpoint TEXT,
  sweep TEXT
)"""


def default_root() -> Path:
  """`$GRPO_JAX_RUNS`, else `./runs`."""
  return Path(os.environ.get("GRPO_JAX_RUNS", "runs"))


def git_commit(path: Optional[os.PathLike] = None) -> Optional[str]:
  """HEAD of the git checkout holding `path` (default: this package), with
  "-dirty" when tracked files changed; None outside git."""
  cwd = Path(path) if path else Path(__file__).resolve().parent

  def git(*args):
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True,
                          text=True, timeout=10, check=True).stdout.strip()
  try:
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.SubprocessError):
    return None
  return commit + ("-dirty" if dirty else "")


def _config_json(config: Any) -> str:
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  return json.dumps(config, default=repr, sort_keys=True)


@dataclasses.dataclass
class Run:
  """One row of the store; config and metrics are decoded JSON."""
  id: int
  name: str
  status: str
  config: dict
  git_commit: Optional[str]
  start_time: float
  end_time: Optional[float]
  metrics: dict
  workdir: Optional[str]
  checkpoint: Optional[str]
  sweep: Optional[str]

  @classmethod
  def from_row(cls, row: sqlite3.Row) -> "Run":
    fields = dict(row)
    fields["config"] = json.loads(fields["config"])
    fields["metrics"] = json.loads(fields["metrics"] or "{}")
    return cls(**fields)

  @property
  def duration(self) -> Optional[float]:
    return None if self.end_time is None else self.end_time - self.start_time


@dataclasses.dataclass
class RunRecord:
  """What `RunStore.record` hands the body: set metrics and checkpoint on it."""
  id: int
  metrics: dict = dataclasses.field(default_factory=dict)
  checkpoint: Optional[str] = None
  status: str = "finished"


class RunStore:
  """A SQLite table of runs under `root`, created if needed unless `create`
  is False (reading: a mistyped --root fails instead of making a store)."""

  def __init__(self, root: Optional[os.PathLike] = None, *, create: bool = True):
    self.root = Path(root) if root is not None else default_root()
    self.path = self.root / DB_NAME
    if not create and not self.path.is_file():
      raise RunStoreError(f"no run store at {self.path}: is the root right? "
                          "(--root, else $GRPO_JAX_RUNS, else ./runs)")
    advice = ("point $GRPO_JAX_RUNS (or --root) at a directory; runs are not "
              "recorded until then")
    try:
      outdir.check_writable(self.root, "the run store root", advice)
      self.root.mkdir(parents=True, exist_ok=True)
    except UnwritableDirectoryError as e:
      raise RunStoreError(str(e)) from None
    except OSError as e:
      raise RunStoreError(f"cannot make the run store root {self.root} ({e.strerror}): "
                          f"{advice}") from None
    try:
      with self._connect() as db:
        db.execute(_SCHEMA)
    except sqlite3.Error as e:
      raise store_error(self.path, e) from None

  # How long a call waits for another process's lock on the file.
  timeout_s = 30.0

  @contextlib.contextmanager
  def _connect(self) -> Iterator[sqlite3.Connection]:
    # One short connection per call: several processes (a sweep, a run, the
    # CLI) share the file; the timeout waits out another writer's lock.
    db = sqlite3.connect(self.path, timeout=self.timeout_s)
    db.row_factory = sqlite3.Row
    try:
      with db:   # commits, or rolls back on error
        yield db
    finally:
      db.close()

  def start(self, name: str, config: Any, workdir: Optional[os.PathLike] = None,
            *, sweep: Optional[str] = None) -> int:
    """Records a run as "running"; returns its id."""
    with self._connect() as db:
      cursor = db.execute(
          "INSERT INTO runs (name, status, config, git_commit, start_time, workdir, sweep)"
          " VALUES (?, 'running', ?, ?, ?, ?, ?)",
          (name, _config_json(config), git_commit(), time.time(), _where(workdir), sweep))
      return cursor.lastrowid

  def finish(self, run_id: int, status: str, metrics: Optional[dict] = None,
             checkpoint: Optional[os.PathLike] = None):
    """Records a run's end: status, final metrics (`scalar_metrics` of them),
    last checkpoint."""
    if status not in STATUSES[1:]:
      raise ValueError(f"status {status!r}; allowed: {STATUSES[1:]}")
    with self._connect() as db:   # only a running row: an end is never rewritten
      updated = db.execute(
          "UPDATE runs SET status = ?, end_time = ?, metrics = ?, checkpoint = ? "
          "WHERE id = ? AND status = 'running'",
          (status, time.time(), json.dumps(scalar_metrics(metrics or {})),
           None if checkpoint is None else os.fspath(checkpoint), run_id)).rowcount
    if not updated:
      ended = self.get(run_id).status   # KeyError: no such run
      logging.warning("run %d in %s already ended as %r; not recorded again as %r",
                      run_id, self.path, ended, status)

  def get(self, run_id: int) -> Run:
    with self._connect() as db:
      row = db.execute("SELECT * FROM runs WHERE id = ?", (int(run_id),)).fetchone()
    if row is None:
      raise KeyError(f"no run {run_id} in {self.path}; `python experiments/runs.py "
                     "list` shows the runs")
    return Run.from_row(row)

  def list(self, *, name: Optional[str] = None, sweep: Optional[str] = None,
           status: Optional[str] = None) -> list[Run]:
    """Runs, oldest first, optionally only those with a name/sweep/status."""
    where = {"name": name, "sweep": sweep, "status": status}
    where = {k: v for k, v in where.items() if v is not None}
    sql = "SELECT * FROM runs"
    if where:
      sql += " WHERE " + " AND ".join(f"{k} = ?" for k in where)
    with self._connect() as db:
      rows = db.execute(sql + " ORDER BY id", tuple(where.values())).fetchall()
    return [Run.from_row(row) for row in rows]

  @contextlib.contextmanager
  def record(self, name: str, config: Any, workdir: Optional[os.PathLike] = None,
             *, sweep: Optional[str] = None) -> Iterator[RunRecord]:
    """Starts a run and finishes it however the body ends: `record.status`
    ("finished"), "failed" (an exception, re-raised), "preempted" (SIGTERM
    or a first Ctrl-C: interrupts.Preempted) or "killed" (a second Ctrl-C,
    SystemExit)."""
    try:
      record = RunRecord(self.start(name, config, workdir, sweep=sweep))
    except sqlite3.Error as e:   # bookkeeping never fails a run
      logging.warning("this run is not recorded: %s", store_error(self.path, e))
      record = RunRecord(id=-1)
    status = "failed"
    try:
      yield record
      status = record.status
    except interrupts.Preempted:
      status = "preempted"
      raise
    except (KeyboardInterrupt, SystemExit):
      status = "killed"
      raise
    finally:
      if record.id >= 0:
        self._finish_or_warn(record, status)

  def _finish_or_warn(self, record: RunRecord, status: str) -> None:
    """`finish`, where a locked or damaged store is a warning: the run's
    result (its workdir, checkpoints, metrics) stands either way."""
    try:
      self.finish(record.id, status, record.metrics, record.checkpoint)
    except (sqlite3.Error, KeyError) as e:
      error = store_error(self.path, e) if isinstance(e, sqlite3.Error) else e
      logging.warning("the end of run %d (%s) is not recorded: %s; the run's "
                      "workdir holds its result", record.id, status, error)


def store_error(path: Path, error: sqlite3.Error) -> RunStoreError:
  """The RunStoreError of a failed call on the store at `path`: "locked"
  (another process holds it: wait, nothing is wrong with it) told apart
  from "unreadable" (damaged: move it aside)."""
  text = str(error)
  if "locked" in text or "busy" in text:
    return RunStoreError(
        f"the run store {path} is locked by another process (a long "
        f"`sqlite3` session, a sweep, a copy in progress?): {text}. The store "
        "is not damaged: do not move it; runs are recorded again once it is "
        "released")
  return RunStoreError(
      f"the run store {path} is unreadable ({text}): move it aside "
      f"(mv {path} {path}.bad) and a new one is started; "
      "training records nothing meanwhile")


def observed(runs: Sequence[Run]) -> list[Run]:
  """`runs` (the whole store, oldest first) as they stand: a row recorded
  "running" shows "died" when its process is gone: its workdir's lock file
  is missing, or names a process of this host that no longer exists, or a
  newer "running" row holds the same workdir (one writer per workdir).
  Rows of another host's process or of a remote workdir stay as recorded."""
  newest = {r.workdir: r.id for r in runs if r.status == "running"}
  return [dataclasses.replace(r, status="died") if r.status == "running"
          and _died(r, newest) else r for r in runs]


def _where(workdir: Optional[os.PathLike]) -> Optional[str]:
  """A local workdir as an absolute path (the store is read from anywhere)."""
  if workdir is None or "://" in os.fspath(workdir):
    return None if workdir is None else os.fspath(workdir)
  return os.path.abspath(workdir)


def _died(run: Run, newest: dict) -> bool:
  if not run.workdir or "://" in run.workdir:
    return False
  if not os.path.isabs(run.workdir) and not os.path.isdir(run.workdir):
    return False   # recorded relative to a directory this is not run from
  if newest[run.workdir] != run.id:
    return True
  who = workdir_lock.holder(run.workdir)
  if who is None:
    return True
  return who.get("host") == socket.gethostname() and not workdir_lock.pid_alive(who["pid"])


def scalar_metrics(summary: dict) -> dict[str, Any]:
  """The entries of a run's summary worth a column: numbers, strings, paths
  and one-element arrays. Anything bigger (a final TrainState, a curve) is
  left out, so the store stays small and `compare` readable."""
  out = {}
  for key, value in summary.items():
    if hasattr(value, "size") and hasattr(value, "item") and value.size == 1:
      value = value.item()
    if isinstance(value, os.PathLike):
      value = os.fspath(value)
    if value is None or isinstance(value, (bool, int, float, str)):
      out[str(key)] = value
  return out


# ----------------------------------------------------------------------------
# Plain-text tables.
# ----------------------------------------------------------------------------

def format_value(value: Any) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.4g}" if math.isfinite(value) else str(value)
  if isinstance(value, (dict, list)):
    return json.dumps(value)
  return str(value)


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """Columns padded to their widest cell, a rule under the header."""
  cells = [list(header)] + [[format_value(v) for v in row] for row in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def _time(t: Optional[float]) -> str:
  return "-" if t is None else datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")


def _duration(seconds: Optional[float]) -> str:
  return "-" if seconds is None else str(datetime.timedelta(seconds=round(seconds)))


def format_runs(runs: Sequence[Run]) -> str:
  """`runs.py list`: one line per run."""
  rows = [(r.id, r.name, r.status, _time(r.start_time), _duration(r.duration),
           r.sweep, r.workdir) for r in runs]
  return format_table(("id", "name", "status", "started", "took", "sweep", "workdir"), rows)


def format_run(run: Run) -> str:
  """`runs.py show`: every field, then the config and metrics as JSON."""
  rows = [("name", run.name), ("status", run.status), ("git commit", run.git_commit),
          ("started", _time(run.start_time)), ("ended", _time(run.end_time)),
          ("took", _duration(run.duration)), ("sweep", run.sweep),
          ("workdir", run.workdir), ("checkpoint", run.checkpoint)]
  return "\n".join([f"run {run.id}", format_table(("field", "value"), rows),
                    "", "metrics:", json.dumps(run.metrics, indent=2, sort_keys=True),
                    "", "config:", json.dumps(run.config, indent=2, sort_keys=True)])


def compare_runs(runs: Sequence[Run]) -> str:
  """`runs.py compare`: one column per run; the config fields that differ
  between them, then every final metric."""
  configs = [flat_fields(r.config) for r in runs]
  keys = sorted(set().union(*configs))
  differing = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
  metrics = sorted(set().union(*(r.metrics for r in runs)))
  rows = [("name", *(r.name for r in runs)), ("status", *(r.status for r in runs)),
          ("took", *(_duration(r.duration) for r in runs))]
  rows += [(f"config.{k}", *(c.get(k) for c in configs)) for k in differing]
  rows += [(m, *(r.metrics.get(m) for r in runs)) for m in metrics]
  return format_table(("run", *(str(r.id) for r in runs)), rows)
