"""Format rewards and DAPO's soft overlong punishment.

Every reward here has the signature
`fn(prompts, completions, answers, completion_lengths, **kwargs) -> float32[N]`
with N = len(completions) = B*G; prompts and answers may have one entry per
completion or one per prompt.
"""
from __future__ import annotations

import numpy as np

from grpo_jax.registry import register
from grpo_jax.rewards._common import per_completion

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
BOXED = "\\boxed{"
ANSWER_RULES = ("any", "boxed")


def with_prefill(prompt: str, completion: str) -> str:
  """R1-Zero style templates end the prompt with "<think>"; the completion
  then starts inside the thought, and the tag belongs to it."""
  if prompt.rstrip().endswith(THINK_OPEN) and not completion.lstrip().startswith(THINK_OPEN):
    return THINK_OPEN + completion
  return completion


def _split_think(text: str) -> tuple[str, str] | None:
  """(thought, rest) if the text is exactly one leading <think>...</think>."""
  text = text.strip()
  if not text.startswith(THINK_OPEN):
    return None
  if text.count(THINK_OPEN) != 1 or text.count(THINK_CLOSE) != 1:
    return None
  thought, rest = text[len(THINK_OPEN):].split(THINK_CLOSE)
  return thought, rest


def has_boxed_answer(text: str) -> bool:
  """A non-empty `\\boxed{...}` (braces balanced) in the text."""
  start = text.find(BOXED)
  while start >= 0:
    depth, i = 1, start + len(BOXED)
    while i < len(text) and depth:
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      i += 1
    if depth == 0 and text[start + len(BOXED):i - 1].strip():
      return True
    start = text.find(BOXED, i)
  return False


def is_think_format(text: str, answer: str = "any") -> bool:
  """`<think>reasoning</think>` then a non-empty answer; with answer="boxed"
  the text after `</think>` must hold a non-empty `\\boxed{}` (the r1_think
  template's answer), so prose without a box after the thought earns nothing."""
  parts = _split_think(text)
  if parts is None or not parts[0].strip() or not parts[1].strip():
    return False
  return answer == "any" or has_boxed_answer(parts[1])


def is_r1_format(text: str) -> bool:
  """`<think>reasoning</think><answer>answer</answer>` and nothing else."""
  parts = _split_think(text)
  if parts is None or not parts[0].strip():
    return False
  rest = parts[1].strip()
  if not (rest.startswith(ANSWER_OPEN) and rest.endswith(ANSWER_CLOSE)):
    return False
  if rest.count(ANSWER_OPEN) != 1 or rest.count(ANSWER_CLOSE) != 1:
    return False
  return bool(rest[len(ANSWER_OPEN):-len(ANSWER_CLOSE)].strip())


def _format_reward(check, prompts, completions) -> np.ndarray:
  prompts = per_completion(prompts, len(completions))
  return np.array([float(check(with_prefill(p, c)))
                   for p, c in zip(prompts, completions)], np.float32)


@register("reward", "format_think")
def format_think_reward(prompts, completions, answers, completion_lengths, *,
                        answer: str = "any") -> np.ndarray:
  """1 if the completion is `<think>…</think>` followed by an answer, else 0;
  answer="boxed" asks for a `\\boxed{}` answer after the thought."""
  del answers, completion_lengths
  if answer not in ANSWER_RULES:
    raise ValueError(f"format_think: answer={answer!r}, want one of {ANSWER_RULES}")
  return _format_reward(lambda text: is_think_format(text, answer), prompts, completions)


@register("reward", "format_r1")
def format_r1_reward(prompts, completions, answers, completion_lengths
                     ) -> np.ndarray:
  """1 for DeepSeek-R1's `<think>…</think><answer>…</answer>`, else 0."""
  del answers, completion_lengths
  return _format_reward(is_r1_format, prompts, completions)


def overlong_penalty(lengths, max_length: int, cache_length: int) -> np.ndarray:
  """DAPO eq. 13, in tokens: 0 up to L_max - L_cache, then a linear ramp to
  -1 at L_max, and -1 beyond."""
  if not 0 < cache_length <= max_length:
    raise ValueError(f"need 0 < cache_length <= max_length, got "
                     f"{cache_length=}, {max_length=}")
  lengths = np.asarray(lengths, np.float64)
  free = max_length - cache_length
  ramp = (free - lengths) / cache_length
  penalty = np.where(lengths <= free, 0.0, np.where(lengths <= max_length, ramp, -1.0))
  return penalty.astype(np.float32)


@register("reward", "overlong")
def overlong_reward(prompts, completions, answers, completion_lengths, *,
                    max_length: int = 20480, cache_length: int = 4096
                    ) -> np.ndarray:
  """Soft overlong punishment on completion TOKEN counts (paper defaults)."""
  del prompts, completions, answers
  return overlong_penalty(completion_lengths, max_length, cache_length)
