"""Runs one experiment: python experiments/run.py --config=configs/X.py[:arg].

  --config.rl.num_generations=16   overrides any field (ml-collections)
  --workdir=DIR                    where the resolved config (config.yaml),
                                   metrics, TensorBoard logs, checkpoints
                                   and plots go
  --verbosity=1                    also the libraries' INFO logs (orbax)
  --list                           lists the named experiments in configs/
"""
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags

from grpo_jax import errors
from grpo_jax.harness import cli, interrupts

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default: "
                               "workdirs/<config name>).")
_LIST = flags.DEFINE_bool("list", False, "List the experiments and exit.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: every argument is a "
                         "--flag=value (a forgotten '--' or '='?)")
  if _LIST.value:
    from grpo_jax.harness import runs  # pylint: disable=import-outside-toplevel
    configs_dir = os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "configs")
    for name, description in runs.list_experiments(configs_dir):
      print(f"{name:28s} {description}")
    return
  if _CONFIG.value is None:
    raise app.UsageError("--config is required (or --list)")
  config = _CONFIG.value
  workdir = _WORKDIR.value or os.path.join("workdirs", config.name)
  # SIGTERM / Ctrl-C: see grpo_jax/harness/interrupts.py (installed before the slow
  # imports, so a signal during start-up is recorded too).
  with cli.user_errors(workdir, exit_hard=True), interrupts.handle_signals(
      install=not _distributed(config)):
    summary = _run(config, workdir)
  for key in ("eval_before", "eval_after", "reward/mean", "plot"):
    if key in summary:
      print(f"{key}: {summary[key]}")


def _distributed(config) -> bool:
  from grpo_jax.harness import distributed  # pylint: disable=import-outside-toplevel
  return distributed.distributed_args(config.mesh) is not None


def _run(config, workdir: str) -> dict:
  # pylint: disable=import-outside-toplevel
  from grpo_jax import checkpoint, registry
  from grpo_jax.harness import experiment, runs
  # Validation and joining the processes happen once, here, before the run
  # is recorded (the method's guard finds the run started); the signal
  # handlers are main's; the method's guard takes the workdir lock.
  with experiment.started(config, workdir):
    run = registry.lookup("method", config.method)  # rl.train.run, star.loop.run
    # Every run is recorded (name, config, commit, times, status, metrics,
    # workdir, checkpoint) in the run store: experiments/runs.py list|show.
    with _record(config, workdir) as record:
      summary = run(config, workdir)
      record.metrics = runs.scalar_metrics(summary)
      # a pipeline's is its last stage's
      record.checkpoint = (summary.get("checkpoint")
                           or checkpoint.latest_checkpoint(workdir))
  return summary


def _record(config, workdir: str):
  """The run store's record on process 0 (one row per run, not per host); a
  record that goes nowhere on the other processes of a multi-host run, or
  when the store is unreadable (a warning says how to fix it: training goes
  on)."""
  from grpo_jax.harness import metrics, runs  # pylint: disable=import-outside-toplevel
  nowhere = contextlib.nullcontext(runs.RunRecord(id=-1))
  if not metrics.is_primary():
    return nowhere
  try:
    return runs.RunStore().record(config.name, config, workdir)
  except errors.RunStoreError as e:
    logging.warning("%s", e)
    return nowhere


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
