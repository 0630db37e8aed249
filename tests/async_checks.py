"""Asynchronous rollouts against the synchronous loop (a script and a module).

tests/test_async.py imports the config and the helpers; as a script it runs
one training run in a process whose device count is fixed before JAX starts
(the split needs 8 fake CPU devices, its reference 4):

  python tests/async_checks.py DEVICES WORKDIR OUT.npz [field=value ...]

and saves the run's metrics (timings dropped) and final parameters to OUT.
The config is configs/tiny.py with dynamic sampling and KL on, and a reward
that mixes some groups and not others (a completion scores 1 when its
first byte is a multiple of 4: about a third of the random tiny model's
groups of 4 score all 0), so dynamic sampling keeps some groups and refills
the rest.
"""
import os
import sys

if __name__ == "__main__":  # before JAX starts a backend; importers keep theirs
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count="
                             f"{int(sys.argv[1])}")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

import json  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax
import numpy as np

from configs import tiny
from grpo_jax import registry
from grpo_jax.harness import metrics as metrics_lib

VOLATILE = ("time/", "tokens_per_second")   # and every "*seconds"
# What only the asynchronous loop logs.
ASYNC_KEYS = ("staleness/", "rollout/version", "sync/")


@registry.register("reward", "async_first_byte_mod4")
def first_byte_mod4(prompts, completions, answers, completion_lengths):
  del prompts, answers, completion_lengths
  return np.asarray([bool(t) and ord(t[0]) % 4 == 0 for t in completions],
                    np.float32)


def config(steps: int = 3, **fields):
  """The tiny config with dynamic sampling and KL on; `fields`: dotted
  overrides (rollout.max_staleness=1, ...)."""
  c = tiny.get_config()
  c.train.update(steps=steps, eval_at_start=False, eval_at_end=False)
  c.rewards = {"async_first_byte_mod4": 1.0}
  c.accuracy_reward = "async_first_byte_mod4"
  c.rl.update(dynamic_sampling=True, kl_beta=0.1, mini_batch_size=4)
  c.optim.eps = 1e-3   # Adam's first steps ~ linear in small gradients
  c.update_from_flattened_dict(fields)
  return c


def stale(c, k: int = 1):
  """`c` with rows k versions stale, on the decoupled objective."""
  c.rollout.max_staleness = k
  c.rl.old_logp = "recompute"
  c.rl.rollout_correction.is_level = "token"
  return c


def run_metrics(workdir: str) -> list[dict]:
  """metrics.jsonl without timings."""
  return [{k: v for k, v in row.items()
           if not k.startswith(VOLATILE) and not k.endswith("seconds")}
          for row in metrics_lib.read_jsonl(os.path.join(workdir,
                                                         "metrics.jsonl"))]


def leaves(params) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in
          jax.tree_util.tree_flatten_with_path(params)[0]}


def without_async_keys(rows: list[dict]) -> list[dict]:
  return [{k: v for k, v in row.items() if not k.startswith(ASYNC_KEYS)}
          for row in rows]


def _value(text: str):
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def _tuple(value):
  return tuple(value) if isinstance(value, list) else value


def main(argv) -> None:
  from grpo_jax.rl import train  # pylint: disable=import-outside-toplevel
  workdir, out = argv[2], argv[3]
  fields = dict(arg.split("=", 1) for arg in argv[4:])
  c = config(**{k: _tuple(_value(v)) for k, v in fields.items()
                if k != "stale"})
  if "stale" in fields:
    stale(c, int(fields["stale"]))
  summary = train.run(c, workdir)
  np.savez(out, metrics=json.dumps(run_metrics(workdir)),
           devices=jax.device_count(), **leaves(summary["state"].params))


if __name__ == "__main__":
  main(sys.argv)
