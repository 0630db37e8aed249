"""REFERENCE + UPDATE of one RL step, on the step's packed rollout.

    score_step      the full UpdateBatch: π_ref (β > 0) and π_old recomputed
                    (rl.old_logp = recompute, with the decoupled correction)
    update_passes   rl.num_updates passes over shuffled mini-batches, each
                    run packed or padded (`choose_packing`)

`train_step` is the two in order; `rl.train` calls it once per step.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sharding as sharding_lib
from grpo_jax.algorithms import rollout_correction
from grpo_jax.rl import nonfinite, packing
from grpo_jax.rl.update import (LossSettings, UpdateBatch, micro_batch_rows,
                                pack_update_batch, score_logprobs,
                                score_packed, update_step)


def _minibatches(n: int, size: int, rng: np.random.Generator,
                 group_size: int = 1):
  """Shuffled mini-batches of row indices. group_size > 1: whole groups are
  shuffled, so each mini-batch is whole groups of consecutive rows."""
  groups = rng.permutation(n // group_size)
  order = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
  return [order[i:i + size] for i in range(0, n, size)]


def update_group_size(rl, mini: int) -> int:
  """Rows per prompt the update may rely on (1: none): the G rows of a group
  share their prompt, which the update then runs once (rl.shared_prompt)."""
  G = rl.num_generations
  return G if rl.shared_prompt and G > 1 and mini % G == 0 else 1


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """How one step's n rows of s columns (t completion tokens) are split:
  mini-batches of `mini` rows, micro-batches of `micro`, G rows sharing a
  prompt in groups of `group` (of `whole` over the full batch, for
  scoring), over `shards` row shards."""
  n: int
  T: int
  seq_len: int
  mini: int
  micro: int
  group: int
  whole: int
  shards: int

  @classmethod
  def of(cls, rl, packed, layout=None) -> "UpdatePlan":
    n, seq_len = packed.tokens_ns.shape
    mini = rl.mini_batch_size or n
    return cls(n=n, T=packed.mask_nt.shape[1], seq_len=seq_len, mini=mini,
               micro=micro_batch_rows(mini, seq_len, rl.micro_batch_size,
                                      rl.micro_batch_tokens),
               group=update_group_size(rl, mini),
               whole=update_group_size(rl, n),
               shards=layout.batch_shards if layout is not None else 1)


def choose_packing(rl, plan: UpdatePlan, tokens_ns, valid_ns, mask_nt,
                   group_size: int):
  """(packed rows, micro-batches) for these rows, or None where rl.packing
  says to stay padded (off; auto: where packing does not save tokens).
  Packed rows keep the padded path's micro-batch token budget."""
  if rl.packing == "off":
    return None
  rows, num_micro = packing.pack_rows(tokens_ns, valid_ns, mask_nt,
                                      group_size, plan.micro, plan.shards)
  if rl.packing == "auto" and not packing.wins(
      rows, len(mask_nt), plan.seq_len - plan.T, plan.T, group_size):
    return None
  return rows, num_micro


def score_step(rl, model_config, state, packed, adv_n, ref_params,
               settings: LossSettings, plan: UpdatePlan, put, layout=None,
               base=None) -> tuple[UpdateBatch, dict]:
  """REFERENCE: the step's full UpdateBatch, with log-probs under π_ref
  (β > 0) and π_old recomputed (rl.old_logp = recompute, then the decoupled
  rollout correction), scored packed or padded as `choose_packing` says.
  With LoRA (`base` given) the policy is the base with the adapters
  state.params, and ref_params is the base itself (adapters off)."""
  cols = (put(packed.tokens_ns), put(packed.positions_ns),
          put(packed.valid_ns))
  metrics, t0 = {}, time.perf_counter()
  old = put(packed.old_logp_nt)
  scored = (choose_packing(rl, plan, packed.tokens_ns, packed.valid_ns,
                           packed.mask_nt, plan.whole)
            if settings.use_kl or rl.old_logp == "recompute" else None)
  if scored is not None:
    rows, num_micro = jax.tree.map(put, scored[0]), scored[1]
    score = lambda params, base=None: score_packed(
        params, rows, model_config, settings, num_micro, plan.n, layout, base)
  else:
    score = lambda params, base=None: score_logprobs(
        params, *cols, model_config, plan.T, settings, plan.whole,
        plan.n // plan.micro, layout, base)
  if rl.old_logp == "recompute":
    old = score(state.params, base)
  ref = jnp.zeros_like(old)
  if settings.use_kl:
    ref = score(ref_params)
  mask, weight = put(packed.mask_nt), None
  if rl.old_logp == "recompute":   # decoupled: ρ = π_old / π_rollout
    weight, mask, corr = decoupled_correction(rl, old,
                                              put(packed.old_logp_nt), mask)
    metrics.update({k: float(v) for k, v in corr.items()})
  jax.block_until_ready(ref)
  metrics["time/reference"] = time.perf_counter() - t0
  return UpdateBatch(*cols, mask, old, ref, put(adv_n), weight), metrics


def update_passes(rl, model_config, state, optimizer, full: UpdateBatch,
                  packed, settings: LossSettings, plan: UpdatePlan,
                  rng: np.random.Generator, put, layout=None, base=None):
  """UPDATE: rl.num_updates passes over shuffled mini-batches of `full`,
  each packed or padded as `choose_packing` says. Returns the state and the
  per-update metrics and packing metrics (host values)."""
  mask_host = (np.asarray(sharding_lib.to_host(full.mask_nt))
               if rl.packing != "off" else None)
  step_metrics, pack_metrics = [], []
  for _ in range(rl.num_updates):
    for idx in _minibatches(plan.n, plan.mini, rng, plan.group):
      batch = jax.tree.map(lambda x: put(x[idx]), full)
      num_micro = plan.mini // plan.micro
      chosen = None if mask_host is None else choose_packing(
          rl, plan, packed.tokens_ns[idx], packed.valid_ns[idx],
          mask_host[idx], plan.group)
      pack_metrics.append({"pack/used": float(chosen is not None)})
      if chosen is not None:
        rows, num_micro = chosen
        batch = jax.tree.map(put, pack_update_batch(batch, rows))
        pack_metrics[-1].update(packing.describe(rows, len(idx)))
      state, m = update_step(state, batch, model_config, optimizer,
                             num_micro, settings, layout, plan.group, base)
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
  metrics.update({k: float(v) for k, v in step_metrics[0].items()
                  if k.startswith("rollout_")})
  return metrics


def train_step(config, model_config, state, optimizer, packed, adv_n,
               ref_params, settings: LossSettings, rng: np.random.Generator,
               layout: sharding_lib.Layout | None = None, base=None):
  """REFERENCE + UPDATE for one rollout: μ passes over shuffled mini-batches.
  With a layout, batches are row-sharded global arrays (each host gives its
  rows) and the update keeps the state's shardings. rl.packing (on, or
  auto: where it pays for fewer tokens): scoring and each update run on
  packed rows (packing.py), the same micro-batch token budget.
  base: with LoRA, the frozen base (state.params are the adapters)."""
  rl = config.rl
  put = layout.rows if layout is not None else jnp.asarray
  plan = UpdatePlan.of(rl, packed, layout)
  full, metrics = score_step(rl, model_config, state, packed, adv_n,
                             ref_params, settings, plan, put, layout, base)
  t0 = time.perf_counter()
  state, step_metrics, pack_metrics = update_passes(
      rl, model_config, state, optimizer, full, packed, settings, plan, rng,
      put, layout, base)
  metrics["time/update"] = time.perf_counter() - t0
  metrics.update(mean_update_metrics(step_metrics, pack_metrics))
  return state, metrics


def decoupled_correction(rl, old_nt, roll_nt, mask_nt):
  """Rollout correction with π_old recomputed (rl.old_logp = recompute), once
  on the step's whole batch: (weights or None when off, loss mask, metrics).
  The mismatch metrics are logged whether or not a correction is on."""
  settings = rollout_correction.CorrectionSettings.from_config(
      rl.rollout_correction)
  weight, corrected, metrics = rollout_correction.correct(old_nt, roll_nt,
                                                          mask_nt, settings)
  if not settings.active:
    return None, mask_nt, metrics
  return weight, corrected, metrics
