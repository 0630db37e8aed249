"""The math verifier: `verify(gold, prediction) -> bool` and its batch form.

Pipeline for one (gold, prediction) pair:
  1. extraction, in the trainer process, by pure linear-time string code
     (`extract.py`): the last \\boxed{}/\\fbox{} (or the final list of boxes),
     else the latest `Answer:` line / "the answer is" / `#### 42`, else the
     final statement ("so there are 24 ways"), else the whole text; an
     answer that is program text (`(lambda: 7)()`) is refused here;
  2. a fast path: answers equal after removing spacing and `$` are accepted
     without a worker (half of the benchmark's solutions), and two plain
     numbers (`1,234`, `-7`, `2.50`, `3/4`, `\\frac{3}{4}`) are compared
     exactly as fractions (a differing decimal still goes to the worker);
  3. otherwise parsing and symbolic comparison (`symbolic.py`, built on
     math-verify) in a worker process of `pool.WorkerPool`, under a hard
     wall-clock timeout. Model text reaches sympy only there.

`verify` never raises and returns within about its timeout; a timeout, a
crashed worker or an unparsable answer all count as not verified.
"""
from __future__ import annotations

import fractions
import logging
import re
import threading
from typing import Any, Sequence

import numpy as np

from grpo_jax.registry import register
from grpo_jax.rewards import extract
from grpo_jax.rewards import minerva
from grpo_jax.rewards import pool as pool_lib
from grpo_jax.rewards._common import per_completion

DEFAULT_TIMEOUT = 5.0
# No real final answer is this long; longer "answers" are refused before any
# parsing (a 1 MB \boxed{} would otherwise hold a worker for the full timeout).
MAX_ANSWER_CHARS = 1000

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


def _cleaned(answer: extract.Answer) -> extract.Answer:
  return answer._replace(text=extract.collapse_parens(answer.text))


def _one_line(text: str) -> bool:
  return len(text) <= 200 and "\n" not in text


# Integers (with or without 1,000 groups), decimals, a/b and \frac{a}{b}:
# exact values that Python's Fraction reads without evaluating anything.
_PLAIN_NUMBER = re.compile(
    r"(?P<sign>[-+]?)(?:(?P<decimal>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)"
    r"|(?P<p>\d+)/(?P<q>[1-9]\d*)|\\frac\{(?P<fp>\d+)\}\{(?P<fq>[1-9]\d*)\})")
_MAX_PLAIN_DIGITS = 100


def _plain_value(text: str) -> fractions.Fraction | None:
  match = _PLAIN_NUMBER.fullmatch(text) if len(text) <= _MAX_PLAIN_DIGITS else None
  if match is None:
    return None
  if match["decimal"]:
    value = fractions.Fraction(match["decimal"].replace(",", ""))
  else:
    value = fractions.Fraction(int(match["p"] or match["fp"]),
                               int(match["q"] or match["fq"]))
  return -value if match["sign"] == "-" else value


def _plain_numbers_verdict(gold: str, prediction: str) -> bool | None:
  """Decides two plain numbers in the parent: exactly equal values are
  equal; two integers or fractions that differ are not. A decimal that
  differs goes to the worker (`0.333333` is 1/3 at 6 decimals)."""
  gold_value, pred_value = _plain_value(gold), _plain_value(prediction)
  if gold_value is None or pred_value is None:
    return None
  if gold_value == pred_value:
    return True
  return False if "." not in gold + prediction else None


def _prepare(gold: Any, prediction: Any) -> bool | tuple:
  """Decides a pair in the parent if it can (bool), else the worker's args."""
  gold, prediction = gold_text(gold), _as_text(prediction)
  if gold is None or prediction is None:
    return False
  gold_answer = _cleaned(extract.extract_answer(gold))
  pred_answer = _cleaned(extract.extract_answer(prediction))
  if not gold_answer.text or not pred_answer.text:
    return False
  if pred_answer.anchored and len(pred_answer.text) > max(
      MAX_ANSWER_CHARS, 4 * len(gold_answer.text)):
    return False
  if ((pred_answer.anchored and extract.looks_like_program(pred_answer.text))
      or (_one_line(prediction) and extract.looks_like_program(prediction))):
    return False  # Text is never code: `(lambda: 7)()` earns nothing.
  gold_light = extract.light_normalise(gold_answer.text)
  pred_light = extract.light_normalise(pred_answer.text)
  if gold_light == pred_light:
    return True
  verdict = _plain_numbers_verdict(gold_light, pred_light)
  if verdict is not None:
    return verdict
  return (gold_answer.text, gold_answer.anchored,
          pred_answer.text, pred_answer.anchored)


def verify_batch(golds: Sequence[Any], predictions: Sequence[Any],
                 timeout: float = DEFAULT_TIMEOUT,
                 pool: pool_lib.WorkerPool | None = None) -> list[bool]:
  """`verify` over pairs, in parallel across the pool; order is preserved."""
  try:
    prepared = [_prepare(g, p) for g, p in zip(golds, predictions, strict=True)]
    todo = [i for i, item in enumerate(prepared) if isinstance(item, tuple)]
    answers = (pool or default_pool()).run(
        "math", [prepared[i] for i in todo], timeout) if todo else []
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

  The answer is taken from the prediction's last `\\boxed{...}` or its final
  `Answer: ...` line (also "the answer is ...", `#### 42`), else the whole
  string. Never raises; returns within about `timeout` seconds.
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
