"""The python env: a turn's last fenced ```python block runs in the code
sandbox (`rewards/sandbox.py`: namespaces, rlimits, no network, its
limits), and what it printed comes back as the observation. A non-zero exit
is its exception's name, a time-out says so: both are observations. A turn
without a block ends the episode.
"""
from __future__ import annotations

from typing import Sequence

from grpo_jax import registry
from grpo_jax.envs import base
from grpo_jax.rewards import code, sandbox
from grpo_jax.rewards._results import Raised

INSTRUCTIONS = ("You may run Python: write a ```python block that prints what "
                "you need and wait for its output. End with the final answer.")


def run_program(program: str, limits: sandbox.Limits) -> base.Observation:
  """The program as a script in a fresh sandbox: its stdout, or an error."""
  run = sandbox.run_calls(program, (), limits, stdin=("",), label="env")
  if run.timed_out:
    return base.tool_error(f"timed out after {limits.timeout:g} s")
  if run.setup_error is not None:
    return base.tool_error(f"sandbox: {run.setup_error}")
  out = run.outputs[0]
  if isinstance(out, Raised):
    return base.tool_error(out.name)
  return base.Observation(out)


@registry.register("env", "python")
class Python:
  """Runs the turn's last ```python block (extract_code: the code
  reward's reader), `timeout_s` wall-clock and `memory_mb` per process."""

  def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512,
               instructions: str = INSTRUCTIONS):
    self.limits = sandbox.Limits(timeout=timeout_s, memory_mb=memory_mb)
    self.instructions = instructions

  def initial_messages(self, example) -> base.Messages:
    return base.user_messages(example, self.instructions)

  def step(self, turn_text: str, turn_ids: Sequence[int]) -> base.StepResult:
    del turn_ids
    program = code.extract_code(turn_text)
    if program is None:
      return base.Done()
    return run_program(program, self.limits)


Python.check_host = sandbox.require   # validation: refused where no sandbox
