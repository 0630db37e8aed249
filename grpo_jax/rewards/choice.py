"""Multiple-choice letter match (CommonsenseQA-style: "(A)" ... "(E)")."""
from __future__ import annotations

import re

import numpy as np

from grpo_jax.registry import register
from grpo_jax.rewards import extract
from grpo_jax.rewards._common import per_completion


def _letter_pattern(letters: str) -> re.Pattern[str]:
  """A choice letter standing alone: "B", "(B)", "B)", "**B**", "B." ..."""
  return re.compile(rf"(?<![A-Za-z])\(?([{letters}])\)?(?![A-Za-z])")


def _parenthesised_pattern(letters: str) -> re.Pattern[str]:
  """"(d)": in parentheses, a lower-case letter is a choice too."""
  return re.compile(rf"\(([{letters}])\)", re.IGNORECASE)


def _hedge_pattern(letters: str) -> re.Pattern[str]:
  """"A or B", "A/B", "A, B", "A and B": more than one letter offered."""
  one = rf"\(?[{letters}]\)?"
  return re.compile(rf"(?<![A-Za-z]){one}\s*(?:,|/|\bor\b|\band\b)\s*{one}(?![A-Za-z])")


def gold_letter(answer: str, letters: str = "ABCDE") -> str | None:
  """"B", "(b)", "B) a river" -> "B"."""
  match = _letter_pattern(letters).search(answer.strip().upper())
  return match.group(1) if match else None


def predicted_letter(completion: str, letters: str = "ABCDE") -> str | None:
  """The chosen letter: from <answer>, \\boxed{}, an `Answer:` line or
  "the answer is"; else the whole completion if it is just a letter.
  A hedge ("A or B") chooses nothing."""
  span = extract.last_tagged(completion, "answer")
  if span is None:
    span = extract.last_boxed(completion) or extract.anchored_span(completion)
  if span is None:  # Unanchored: only a bare "B" / "(B)." counts.
    bare = completion.strip().strip("*.").strip()
    span = bare if len(bare) <= 3 else None
  if span is None:
    return None
  span = span.replace("\\text{", " ")
  if len(span.strip(" ()*.{}")) == 1:  # A lone "b" is a letter, not a word.
    span = span.upper()
  if _hedge_pattern(letters).search(span):
    return None
  match = (_parenthesised_pattern(letters).search(span)
           or _letter_pattern(letters).search(span))
  return match.group(1).upper() if match else None


@register("reward", "multiple_choice")
def multiple_choice_reward(prompts, completions, answers, completion_lengths, *,
                           letters: str = "ABCDE") -> np.ndarray:
  """1 if the chosen letter is the reference letter, else 0."""
  del prompts, completion_lengths
  golds = per_completion(answers, len(completions))
  chosen = [predicted_letter(c, letters) for c in completions]
  return np.array([float(p is not None and p == gold_letter(str(g), letters))
                   for g, p in zip(golds, chosen)], np.float32)
