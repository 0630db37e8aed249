"""Partial rollouts against today's per-step sampling (`ragged.py --partial`).

    python benchmarks/ragged.py --partial [--steps 4] [--prompts 4]
        [--generations 8] [--new-tokens 128] [--slots 8]

The same S steps of B prompts x G rows (ragged.py's prompts, EOS on,
temperature 1, SmolLM2-135M-Instruct in float32), sampled and scored
three ways, each once to compile and then timed:

  continuous   today's continuous-batching sampler, paged KV, one call per
               step (`rollout.generate_groups`, as the loop calls it): each
               call's slots drain at its end (the tail)
  parked, k=0  rl/partial_rollouts.py's sampler thread at k = 0: the
               stream on the parked engine, every step's rows ended before
               the next step's start (a full drain: the engine's own
               per-step figure, so the next row isolates the tail)
  partial, k=1 the same thread as `rollout.partial` runs it at k = 1:
               slots refilled with the next step's rows, a weight switch
               (every row off the engine, its KV recomputed) at each step

All at the given slots, a trainer that publishes the same weights as each
new version at once (no update: the sampler's side alone). Useful tokens:
through each row's stop token. The stream's seconds are split into the
parked engine's prefill and decode calls (each ends in a device_get, so
timing them adds no wait) and the rest (host). The last line is `ratios:
partial_vs_continuous <x>, partial_vs_drained <y>` (useful tokens/s).
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time

import _common
import jax

from grpo_jax.data.iterator import BatchIterator
from grpo_jax.generate import parked_programs, rollout, sampling
from grpo_jax.rl import async_rollouts, partial_rollouts
from grpo_jax.rl.weight_sync import WeightStore

SECONDS = collections.Counter()    # the engine's calls, by program


def _timed(name: str, program):
  def call(*args, **kwargs):
    t0 = time.perf_counter()
    out = jax.block_until_ready(program(*args, **kwargs))
    SECONDS[name] += time.perf_counter() - t0
    return out
  return call


parked_programs.prefill = _timed("prefill", parked_programs.prefill)
parked_programs.decode_steps = _timed("decode",
                                      parked_programs.decode_steps)


class _SameWeights:
  """A weight sync whose every version is the same parameters."""

  def __init__(self, store: WeightStore):
    self.store = store

  def publish(self, version: int, params) -> dict:
    self.store.publish(version, params)
    return {}

  def policy(self, params):
    return params


def _settings(step) -> rollout.GroupSettings:
  c = step.config
  return rollout.GroupSettings(c.rl.num_generations, step.spec,
                               c.data.template, c.data.system_prompt)


def _sampler(step, slots: int, page_size: int) -> sampling.Sampler:
  """The step's sampler settings on the paged continuous engine."""
  cfg = dataclasses.replace(step.sample_cfg, continuous_batching=True,
                            kv_cache="paged", slots=slots,
                            page_size=page_size)
  return sampling.Sampler(step.model_config, cfg, None, sampling.PagePools())


def continuous(step, sampler, examples, steps: int, seed: int) -> dict:
  """Today: one generate_groups call per step."""
  data = BatchIterator(examples, step.config.rl.prompts_per_step, seed=seed)
  t0, tokens, decode_steps = time.perf_counter(), 0, 0
  for u in range(steps):
    _, m = rollout.generate_groups(sampler, step.state.params, step.tokenizer,
                                   next(data), jax.random.key(u),
                                   _settings(step))
    tokens += m["sample/tokens"]
    decode_steps += m["sample/decode_steps"]
  return {"seconds": time.perf_counter() - t0, "tokens": tokens,
          "decode_steps": decode_steps, "carried": 0}


def stream(step, sampler, examples, steps: int, seed: int, k: int) -> dict:
  """rl/partial_rollouts.py's sampler thread at staleness k, the trainer
  taking each batch and publishing the next version at once."""
  c = step.config
  settings = async_rollouts.RolloutSettings(max_staleness=k, partial=True)
  data = BatchIterator(examples, c.rl.prompts_per_step, seed=seed)
  store = WeightStore()
  key_data = async_rollouts.key_value(jax.random.key(seed))
  t0 = time.perf_counter()
  threaded = partial_rollouts.PartialThreaded(
      async_rollouts.Source(settings, data, steps, []),
      partial_rollouts.PartialSampling(
          sampler, step.tokenizer, _settings(step), c.rl.prompts_per_step,
          jax.random.key(seed)),
      _SameWeights(store), store, 0, key_data, None)
  tokens = decode_steps = carried = 0
  try:
    threaded.publish(0, step.state.params)
    for u, step_key in async_rollouts.step_keys(key_data, 0, steps):
      batch, _ = threaded.take(u, step_key)
      tokens += batch.metrics["sample/tokens"]
      decode_steps += batch.metrics["sample/decode_steps"]
      carried += batch.metrics["partial/rows_carried"]
      threaded.publish(u + 1, step.state.params)
  finally:
    threaded.close()
  return {"seconds": time.perf_counter() - t0, "tokens": tokens,
          "decode_steps": decode_steps, "carried": carried}


def run(args, step, examples) -> int:
  """Each way once to compile, then once timed; the table and ratios."""
  S = args.steps
  sampler = _sampler(step, args.slot_counts[0] or args.generations,
                     args.page_size)
  ways = {
      "continuous": lambda: continuous(step, sampler, examples, S, args.seed),
      "parked, k=0": lambda: stream(step, sampler, examples, S, args.seed, 0),
      "partial, k=1": lambda: stream(step, sampler, examples, S, args.seed, 1),
  }
  for name, way in ways.items():
    mark = step.clock.mark()
    way()
    print(f"{name}: compile run, {step.clock.since(mark)[0]} compile(s)")
    sys.stdout.flush()
  rows = {}
  for name, way in ways.items():
    mark = step.clock.mark()
    SECONDS.clear()
    r = way()
    r.update(SECONDS)
    r["compiles"] = step.clock.since(mark)[0]
    r["tps"] = r["tokens"] / r["seconds"]
    rows[name] = r
    print(f"{name}: {r['seconds']:.1f} s, {r['tokens']:.0f} useful tokens, "
          f"{r['decode_steps']:.0f} decode steps, {r['tps']:.1f} tok/s, "
          f"rows carried {r['carried']:.0f}, {r['compiles']} compile(s)")
    sys.stdout.flush()
  _common.print_table(
      ("way", "s", "prefill s", "decode s", "useful tokens", "decode steps",
       "tokens/step", "useful tok/s", "rows carried"),
      [(n, f"{r['seconds']:.1f}", f"{r.get('prefill', 0):.1f}",
        f"{r.get('decode', 0):.1f}", f"{r['tokens']:.0f}",
        f"{r['decode_steps']:.0f}",
        f"{r['tokens'] / max(r['decode_steps'], 1):.2f}", f"{r['tps']:.1f}",
        f"{r['carried']:.0f}") for n, r in rows.items()])
  tps = {n: r["tps"] for n, r in rows.items()}
  print(f"ratios: partial_vs_continuous "
        f"{tps['partial, k=1'] / tps['continuous']:.2f}, partial_vs_drained "
        f"{tps['partial, k=1'] / tps['parked, k=0']:.2f}")
  return 0

