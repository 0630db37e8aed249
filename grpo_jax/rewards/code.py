"""Code reward: the completion's Python program against the task's unit tests.

`answers[i]` is one test (all-or-nothing) or a list of tests (reward =
fraction passed). A test is assert statements as in MBPP (`_code_checks`
says which forms are decided and how), or an I/O case {"input": stdin,
"output": expected stdout} for which the program runs as a script. The program is the
last fenced ```python block of the completion (any fenced block if none is
marked). It runs in `sandbox` (one fresh, isolated run per completion,
several at a time in threads that only wait); the sandbox returns the values
of the tests' calls, and `_checker` decodes them and takes the verdicts
outside it, in a process with hard time and memory bounds, not here.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from typing import Any, Mapping, Sequence

import numpy as np

from grpo_jax.registry import register
from grpo_jax.rewards import _checker, _code_checks, sandbox
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


@dataclasses.dataclass(frozen=True)
class Result:
  passed: int
  total: int
  timed_out: bool = False

  @property
  def fraction(self) -> float:
    return self.passed / self.total if self.total else 0.0


io_case = _code_checks.io_case
same_output = _code_checks.same_output


def run_tests(program: str, tests: Sequence[str | Mapping[str, str]],
              limits: sandbox.Limits = sandbox.Limits(), *, label: str = ""
              ) -> Result:
  """How many of `tests` the program passes, all run in one sandbox and
  decided in `_checker` (never here: the values are the model's data):
  assert-style sources (`_code_checks`), or I/O cases {"input": stdin,
  "output": expected stdout} for which it runs as a script. Raises
  `sandbox.SandboxUnavailable` where code cannot be isolated."""
  sandbox.require()
  tests = [t if isinstance(t, str) else
           dict(zip(("input", "output"), io_case(t))) if io_case(t) else None
           for t in tests]
  calls, stdin = _code_checks.calls_of(tests)
  if not calls and not stdin:  # Nothing of the program's to run.
    run = sandbox.Output(sandbox.READY + b"\n")
  else:
    run = sandbox.execute(program, calls, limits, stdin=stdin, label=label)
  if run.setup_error is not None:
    _log_once(f"a sandbox could not be built ({run.setup_error}); "
              "that completion scores 0")
    return Result(0, len(tests), run.timed_out)
  passed = _checker.count_passed(tests, run.results)
  if passed is None:
    _log_once("checking a completion's results ran past its time or memory "
              f"bound ({_checker.CPU_S} CPU s, {_checker.MEMORY_MB} MB) or "
              "failed; it scores 0")
  return Result(passed or 0, len(tests), run.timed_out)


class UnevaluableTest(ValueError):
  """A code test whose expected side neither the checker nor the model's side can hold."""


def check_tests(answers: Sequence[Any]) -> None:
  """Refuses, naming the test, any test the checker cannot decide outside
  the sandbox (issue 45: an expected value is never computed where model
  code runs). Call it when the data is loaded; `code_reward` calls it too,
  before running anything. `answers` holds one test or a list per row."""
  for row in answers:
    for test in [row] if isinstance(row, (str, Mapping)) else list(row):
      if io_case(test) is None:
        try:
          _code_checks.parse(test if isinstance(test, str) else repr(test))
        except _code_checks.Unsplittable as e:
          raise UnevaluableTest(f"code test refused ({e}): {str(test)[:200]!r}") from None


_logged: set[str] = set()


def _log_once(message: str) -> None:
  if message not in _logged and len(_logged) < 20:
    _logged.add(message)
    logging.error("code reward: %s", message)


def _score(completion: str, tests, limits: sandbox.Limits,
           batch_end: float) -> float:
  """Never raises for any completion: a failure of any kind scores 0."""
  try:
    program = extract_code(completion)
    if program is None:
      return 0.0
    remaining = batch_end - time.monotonic()
    if remaining <= 0:
      return 0.0
    limits = dataclasses.replace(limits, timeout=min(limits.timeout, remaining))
    all_or_nothing = isinstance(tests, (str, Mapping))
    result = run_tests(program, [tests] if all_or_nothing else list(tests),
                       limits)
    return (float(result.passed == result.total) if all_or_nothing
            else result.fraction)
  except sandbox.SandboxUnavailable:
    raise
  except Exception as e:  # pylint: disable=broad-except
    _log_once(f"scoring a completion failed ({type(e).__name__}: {e}); "
              "it scores 0")
    return 0.0


@register("reward", "code")
def code_reward(prompts, completions, answers, completion_lengths, *,
                timeout: float = 10.0, memory_mb: int = 1024,
                disk_mb: int = 64, processes: int = 16,
                max_parallel: int | None = None,
                batch_timeout: float | None = None) -> np.ndarray:
  """Fraction of unit tests the completion's program passes, in a sandbox.

  `memory_mb` bounds each of a run's processes, and the run as a whole where
  this process may create cgroups; elsewhere (an unprivileged trainer,
  usually) a run may use `processes` x `memory_mb` in all (the start-up log
  says which: `sandbox.resource_control()`).
  `timeout` bounds each completion's run (wall clock); up to `max_parallel`
  run at once (default: 4 per CPU, at most 32), so N looping completions
  cost about timeout * N / max_parallel. `batch_timeout`, if set, bounds the
  whole batch: a run gets at most the time left, one not started by then
  scores 0. Raises `sandbox.SandboxUnavailable` (before running anything)
  where the host cannot isolate model code, and `UnevaluableTest` (naming
  it) for a test whose expected side the checker cannot evaluate.
  """
  del prompts, completion_lengths
  sandbox.require()
  check_tests(answers)
  tests = per_completion(answers, len(completions))
  limits = sandbox.Limits(timeout=timeout, memory_mb=memory_mb,
                          disk_mb=disk_mb, processes=processes)
  batch_end = time.monotonic() + (batch_timeout if batch_timeout is not None
                                  else float("inf"))
  workers = max_parallel or max(1, min(32, 4 * (os.cpu_count() or 1)))
  with concurrent.futures.ThreadPoolExecutor(workers) as executor:
    scores = list(executor.map(
        lambda ct: _score(ct[0], ct[1], limits, batch_end),
        zip(completions, tests)))
  return np.asarray(scores, np.float32)


code_reward.check_host = sandbox.require  # For `validate_specs` at start-up.
