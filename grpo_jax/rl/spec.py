"""The run's settings, derived once: `RunSpec`.

The config (an ml_collections.ConfigDict) is validated once at start
(`validation/`); everything the loops, evaluation and `aot/` compute from it
is computed here, once, into small frozen values that travel instead of the
ConfigDict:

    RunSpec.from_config(config, tokenizer)
      batch      BatchSizes       b prompts x g rows a step, the mini-batch,
                                  updates per step and in the run
      update     UpdateSpec       the loss, mini/micro-batches, packing,
                                  π_old recomputed and its correction
      optimizer  OptimizerSpec    config.optim over the run's updates
      sampling   SamplingConfig   config.sampling with the tokenizer's ids
      rollout    RolloutSettings  where rows are sampled, how stale
      reward     RewardSpec       the rewards and the accuracy reward
      eval       EvalSettings     what an evaluation reads
      lora       LoraSpec         model.lora (rank 0: off)
      groups     GroupSettings    g rows a prompt, the rewards, the template
      dynamic    DynamicSampling  DAPO's refills
      advantage  AdvantageSettings

The loops hold a RunSpec and read nothing else of the config for what it
derives; `aot/` builds the same RunSpec for the programs it compiles, so an
ahead-of-time compile and a run agree by construction.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from grpo_jax import evaluation
from grpo_jax.envs import base as envs
from grpo_jax.generate import rollout, sampling
from grpo_jax.harness import experiment
from grpo_jax.models import lora
from grpo_jax.rl.async_rollouts import RolloutSettings
from grpo_jax.rl.optimizer import OptimizerSpec, learning_rate_schedule
from grpo_jax.rl.step import UpdateSpec


class TokenIds(NamedTuple):
  """The two things the run's settings read of a tokenizer: the sampler's
  stop ids and pad id (aot/ compiles with these stand-ins)."""
  stop_ids: tuple[int, ...] = (0,)
  pad_id: int = 0


@dataclasses.dataclass(frozen=True)
class BatchSizes:
  """One RL step's rows and updates: b prompts of g rows each, rl.num_updates
  passes over mini-batches of `mini` rows, for `steps` steps."""
  prompts: int       # b: rl.prompts_per_step
  generations: int   # g: rl.num_generations
  mini: int          # rows per mini-batch (rl.mini_batch_size, 0: all rows)
  passes: int        # μ: rl.num_updates
  steps: int         # train.steps

  @classmethod
  def from_config(cls, config) -> "BatchSizes":
    rl = config.rl
    rows = rl.prompts_per_step * rl.num_generations
    return cls(prompts=rl.prompts_per_step, generations=rl.num_generations,
               mini=rl.mini_batch_size or rows, passes=rl.num_updates,
               steps=config.train.steps)

  @property
  def rows(self) -> int:
    """n = b*g rows a step."""
    return self.prompts * self.generations

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates a step: μ passes over n / mini mini-batches."""
    return self.passes * self.rows // self.mini

  @property
  def total_updates(self) -> int:
    return self.steps * self.updates_per_step

  def steps_done(self, updates: int) -> int:
    """The completed steps of a state that has run `updates` updates."""
    return updates // self.updates_per_step


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
  """The advantage estimator (config.rl.advantage, its ddof and eps) and the
  process reward ('' = none; read by `grpo_process` and logged otherwise)."""
  name: str
  ddof: int
  eps: float
  process_reward: str

  @classmethod
  def from_config(cls, config) -> "AdvantageSettings":
    rl = config.rl
    return cls(rl.advantage, rl.adv_ddof, rl.adv_eps, rl.process_reward)

  @property
  def per_token(self) -> bool:
    """Process supervision: advantages [n, t], not [n]."""
    return self.name == "grpo_process"


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """Everything a run derives from its validated config (module docstring)."""
  batch: BatchSizes
  update: UpdateSpec
  optimizer: OptimizerSpec
  sampling: sampling.SamplingConfig
  sampler_dtype: str     # the sampler's weights (sampling.compute_dtype or
                         # model.compute_dtype)
  sampler_weights: str   # "" (in sampler_dtype) | int8 (models/quant.py)
  rollout: RolloutSettings
  reward: rollout.RewardSpec
  eval: evaluation.EvalSettings
  lora: lora.LoraSpec
  advantage: AdvantageSettings
  groups: rollout.GroupSettings    # G rows a prompt, rewards, prompt format
  dynamic: rollout.DynamicSampling
  overlong_filter: bool   # truncated rows out of the loss (DAPO)
  seed: int

  @classmethod
  def from_config(cls, config, tokenizer=TokenIds()) -> "RunSpec":
    """The run's settings; the sampler stops at `tokenizer.stop_ids` and pads
    with `tokenizer.pad_id` (a tokenizer, or `TokenIds` where none loads:
    aot/). Assumes `validation.validate(config)` passed."""
    batch = BatchSizes.from_config(config)
    sampler = experiment.sampling_config(config, tokenizer)
    reward = rollout.RewardSpec.from_config(config)
    return cls(
        batch=batch, update=UpdateSpec.from_config(config),
        optimizer=OptimizerSpec.from_config(config.optim,
                                            batch.total_updates),
        sampling=dataclasses.replace(   # routing replay: the trainer's only
            sampler, record_routes=config.model.moe.routing_replay
            == "rollout"),
        sampler_dtype=(config.sampling.compute_dtype
                       or config.model.compute_dtype),
        sampler_weights=config.sampling.weights_dtype,
        rollout=RolloutSettings.from_config(config), reward=reward,
        eval=evaluation.EvalSettings.from_config(config, sampler, reward),
        lora=lora.LoraSpec.from_config(config),
        advantage=AdvantageSettings.from_config(config),
        groups=rollout.GroupSettings(
            batch.generations, reward, config.data.template,
            config.data.system_prompt,
            env=envs.EnvSpec.from_config(config)),
        dynamic=rollout.DynamicSampling(
            bool(config.rl.dynamic_sampling), config.rl.max_gen_batches,
            config.rl.on_cap),
        overlong_filter=bool(config.rl.overlong_filter), seed=config.seed)

  def learning_rate(self, count: int) -> float:
    """The rate of update `count` (0, 1, ...: optax reads the count before
    it increments it)."""
    return float(learning_rate_schedule(self.optimizer,
                                        self.optimizer.total_steps)(count))
