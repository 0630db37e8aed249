"""The continuous-batching sampler at pod scale: dense slots against the
paged KV cache, in the same HBM, on the same simulated rows.

`check.check` compiles the sampler the config asks for; this module gives
what both samplers need for the comparison: the paged program
(`paged_slots.sample_pages` with the TPU kernel inside `jax.shard_map`),
the pool it gets (the bytes the dense slots would take), the per-chip
costs of a decode step (`schedule.Cost`) and the two simulated schedules
(`schedule.dense`, `schedule.paged`; the paged slots searched when not
configured).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.aot import flops as flops_lib
from grpo_jax.aot import schedule
from grpo_jax.aot.plan import Plan
from grpo_jax.aot.programs import Chips, Program, compile_program, replicated, row_sharded
from grpo_jax.generate import page_pool, paged_slots, sampling

# Paged slots tried per row shard when sampling.slots is 0: these multiples
# of the dense slots, and every row of the shard (admission by pages alone).
SLOT_MULTIPLES = (1, 2, 4)


def slot_search(dense_slots_per_shard: int, rows_per_shard: int) -> list:
  """Paged slots per row shard the schedule is simulated at when not
  configured: SLOT_MULTIPLES x the dense slots, and every row of a shard
  (admission by pages alone), none above the shard's rows."""
  return sorted({min(k * dense_slots_per_shard, rows_per_shard)
                 for k in SLOT_MULTIPLES} | {rows_per_shard})


def padded_prompts(plan: Plan) -> int:
  """The prompts of a step's call, padded to the row shards."""
  shards = plan.layout.batch_shards
  return -(-plan.run.batch.prompts // shards) * shards


class SamplerInputs(NamedTuple):
  """The abstract arguments of a slots sampler's call on a step's prompts."""
  prompts: int             # B, padded to the row shards
  prompt_bp: jax.ShapeDtypeStruct
  prompt_len_b: jax.ShapeDtypeStruct
  key: jax.ShapeDtypeStruct


def sampler_inputs(plan: Plan) -> SamplerInputs:
  b = padded_prompts(plan)
  return SamplerInputs(
      b, row_sharded(plan.layout, (b, plan.prompt_len), jnp.int32),
      row_sharded(plan.layout, (b,), jnp.int32),
      replicated(plan.layout, jax.eval_shape(lambda: jax.random.key(0))))


def paged_sampler(plan: Plan, slots: int, pages: int) -> Program:
  """`paged_slots.sample_pages` on all of a step's prompts x G rows with
  `slots` slots and `pages` pages per row shard (rows: the slots)."""
  x = sampler_inputs(plan)
  params, resident = plan.sampler_params(), plan.sampler_resident()
  call = sampling.CallSpec(plan.model_config, plan.paged_sampling_config(),
                           plan.run.batch.generations, plan.layout, slots,
                           pages)
  lower = lambda: paged_slots.sample_pages.lower(
      call, params, x.prompt_bp, x.prompt_len_b, x.key, jnp.int32(x.prompts))
  return compile_program("sampler paged", slots, lower, resident)


def pool_pages(plan: Plan, dense_slots: int) -> int:
  """Pages per row shard: sampling.pages, or (0) what `dense_slots` dense
  slots would hold beside the prompts (`sampling.pool_pages`), every
  prompt at the full bucket."""
  b, shards = padded_prompts(plan), plan.layout.batch_shards
  paged_config = dataclasses.replace(plan.paged_sampling_config(),
                                     pages=plan.config.sampling.pages)
  lengths_b = np.full(b, plan.prompt_len)
  item = jnp.dtype(plan.config.model.compute_dtype).itemsize
  ratio = sampling.kv_ratio(plan.model_config, item, plan.run.sampling.kv_dtype)
  return sampling.pool_pages(paged_config, lengths_b, b, dense_slots, shards,
                             plan.prompt_len, ratio)


def step_cost(plan: Plan, chips: Chips, kv_dtype: str = "") -> schedule.Cost:
  """Per-chip costs of one decode step on `chips`: rows over the batch
  shards, each shard's heads (and weights' output columns) over its chips;
  the KV columns (MLA: the latent once, `page_pool.token_bytes`) in the
  compute dtype or (kv_dtype int8, the paged pool's) int8 with a float32
  scale."""
  c = plan.model_config
  token = page_pool.token_bytes(
      c, jnp.dtype(plan.config.model.compute_dtype).itemsize, kv_dtype)
  per_shard = chips.count / plan.layout.batch_shards
  return schedule.Cost(
      prompt_len=plan.prompt_len,
      column_bytes=token / plan.layout.splits("kv_heads", c.num_kv_heads),
      weight_bytes=plan.weight_bytes(),
      slot_flops=2.0 * (flops_lib.body_weights(c) + flops_lib.head_weights(c))
      / per_shard,
      column_flops=flops_lib.attention_flops(c, 1) / per_shard,
      bandwidth=chips.spec["bandwidth"], peak_flops=chips.spec["flops"])


class Comparison(NamedTuple):
  dense: schedule.Schedule
  paged: schedule.Schedule
  tried: list             # paged Schedules of the slot search
  lengths: str            # how the rows' lengths were drawn
  mean_fraction: float    # their mean / the cap
  page_size: int          # the paged pool's columns per page


def shard_lengths(plan: Plan, lengths_n: np.ndarray) -> np.ndarray:
  """(R, N/R): the step's rows split as the sampler splits them; the rows of
  padded prompts (never decoded) count as one-token rows."""
  G, R = plan.run.batch.generations, plan.layout.batch_shards
  rows = padded_prompts(plan) * G
  out = np.ones(rows, np.int64)
  out[:len(lengths_n)] = lengths_n
  return out.reshape(R, rows // R)


def compare(plan: Plan, chips: Chips, dense_slots: int,
            lengths_n: np.ndarray, description: str,
            log=lambda line: None) -> Comparison:
  """Both samplers' schedules on `chips`, on the same rows: the dense slots
  and the paged pool of the same bytes; paged slots sampling.slots, or the
  fastest of SLOT_MULTIPLES x the dense slots and all of a shard's rows."""
  R, G = plan.layout.batch_shards, plan.run.batch.generations
  cost = step_cost(plan, chips)
  paged_cost = step_cost(plan, chips, plan.run.sampling.kv_dtype)
  lengths_rn = shard_lengths(plan, lengths_n)
  pages = pool_pages(plan, dense_slots)
  Z = plan.config.sampling.page_size
  dense = schedule.dense(lengths_rn, dense_slots // R, cost)
  if plan.config.sampling.slots and plan.config.sampling.kv_cache == "paged":
    candidates = [plan.config.sampling.slots // R]
  else:
    candidates = slot_search(dense_slots // R, lengths_rn.shape[1])
  tried = []
  for m in candidates:
    tried.append(schedule.paged(lengths_rn, m, pages, Z, G, paged_cost))
    log(f"  simulated paged, {m} slots per row shard: {tried[-1].steps} "
        f"steps, {tried[-1].seconds:.1f} s")
  best = min(tried, key=lambda s: s.seconds)
  return Comparison(dense, best, tried, description,
                    float(lengths_n.mean()) / plan.config.sampling.max_new_tokens, Z)


def page_write_bytes(s: schedule.Schedule, page_size: int) -> np.ndarray:
  """HBM bytes per chip a paged decode step's writes move, not in the
  roofline (which counts the columns read): `PoolLayout.write_step` reads
  every slot's page and writes each live row's back whole, so a step moves
  (slots + live rows) pages of every layer's keys and values."""
  return (s.slots + s.live_k) * page_size * s.cost.column_bytes


def format_comparison(cmp: Comparison, shards: int) -> list[str]:
  """The table aot.py prints: per row shard (its chips hold its rows' KV,
  split over their KV heads) and per chip."""
  GB = 1e9
  lines = [f"slot schedule (simulated, {cmp.lengths}; mean "
           f"{cmp.mean_fraction:.3f} of the cap; per-chip memory-bound "
           f"roofline, module grpo_jax/aot/schedule.py):",
           f"  {'sampler':8s} {'slots':>6s} {'pages':>7s} {'in flight (peak)':>15s}"
           f" {'steps':>7s} {'GB/step':>8s} {'ms/step':>8s} {'seconds':>8s}"
           f" {'tail steps':>11s} {'tail s':>7s} {'mem-bound':>9s}"
           f" {'preempted':>9s}"]
  for s in (cmp.dense, cmp.paged):
    lines.append(
        f"  {s.kind:8s} {s.slots:6d} {s.pages or '-':>7} "
        f"{s.in_flight:7.1f} ({s.live_k.max():5.0f})"
        f" {s.steps:7d} {s.bytes_k.mean() / GB:8.2f} "
        f"{1e3 * s.seconds / s.steps:8.2f} {s.seconds:8.1f} {s.tail:11d} "
        f"{s.tail_seconds:7.1f} {100 * s.memory_bound:8.0f}% {s.preempted:9d}")
  d, p = cmp.dense, cmp.paged
  lines.append(
      f"  paged / dense: time {p.seconds / d.seconds:.2f}x, time per decode "
      f"step {p.seconds / p.steps / (d.seconds / d.steps):.2f}x, rows in "
      f"flight {p.in_flight / d.in_flight:.2f}x on average over the steps "
      f"({p.live_k.max() / d.live_k.max():.2f}x at the peak); per row shard "
      f"({shards} shards), each of its chips holding their KV for its share "
      "of the KV heads")
  write_k = page_write_bytes(p, cmp.page_size)
  extra = float(write_k.sum()) / p.cost.bandwidth
  lines.append(
      f"  paged: its whole-page writes (not in the roofline) move "
      f"{write_k.mean() / GB:.2f} GB per step on average, {extra:.1f} s at "
      f"the HBM bandwidth (+{100 * extra / p.seconds:.1f}% of its time)")
  return lines
