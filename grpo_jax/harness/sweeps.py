"""Sweeps: one base config, a list of override dicts, one run per dict.

A sweep file (`configs/sweeps/<name>.py`) defines `get_sweep()`, a list of
dicts from dotted config fields to values:

    def get_sweep():
      return [{"rl.eps_high": 0.2}, {"rl.eps_high": 0.28}]

`run_sweep` applies every dict and validates every resulting config before
the first run starts, runs them one after another, each in its own workdir and recorded
in the RunStore; `run_command` is the same point as an `experiments/run.py`
command line, for a cluster. Workdirs are a function of the sweep point, so
re-running an interrupted sweep resumes each run from its own checkpoint.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

from grpo_jax.harness import runs

Overrides = Mapping[str, Any]


def load_sweep(path: os.PathLike) -> list[dict[str, Any]]:
  """The override dicts of a sweep file's `get_sweep()`, checked for shape."""
  path = Path(path)
  spec = importlib.util.spec_from_file_location(f"_grpo_jax_sweep_{path.stem}", path)
  if spec is None or not path.is_file():
    raise FileNotFoundError(f"sweep file {path} not found")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"sweep file {path} defines no get_sweep()")
  sweep = module.get_sweep()
  if (not isinstance(sweep, (list, tuple)) or not sweep or
      not all(isinstance(o, Mapping) and all(isinstance(k, str) for k in o) for o in sweep)):
    raise ValueError(f"{path}: get_sweep() must return a non-empty list of dicts "
                     f"from dotted config fields to values, got {sweep!r:.200}")
  return [dict(o) for o in sweep]


def apply_overrides(config, overrides: Overrides):
  """A copy of `config` (a ConfigDict) with each dotted field set.

  An unknown field raises KeyError naming it and the fields that exist
  there; a value of the wrong type raises ValueError naming the field.
  """
  config = copy.deepcopy(config)
  for key, value in overrides.items():
    node = config
    parts = key.split(".")
    for depth, part in enumerate(parts):
      where = ".".join(parts[:depth]) or "the top level"
      if not hasattr(node, "keys"):
        raise KeyError(f"override {key!r}: {where} is a value, not a group of fields")
      if part not in node:
        raise KeyError(f"override {key!r}: the config has no field {part!r} at "
                       f"{where}; fields there: {sorted(node.keys())}")
      if depth < len(parts) - 1:
        node = node[part]
    try:
      node[parts[-1]] = value
    except TypeError as e:
      raise ValueError(f"override {key}={value!r}: {e}") from e
  return config


def label(overrides: Overrides) -> str:
  """A sweep point's name: "rl.eps_high=0.28" ("base" for no overrides)."""
  return "+".join(f"{k}={v}" for k, v in overrides.items()) or "base"


# The longest label a workdir's name keeps (file names end at 255 bytes);
# a longer one is cut and ends with a hash of the whole label.
MAX_LABEL = 120


def sweep_workdir(base: os.PathLike, index: int, overrides: Overrides) -> Path:
  """`<base>/<index>_<label>`, the label made safe for a path (a label
  longer than MAX_LABEL cut there, with a hash of it: still one per point)."""
  name = re.sub(r'[^A-Za-z0-9._=+-]', '-', label(overrides))
  if len(name) > MAX_LABEL:
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    name = f"{name[:MAX_LABEL - 13]}-{digest}"
  return Path(base) / f"{index:02d}_{name}"


def override_flags(overrides: Overrides) -> list[str]:
  """`--config.<field>=<value>` flags that ml_collections' config_flags parses."""
  return [f"--config.{k}={v if isinstance(v, str) else repr(v)}"
          for k, v in overrides.items()]


def run_command(config_spec: str, overrides: Overrides, workdir: os.PathLike,
                extra_overrides: Overrides = ()) -> str:
  """The shell command that runs one sweep point with experiments/run.py."""
  args = ["python", "experiments/run.py", f"--config={config_spec}",
          *override_flags(dict(extra_overrides)), *override_flags(overrides),
          f"--workdir={os.fspath(workdir)}"]
  return " ".join(shlex.quote(a) for a in args)


RunFn = Callable[[Any, str], Optional[Mapping[str, Any]]]


def check_points(config, sweep: Sequence[Overrides],
                 validate: Optional[Callable[[Any], Any]] = None) -> list:
  """Every point's config, each validated (`validate(config)`, e.g.
  validation.validate); an invalid point raises naming its index and label, so
  a sweep fails before its first run rather than after it."""
  configs = []
  for index, overrides in enumerate(sweep):
    point = apply_overrides(config, overrides)
    if validate is not None:
      try:
        validate(point)
      except ValueError as e:
        raise type(e)(f"sweep point {index} ({label(overrides)}): {e}") from None
    configs.append(point)
  return configs


def run_method(config, workdir: str) -> dict:
  """Runs one point with its config's method (the "method" registry: rl is
  train.run, star is star_loop.run), as experiments/run.py does."""
  import grpo_jax  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import  (registers the methods)
  from grpo_jax import registry  # pylint: disable=g-import-not-at-top
  return registry.lookup("method", config.method)(config, workdir)


class Destination(NamedTuple):
  """Where a sweep's runs go: each recorded in `store` as "<name>[<label>]"
  of sweep `sweep_name`, in its workdir under `base_workdir`
  (`sweep_workdir`)."""
  store: runs.RunStore
  name: str
  sweep_name: str
  base_workdir: os.PathLike


def run_sweep(config, sweep: Sequence[Overrides], run_fn: RunFn,
              destination: Destination, *, log: Callable[[str], None] = print,
              validate: Optional[Callable[[Any], Any]] = None) -> list[int]:
  """Runs every sweep point with `run_fn(config, workdir) -> final metrics`.

  Every point is checked first (`check_points`). Each run is recorded as
  `destination` says. A failing point is
  recorded as failed and the sweep goes on; a pre-empted point (SIGTERM,
  Ctrl-C: interrupts.Preempted) is recorded "preempted" and stops the sweep,
  as does a second Ctrl-C. Returns the run ids in sweep order.
  """
  from grpo_jax.checkpoint import latest_checkpoint  # imports JAX: only when running
  configs = check_points(config, sweep, validate)
  ids = []
  for index, (overrides, run_config) in enumerate(zip(sweep, configs)):
    workdir = sweep_workdir(destination.base_workdir, index, overrides)
    log(f"[{index + 1}/{len(sweep)}] {label(overrides)}: workdir {workdir}")
    try:
      with destination.store.record(
          f"{destination.name}[{label(overrides)}]", run_config, workdir,
          sweep=destination.sweep_name) as record:
        ids.append(record.id)
        record.metrics = dict(run_fn(run_config, os.fspath(workdir)) or {})
        record.checkpoint = latest_checkpoint(workdir)
    except Exception as e:   # pylint: disable=broad-except
      # One diverging point must not cost the rest of the sweep.
      log(f"run {ids[-1]} ({label(overrides)}) failed: {type(e).__name__}: {e}")
  return ids
