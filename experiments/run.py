"""Runs one experiment: python experiments/run.py --config=configs/X.py[:arg].

  --config.rl.num_generations=16   overrides any field (ml-collections)
  --workdir=DIR                    where metrics, TensorBoard logs,
                                   checkpoints and plots go
  --list                           lists the named experiments in configs/
"""
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default: "
                               "workdirs/<config name>).")
_LIST = flags.DEFINE_bool("list", False, "List the experiments and exit.")


def main(argv):
  del argv
  if _LIST.value:
    from grpo_jax import runs  # pylint: disable=import-outside-toplevel
    configs_dir = os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "configs")
    for name, description in runs.list_experiments(configs_dir):
      print(f"{name:28s} {description}")
    return
  if _CONFIG.value is None:
    raise app.UsageError("--config is required (or --list)")
  from grpo_jax import registry  # pylint: disable=import-outside-toplevel
  config = _CONFIG.value
  workdir = _WORKDIR.value or os.path.join("workdirs", config.name)
  logging.info("config:\n%s", config)
  from grpo_jax import checkpoint, runs  # pylint: disable=import-outside-toplevel
  run = registry.lookup("method", config.method)  # rl: train.run, star: star_loop.run
  # Every run is recorded (name, config, commit, times, status, metrics,
  # workdir, checkpoint) in the run store: experiments/runs.py list|show|compare.
  with _record(config, workdir) as record:
    summary = run(config, workdir)
    record.metrics = runs.scalar_metrics(summary)
    record.checkpoint = checkpoint.latest_checkpoint(workdir)
  for key in ("eval_before", "eval_after", "reward/mean", "plot"):
    if key in summary:
      print(f"{key}: {summary[key]}")


def _record(config, workdir: str):
  """The run store's record on process 0 (one row per run, not per host); a
  record that goes nowhere on the other processes of a multi-host run."""
  from grpo_jax import metrics, runs, sharding  # pylint: disable=import-outside-toplevel
  sharding.initialize_distributed(config)  # before jax.process_index()
  if not metrics.is_primary():
    return contextlib.nullcontext(runs.RunRecord(id=-1))
  return runs.RunStore().record(config.name, config, workdir)


if __name__ == "__main__":
  app.run(main)
