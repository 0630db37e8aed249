"""Code reward: the completion's Python program against the task's unit tests.

`answers[i]` is the test code: one string (all-or-nothing) or a list of
test snippets (reward = fraction passed). The program is the last fenced
```python block of the completion (any fenced block if none is marked).
Execution happens in `sandbox.run_tests`, several at a time in threads
(each run is its own subprocess; the threads only wait).
"""
from __future__ import annotations

import concurrent.futures
import os

import numpy as np

from grpo_jax.registry import register
from grpo_jax.rewards import sandbox
from grpo_jax.rewards._common import per_completion

_PYTHON = ("python", "py", "python3")


def _fenced_blocks(completion: str) -> list[tuple[str, str]]:
  """(language, code) of each closed ``` block; linear (split, no regex)."""
  parts = completion.split("```")
  closed = parts[1:len(parts) - (len(parts) % 2 == 0):2]  # Drop an unclosed one.
  blocks = []
  for part in closed:
    info, _, body = part.partition("\n")
    blocks.append((info.strip().lower(), body))
  return blocks


def extract_code(completion: str) -> str | None:
  """The last ```python fenced block, else the last fenced block."""
  blocks = [b for b in _fenced_blocks(completion) if b[1].strip()]
  python = [body for lang, body in blocks if lang in _PYTHON]
  if python:
    return python[-1]
  return blocks[-1][1] if blocks else None


def _score(completion: str, tests, limits: sandbox.Limits) -> float:
  program = extract_code(completion)
  if program is None:
    return 0.0
  all_or_nothing = isinstance(tests, str)
  result = sandbox.run_tests(program, [tests] if all_or_nothing else list(tests),
                             limits)
  return float(result.passed == result.total) if all_or_nothing else result.fraction


@register("reward", "code")
def code_reward(prompts, completions, answers, completion_lengths, *,
                timeout: float = 10.0, memory_mb: int = 1024,
                max_parallel: int | None = None) -> np.ndarray:
  """Fraction of unit tests the completion's program passes, in a sandbox."""
  del prompts, completion_lengths
  tests = per_completion(answers, len(completions))
  limits = sandbox.Limits(timeout=timeout, memory_mb=memory_mb)
  workers = max_parallel or max(1, min(16, os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers) as executor:
    scores = list(executor.map(lambda ct: _score(ct[0], ct[1], limits),
                               zip(completions, tests)))
  return np.asarray(scores, np.float32)
