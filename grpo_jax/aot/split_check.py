"""The split check experiments/aot.py runs (--sampler_devices,
--sampler_topology): the colocated loop and each split of a topology's
chips (`Splits`), priced by `split.sides` and printed; the fastest one's
paged sampler and update compiled, with the step times again at its
decode steps' collectives not overlapped (`format_collectives`).
"""
from __future__ import annotations

import copy
import dataclasses

from grpo_jax.aot import check as aot
from grpo_jax.aot import programs as programs_lib
from grpo_jax.aot import sampler as pod_sampler
from grpo_jax.aot import schedule
from grpo_jax.aot.plan import Plan
from grpo_jax.aot.programs import Chips
from grpo_jax.aot.split import (
  ICI_BANDWIDTH,
  STEADY_STEPS,
  Colocated,
  Partition,
  Sides,
  colocated_step,
  format_split,
  layout,
  placement,
  sampler_seconds,
  sides,
)
from grpo_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Splits:
  """The splits `run` tries: on `topology`, each host's last chips
  sampling (`placement`), N of them for each N of `sampler_chips`; or,
  with `sampler_topology`, all of its chips sampling (mesh `sampler_mesh`;
  () takes rollout.sampler_mesh) and all of `topology`'s training, the
  weights crossing DCN at `dcn_bandwidth` bytes/s per sampler chip."""
  topology: str
  sampler_chips: tuple = ()
  sampler_topology: str = ""
  sampler_mesh: tuple = ()
  dcn_bandwidth: float = 0.0


def partitions(splits: Splits, whole: Chips, log) -> list[Partition]:
  """The partitions `splits` names (one not possible on `whole`'s
  topology is logged and skipped)."""
  if splits.sampler_topology:
    # The copy as one device_put over DCN (a route not built).
    sampler = Chips.of(programs_lib.topology_devices(splits.sampler_topology))
    return [Partition(sampler, whole, splits.dcn_bandwidth)]
  ici = ICI_BANDWIDTH[whole.spec["kind"]]
  hosts = len({d.process_index for d in whole.devices})
  out = []
  for n in splits.sampler_chips:
    try:
      train, sample = placement(whole.devices, n)
    except ConfigError as e:
      log(f"  split {n} + {whole.count - n}: not possible: {e}")
      continue
    out.append(Partition(Chips(sample, whole.spec, whole.hbm),
                         Chips(train, whole.spec, whole.hbm), ici, hosts))
  return out


def run(config, splits: Splits, prompt_len: int, lengths_flag: str,
        seed: int, compile_programs: bool, log=print) -> bool:
  """Prints the colocated loop and each split of `splits`
  (`format_split`). With compile_programs, compiles the fastest split's
  paged sampler on its chips and its update on the others
  (`compile_fastest`). Returns whether they fit (True when not
  compiled)."""
  whole = Chips.of(programs_lib.topology_devices(splits.topology))
  model_config = programs_lib.model_config_from_source(config.model.source)
  plan = Plan(config, model_config, layout(config, whole.devices), prompt_len)
  rows = plan.rows
  more_n, what = schedule.lengths_from_flag(
      lengths_flag, rows * STEADY_STEPS, config.sampling.max_new_tokens, seed)
  lengths_n = more_n[:rows]      # the first step's rows
  log(f"split check on {splits.topology} ({whole.count} chips, "
      f"{whole.spec['kind']}); rows: {what}, mean "
      f"{lengths_n.mean() / config.sampling.max_new_tokens:.3f} of the cap; "
      "paged sampler on both sides")
  colocated = colocated_step(plan, whole, lengths_n)
  log(f"  colocated: sampler {colocated.sampler_seconds:.1f} s (paged, "
      f"{colocated.paged.slots} slots per row shard, tail "
      f"{colocated.paged.tail_seconds:.1f} s) + update "
      f"{colocated.trainer_seconds:.1f} s = {colocated.step:.1f} s per step, "
      "synchronous or asynchronous (sampler_devices=0: the same device time, "
      "host work under it)")
  _, _, steady, switch = sampler_seconds(plan, whole, lengths_n, more_n,
                                         lambda line: None)
  prompts = colocated.sampler_seconds - colocated.paged.seconds
  partial = steady + prompts + colocated.trainer_seconds
  log(f"  colocated with partial rollouts (rollout.partial, k >= 1): sampler "
      f"{steady + prompts:.1f} s (steady state {steady - switch:.1f} + the "
      f"switch's prefill {switch:.1f} + the prompts' {prompts:.1f}) + update "
      f"{colocated.trainer_seconds:.1f} s = {partial:.1f} s per step = "
      f"{partial / colocated.step:.3f}x (partial drains not simulated)")
  sampler_config = copy.deepcopy(config)
  sampler_config.mesh.shape = (tuple(splits.sampler_mesh)
                               or plan.run.rollout.sampler_mesh)
  found = []
  for partition in partitions(splits, whole, log):
    split = sides(colocated, sampler_config, partition, lengths_n, more_n,
                  log)
    if split is not None:
      found.append((split, partition))
      for line in format_split(split, colocated,
                               splits.sampler_topology or splits.topology,
                               splits.topology):
        log(line)
  if not found or not compile_programs:
    return True
  return compile_fastest(*min(found, key=lambda x: x[0].step), colocated,
                         whole, log)


def compile_fastest(split: Sides, partition: Partition, colocated: Colocated,
                    whole: Chips, log) -> bool:
  """Compiles `split`'s paged sampler on its chips and its update on the
  others, and the colocated loop's paged sampler on `whole` for its
  collectives (`format_collectives`); whether the split's two fit."""
  log(f"compiling the fastest split: {split.sampler_chips} sampling chips")
  log(aot.HEADER)
  paged = pod_sampler.paged_sampler(
      split.sampler, split.one_step.slots * split.sampler.layout.batch_shards,
      split.one_step.pages)
  t = split.trainer
  update = (t.update(t.micro_rows()) if t.config.rl.packing == "off"
            else t.packed_update(t.micro_rows()))
  on_chips = ((paged, partition.sampler.hbm), (update, partition.trainer.hbm))
  for program, hbm in on_chips:
    log(aot.format_program(program, hbm))
  log("and the colocated loop's paged sampler, for its collectives:")
  plan, one = colocated.plan, colocated.paged
  colocated_paged = pod_sampler.paged_sampler(
      plan, one.slots * plan.layout.batch_shards, one.pages)
  log(aot.format_program(colocated_paged, whole.hbm))
  for line in format_collectives(
      split, paged, colocated, colocated_paged,
      (ICI_BANDWIDTH[whole.spec["kind"]],
       ICI_BANDWIDTH[partition.sampler.spec["kind"]])):
    log(line)
  return all(program.fits(hbm) for program, hbm in on_chips)


def collective_seconds(program, one: schedule.Schedule, ici: float) -> float:
  """A call's decode-step collectives at `ici` bytes/s per chip, not
  overlapped with anything: per-step bytes x the schedule's steps."""
  return sum(b for _, b in program.collectives) / ici * one.steps


def format_collectives(split: Sides, sampler_program, colocated: Colocated,
                       colocated_program, ici: tuple) -> list[str]:
  """The step times again with each sampler's decode-step collectives
  (from its compiled program; `ici`: the colocated and the split sampler's
  chips' bandwidth) added, none overlapped: the bound opposite the
  roofline's, where all of them are."""
  paged = colocated.paged
  extra_c = collective_seconds(colocated_program, paged, ici[0])
  extra_s = collective_seconds(sampler_program, split.one_step, ici[1])
  sync_step = colocated.sampler_seconds + extra_c + colocated.trainer_seconds
  step = (max(split.sampler_seconds + extra_s, split.trainer_seconds)
          + split.sync_seconds)
  return [
      f"  with the decode steps' collectives not overlapped (at one chip's "
      f"ICI bandwidth): colocated sampler +{extra_c:.1f} s ({paged.steps} "
      f"steps), split sampler +{extra_s:.1f} s ({split.one_step.steps} "
      f"steps) -> step {step:.1f} s = {step / sync_step:.3f}x the colocated "
      f"{sync_step:.1f} s (all overlapped: "
      f"{split.step / colocated.step:.3f}x)"]
