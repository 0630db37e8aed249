"""The RL trainer: GRPO, Dr. GRPO and DAPO are configs of this one loop.

    for step:
      # SAMPLE + SCORE  (rollout.py: the jitted sampler with π_old, rewards,
      #                  dynamic sampling)
      # ADVANTAGE       (vmapped over groups)
      # REFERENCE       (log-probs under π_ref, only when β > 0)
      # UPDATE          (update.py: μ passes × mini-batches; jitted, donated)

`run(config, workdir)` is the whole experiment, registered as the method
"rl" (config.method = "rl"; the STaR loop, `star_loop.py`, is its sibling);
`experiments/run.py` only parses flags and calls it.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import config as config_lib
from grpo_jax import evaluation, registry
from grpo_jax.harness import experiment
from grpo_jax.generate import rollout, sampling
from grpo_jax.harness import interrupts, preflight
from grpo_jax.rl import packing
from grpo_jax.harness import metrics as metrics_lib
from grpo_jax import sharding as sharding_lib
from grpo_jax.algorithms import advantages as adv_lib
from grpo_jax.algorithms import rollout_correction
from grpo_jax.data.iterator import BatchIterator
from grpo_jax.rewards import process
from grpo_jax.rl.update import (LossSettings, OptimizerSpec, UpdateBatch, cast,
                             init_state, learning_rate_schedule,
                             micro_batch_rows, pack_update_batch,
                             score_logprobs, score_packed, update_step)


def advantages(config, reward_bg: np.ndarray,
               mask_nt: np.ndarray | None = None) -> np.ndarray:
  """ADVANTAGE: the configured estimator on the step's whole batch (before
  any mini/micro-batching: REINFORCE++ whitens over all its tokens), [B*G]."""
  fn = registry.lookup("advantage", config.rl.advantage)
  length_bg = None if mask_nt is None else jnp.asarray(
      np.asarray(mask_nt, np.float32).sum(axis=1).reshape(reward_bg.shape))
  adv_bg = fn(jnp.asarray(reward_bg), ddof=config.rl.adv_ddof,
              eps=config.rl.adv_eps, length_bg=length_bg)
  return np.asarray(adv_bg, np.float32).reshape(-1)


def process_step_rewards(config, tokenizer, groups
                         ) -> tuple[np.ndarray, np.ndarray, dict]:
  """The configured process reward's (step_reward_bgt, step_end_bgt,
  process/* metrics) for the step's groups."""
  # the text the rewards read: without the stop token (rollout.generate_groups)
  text_len_bg = groups.length_bg - (~groups.truncated_bg)
  return process.step_rewards(
      config.rl.process_reward, tokenizer, groups.tokens_bgt, text_len_bg,
      groups.correct_bg, groups.tokens_bgt.shape[2])


def process_advantages(config, tokenizer, groups) -> tuple[np.ndarray, dict]:
  """ADVANTAGE with process supervision (DeepSeekMath §4.1.3): step rewards
  from the configured process reward at step-end tokens, z-scored over all
  steps of each group and summed over the steps at or after each token:
  per-token advantages [B*G, T]."""
  B, G, T = groups.tokens_bgt.shape
  step_r, step_end, metrics = process_step_rewards(config, tokenizer, groups)
  adv_bgt = adv_lib.grpo_process_advantages(
      jnp.asarray(step_r), jnp.asarray(step_end), ddof=config.rl.adv_ddof,
      eps=config.rl.adv_eps)
  return np.asarray(adv_bgt, np.float32).reshape(B * G, T), metrics


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


def train_step(config, model_config, state, optimizer, packed, adv_n,
               ref_params, settings: LossSettings, rng: np.random.Generator,
               layout: sharding_lib.Layout | None = None):
  """REFERENCE + UPDATE for one rollout: μ passes over shuffled mini-batches.
  With a layout, batches are row-sharded global arrays (each host gives its
  rows) and the update keeps the state's shardings. rl.packing (on, or
  auto: where it pays for fewer tokens): scoring and each update run on
  packed rows (packing.py), the same micro-batch token budget."""
  rl = config.rl
  T = packed.mask_nt.shape[1]
  n = packed.tokens_ns.shape[0]
  put = layout.rows if layout is not None else jnp.asarray
  cols = (put(packed.tokens_ns), put(packed.positions_ns),
          put(packed.valid_ns))
  metrics, t0 = {}, time.perf_counter()
  mini = rl.mini_batch_size or n
  group = update_group_size(rl, mini)
  whole = update_group_size(rl, n)
  old = put(packed.old_logp_nt)
  seq_len = packed.tokens_ns.shape[1]
  micro = micro_batch_rows(mini, seq_len, rl.micro_batch_size,
                           rl.micro_batch_tokens)
  shards = layout.batch_shards if layout is not None else 1
  def pack(idx, mask_nt, group_size):
    """(rows, micro-batches) of packed rows, or None where rl.packing
    says to stay padded (auto: when packing pays for more tokens)."""
    if rl.packing == "off":
      return None
    rows, num_micro = packing.pack_rows(
        packed.tokens_ns[idx], packed.valid_ns[idx], mask_nt, group_size,
        micro, shards)
    if rl.packing == "auto" and not packing.wins(
        rows, len(mask_nt), seq_len - T, T, group_size):
      return None
    return rows, num_micro

  scored = (pack(slice(None), packed.mask_nt, whole)
            if settings.use_kl or rl.old_logp == "recompute" else None)
  if scored is not None:
    rows, num_micro = jax.tree.map(put, scored[0]), scored[1]
    score = lambda params: score_packed(params, rows, model_config, settings,
                                        num_micro, n, layout)
  else:
    score = lambda params: score_logprobs(params, *cols, model_config, T,
                                          settings, whole, n // micro,
                                          layout)
  if rl.old_logp == "recompute":
    old = score(state.params)
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
  full = UpdateBatch(*cols, mask, old, ref, put(adv_n), weight)
  mask_host = (np.asarray(sharding_lib.to_host(mask))
               if rl.packing != "off" else None)
  t0 = time.perf_counter()
  step_metrics, pack_metrics = [], []
  for _ in range(rl.num_updates):
    for idx in _minibatches(n, mini, rng, group):
      batch = jax.tree.map(lambda x: put(x[idx]), full)
      num_micro = mini // micro
      chosen = None if mask_host is None else pack(idx, mask_host[idx], group)
      pack_metrics.append({"pack/used": float(chosen is not None)})
      if chosen is not None:
        rows, num_micro = chosen
        batch = jax.tree.map(put, pack_update_batch(batch, rows))
        pack_metrics[-1].update(packing.describe(rows, len(idx)))
      state, m = update_step(state, batch, model_config, optimizer,
                             num_micro, settings, layout, group)
      step_metrics.append(m)
  step_metrics = jax.device_get(step_metrics)
  metrics["time/update"] = time.perf_counter() - t0
  for k in step_metrics[0]:
    metrics[k] = float(np.mean([m[k] for m in step_metrics]))
  for k in {k for m in pack_metrics for k in m}:
    metrics[k] = float(np.mean([m[k] for m in pack_metrics if k in m]))
  metrics["ratio/first_update_mean"] = float(step_metrics[0]["ratio/mean"])
  # bypass mode: the sampler/trainer mismatch is the first update's (θ = θ_old)
  metrics.update({k: float(v) for k, v in step_metrics[0].items()
                  if k.startswith("rollout_")})
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


@registry.register("method", "rl")
@experiment.guarded   # workdir lock; SIGTERM / Ctrl-C save, then stop
def run(config, workdir: str) -> dict:
  """Trains as `config` says, writing everything under `workdir`; returns
  the final metrics (including the held-out greedy accuracy before/after).

  Restarting with the same workdir resumes exactly from the last checkpoint:
  the checkpoint holds the TrainState (params, optimizer state, step, PRNG
  key) and the host state (data iterator position, held-out accuracy before
  training); mini-batch order is a function of (seed, step). Dynamic
  sampling discards surplus groups (as DAPO does), so nothing else carries
  over between steps.
  """
  config_lib.validate(config)
  sharding_lib.initialize_distributed(config)  # before any device is used
  layout = sharding_lib.Layout.from_config(config)
  os.makedirs(workdir, exist_ok=True)
  # Cheap checks first: the data, the tokenizer and the model's config
  # against each other, then the weights.
  train_examples, eval_examples = experiment.load_examples(config)
  eval_examples = eval_examples[:config.train.eval_examples]
  tokenizer = experiment.load_tokenizer(config)
  preflight.check_model(
      config, experiment.model_config_of(config), tokenizer,
      preflight.data_prompts(config, tokenizer, train_examples, eval_examples))
  model_config, params = experiment.load_model(config)
  ckpt = experiment.make_checkpointer(config, workdir, model_config)
  spec = rollout.RewardSpec.from_config(config)
  settings = LossSettings.from_config(config)
  sample_cfg = experiment.sampling_config(config, tokenizer)
  rl = config.rl
  rows = rl.prompts_per_step * rl.num_generations
  updates_per_step = rl.num_updates * rows // (rl.mini_batch_size or rows)
  total_updates = config.train.steps * updates_per_step
  optimizer = OptimizerSpec.from_config(config.optim, total_updates)
  lr_schedule = learning_rate_schedule(config.optim, total_updates)
  # Policy and reference on one mesh; the reference is its own copy, as the
  # update donates the policy's buffers.
  params = layout.shard_params(model_config, params)
  ref_params = sharding_lib.copy_tree(params) if settings.use_kl else None
  state = layout.place_state(model_config, optimizer.build(),
                             init_state(params, optimizer, config.seed))
  del params
  state, host, resumed = experiment.restore_or_init(ckpt, workdir, config,
                                                    state)
  start = int(state.step) // updates_per_step
  preflight.check_resume_step(start, config, workdir)
  data = (BatchIterator.from_state(train_examples, host["data"])
          if "data" in host else
          BatchIterator(train_examples, rl.prompts_per_step, seed=config.seed))
  summary: dict[str, Any] = dict(host.get("summary", {}))
  writer = experiment.metric_writer(workdir, None if resumed is None else start,
                                    final=start == config.train.steps)
  primary = writer.enabled   # the one host that writes files

  def evaluate(step):
    m = evaluation.evaluate_policy(config, model_config, state.params,
                                   tokenizer, eval_examples,
                                   layout=layout).metrics
    writer.write(step, m)
    logging.info("step %d: %s", step, m)
    return m

  if config.train.eval_at_start and eval_examples and start == 0:
    summary["eval_before"] = evaluate(0)["eval/greedy_accuracy"]
  progress = _progress(config.train.steps, config.train.progress and primary,
                       start)
  interrupts.defer_to_step_boundary()
  for step in range(start, config.train.steps):
    t_step = time.perf_counter()
    key = jax.random.wrap_key_data(state.key)
    key, step_key = jax.random.split(key)
    state = state._replace(key=jax.random.key_data(key))
    compute = cast(state.params, config.sampling.compute_dtype
                   or config.model.compute_dtype)   # the sampler's dtype

    # SAMPLE + SCORE
    def generate(i):
      return rollout.generate_groups(
          model_config, compute, tokenizer, next(data),
          jax.random.fold_in(step_key, i), sample_cfg, rl.num_generations,
          spec, config.data.template, config.data.system_prompt,
          layout=layout)

    groups, metrics = rollout.collect(generate, rl.prompts_per_step,
                                      rl.dynamic_sampling, rl.max_gen_batches,
                                      rl.on_cap)
    del compute   # the compute-dtype copy is not kept through the update
    packed = rollout.pack(groups, tokenizer.pad_id or 0, rl.overlong_filter)
    # ADVANTAGE
    if rl.advantage == "grpo_process":    # per token [N, T]
      adv_n, process_metrics = process_advantages(config, tokenizer, groups)
      metrics.update(process_metrics)
    else:
      adv_n = advantages(config, packed.reward_bg, packed.mask_nt)
      if rl.process_reward:   # its metrics only, to compare with process runs
        metrics.update(process_step_rewards(config, tokenizer, groups)[2])
    metrics.update({"advantage/mean": float(adv_n.mean()),
                    "advantage/std": float(adv_n.std()),
                    "advantage/abs_max": float(np.abs(adv_n).max())})
    # REFERENCE + UPDATE
    state, update_metrics = train_step(
        config, model_config, state, optimizer, packed, adv_n, ref_params,
        settings, np.random.default_rng([config.seed, step]), layout)
    metrics.update(update_metrics)
    # the rate of this step's last update (optax reads the count before it
    # increments it: update k uses lr_schedule(k), k = 0, 1, ...)
    metrics["learning_rate"] = float(lr_schedule(int(state.step) - 1))
    metrics["time/step"] = time.perf_counter() - t_step
    metrics["tokens_per_second"] = metrics["sample/tokens"] / max(
        metrics["time/sample"], 1e-9)
    metrics["sampler/compilations"] = sampling.COMPILES.count
    if step % config.train.log_every == 0 or step == config.train.steps - 1:
      writer.write(step + 1, metrics)
    progress.update(1)
    progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                         acc=f"{metrics['accuracy']:.3f}")
    if (config.train.eval_every and (step + 1) % config.train.eval_every == 0
        and step + 1 < config.train.steps and eval_examples):
      evaluate(step + 1)
    summary.update({k: metrics[k] for k in ("reward/mean", "accuracy",
                                            "loss") if k in metrics})
    stop = interrupts.stop_requested()
    ckpt.save(step + 1, state, {"data": data.state_dict(), "summary": summary},
              force=step + 1 == config.train.steps or stop)
    if ckpt.preempted or stop:
      interrupts.mark_preempted(step + 1, str(ckpt.step_path(step + 1)))
      break
  progress.close()
  ckpt.close()
  finished = int(state.step) // updates_per_step == config.train.steps
  if finished and config.train.eval_at_end and eval_examples:
    summary["eval_after"] = evaluate(config.train.steps)["eval/greedy_accuracy"]
  writer.close()
  if config.train.plot and primary:
    rows_ = metrics_lib.read_jsonl(writer.path)
    summary["plot"] = metrics_lib.plot_curves(
        rows_, os.path.join(workdir, "curves.png"), title=config.name)
  summary["state"] = state
  return summary


def _progress(total: int, enabled: bool, initial: int = 0):
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, initial=initial, disable=not enabled, desc="train",
              unit="step")
