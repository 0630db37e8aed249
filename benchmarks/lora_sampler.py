"""LoRA sampling: adapters merged once per update vs the unmerged low-rank path.

    python benchmarks/lora_sampler.py [--models tiny,smollm2-135m-instruct]
        [--rank 32] [--prompts 8] [--generations 4] [--new-tokens 64]

For each model, rank-r adapters on all seven projections (B random, as
after training), the same prompts and key on both sides, EOS ignored:

  merged    lora.policy_params(..., sampler="merged"): W + α/r·A·B into a
            compute-dtype copy (one jitted merge, timed with the sampling),
            then `sampling.sample` on plain weights;
  unmerged  the base with the adapters attached: every decode step adds
            (x·A)·B beside x·W for each projection.

Prints tokens/s of each (best of --repeats after a warm-up compile) and the
ratio merged / unmerged; the merge's own seconds are included in `merged`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import numpy as np

from grpo_jax.generate import sampling
from grpo_jax.models import get_preset, init_params, load_pretrained, lora


def _model(name):
  if name == "tiny":
    config = get_preset("tiny")
    return config, init_params(config, jax.random.key(0))
  return load_pretrained(name)


def _adapters(config, spec):
  adapters = lora.init_adapters(config, spec, jax.random.key(1))
  keys = iter(jax.random.split(jax.random.key(2), 100))
  return jax.tree_util.tree_map_with_path(
      lambda p, x: (0.02 * jax.random.normal(next(keys), x.shape)
                    if p[-1].key == "b" else x), adapters)


def _timed(fn, repeats):
  fn()                                      # compile
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn().tokens_nt)
    best = min(best, time.perf_counter() - t0)
  return best


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", default="tiny,smollm2-135m-instruct")
  ap.add_argument("--rank", type=int, default=32)
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--generations", type=int, default=4)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=2)
  args = ap.parse_args()
  cfg = sampling.SamplingConfig(max_new_tokens=args.new_tokens,
                                temperature=1.0, stop_ids=())
  for name in args.models.split(","):
    config, base = _model(name)
    spec = lora.LoraSpec(rank=args.rank, alpha=float(args.rank))
    adapters = _adapters(config, spec)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(1, config.vocab_size, rng.randint(16, 33)))
               for _ in range(args.prompts)]
    key = jax.random.key(3)
    rows = args.prompts * args.generations
    secs = {}
    for sampler in lora.SAMPLERS:
      s = dataclasses.replace(spec, sampler=sampler)
      run = lambda s=s: sampling.sample(
          config, lora.policy_params(base, adapters, s, "float32"), prompts,
          key, cfg, args.generations)
      secs[sampler] = _timed(run, args.repeats)
    t0 = time.perf_counter()
    jax.block_until_ready(lora.policy_params(base, adapters, spec, "float32"))
    merge_s = time.perf_counter() - t0
    tps = {k: rows * args.new_tokens / v for k, v in secs.items()}
    print(f"{name}: rank {args.rank}, {rows} rows x {args.new_tokens} tokens: "
          f"merged {tps['merged']:.0f} tok/s ({secs['merged']:.2f} s, of "
          f"which the merge {merge_s:.3f} s), unmerged {tps['unmerged']:.0f} "
          f"tok/s ({secs['unmerged']:.2f} s); merged/unmerged "
          f"{tps['merged'] / tps['unmerged']:.2f}x", flush=True)


if __name__ == "__main__":
  main()
