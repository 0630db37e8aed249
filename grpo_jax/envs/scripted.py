"""A scripted env for tests: fixed observations in turn order, and a record
of every turn it was shown (the ids exactly as sampled)."""
from __future__ import annotations

import time
from typing import Sequence

from grpo_jax import registry
from grpo_jax.envs import base


@registry.register("env", "scripted")
class Scripted:
  """Turn k gets observations[k] (the episode ends after the last one);
  `delay_s` sleeps in each step (a slow tool); an observation "raise" makes
  the step fail as a crashing tool would (the rollout must survive it);
  `turn_reward` is added per observation."""

  def __init__(self, timeout_s: float = 5.0,
               observations: Sequence[str] = ("ok",), delay_s: float = 0.0,
               turn_reward: float = 0.0):
    self.timeout_s = timeout_s
    self.observations = tuple(observations)
    self.delay_s = delay_s
    self.turn_reward = turn_reward
    self.turns: list[tuple[str, tuple[int, ...]]] = []

  def initial_messages(self, example) -> base.Messages:
    return [{"role": "user", "content": example.question}]

  def step(self, turn_text: str, turn_ids: Sequence[int]) -> base.StepResult:
    self.turns.append((turn_text, tuple(int(i) for i in turn_ids)))
    if self.delay_s:
      time.sleep(self.delay_s)
    k = len(self.turns) - 1
    if k >= len(self.observations):
      return base.Done()
    if self.observations[k] == "raise":
      raise RuntimeError("scripted tool failure")
    return base.Observation(self.observations[k], self.turn_reward)
