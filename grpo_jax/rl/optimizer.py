"""The optimizer: AdamW (optax) with warm-up and a constant or cosine
schedule, gradient clipping, and float32 moments whatever the params' dtype.

`OptimizerSpec` is the optimizer as a value (hashable): the jitted update
and SFT steps take it as a static argument, so equal specs share one
compiled program however many times the optimizer is made (STaR makes a
fresh one every outer iteration).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(optim, total_steps: int) -> optax.Schedule:
  """Linear warm-up, then constant or cosine decay (optax schedules)."""
  warm = max(int(optim.warmup_steps), 0)
  if optim.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, optim.learning_rate, max(warm, 1), max(total_steps, warm + 1))
  if warm == 0:
    return optax.constant_schedule(optim.learning_rate)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, optim.learning_rate, warm),
       optax.constant_schedule(optim.learning_rate)], [warm])


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """`make_optimizer`'s arguments as a hashable value (config.optim and the
  schedule's length); `build()` gives the optax transformation."""
  learning_rate: float
  warmup_steps: int
  schedule: str
  weight_decay: float
  b1: float
  b2: float
  eps: float
  grad_clip: float
  total_steps: int

  @classmethod
  def from_config(cls, optim, total_steps: int) -> "OptimizerSpec":
    fields = [f.name for f in dataclasses.fields(cls)][:-1]
    return cls(**{name: optim[name] for name in fields},
               total_steps=total_steps)

  def build(self) -> optax.GradientTransformation:
    return make_optimizer(self, self.total_steps)


def as_optax(optimizer) -> optax.GradientTransformation:
  """An OptimizerSpec built, or an optax transformation as it is."""
  return optimizer.build() if isinstance(optimizer, OptimizerSpec) else optimizer


def make_optimizer(optim, total_updates: int) -> optax.GradientTransformation:
  """AdamW with global-norm gradient clipping, its state in float32."""
  return float32_state(optax.chain(
      optax.clip_by_global_norm(optim.grad_clip),
      optax.adamw(learning_rate_schedule(optim, total_updates), b1=optim.b1,
                  b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)))


def float32_state(inner: optax.GradientTransformation
                  ) -> optax.GradientTransformation:
  """`inner` with its state and updates in float32 whatever the params'
  dtype (param_dtype="bfloat16": Adam's moments would underflow in bf16).
  The update is rounded to the params' dtype once, by optax.apply_updates.
  A no-op for float32 params."""
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)

  def update(updates, state, params=None):
    return inner.update(f32(updates), state,
                        None if params is None else f32(params))

  return optax.GradientTransformation(lambda p: inner.init(f32(p)), update)
