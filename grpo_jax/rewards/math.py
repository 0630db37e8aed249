"""The math verifier: `verify(gold, prediction) -> bool` and its batch form.

The trainer's thread does only this: turn the gold and the completion into
text (a missing gold matches nothing), keep the completion's last
`MAX_COMPLETION_CHARS` characters, and hand the pair to a worker process of
`pool.WorkerPool`. Everything else (extraction, the fast path, sympy) is
`contract.decide` in that worker, under the pool's hard wall-clock time-out,
so a 40 KB repetition loop costs the trainer a JSON line, not a scan.
docs/verifier.md states the answer and equivalence contracts it implements.

`verify` never raises and returns within about its timeout; a timeout, a
crashed worker or an unparsable answer all count as not verified.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import numpy as np

from grpo_jax.registry import register
from grpo_jax.rewards import minerva
from grpo_jax.rewards import pool as pool_lib
from grpo_jax.rewards._common import per_completion

DEFAULT_TIMEOUT = 5.0
MAX_COMPLETION_CHARS = 100_000  # A1: only a completion's end is read.

log = logging.getLogger(__name__)
_default_pool: pool_lib.WorkerPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> pool_lib.WorkerPool:
  """The process-wide verifier pool, created on first use."""
  global _default_pool
  with _default_pool_lock:
    if _default_pool is None:
      _default_pool = pool_lib.WorkerPool()
    return _default_pool


# What a missing value becomes as text (a pandas NaN read as "nan"). Not
# "None": that can be a real answer ("None of them").
_MISSING = frozenset(("", "nan"))


def _as_text(value: Any) -> str | None:
  """Golds may be numbers in a dataset; anything else that is not text is no
  answer. A float 5.0 (a pandas column) is "5"; a non-finite one is none."""
  if isinstance(value, str):
    return value
  if isinstance(value, (float, np.floating)):
    if not np.isfinite(value):
      return None
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else str(value)
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return str(value)
  return None


def gold_text(gold: Any) -> str | None:
  """The gold as text, or None where it is missing: not text or a number, a
  NaN or infinite float, or text that is empty or `nan` (what an empty
  pandas cell becomes). No prediction matches a missing gold."""
  text = _as_text(gold)
  if text is None or text.strip().lower() in _MISSING:
    return None
  return text


def _prepare(gold: Any, prediction: Any) -> bool | tuple:
  """False for a pair that cannot match, else the worker's args. No scan of
  the text happens here (docs/verifier.md, A1: the last 100,000 characters)."""
  gold, prediction = gold_text(gold), _as_text(prediction)
  if gold is None or prediction is None:
    return False
  return (gold[-MAX_COMPLETION_CHARS:], prediction[-MAX_COMPLETION_CHARS:])


def verify_batch(golds: Sequence[Any], predictions: Sequence[Any],
                 timeout: float = DEFAULT_TIMEOUT,
                 pool: pool_lib.WorkerPool | None = None) -> list[bool]:
  """`verify` over pairs, in parallel across the pool; order is preserved."""
  try:
    prepared = [_prepare(g, p) for g, p in zip(golds, predictions, strict=True)]
    todo = [i for i, item in enumerate(prepared) if isinstance(item, tuple)]
    answers = (pool or default_pool()).run(
        "decide", [prepared[i] for i in todo], timeout) if todo else []
    for i, value in zip(todo, answers):
      prepared[i] = value is True
    return [bool(item) for item in prepared]
  except Exception:  # pylint: disable=broad-except
    # verify's contract is to never raise; a bug here must not stop training.
    log.exception("verify_batch failed; scoring %d pairs as wrong", len(golds))
    return [False] * len(golds)


def verify(gold: Any, prediction: Any, timeout: float = DEFAULT_TIMEOUT,
           pool: pool_lib.WorkerPool | None = None) -> bool:
  """True if `prediction`'s final answer equals `gold` mathematically.

  The answer and the comparison are docs/verifier.md's contracts (A1-A8,
  E1-E8), decided in a worker (`contract.decide`). Never raises; returns
  within about `timeout` seconds.
  """
  try:
    return verify_batch([gold], [prediction], timeout=timeout, pool=pool)[0]
  except Exception:  # pylint: disable=broad-except
    return False


def verify_dapo(gold: Any, prediction: Any) -> bool:
  """DAPO's string check (see `minerva.py`); no worker needed. A missing
  gold (`gold_text`) matches nothing here either."""
  gold, prediction = gold_text(gold), _as_text(prediction)
  if gold is None or prediction is None:
    return False
  try:
    return minerva.is_correct(gold, prediction)
  except Exception:  # pylint: disable=broad-except
    return False


@register("reward", "math")
def math_reward(prompts, completions, answers, completion_lengths, *,
                timeout: float = DEFAULT_TIMEOUT, correct: float = 1.0,
                wrong: float = 0.0) -> np.ndarray:
  """1 if the completion's answer verifies against the reference, else 0."""
  del prompts, completion_lengths
  golds = per_completion(answers, len(completions))
  ok = np.asarray(verify_batch(golds, completions, timeout=timeout), dtype=bool)
  return np.where(ok, correct, wrong).astype(np.float32)


@register("reward", "math_dapo")
def math_dapo_reward(prompts, completions, answers, completion_lengths
                     ) -> np.ndarray:
  """DAPO's reward: +1 if the final `Answer:` matches exactly, else -1."""
  del prompts, completion_lengths
  golds = per_completion(answers, len(completions))
  ok = np.array([verify_dapo(g, c) for g, c in zip(golds, completions)], bool)
  return np.where(ok, 1.0, -1.0).astype(np.float32)
