"""REFERENCE + UPDATE of one RL step, on the step's rollout rows.

    train_step      score_step: the whole step's rows scored once, π_ref
                    (β > 0) and π_old recomputed (rl.old_logp = recompute,
                    then the decoupled rollout correction) -> UpdateBatch
                    update_passes: rl.num_updates passes over shuffled
                    mini-batches of it, one optimizer update each

Both stages take one path: a batch (the step's rows, or one mini-batch) is
packed where `choose_packing` says (`for_program`), then one jitted program
runs it padded or packed alike (`update.score_logprobs`,
`update.update_step`). The settings come as values: an `UpdateSpec`, derived
from the config once per run (`UpdateSpec.from_config`), and the run's
static `update.UpdateProgram`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sharding as sharding_lib
from grpo_jax.algorithms import distillation, rollout_correction
from grpo_jax.rl import nonfinite, packing
from grpo_jax.rl.batch import RolloutBatch
from grpo_jax.rl.update import (
  LossSettings,
  Policy,
  UpdateBatch,
  UpdateProgram,
  micro_batch_rows,
  pack_update_batch,
  score_logprobs,
  update_step,
)


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
  """How a step's rollout becomes optimizer updates (config.rl, derived once
  per run by `from_config`): the loss settings; μ = num_updates passes over
  mini-batches of `mini_batch_size` rows (0: all), micro-batches of
  `micro_batch_size` rows or of at most `micro_batch_tokens` tokens (0:
  whole); groups of `num_generations` rows sharing a prompt run it once
  (`shared_prompt`); `packing` (off, on, auto); π_old recomputed
  (`recompute_old`, rl.old_logp = recompute) with the decoupled rollout
  `correction`."""
  loss: LossSettings = LossSettings()
  num_updates: int = 1
  mini_batch_size: int = 0
  micro_batch_size: int = 0
  micro_batch_tokens: int = 0
  num_generations: int = 1
  shared_prompt: bool = True
  packing: str = "off"
  recompute_old: bool = False
  distill: bool = False
  correction: rollout_correction.CorrectionSettings = (
      rollout_correction.CorrectionSettings())

  @classmethod
  def from_config(cls, config) -> "UpdateSpec":
    rl = config.rl
    return cls(
        loss=LossSettings.from_config(config), num_updates=rl.num_updates,
        mini_batch_size=rl.mini_batch_size,
        micro_batch_size=rl.micro_batch_size,
        micro_batch_tokens=rl.micro_batch_tokens,
        num_generations=rl.num_generations, shared_prompt=rl.shared_prompt,
        packing=rl.packing, recompute_old=rl.old_logp == "recompute",
        distill=rl.distill.mode == "on_policy",
        correction=rollout_correction.CorrectionSettings.from_config(
            rl.rollout_correction))

  @property
  def scores(self) -> bool:
    """Whether a step scores its rows (π_ref, π_old recomputed, or the
    distillation teacher)."""
    return self.loss.use_kl or self.recompute_old or self.distill

  def program(self, model_config, optimizer, layout=None) -> UpdateProgram:
    """The run's static update world (`update.UpdateProgram`) with these
    loss settings; steps specialise its micro-batches and group size."""
    return UpdateProgram(model_config, self.loss, optimizer, layout=layout)

  def group_size(self, rows: int) -> int:
    """Rows per prompt the update may rely on in batches of `rows` rows
    (1: none): the G rows of a group share their prompt, which the update
    then runs once (rl.shared_prompt)."""
    G = self.num_generations
    return G if self.shared_prompt and G > 1 and rows % G == 0 else 1


class Frozen(NamedTuple):
  """The parameters a step reads and never trains: with LoRA the frozen
  `base` (state.params are its adapters), the `reference` policy's
  params when β > 0 (with LoRA the base itself: adapters off), and the
  on-policy distillation `teacher` (rl/distill.py's Teacher)."""
  base: object = None
  reference: object = None
  teacher: object = None


def _put(program: UpdateProgram):
  """Host rows -> the program's device arrays (row-sharded with a layout)."""
  return program.layout.rows if program.layout is not None else jnp.asarray


def _minibatches(n: int, size: int, rng: np.random.Generator,
                 group_size: int = 1):
  """Shuffled mini-batches of row indices. group_size > 1: whole groups are
  shuffled, so each mini-batch is whole groups of consecutive rows."""
  groups = rng.permutation(n // group_size)
  order = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
  return [order[i:i + size] for i in range(0, n, size)]


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """`spec` applied to one step's n rows of s columns (t completion
  tokens): mini-batches of `mini` rows, micro-batches of `micro`, G rows
  sharing a prompt in groups of `group` (of `whole` over the full batch,
  for scoring), over `shards` row shards."""
  spec: UpdateSpec
  n: int
  T: int
  seq_len: int
  mini: int
  micro: int
  group: int
  whole: int
  shards: int

  @classmethod
  def of(cls, spec: UpdateSpec, rollout: RolloutBatch, layout=None
         ) -> "UpdatePlan":
    n, seq_len = rollout.tokens_ns.shape
    mini = spec.mini_batch_size or n
    micro = micro_batch_rows(mini, seq_len, spec.micro_batch_size,
                             spec.micro_batch_tokens)
    return cls(spec=spec, n=n, T=rollout.mask_nt.shape[1], seq_len=seq_len,
               mini=mini, micro=micro,
               group=spec.group_size(mini), whole=spec.group_size(n),
               shards=layout.batch_shards if layout is not None else 1)


def choose_packing(plan: UpdatePlan, tokens_ns, valid_ns, mask_nt,
                   routes_nslc, group_size: int):
  """(packed rows, micro-batches) for these rows, or None where rl.packing
  says to stay padded (off; auto: where packing does not save tokens).
  Packed rows keep the padded path's micro-batch token budget; recorded
  routes (routing replay; None: none) are packed with their tokens."""
  if plan.spec.packing == "off":
    return None
  rows, num_micro = packing.pack_rows(tokens_ns, valid_ns, mask_nt,
                                      group_size, plan.micro, plan.shards,
                                      routes_nslc)
  if plan.spec.packing == "auto" and not packing.wins(
      rows, len(mask_nt), plan.seq_len - plan.T, plan.T, group_size):
    return None
  return rows, num_micro


def for_program(plan: UpdatePlan, batch: UpdateBatch, host: tuple,
                group_size: int, put):
  """A batch of padded rows as its program runs it: packed where
  `choose_packing` says for its host (tokens, valid, loss mask, routes or
  None), else as it is; (batch, micro-batches, packing metrics)."""
  n = len(host[0])
  chosen = choose_packing(plan, *host, group_size)
  if chosen is None:
    return batch, n // plan.micro, {"pack/used": 0.0}
  rows, num_micro = chosen
  return (jax.tree.map(put, pack_update_batch(batch, rows)), num_micro,
          {"pack/used": 1.0, **packing.describe(rows, n)})


def score_step(plan: UpdatePlan, program: UpdateProgram, state,
               rollout: RolloutBatch, adv_n, frozen: Frozen
               ) -> tuple[UpdateBatch, dict]:
  """REFERENCE: the step's full UpdateBatch, with log-probs under π_ref
  (β > 0) and π_old recomputed (rl.old_logp = recompute, then the decoupled
  rollout correction), scored packed or padded (`for_program`). With LoRA
  the policy is the base with the adapters state.params, the reference the
  base itself."""
  spec, put = plan.spec, _put(program)
  routes = rollout.routes_nslc
  cols = UpdateBatch(put(rollout.tokens_ns), put(rollout.positions_ns),
                     put(rollout.valid_ns),
                     routes_nslc=None if routes is None else put(routes))
  metrics, t0 = {}, time.perf_counter()
  old = put(rollout.old_logp_nt)
  if spec.scores:
    scored, num_micro, _ = for_program(
        plan, cols, (rollout.tokens_ns, rollout.valid_ns,
                     rollout.mask_nt, routes), plan.whole, put)
    score = dataclasses.replace(program, num_micro=num_micro,
                                group_size=plan.whole,
                                logp_shape=(plan.n, plan.T))
  if spec.recompute_old:
    old = score_logprobs(Policy(state.params, frozen.base), scored, score)
  ref = jnp.zeros_like(old)
  if spec.loss.use_kl:
    ref = score_logprobs(Policy(frozen.reference), scored, score)
  mask, weight, adv = put(rollout.mask_nt), None, None
  if spec.distill:   # the teacher grades every sampled token
    adv, distill_metrics = teacher_advantages(frozen.teacher, scored, score,
                                                old, mask)
    metrics.update(distill_metrics)
  if spec.recompute_old:   # decoupled: ρ = π_old / π_rollout
    weight, mask, corr = decoupled_correction(
        spec.correction, old, put(rollout.old_logp_nt), mask)
    metrics.update({k: float(v) for k, v in corr.items()})
  jax.block_until_ready(ref)
  metrics["time/reference"] = time.perf_counter() - t0
  return cols._replace(mask_nt=mask, old_logp_nt=old, ref_logp_nt=ref,
                       adv_n=put(adv_n) if adv is None else adv,
                       is_weight_nt=weight), metrics


def update_passes(plan: UpdatePlan, program: UpdateProgram, state,
                  full: UpdateBatch, rollout: RolloutBatch, frozen: Frozen,
                  rng: np.random.Generator):
  """UPDATE: rl.num_updates passes over shuffled mini-batches of `full`,
  each packed or padded (`for_program`). Returns the state and the
  per-update metrics and packing metrics (host values)."""
  spec, put = plan.spec, _put(program)
  mask_host = (np.asarray(sharding_lib.to_host(full.mask_nt))
               if spec.packing != "off" else None)
  routes = rollout.routes_nslc
  take = lambda x, idx: None if x is None else x[idx]
  step_metrics, pack_metrics = [], []
  for _ in range(spec.num_updates):
    for idx in _minibatches(plan.n, plan.mini, rng, plan.group):
      batch = jax.tree.map(lambda x: put(x[idx]), full)
      num_micro, packed = plan.mini // plan.micro, {"pack/used": 0.0}
      if mask_host is not None:
        batch, num_micro, packed = for_program(
            plan, batch, (rollout.tokens_ns[idx], rollout.valid_ns[idx],
                          mask_host[idx], take(routes, idx)),
            plan.group, put)
      pack_metrics.append(packed)
      state, m = update_step(
          state, batch, dataclasses.replace(
              program, num_micro=num_micro, group_size=plan.group),
          frozen.base)
      step_metrics.append(m)
  return state, jax.device_get(step_metrics), pack_metrics


def mean_update_metrics(step_metrics: list[dict], pack_metrics: list[dict]
                        ) -> dict:
  """The step's metrics from its updates': means, the non-finite updates
  (`nonfinite.summarise`), and the first update's ratio and rollout
  mismatch (in bypass mode the sampler/trainer mismatch is the first
  update's, θ = θ_old)."""
  metrics = {k: float(np.mean([m[k] for m in step_metrics]))
             for k in step_metrics[0]}
  for k in {k for m in pack_metrics for k in m}:
    metrics[k] = float(np.mean([m[k] for m in pack_metrics if k in m]))
  metrics.update(nonfinite.summarise(step_metrics))   # skips: a count
  metrics["ratio/first_update_mean"] = float(step_metrics[0]["ratio/mean"])
  # The sampler/trainer mismatch is the first update's (θ = θ_old): the
  # log-probs' (rollout_*) and, routing replay on, the routes'.
  metrics.update({k: float(v) for k, v in step_metrics[0].items()
                  if k.startswith("rollout_") or k == "moe/routes_differ"})
  return metrics


def train_step(spec: UpdateSpec, program: UpdateProgram, state,
               rollout: RolloutBatch, adv_n, frozen: Frozen,
               rng: np.random.Generator):
  """REFERENCE + UPDATE for one rollout: μ passes over shuffled mini-batches.
  program: the run's static world (model, spec.loss, optimizer, layout);
  with a layout, batches are row-sharded global arrays (each host gives its
  rows) and the update keeps the state's shardings. rl.packing (on, or
  auto: where it pays for fewer tokens): scoring and each update run on
  packed rows (packing.py), the same micro-batch token budget."""
  plan = UpdatePlan.of(spec, rollout, program.layout)
  full, metrics = score_step(plan, program, state, rollout, adv_n, frozen)
  t0 = time.perf_counter()
  state, step_metrics, pack_metrics = update_passes(
      plan, program, state, full, rollout, frozen, rng)
  metrics["time/update"] = time.perf_counter() - t0
  metrics.update(mean_update_metrics(step_metrics, pack_metrics))
  return state, metrics


def teacher_advantages(teacher, scored: UpdateBatch, score: UpdateProgram,
                       student_nt, mask_nt):
  """On-policy distillation's per-token advantages [n, t], -(log π_S - log
  π_T) (algorithms/distillation.py), with the teacher scored on the same
  rows as the student (its own model config) and its reverse-KL metrics."""
  teacher_nt = score_logprobs(Policy(teacher.params), scored,
                              dataclasses.replace(score, model_config=teacher.model_config))
  adv_nt = distillation.reverse_kl_advantages(student_nt, teacher_nt, mask_nt)
  metrics = distillation.reverse_kl_metrics(student_nt, teacher_nt, mask_nt)
  return adv_nt, {k: float(v) for k, v in metrics.items()}


def decoupled_correction(correction: rollout_correction.CorrectionSettings,
                         old_nt, roll_nt, mask_nt):
  """Rollout correction with π_old recomputed (rl.old_logp = recompute), once
  on the step's whole batch: (weights or None when off, loss mask, metrics).
  The mismatch metrics are logged whether or not a correction is on."""
  weight, corrected, metrics = rollout_correction.correct(
      old_nt, roll_nt, mask_nt, correction)
  if not correction.active:
    return None, mask_nt, metrics
  return weight, corrected, metrics
