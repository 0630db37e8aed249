"""The RL trainer: GRPO, Dr. GRPO and DAPO are configs of this one loop.

    for step:
      # SAMPLE + SCORE  (generate/rollout.py: the jitted sampler with π_old,
      #                  rewards, dynamic sampling; inline, or a sampler
      #                  thread up to k versions ahead: async_rollouts.py)
      # ADVANTAGE       (vmapped over groups)
      # REFERENCE       (log-probs under π_ref, only when β > 0)
      # UPDATE          (step.py, update.py: μ passes × mini-batches; jitted,
      #                  donated)

`run(config, workdir)` is the whole experiment, registered as the method
"rl" (config.method = "rl"; the STaR loop, `star/loop.py`, is its sibling);
`experiments/run.py` only parses flags and calls it.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import checkpoint, evaluation, registry
from grpo_jax import sharding as sharding_lib
from grpo_jax.algorithms import advantages as adv_lib
from grpo_jax.algorithms import staleness
from grpo_jax.data.iterator import BatchIterator
from grpo_jax.errors import ConfigError
from grpo_jax.generate import rollout, sampling
from grpo_jax.harness import experiment, interrupts, preflight
from grpo_jax.harness import metrics as metrics_lib
from grpo_jax.models import quant, transformer
from grpo_jax.rewards import process
from grpo_jax.rl import (
  async_rollouts,
  distill,
  nonfinite,
  partial_rollouts,
  weight_sync,
)
from grpo_jax.rl.batch import to_rows
from grpo_jax.rl.spec import AdvantageSettings, RunSpec
from grpo_jax.rl.step import Frozen, train_step
from grpo_jax.rl.update import UpdateProgram, init_state


def advantages(spec: AdvantageSettings, reward_bg: np.ndarray,
               mask_nt: np.ndarray | None = None) -> np.ndarray:
  """ADVANTAGE: the configured estimator on the step's whole batch (before
  any mini/micro-batching: REINFORCE++ whitens over all its tokens), [B*G]."""
  fn = registry.lookup("advantage", spec.name)
  length_bg = None if mask_nt is None else jnp.asarray(
      np.asarray(mask_nt, np.float32).sum(axis=1).reshape(reward_bg.shape))
  adv_bg = fn(jnp.asarray(reward_bg), ddof=spec.ddof, eps=spec.eps,
              length_bg=length_bg)
  return np.asarray(adv_bg, np.float32).reshape(-1)


def process_step_rewards(spec: AdvantageSettings, tokenizer, groups
                         ) -> tuple[np.ndarray, np.ndarray, dict]:
  """The configured process reward's (step_reward_bgt, step_end_bgt,
  process/* metrics) for the step's groups."""
  # the text the rewards read: without the stop token (rollout.generate_groups)
  text_len_bg = groups.length_bg - (~groups.truncated_bg)
  return process.step_rewards(
      spec.process_reward, tokenizer, groups.tokens_bgt, text_len_bg,
      groups.correct_bg, groups.tokens_bgt.shape[2])


def process_advantages(spec: AdvantageSettings, tokenizer, groups
                       ) -> tuple[np.ndarray, dict]:
  """ADVANTAGE with process supervision (DeepSeekMath §4.1.3): step rewards
  from the configured process reward at step-end tokens, z-scored over all
  steps of each group and summed over the steps at or after each token:
  per-token advantages [B*G, T]."""
  B, G, T = groups.tokens_bgt.shape
  step_r, step_end, metrics = process_step_rewards(spec, tokenizer, groups)
  adv_bgt = adv_lib.grpo_process_advantages(
      jnp.asarray(step_r), jnp.asarray(step_end), ddof=spec.ddof,
      eps=spec.eps)
  return np.asarray(adv_bgt, np.float32).reshape(B * G, T), metrics


class _Run(NamedTuple):
  """What the RL loop holds through a run (built by `_setup`): the run's
  settings (`spec`, derived once from the config) and what they were
  applied to."""
  spec: RunSpec
  model_config: Any
  tokenizer: Any
  layout: sharding_lib.Layout
  sampler_layout: sharding_lib.Layout   # `layout` itself when colocated
  ckpt: Any
  program: UpdateProgram   # the update's static world (spec.update's)
  frozen: Frozen           # LoRA's base (state.params: adapters); π_ref
  eval_examples: list
  sampler: sampling.Sampler   # on sampler_layout; its page pool kept all run
  base_identity: Any = None   # LoRA: experiment.base_identity, saved
  init_from: str = ""   # the step directory the run started from, saved


def policy(r: _Run, params, dtype: str):
  """The policy the sampler and evaluation run, in `dtype` (with LoRA the
  adapters merged into, or attached to, the base)."""
  return experiment.policy_params(r.spec.lora, params, r.frozen.base, dtype)


def sampler_policy(r: _Run, params):
  """The policy the training sampler runs: `policy` in the sampler's dtype,
  its weights quantised where `sampling.weights_dtype` says (models/quant.py;
  the trainer's parameters are never quantised)."""
  return quant.sampler_weights(policy(r, params, r.spec.sampler_dtype),
                               r.spec.sampler_weights,
                               transformer.PROJECTION_INPUTS)


def _setup(config, workdir: str):
  """Loads and checks everything a run needs, cheap checks first (the data,
  the tokenizer and the model's config against each other, then the
  weights), and restores the last checkpoint: (_Run, state, host state,
  resumed step or None, train examples)."""
  train_examples, eval_examples = experiment.load_examples(config)
  eval_examples = eval_examples[:config.train.eval_examples]
  tokenizer = experiment.load_tokenizer(config)
  spec = RunSpec.from_config(config, tokenizer)
  train_devices, sample_devices = weight_sync.split_devices(spec.rollout)
  layout = sharding_lib.Layout.from_config(config, train_devices)
  sampler_layout = (weight_sync.sampler_layout(config, spec.rollout,
                                                  sample_devices)
                    if sample_devices else layout)
  preflight.check_engine(config)
  if len(train_examples) < spec.batch.prompts:
    raise ConfigError(
        f"config field 'rl.prompts_per_step' = {config.rl.prompts_per_step}: a step "
        f"takes {spec.batch.prompts} prompts but the training data (data.source = "
        f"{config.data.source!r}, data.kwargs) has {len(train_examples)} examples: "
        f"use at most {len(train_examples)}, or more data")
  os.makedirs(workdir, exist_ok=True)
  preflight.check_model(
      config, experiment.model_config_of(config), tokenizer,
      preflight.data_prompts(config, tokenizer, train_examples, eval_examples))
  teacher = distill.load_teacher(config, tokenizer, layout)
  model_config, params = experiment.load_model(config)
  ckpt = experiment.make_checkpointer(config, workdir, model_config)
  # Policy and reference on one mesh; the reference is its own copy, as the
  # update donates the policy's buffers. With LoRA the base is frozen (never
  # donated) and is the reference itself: the policy with adapters off.
  params = layout.shard_params(model_config, params)
  base = identity = None
  use_kl = spec.update.loss.use_kl
  if spec.lora.enabled:
    base, identity = params, experiment.base_identity(config, params)
    params = experiment.init_adapters(config, model_config, layout)
    ref_params = base if use_kl else None
  else:
    ref_params = sharding_lib.copy_tree(params) if use_kl else None
  state = layout.place_state(model_config, spec.optimizer.build(),
                             init_state(params, spec.optimizer, spec.seed))
  del params
  state, host, resumed = experiment.restore_or_init(ckpt, workdir, config,
                                                    state, check_steps=True)
  if identity is not None and resumed is not None:
    experiment.check_base(host, identity, str(ckpt.step_path(resumed)))
  experiment.record_config(config, workdir)   # every resume check passed
  init_from = host.get("init_from", "")
  if resumed is not None and config.init_from and not init_from:
    directory, step = checkpoint.find_step(config.init_from)   # an older checkpoint's run
    init_from = str(directory / str(step))
  if ref_params is not None and base is None:
    ref_params = start_reference(config, state, ref_params, resumed, init_from)
  program = spec.update.program(model_config, spec.optimizer, layout)
  run = _Run(spec, model_config, tokenizer, layout, sampler_layout, ckpt,
             program, Frozen(base, ref_params, teacher), eval_examples,
             sampling.Sampler(model_config, spec.sampling, sampler_layout,
                              sampling.PagePools()), identity, init_from)
  return run, state, host, resumed, train_examples


def start_reference(config, state, pretrained, resumed: int | None,
                    init_from: str):
  """π_ref (rl.kl_reference): "model", `pretrained` (model.source's
  weights); "start", the policy the run started from: init_from's
  parameters when the run started from another run's checkpoint (a copy of
  the fresh state's, or loaded again from `init_from` on resume), else
  `pretrained`."""
  if config.rl.kl_reference == "model" or not init_from:
    return pretrained
  if resumed is None:
    return sharding_lib.copy_tree(state.params)
  return checkpoint.load_params(init_from, pretrained)


def sample_step(r: _Run, compute, prompts, step_key
                ) -> tuple[rollout.Groups, dict]:
  """SAMPLE + SCORE of one step with the policy `compute` (on the
  sampler's layout, in its dtype), with dynamic sampling's refills from
  `prompts`, an iterator of prompt batches."""
  spec = r.spec

  def generate(i):
    return rollout.generate_groups(
        r.sampler, compute, r.tokenizer, next(prompts),
        jax.random.fold_in(step_key, i), spec.groups)

  return rollout.collect(generate, spec.batch.prompts, spec.dynamic)


def learn(r: _Run, state, groups: rollout.Groups, metrics: dict,
          step: int):
  """ADVANTAGE, REFERENCE + UPDATE on one step's groups (`metrics`: their
  SAMPLE + SCORE metrics). Returns the new state and the step's metrics."""
  spec = r.spec
  metrics = dict(metrics)
  batch = to_rows(groups, spec.sampling.pad_id, spec.overlong_filter)
  if batch.version_nt is not None:   # partial rollouts: the per-token bound
    mask_nt, version_metrics = staleness.bound_rows(
        batch.version_nt, groups.mask_bgt.reshape(batch.mask_nt.shape),
        batch.mask_nt, step, spec.rollout.max_staleness)
    batch = batch._replace(mask_nt=mask_nt)
    metrics.update(version_metrics)
  # ADVANTAGE
  if spec.update.distill:    # per token [N, T], from the teacher (score_step)
    adv_n = np.zeros(batch.mask_nt.shape, np.float32)
  elif spec.advantage.per_token:    # per token [N, T]
    adv_n, process_metrics = process_advantages(spec.advantage, r.tokenizer,
                                                groups)
    metrics.update(process_metrics)
  else:
    adv_n = advantages(spec.advantage, batch.reward_bg, batch.mask_nt)
    if spec.advantage.process_reward:   # its metrics only, to compare
      metrics.update(process_step_rewards(spec.advantage, r.tokenizer,
                                          groups)[2])
  if not spec.update.distill:
    metrics.update({"advantage/mean": float(adv_n.mean()),
                    "advantage/std": float(adv_n.std()),
                    "advantage/abs_max": float(np.abs(adv_n).max())})
  # REFERENCE + UPDATE
  state, update_metrics = train_step(
      spec.update, r.program, state, batch, adv_n, r.frozen,
      np.random.default_rng([spec.seed, step]))
  metrics.update(update_metrics)
  # the rate of this step's last update (optax reads the count before it
  # increments it: update k uses lr_schedule(k), k = 0, 1, ...)
  metrics["learning_rate"] = spec.learning_rate(int(state.step) - 1)
  return state, metrics


def make_rollouts(config, r: _Run, state, data, start: int, host: dict):
  """Where each step's rows come from (async_rollouts.py): sampled inline
  with the current parameters (the synchronous colocated loop), or by a
  sampler thread from published weights (rollout.sampler_devices > 0 or
  rollout.max_staleness > 0); batches a checkpoint kept come first."""
  spec = r.spec
  restored = [async_rollouts.decode(b) for b in host.get("rollouts", [])]
  source = async_rollouts.Source(spec.rollout, data, spec.batch.steps,
                                 restored)
  sample = functools.partial(sample_step, r)
  if not async_rollouts.use_thread(spec.rollout):
    return async_rollouts.Inline(
        source, sample, functools.partial(sampler_policy, r))
  store = weight_sync.WeightStore()
  sync = weight_sync.WeightSync(
      (spec.sampler_dtype, spec.sampler_weights), r.model_config,
      r.sampler_layout, store, r.frozen.base,
      functools.partial(experiment.policy_params, spec.lora))
  if spec.rollout.partial:
    return partial_rollouts.PartialThreaded(
        source, partial_rollouts.PartialSampling(
            r.sampler, r.tokenizer, spec.groups, spec.batch.prompts,
            jax.random.key(spec.seed), spec.dynamic),
        sync, store, start, async_rollouts.key_value(state.key),
        host.get("partial"))
  return async_rollouts.Threaded(source, sample, sync, store, start,
                                 async_rollouts.key_value(state.key))


@registry.register("method", "rl")
@experiment.guarded   # validation, processes, workdir lock, signals: once
def run(config, workdir: str) -> dict:
  """Trains as `config` says, writing everything under `workdir`; returns
  the final metrics (including the held-out greedy accuracy before/after).

  Restarting with the same workdir resumes exactly from the last checkpoint:
  the checkpoint holds the TrainState (params, optimizer state, step, PRNG
  key) and the host state (data iterator position, held-out accuracy before
  training); mini-batch order is a function of (seed, step). Dynamic
  sampling discards surplus groups (as DAPO does). Asynchronous rollouts
  (config.rollout, async_rollouts.py) also save the finished rows that the
  saved policy cannot regenerate; later rows are regenerated exactly.
  """
  r, state, host, resumed, train_examples = _setup(config, workdir)
  start = done = resumed or 0   # the checkpoint's step is the steps completed
  data = (BatchIterator.from_state(train_examples, host["data"])
          if "data" in host else
          BatchIterator(train_examples, r.spec.batch.prompts,
                        seed=r.spec.seed))
  summary: dict[str, Any] = dict(host.get("summary", {}))
  writer = experiment.metric_writer(workdir, None if resumed is None else start,
                                    final=start == config.train.steps)
  primary = writer.enabled   # the one host that writes files

  def evaluate(step):
    m = evaluation.evaluate_policy(
        r.spec.eval, r.model_config,
        policy(r, state.params, r.spec.eval.compute_dtype),
        r.tokenizer, r.eval_examples, layout=r.layout).metrics
    writer.write(step, m)
    logging.info("%s", metrics_lib.step_line(
        step, config.train.steps, m, metrics_lib.EVAL_LINE,
        metrics_lib.EVAL_TIMES))
    return m

  if config.train.eval_at_start and r.eval_examples and start == 0:
    summary["eval_before"] = evaluate(0)["eval/greedy_accuracy"]
  progress = metrics_lib.progress_bar(
      config.train.steps, config.train.progress and primary, start)
  rollouts = make_rollouts(config, r, state, data, start, host)

  def host_state(done: int, wait: bool = True) -> dict:
    out = {**rollouts.host_state(done, wait), "summary": summary}
    if r.base_identity is not None:
      out["lora_base"] = r.base_identity
    if r.init_from:
      out["init_from"] = r.init_from
    return out

  interrupts.defer_to_step_boundary()
  try:
    rollouts.publish(start, state.params)
    for step in range(start, config.train.steps):
      t_step = time.perf_counter()
      key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
      batch, waited = rollouts.take(step, step_key)
      state = state._replace(key=jax.random.key_data(key))
      state, metrics = learn(r, state, batch.groups, batch.metrics,
                             step)
      done = step + 1
      metrics.update(rollouts.publish(step + 1, state.params))
      metrics["time/step"] = time.perf_counter() - t_step
      metrics["tokens_per_second"] = metrics["sample/tokens"] / max(
          metrics["time/sample"], 1e-9)
      metrics["sampler/compilations"] = sampling.COMPILES.count
      if isinstance(rollouts, async_rollouts.Threaded):
        metrics.update(async_rollouts.staleness_metrics(
            batch, r.spec.rollout.max_staleness))
        metrics["time/trainer_idle_fraction"] = waited / metrics["time/step"]
        metrics["time/sampler_idle_fraction"] = (
            rollouts.sampler_idle_fraction())
      code = metrics.pop(nonfinite.CODE)
      halt = code and config.train.on_non_finite == "stop"
      if (step % config.train.log_every == 0
          or step == config.train.steps - 1 or halt):
        writer.write(step + 1, metrics)
        logging.info("%s", metrics_lib.step_line(step + 1, config.train.steps,
                                                 metrics))
      if halt:   # nothing of this step is saved; earlier saves finish first
        progress.close()
        r.ckpt.close()
        writer.close()
        raise nonfinite.error(code, f"step {step + 1}/{config.train.steps}",
                              state.params)
      progress.update(1)
      progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                           acc=f"{metrics['accuracy']:.3f}")
      if (config.train.eval_every and (step + 1) % config.train.eval_every == 0
          and step + 1 < config.train.steps and r.eval_examples):
        evaluate(step + 1)
      summary.update({k: metrics[k] for k in ("reward/mean", "accuracy",
                                              "loss") if k in metrics})
      stop = interrupts.stop_requested()
      if (step + 1 == config.train.steps or stop
          or r.ckpt.should_save(step + 1)):
        r.ckpt.save(step + 1, state, host_state(step + 1), force=True)
      if r.ckpt.preempted or stop:
        interrupts.mark_preempted(step + 1, str(r.ckpt.step_path(step + 1)))
        break
  except async_rollouts.SamplerError:
    # the last completed step is saved, with the rows finished so far
    if done > start:
      r.ckpt.save(done, state, host_state(done, wait=False), force=True)
    progress.close()
    r.ckpt.close()
    writer.close()
    raise
  finally:
    rollouts.close()
  progress.close()
  r.ckpt.close()
  finished = done == config.train.steps
  if finished and config.train.eval_at_end and r.eval_examples:
    summary["eval_after"] = evaluate(config.train.steps)["eval/greedy_accuracy"]
  writer.close()
  if config.train.plot and primary:
    rows_ = metrics_lib.read_jsonl(writer.path)
    summary["plot"] = metrics_lib.plot_curves(
        rows_, os.path.join(workdir, "curves.png"), title=config.name)
  summary["state"] = state
  if r.frozen.base is not None:   # LoRA: state.params are the adapters
    summary["base"] = r.frozen.base
  return summary

