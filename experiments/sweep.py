r"""Runs a sweep: one training run per override dict, then a comparison table.

  python experiments/sweep.py --config=configs/dapo_aime.py:local \
      --sweep=configs/sweeps/clip_higher.py
  python experiments/sweep.py ... --dry_run    # one run.py command per point

`--config` takes the same spec and `--config.x.y=v` overrides as
experiments/run.py. Each point runs in `<workdir>/<index>_<label>` (default
workdir: $GRPO_JAX_RUNS/sweeps/<config>-<sweep>), so running the same sweep
again resumes every run from its own checkpoint. Every run is recorded in
the run store; `python experiments/runs.py list --sweep=<sweep>` finds them.
"""
import os
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import (
  app,  # pylint: disable=g-import-not-at-top
  flags,
)
from ml_collections import config_flags

from grpo_jax import errors, validation
from grpo_jax.harness import cli, interrupts, outdir, runs, sweeps

_CONFIG = config_flags.DEFINE_config_file("config", None, "Base config: file.py[:arg].")
_SWEEP = flags.DEFINE_string("sweep", None, "Sweep file defining get_sweep().",
                             required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Parent of the runs' workdirs.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands, run nothing.")
_RUNS_ROOT = flags.DEFINE_string("runs_root", None, "Run store root "
                                 "(default $GRPO_JAX_RUNS, else ./runs).")


def _names(config_spec: str) -> tuple[str, str]:
  """("dapo_aime:local", "dapo_aime_local-clip_higher") from the flags."""
  path, _, arg = config_spec.partition(":")
  name = Path(path).stem + (f":{arg}" if arg else "")
  return name, f"{name.replace(':', '_')}-{Path(_SWEEP.value).stem}"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  with cli.user_errors():
    _sweep()


def _sweep():
  spec = config_flags.get_config_filename(flags.FLAGS["config"])
  name, sweep_id = _names(spec)
  root = Path(_RUNS_ROOT.value) if _RUNS_ROOT.value else runs.default_root()
  base = Path(_WORKDIR.value) if _WORKDIR.value else root / "sweeps" / sweep_id
  # Every point validated (unknown fields, values) before anything runs.
  try:
    sweep = sweeps.load_sweep(_SWEEP.value)
    sweeps.check_points(_CONFIG.value, sweep, validation.validate)
  except (KeyError, ValueError, FileNotFoundError) as e:   # a bad sweep file or point
    raise errors.ConfigError(f"--sweep={_SWEEP.value}: {e.args[0] if e.args else e}") from None
  if _DRY_RUN.value:
    overrides_cli = config_flags.get_override_values(flags.FLAGS["config"])
    for index, overrides in enumerate(sweep):
      print(sweeps.run_command(spec, overrides, sweeps.sweep_workdir(base, index, overrides),
                               overrides_cli))
    return
  outdir.check_writable(base, "the sweep's --workdir")   # before the first run
  store = runs.RunStore(root)
  try:
    destination = sweeps.Destination(store, name, Path(_SWEEP.value).stem, base)
    ids = sweeps.run_sweep(_CONFIG.value, sweep, sweeps.run_method, destination,
                           validate=validation.validate)
  except interrupts.Preempted as e:
    print(f"sweep stopped: {e}; run the same sweep command again to resume "
          "(each point from its own checkpoint)", file=sys.stderr)
    sys.exit(e.exit_code)
  try:   # a point the store could not record (locked: a warning) has id -1
    recorded = [store.get(i) for i in ids if i >= 0]
  except sqlite3.Error as e:
    raise runs.store_error(store.path, e) from None
  print(runs.compare_runs(recorded))
  if any(r.status != "finished" for r in recorded):
    sys.exit(1)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=cli.parse_flags)
