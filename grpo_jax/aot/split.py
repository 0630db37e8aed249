"""Sampler and trainer on disjoint chips of one topology (issue 27's pod
check): the step time of the synchronous colocated loop against the
asynchronous split, from the simulated slot schedule and the rooflines.

  colocated   all chips sample a step's rows (the paged sampler beside the
              train state), then all chips update: step = sampler + update.
  split       `sampler_devices` chips sample, the rest train, placed as a
              run places them (`placement`: each host's last chips); the
              sampler holds only its weights (compute dtype) and a staging
              copy for the weight sync, so its KV pool takes what the train
              state took. As rl/async_rollouts.py samples, each call takes
              one step's rows and its slots drain at the step's end, so a
              step costs one step's simulated schedule, tail included, at
              the paged slots that make it least, of those the colocated
              sampler's search tries (`sampler_seconds`).
              step = max(sampler side, trainer side) + weight sync.
              Also printed: partial rollouts as rl/partial_rollouts.py
              runs them (rollout.partial: slots kept full across steps),
              the steady state (the simulated time of STEADY_STEPS steps'
              rows minus one step's, per extra step) plus one prefill per
              weight switch of the rows then in flight (`switch_prefill`;
              their KV is recomputed under the new weights). The partial
              drains of docs/async.md rule 2 are not simulated.
  colocated asynchronous (sampler_devices = 0, k >= 1): both sides on
              every chip, one after the other on the device: the
              synchronous loop's device time, with host work under it.
  other slice (--sampler_topology) all chips of another topology sample;
              the weights cross DCN at a given bandwidth per sampler chip.
  sync        the sampler-dtype weights moved from the trainer's chips to
              the sampler's over ICI by the route the run takes
              (`sync_cost`: on several hosts every trainer chip first
              gathers the whole model), at one chip's ICI bandwidth
              (ICI_BANDWIDTH; every link busy, no contention, no overlap
              with compute: an estimate).

A split is feasible when the trainer's mini-batch and micro-batch split
over its row shards; the update keeps the colocated loop's rows per row
shard per micro-batch (so it needs the same memory per chip beside a
larger share of the train state). The update is compute-bound: a split
whose trainer alone is slower than the colocated step is not simulated.
Host work (verifier, tokenisation) is not in either step time.
`split_check.run` prices each split of a topology with `sides` and compiles
the fastest.
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import jax
import numpy as np

from grpo_jax import sharding
from grpo_jax.aot import check as aot
from grpo_jax.aot import flops as flops_lib
from grpo_jax.aot import sampler as pod_sampler
from grpo_jax.aot import schedule
from grpo_jax.aot.plan import Plan
from grpo_jax.aot.programs import Chips, per_chip_bytes, quantized
from grpo_jax.rl.spec import BatchSizes

# Per-chip ICI bandwidth, bytes/s (public spec sheets: v5p 4,800 Gbps,
# v6e 3,584 Gbps, v5e 1,600 Gbps, v4 2,400 Gbps).
ICI_BANDWIDTH = {"TPU v5": 600e9, "TPU v6 lite": 448e9, "TPU v5 lite": 200e9,
                 "TPU v4": 300e9}
STEADY_STEPS = 2


class SamplerSide(Plan):
  """The sampler's own chips: no train state; its weights (compute dtype,
  or int8) and one staging copy of the compute-dtype weights the sync
  sends (the next weights, swapped in atomically; int8: quantised there)."""

  def sampler_params(self):
    if self.int8_weights:
      return quantized(self.compute_params())
    return self.compute_params()

  def sampler_resident(self) -> int:
    return self.weight_bytes()

  def sampler_budget(self, hbm: float) -> float:
    return hbm - self.weight_bytes() - per_chip_bytes(self.compute_params())


def placement(devices: list, sampler_chips: int) -> tuple[list, list]:
  """(trainer chips, sampler chips): the chips a run with
  rollout.sampler_devices = sampler_chips gives each role on this topology
  (`weight_sync.split_devices`: each host's last sampler_chips / P chips
  sample, so on a v5p, 4 chips per host, 128 of 256 are every other row)."""
  from grpo_jax.rl import async_rollouts, weight_sync  # pylint: disable=import-outside-toplevel
  return weight_sync.split_devices(
      async_rollouts.RolloutSettings(sampler_devices=sampler_chips), devices)


def layout(config, devices: list) -> sharding.Layout:
  return sharding.Layout(sharding.make_mesh(config.mesh, devices),
                         sharding.logical_rules(config.mesh))


def trainer_config(config, micro_rows: int, colocated_shards: int,
                   trainer_shards: int):
  """The config with the update's micro-batch scaled to the trainer's row
  shards (the colocated rows per shard). Packed (rl.packing = on), where
  that many rows do not divide the mini-batch: the largest micro-batch
  that does, which `packing.pack_rows` rounds up to the row shards (e.g.
  24 row shards, one row each: 16, packed as 24 rows)."""
  out = copy.deepcopy(config)
  want = max(1, micro_rows * trainer_shards // colocated_shards)
  mini = BatchSizes.from_config(config).mini
  if mini % want and config.rl.packing == "on":
    want = max(d for d in range(1, want + 1) if mini % d == 0)
  out.rl.micro_batch_size = want
  return out


def feasible(plan: Plan) -> bool:
  """The update's batches split over the trainer's row shards: padded, its
  micro-batch must; packed (rl.packing = on), `pack_rows` pads the packed
  rows to them (the step's full [rows, s] arrays are then replicated when
  its rows do not split, which aot.py does not compile)."""
  shards, micro = plan.layout.batch_shards, plan.micro_rows()
  if plan.mini % micro:
    return False
  return plan.config.rl.packing == "on" or micro % shards == 0


class Sides(NamedTuple):
  sampler_chips: int
  sampler: Plan
  trainer: Plan
  sampler_seconds: float      # one step's rows per call (slots drain)
  one_step: schedule.Schedule  # that call's schedule
  steady_seconds: float       # partial rollouts: steady state + switch
  switch_seconds: float       # of which one prefill per weight switch
  trainer_seconds: float
  sync_bytes: float           # per chip received (sync_cost)
  sync_seconds: float

  @property
  def step(self) -> float:
    return max(self.sampler_seconds, self.trainer_seconds) + self.sync_seconds

  @property
  def partial_step(self) -> float:
    """The step with partial rollouts (rollout.partial)."""
    return max(self.steady_seconds, self.trainer_seconds) + self.sync_seconds


def sync_cost(sampler: Plan, trainer: Plan, bandwidth: float,
              hosts: int = 1) -> tuple:
  """(bytes, seconds) of one sync by the route rl/weight_sync.py takes,
  each chip's ICI at `bandwidth`, nothing overlapped (an estimate).
  One host: a device_put between the meshes, each sampler chip receiving
  its slice and each trainer chip sending its share of all the sampler's
  replicas; bytes: the larger per-chip count. Several hosts
  (`weight_sync._put_by_host`): each leaf is first replicated over the
  trainer's chips (each receives the whole sampler-dtype model but its
  own share: bytes), then each host copies its sampler chips' slices, one
  after the other."""
  # int8: the compute-dtype weights travel, quantised on arrival.
  int8 = sampler.int8_weights
  sent = lambda plan: (per_chip_bytes(plan.compute_params()) if int8
                       else plan.weight_bytes())
  receive = sent(sampler)
  if hosts > 1:
    tree = sampler.compute_params() if int8 else sampler.sampler_params()
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    gather = whole - sent(trainer)
    return gather, (gather + receive) / bandwidth
  send = receive * sampler.layout.mesh.size / trainer.layout.mesh.size
  return max(receive, send), max(receive, send) / bandwidth


def switch_prefill(plan: Plan, chips: Chips, rows: float,
                   lengths_n: np.ndarray) -> float:
  """Seconds of one weight switch's prefill (compute-bound, at peak) of
  `rows` rows in flight, each its prompt plus the tokens it has sampled:
  a row seen at a random moment of its life has sampled E[L^2] / 2E[L] of
  them (the longer a row, the likelier it is in flight)."""
  done = float((lengths_n.astype(np.float64) ** 2).sum()
               / (2 * max(lengths_n.sum(), 1)))
  tokens = plan.prompt_len + done
  flops = flops_lib.forward_flops(plan.model_config, rows * tokens, rows,
                                  rows * flops_lib.causal_pairs(tokens, 0))
  return flops / (chips.count * chips.spec["flops"])


def sampler_seconds(plan: Plan, chips: Chips, lengths_n: np.ndarray,
                    more_n: np.ndarray, log) -> tuple:
  """(one step's paged Schedule, its seconds, partial rollouts' seconds
  per step, of which the switch's prefill) on `chips`: at each number of
  paged slots per row shard that the colocated sampler's search tries
  (`sampler.slot_search`), the paged sampler on one step's rows (the slots
  with the least time) and on STEADY_STEPS steps' rows (each shard's rows
  of one step after the other's; partial rollouts: the least marginal
  time per extra step, plus `switch_prefill` of the rows in flight then,
  all the slots of every row shard)."""
  dense_slots = aot.auto_slots(plan.config, plan, chips.hbm, configured=False)
  cost = pod_sampler.step_cost(plan, chips, plan.run.sampling.kv_dtype)
  R, G = plan.layout.batch_shards, plan.run.batch.generations
  one_rn = pod_sampler.shard_lengths(plan, lengths_n)
  many_rn = np.concatenate(
      [pod_sampler.shard_lengths(plan, x)
       for x in np.split(more_n, STEADY_STEPS)], axis=1)
  pages = pod_sampler.pool_pages(plan, dense_slots)
  Z = plan.config.sampling.page_size
  best, steady = None, None
  for m in pod_sampler.slot_search(dense_slots // R, one_rn.shape[1]):
    one = schedule.paged(one_rn, m, pages, Z, G, cost)
    many = schedule.paged(many_rn, m, pages, Z, G, cost)
    switch = switch_prefill(plan, chips, m * R, lengths_n)
    partial = (many.seconds - one.seconds) / (STEADY_STEPS - 1) + switch
    log(f"  simulated paged, {m} slots per row shard: one step {one.seconds:.1f}"
        f" s, {STEADY_STEPS} steps {many.seconds:.1f} s ({many.preempted} "
        f"preempted); partial rollouts {partial:.1f} s per step, of which "
        f"{switch:.1f} s the switch's prefill")
    if best is None or one.seconds < best.seconds:
      best = one
    if steady is None or partial < steady[0]:
      steady = (partial, switch)
  return (best, best.seconds) + steady


class Colocated(NamedTuple):
  """The synchronous loop on all chips (`colocated_step`): its plan, its
  paged sampler's Schedule and each stage's seconds."""
  plan: Plan
  paged: schedule.Schedule
  sampler_seconds: float      # incl. the prefill
  trainer_seconds: float

  @property
  def step(self) -> float:
    return self.sampler_seconds + self.trainer_seconds


class Partition(NamedTuple):
  """One split of the chips: each side's, and the link the weights cross
  (`bandwidth` bytes/s per chip; `hosts`: those the copy runs on,
  `sync_cost`)."""
  sampler: Chips
  trainer: Chips
  bandwidth: float
  hosts: int = 1


def sides(colocated: Colocated, sampler_config, partition: Partition,
          lengths_n, more_n, log=lambda line: None) -> Optional[Sides]:
  """The split sampling on `partition.sampler`'s chips (with
  sampler_config's mesh) and training on `partition.trainer`'s, or None
  when the trainer's batch does not split over its row shards or the
  trainer alone is slower than the colocated step."""
  config, model_config = colocated.plan.config, colocated.plan.model_config
  prompt_len = colocated.plan.prompt_len
  sampler, trainer = partition.sampler, partition.trainer
  what = f"  split {sampler.count} + {trainer.count}"
  t_layout = layout(config, trainer.devices)
  t_config = trainer_config(config, colocated.plan.micro_rows(),
                            colocated.plan.layout.batch_shards,
                            t_layout.batch_shards)
  t_plan = Plan(t_config, model_config, t_layout, prompt_len)
  if not feasible(t_plan):
    log(f"{what}: the mini-batch of {t_plan.mini} rows does not split into "
        f"micro-batches over {t_layout.batch_shards} row shards"
        + ("" if config.rl.packing == "on" else
           " (with rl.packing=on the packed rows would)"))
    return None
  if t_plan.rows % t_layout.batch_shards:
    log(f"{what}: the step's {t_plan.rows} rows do not split over the "
        f"trainer's {t_layout.batch_shards} row shards: its full-step arrays "
        "are replicated on each chip (only packed mini-batches split)")
  roof = aot.step_roofline(t_plan, trainer.spec, trainer.count, 1, None,
                           lengths_n)
  train = sum(r.seconds for k, r in roof.items() if k != "sampler")
  if train >= colocated.step:
    log(f"{what}: the trainer alone takes {train:.1f} s >= the colocated "
        f"step {colocated.step:.1f} s (sampler not simulated)")
    return None
  s_plan = SamplerSide(sampler_config, model_config,
                       layout(sampler_config, sampler.devices), prompt_len)
  one, one_seconds, steady, switch = sampler_seconds(
      s_plan, sampler, lengths_n, more_n, log)
  receive, seconds = sync_cost(s_plan, t_plan, partition.bandwidth,
                               partition.hosts)
  return Sides(sampler.count, s_plan, t_plan, one_seconds, one, steady,
               switch, train, receive, seconds)


def colocated_step(plan: Plan, chips: Chips, lengths_n) -> Colocated:
  """The synchronous loop on all `chips` (its paged slots searched as
  `check` searches them)."""
  dense_slots = aot.auto_slots(plan.config, plan, chips.hbm, configured=False)
  cmp = pod_sampler.compare(plan, chips, dense_slots, lengths_n, "")
  roof = aot.step_roofline(plan, chips.spec, chips.count, 1, cmp.paged,
                           lengths_n)
  train = sum(r.seconds for k, r in roof.items() if k != "sampler")
  return Colocated(plan, cmp.paged, roof["sampler"].seconds, train)


def format_split(split: Sides, colocated: Colocated, sampler_topology: str,
                 trainer_topology: str) -> list[str]:
  """One split against the colocated loop, and what it buys."""
  one, paged, sync_step = split.one_step, colocated.paged, colocated.step
  w = lambda sch: sch.cost.weight_bytes / sch.bytes_k.mean()
  idle = lambda side: max(0.0, 1 - side / (split.step - split.sync_seconds))
  return [
      f"  split {split.sampler_chips} sampling ({sampler_topology}) + "
      f"{split.trainer.layout.mesh.size} training chips ({trainer_topology}):"
      f" sampler {split.sampler_seconds:.1f} s per step (one step's rows per "
      f"call, tail {one.tail_seconds:.1f} s; partial rollouts, "
      f"rollout.partial: {split.steady_seconds:.1f} s, of which "
      f"{split.switch_seconds:.1f} s the switch's prefill), trainer "
      f"{split.trainer_seconds:.1f} s, "
      f"sync {split.sync_seconds:.3f} s ({split.sync_bytes / 1e9:.2f} GB per "
      f"chip, {100 * split.sync_seconds / split.step:.2f}% of the step) -> "
      f"step {split.step:.1f} s = {split.step / sync_step:.3f}x the colocated "
      f"{sync_step:.1f} s (sampler {colocated.sampler_seconds:.1f} + update "
      f"{colocated.trainer_seconds:.1f})",
      f"    with partial rollouts (rollout.partial): step "
      f"{split.partial_step:.1f} s = {split.partial_step / sync_step:.3f}x "
      "the colocated (partial drains not simulated)",
      f"    idle: sampler {100 * idle(split.sampler_seconds):.0f}%, trainer "
      f"{100 * idle(split.trainer_seconds):.0f}%; rows in flight per row "
      f"shard {one.in_flight:.1f} (colocated {paged.in_flight:.1f}), pool "
      f"{one.pages} pages (colocated {paged.pages}); weights "
      f"{100 * w(one):.0f}% of a decode step's bytes (colocated "
      f"{100 * w(paged):.0f}%); colocated tail {paged.tail_seconds:.1f} s of "
      f"{paged.seconds:.1f} s"]
