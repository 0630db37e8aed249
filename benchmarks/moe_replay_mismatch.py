"""Sampler vs trainer on an MoE model, with and without routing replay.

tiny-moe (random init; its router is near-uniform, so near ties are far
more common than in a trained model): the lockstep sampler records its
routes; the trainer scores the same rows at the same parameters, replaying
them or routing by itself, in float32 and in bfloat16 (sampler and trainer
in the same dtype).

    python benchmarks/moe_replay_mismatch.py     # 8 prompts x G=4, 16 tokens

Columns: dtype, replay, completion tokens, max and mean |Δ log p| over
them, and (replay) moe/routes_differ: the fraction of (token, sparse
layer) pairs where the trainer's router would choose other experts.
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.generate import rollout, sampling
from grpo_jax.models import cast, get_preset, init_params
from grpo_jax.rl import batch, update

CONFIG = get_preset("tiny-moe")
G, T = 4, 16


def sampled_rows(params, prompts) -> batch.RolloutBatch:
  """G recorded completions per prompt, as the trainer's rows."""
  out = jax.device_get(sampling.sample(
      CONFIG, params, prompts, jax.random.key(0),
      sampling.SamplingConfig(max_new_tokens=T, record_routes=True), G))
  B = len(prompts)
  groups = rollout.shape_groups(out, prompts, np.zeros(B * G, np.float32),
                                np.zeros(B * G, bool), G)
  return batch.to_rows(groups, 0, False)


def scored(params, rows: batch.RolloutBatch, dtype: str, replay: bool):
  """The trainer's log-probs [n, t] and its moe/routes_differ."""
  program = update.UpdateProgram(CONFIG, update.LossSettings(
      compute_dtype=dtype))
  b = update.UpdateBatch(
      *(jnp.asarray(x) for x in (rows.tokens_ns, rows.positions_ns,
                                 rows.valid_ns, rows.mask_nt,
                                 rows.old_logp_nt)),
      jnp.zeros(rows.mask_nt.shape), jnp.ones(len(rows.mask_nt)),
      routes_nslc=jnp.asarray(rows.routes_nslc) if replay else None)
  logp, _, routed = update.batch_logprobs(params, b, T, program)
  differ = routed.stats.differ / routed.stats.tokens
  return np.asarray(logp), float(differ)


def main() -> None:
  rng = np.random.RandomState(0)
  prompts = [list(rng.randint(4, 250, 3 + i % 5)) for i in range(8)]
  params = init_params(CONFIG, jax.random.key(1))
  for dtype in ("float32", "bfloat16"):
    p = cast(params, dtype)
    rows = sampled_rows(p, prompts)
    mask = rows.mask_nt > 0
    for replay in (True, False):
      logp, differ = scored(p, rows, dtype, replay)
      d = np.abs(logp[mask] - rows.old_logp_nt[mask])
      print(f"{dtype:9s} replay={replay!s:5s} tokens={mask.sum()} "
            f"max|dlogp|={d.max():.3g} mean={d.mean():.3g}"
            + (f" routes_differ={differ:.4f}" if replay else ""))


if __name__ == "__main__":
  main()
