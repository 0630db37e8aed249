"""One process of tests/test_multiprocess.py: trains configs/tiny.py for two
steps with `train.run`, prints a JSON line with the last step's loss and
reward, and saves the final parameters to OUT (.npz): what must not depend on
the number of processes.

  python tests/multiprocess_worker.py WORKDIR NUM_PROCESSES PROCESS_ID PORT OUT
      [async]

NUM_PROCESSES = 1 is the single-process reference (no jax.distributed).
`async`: rollouts one version stale on a split (rl/async_rollouts.py): the
last 2 devices in all sample (one per host on two hosts), the rest train.
The processes of one run share WORKDIR, as hosts of a pod share a bucket:
Orbax's multi-host checkpointing needs one directory.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
from jax.experimental import multihost_utils

from configs import tiny
from grpo_jax.registry import register
from grpo_jax.rl import train


@register("reward", "even_bytes")
def even_bytes_reward(prompts, completions, answers, completion_lengths):
  """Fraction of even characters: random text varies, so advantages and the
  loss are non-zero (the tiny model almost never solves a sum)."""
  del prompts, answers, completion_lengths
  return np.asarray([sum(ord(ch) % 2 == 0 for ch in text) / max(len(text), 1)
                     for text in completions], np.float32)


def config_for(num_processes: int, process_id: int, port: int,
               asynchronous: bool = False, sampler_devices: int = 2):
  c = tiny.get_config()
  c.train.steps = 2
  c.train.eval_at_start = False
  c.train.eval_at_end = False
  c.rewards = {"even_bytes": 1.0}
  c.accuracy_reward = "even_bytes"
  # Two mini-batches per step and a KL term: the second update's ratio is
  # not 1 and the policy drifts from the reference, so the loss is not ~0
  # (on-policy, z-scored advantages make the first update's loss ~0).
  c.rl.mini_batch_size = 4
  c.rl.kl_beta = 0.1
  # Adam's first steps are ~ lr·g/(|g| + eps): with eps = 1e-8, rounding
  # noise in a near-zero gradient entry (the all-reduce sums in another
  # order) moves that weight by up to ~lr. eps = 1e-3 keeps the step linear
  # in small gradients, so the runs can be compared at float32 tolerance.
  c.optim.eps = 1e-3
  if asynchronous:
    c.rollout.sampler_devices, c.rollout.max_staleness = sampler_devices, 1
    c.rl.old_logp, c.rl.rollout_correction.is_level = "recompute", "token"
  if num_processes > 1:
    c.mesh.coordinator_address = f"127.0.0.1:{port}"
    c.mesh.num_processes = num_processes
    c.mesh.process_id = process_id
  return c


def main(argv) -> None:
  workdir, num, pid, port, out = argv[1], *map(int, argv[2:5]), argv[5]
  asynchronous = bool(argv[6:]) and argv[6].startswith("async")
  # "async3": 3 sampler devices, on two hosts 2 + 1 (uneven host shares).
  sampler_devices = 3 if argv[6:] == ["async3"] else 2
  summary = train.run(config_for(num, pid, port, asynchronous,
                                 sampler_devices), workdir)
  # Gathered to every host whatever the sharding.
  params = multihost_utils.process_allgather(summary["state"].params,
                                             tiled=True)
  np.savez(out, **{jax.tree_util.keystr(path): np.asarray(x)
                   for path, x in jax.tree_util.tree_flatten_with_path(
                       params)[0]})
  print(json.dumps({"process": jax.process_index(),
                    "processes": jax.process_count(),
                    "devices": jax.device_count(),
                    "loss": summary["loss"], "reward": summary["reward/mean"]}),
        flush=True)


if __name__ == "__main__":
  main(sys.argv)
