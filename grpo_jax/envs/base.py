"""The environment interface of multi-turn episodes (agents that use tools).

An env is made once per episode (`EnvSpec.make`) and driven by the rollout
(`generate/agent.py`):

    messages = env.initial_messages(example)     # the chat the model starts on
    result = env.step(turn_text, turn_ids)       # after each finished turn
      Observation(text, reward)  -> a tool message: the episode continues
      Done(reward)               -> the episode ends

`turn_ids` are the model's turn exactly as sampled (its stop token
included); `turn_text` their text without the stop. The episode's reward is
the run's reward functions on the last turn's text plus the `reward` terms
its steps returned. A step must not raise on anything the model wrote: a
tool's error or time-out is an observation (`tool_error`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, Sequence, Union

from grpo_jax import registry


class Observation(NamedTuple):
  """A tool's answer, shown to the model as a tool message."""
  text: str
  reward: float = 0.0       # a per-turn term added to the episode's reward
  error: bool = False       # the tool failed or timed out (counted)


class Done(NamedTuple):
  """The episode is over (the model answered, or gave no tool call)."""
  reward: float = 0.0


StepResult = Union[Observation, Done]
Messages = list[dict[str, str]]


class Env(Protocol):
  """One episode's environment (registered with @register("env", name) as a
  class taking `timeout_s` and the config's env.kwargs)."""

  def initial_messages(self, example) -> Messages: ...

  def step(self, turn_text: str, turn_ids: Sequence[int]) -> StepResult: ...


def tool_error(what: str) -> Observation:
  """The observation of a tool that failed (an exception's name, a time-out):
  the model reads it and may try again."""
  return Observation(f"error: {what}", error=True)


# env.engine: "turns", a sampler call per turn for the whole batch
# (generate/agent.py); "parked", rows that wait on the paged engine
# (generate/agent_parked.py).
ENGINES = ("turns", "parked")


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """config.env, derived once per run: the env's registry name, at most
  `max_turns` model turns per episode, observations of at most
  `max_observation_tokens` tokens (the tool-turn markers included), each
  tool call bounded by `tool_timeout_s`, the env's own keyword arguments,
  and the engine that runs the episodes (ENGINES)."""
  name: str
  max_turns: int = 4
  max_observation_tokens: int = 64
  tool_timeout_s: float = 5.0
  kwargs: tuple = ()        # sorted (key, value) pairs: hashable
  engine: str = "turns"     # ENGINES
  engine_steps: int = 16    # "parked": decode steps per device call, at most

  @classmethod
  def from_config(cls, config) -> "EnvSpec | None":
    """None where env.name is "" (today's single-turn rollout)."""
    e = config.env
    if not e.name:
      return None
    return cls(e.name, int(e.max_turns), int(e.max_observation_tokens),
               float(e.tool_timeout_s), tuple(sorted(dict(e.kwargs).items())),
               e.engine, int(e.engine_steps))

  def make(self) -> Env:
    """A fresh env for one episode."""
    cls = registry.lookup("env", self.name)
    return cls(timeout_s=self.tool_timeout_s, **dict(self.kwargs))

  def trajectory_tokens(self, max_new_tokens: int) -> int:
    """T of a trajectory: every turn at its budget and an observation at its
    budget between each two turns (the row's token budget)."""
    return (self.max_turns * max_new_tokens
            + (self.max_turns - 1) * self.max_observation_tokens)


def user_messages(example: Any, instructions: str) -> Messages:
  """The default first message: the instructions, then the question."""
  return [{"role": "user", "content": f"{instructions}\n\n{example.question}"}]
