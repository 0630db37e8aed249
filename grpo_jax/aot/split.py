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
              Also printed, as a what-if: the steady state of partial
              rollouts (not implemented: slots kept full across steps, new
              weights taken between decode steps), the simulated time of
              STEADY_STEPS steps' rows minus one step's, per extra step.
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
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import jax
import numpy as np

from grpo_jax import sharding
from grpo_jax.errors import ConfigError
from grpo_jax.aot import check as aot
from grpo_jax.aot import sampler as pod_sampler
from grpo_jax.aot import schedule
from grpo_jax.aot.programs import Plan

# Per-chip ICI bandwidth, bytes/s (public spec sheets: v5p 4,800 Gbps,
# v6e 3,584 Gbps, v5e 1,600 Gbps, v4 2,400 Gbps).
ICI_BANDWIDTH = {"TPU v5": 600e9, "TPU v6 lite": 448e9, "TPU v5 lite": 200e9,
                 "TPU v4": 300e9}
STEADY_STEPS = 2


class SamplerSide(Plan):
  """The sampler's own chips: no train state; its weights in the compute
  dtype and one staging copy (the next weights, swapped in atomically)."""

  def sampler_params(self):
    return self.compute_params()

  def sampler_resident(self) -> int:
    return self.weight_bytes()

  def sampler_budget(self, hbm: float) -> float:
    return hbm - 2 * self.weight_bytes()


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
  mini = (config.rl.mini_batch_size
          or config.rl.prompts_per_step * config.rl.num_generations)
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
  steady_seconds: float       # what-if: partial rollouts, per step
  trainer_seconds: float
  sync_bytes: float           # per chip received (sync_cost)
  sync_seconds: float

  @property
  def step(self) -> float:
    return max(self.sampler_seconds, self.trainer_seconds) + self.sync_seconds


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
  receive = sampler.weight_bytes()
  if hosts > 1:
    whole = sum(x.size * x.dtype.itemsize
                for x in jax.tree.leaves(sampler.sampler_params()))
    gather = whole - trainer.weight_bytes()
    return gather, (gather + receive) / bandwidth
  send = receive * sampler.layout.mesh.size / trainer.layout.mesh.size
  return max(receive, send), max(receive, send) / bandwidth


def sampler_seconds(plan: Plan, spec: dict, chips: int, hbm: float,
                    lengths_n: np.ndarray, more_n: np.ndarray, log) -> tuple:
  """(one step's paged Schedule, its seconds, the partial-rollout what-if
  seconds per step): at each number of paged slots per row shard that the
  colocated sampler's search tries (`sampler.slot_search`), the paged
  sampler on one step's rows (the slots with the least time) and on
  STEADY_STEPS steps' rows (each shard's rows of one step after the
  other's; the what-if is the least marginal time per extra step)."""
  dense_slots = aot.auto_slots(plan.config, plan, hbm, configured=False)
  cost = pod_sampler.step_cost(plan, spec, chips)
  R, G = plan.layout.batch_shards, plan.config.rl.num_generations
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
    marginal = (many.seconds - one.seconds) / (STEADY_STEPS - 1)
    log(f"  simulated paged, {m} slots per row shard: one step {one.seconds:.1f}"
        f" s, {STEADY_STEPS} steps {many.seconds:.1f} s ({many.preempted} "
        "preempted)")
    if best is None or one.seconds < best.seconds:
      best = one
    steady = marginal if steady is None else min(steady, marginal)
  return best, best.seconds, steady


class Chips(NamedTuple):
  """One side's chips: the devices, their spec (programs.chip_spec) and
  HBM per chip."""
  devices: list
  spec: dict
  hbm: float


def sides(config, sampler_config, model_config, sampler: Chips,
          trainer: Chips, prompt_len: int, lengths_n, more_n,
          colocated: Plan, sync_bandwidth: float, colocated_seconds: float,
          log=lambda s: None, sync_hosts: int = 1) -> Optional[Sides]:
  """The split sampling on `sampler`'s chips (with sampler_config's mesh)
  and training on `trainer`'s, or None when the trainer's batch does not
  split over its row shards or the trainer alone is slower than the
  colocated step (`colocated_seconds`). sync_hosts: the hosts the weight
  copy runs on (`sync_cost`)."""
  t_layout = layout(config, trainer.devices)
  t_config = trainer_config(config, colocated.micro_rows(),
                            colocated.layout.batch_shards,
                            t_layout.batch_shards)
  t_plan = Plan(t_config, model_config, t_layout, prompt_len)
  if not feasible(t_plan):
    log(f"  split {len(sampler.devices)} + {len(trainer.devices)}: the "
        f"mini-batch of {t_plan.mini} rows does not split into micro-batches "
        f"over {t_layout.batch_shards} row shards"
        + ("" if config.rl.packing == "on" else
           " (with rl.packing=on the packed rows would)"))
    return None
  if t_plan.rows % t_layout.batch_shards:
    log(f"  split {len(sampler.devices)} + {len(trainer.devices)}: the "
        f"step's {t_plan.rows} rows do not split over the trainer's "
        f"{t_layout.batch_shards} row shards: its full-step arrays are "
        "replicated on each chip (only packed mini-batches split)")
  roof = aot.step_roofline(t_plan, trainer.spec, len(trainer.devices), 1,
                           None, lengths_n)
  train = sum(r.seconds for k, r in roof.items() if k != "sampler")
  if train >= colocated_seconds:
    log(f"  split {len(sampler.devices)} + {len(trainer.devices)}: the "
        f"trainer alone takes {train:.1f} s >= the colocated step "
        f"{colocated_seconds:.1f} s (sampler not simulated)")
    return None
  s_plan = SamplerSide(sampler_config, model_config,
                       layout(sampler_config, sampler.devices), prompt_len)
  one, one_seconds, steady = sampler_seconds(
      s_plan, sampler.spec, len(sampler.devices), sampler.hbm, lengths_n,
      more_n, log)
  receive, seconds = sync_cost(s_plan, t_plan, sync_bandwidth, sync_hosts)
  return Sides(len(sampler.devices), s_plan, t_plan, one_seconds, one, steady,
               train, receive, seconds)


def colocated_step(plan: Plan, spec: dict, chips: int, hbm: float,
                   lengths_n) -> tuple:
  """(paged Schedule, sampler seconds incl. prefill, trainer seconds) of
  the synchronous loop on all chips (its paged slots searched as `check`
  searches them)."""
  dense_slots = aot.auto_slots(plan.config, plan, hbm, configured=False)
  cmp = pod_sampler.compare(plan, spec, chips, dense_slots, lengths_n, "")
  roof = aot.step_roofline(plan, spec, chips, 1, cmp.paged, lengths_n)
  train = sum(r.seconds for k, r in roof.items() if k != "sampler")
  return cmp.paged, roof["sampler"].seconds, train


def format_split(s: Sides, colocated: tuple, sampler_topology: str,
                 trainer_topology: str) -> list[str]:
  """One split against the colocated loop, and what it buys."""
  paged, sample, train = colocated
  sync_step = sample + train
  w = lambda sch: sch.cost.weight_bytes / sch.bytes_k.mean()
  idle = lambda side: max(0.0, 1 - side / (s.step - s.sync_seconds))
  return [
      f"  split {s.sampler_chips} sampling ({sampler_topology}) + "
      f"{s.trainer.layout.mesh.size} training chips ({trainer_topology}): "
      f"sampler {s.sampler_seconds:.1f} s per step (one step's rows per "
      f"call, tail {s.one_step.tail_seconds:.1f} s; partial rollouts, not "
      f"implemented, would give {s.steady_seconds:.1f} s), trainer "
      f"{s.trainer_seconds:.1f} s, "
      f"sync {s.sync_seconds:.3f} s ({s.sync_bytes / 1e9:.2f} GB per chip, "
      f"{100 * s.sync_seconds / s.step:.2f}% of the step) -> step "
      f"{s.step:.1f} s = {s.step / sync_step:.3f}x the colocated "
      f"{sync_step:.1f} s (sampler {sample:.1f} + update {train:.1f})",
      f"    idle: sampler {100 * idle(s.sampler_seconds):.0f}%, trainer "
      f"{100 * idle(s.trainer_seconds):.0f}%; rows in flight per row shard "
      f"{s.one_step.in_flight:.1f} (colocated {paged.in_flight:.1f}), pool "
      f"{s.one_step.pages} pages (colocated {paged.pages}); weights "
      f"{100 * w(s.one_step):.0f}% of a decode step's bytes (colocated "
      f"{100 * w(paged):.0f}%); colocated tail {paged.tail_seconds:.1f} s of "
      f"{paged.seconds:.1f} s"]


def run(config, topology: str, prompt_len: int, lengths_flag: str, seed: int,
        sampler_chips: list, compile_programs: bool, log=print,
        sampler_topology: str = "", sampler_mesh: tuple = (),
        dcn_bandwidth: float = 0.0) -> bool:
  """Prints the colocated loop and each split (`format_split`): the first
  N chips of `topology` sampling for each N of `sampler_chips`, or with
  `sampler_topology` all of its chips (mesh `sampler_mesh`; the weights
  cross DCN at `dcn_bandwidth` bytes/s per sampler chip). With
  compile_programs, compiles the fastest split's paged sampler on its
  chips and its update on the others. Returns whether they fit (True when
  not compiled)."""
  from grpo_jax.aot import programs as programs_lib  # pylint: disable=import-outside-toplevel
  chips = lambda d: Chips(d, programs_lib.chip_spec(d),
                          programs_lib.chip_memory(d))
  whole = chips(programs_lib.topology_devices(topology))
  model_config = programs_lib.model_config_from_source(config.model.source)
  colocated = Plan(config, model_config, layout(config, whole.devices),
                   prompt_len)
  rows = config.rl.prompts_per_step * config.rl.num_generations
  more_n, what = schedule.lengths_from_flag(
      lengths_flag, rows * STEADY_STEPS, config.sampling.max_new_tokens, seed)
  lengths_n = more_n[:rows]      # the first step's rows
  log(f"split check on {topology} ({len(whole.devices)} chips, "
      f"{whole.spec['kind']}); rows: {what}, mean "
      f"{lengths_n.mean() / config.sampling.max_new_tokens:.3f} of the cap; "
      "paged sampler on both sides")
  base = colocated_step(colocated, whole.spec, len(whole.devices), whole.hbm,
                        lengths_n)
  log(f"  colocated: sampler {base[1]:.1f} s (paged, {base[0].slots} slots "
      f"per row shard, tail {base[0].tail_seconds:.1f} s) + update "
      f"{base[2]:.1f} s = {base[1] + base[2]:.1f} s per step, synchronous "
      "or asynchronous (sampler_devices=0: the same device time, host work "
      "under it)")
  sampler_config = copy.deepcopy(config)
  from grpo_jax.rl import async_rollouts  # pylint: disable=import-outside-toplevel
  sampler_config.mesh.shape = (tuple(sampler_mesh) or async_rollouts
                               .RolloutSettings.from_config(config)
                               .sampler_mesh)
  if sampler_topology:
    splits = [(chips(programs_lib.topology_devices(sampler_topology)), whole,
               dcn_bandwidth)]
    hosts = 1     # the copy as one device_put over DCN (a route not built)
  else:
    ici = ICI_BANDWIDTH[whole.spec["kind"]]
    hosts = len({d.process_index for d in whole.devices})
    splits = []
    for n in sampler_chips:
      try:
        train, sample = placement(whole.devices, n)
      except ConfigError as e:
        log(f"  split {n} + {len(whole.devices) - n}: not possible: {e}")
        continue
      splits.append((Chips(sample, whole.spec, whole.hbm),
                     Chips(train, whole.spec, whole.hbm), ici))
  found = []
  for s_chips, t_chips, bandwidth in splits:
    s = sides(config, sampler_config, model_config, s_chips, t_chips,
              prompt_len, lengths_n, more_n, colocated, bandwidth,
              base[1] + base[2], log, hosts)
    if s is not None:
      found.append((s, s_chips.hbm, t_chips.hbm, s_chips.spec["kind"]))
      for line in format_split(s, base, sampler_topology or topology,
                               topology):
        log(line)
  if not found or not compile_programs:
    return True
  best, s_hbm, t_hbm, s_kind = min(found, key=lambda x: x[0].step)
  log(f"compiling the fastest split: {best.sampler_chips} sampling chips")
  log(aot.HEADER)
  paged = pod_sampler.paged_sampler(
      best.sampler, best.one_step.slots * best.sampler.layout.batch_shards,
      best.one_step.pages)
  t = best.trainer
  update = (t.update(t.micro_rows()) if config.rl.packing == "off"
            else t.packed_update(t.micro_rows()))
  for program, hbm in ((paged, s_hbm), (update, t_hbm)):
    log(aot.format_program(program, hbm))
  log("and the colocated loop's paged sampler, for its collectives:")
  colocated_paged = pod_sampler.paged_sampler(
      colocated, base[0].slots * colocated.layout.batch_shards, base[0].pages)
  log(aot.format_program(colocated_paged, whole.hbm))
  for line in format_collectives(
      best, paged, base, colocated_paged,
      (ICI_BANDWIDTH[whole.spec["kind"]], ICI_BANDWIDTH[s_kind])):
    log(line)
  return paged.fits(s_hbm) and update.fits(t_hbm)


def collective_seconds(program, one: schedule.Schedule, ici: float) -> float:
  """A call's decode-step collectives at `ici` bytes/s per chip, not
  overlapped with anything: per-step bytes x the schedule's steps."""
  return sum(b for _, b in program.collectives) / ici * one.steps


def format_collectives(s: Sides, sampler_program, colocated: tuple,
                       colocated_program, ici: tuple) -> list[str]:
  """The step times again with each sampler's decode-step collectives
  (from its compiled program; `ici`: the colocated and the split sampler's
  chips' bandwidth) added, none overlapped: the bound opposite the
  roofline's, where all of them are."""
  paged, sample, train = colocated
  extra_c = collective_seconds(colocated_program, paged, ici[0])
  extra_s = collective_seconds(sampler_program, s.one_step, ici[1])
  sync_step = sample + extra_c + train
  step = max(s.sampler_seconds + extra_s, s.trainer_seconds) + s.sync_seconds
  return [
      f"  with the decode steps' collectives not overlapped (at one chip's "
      f"ICI bandwidth): colocated sampler +{extra_c:.1f} s ({paged.steps} "
      f"steps), split sampler +{extra_s:.1f} s ({s.one_step.steps} steps) "
      f"-> step {step:.1f} s = {step / sync_step:.3f}x the colocated "
      f"{sync_step:.1f} s (all overlapped: {s.step / (sample + train):.3f}x)"]
