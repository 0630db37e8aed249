"""DeepSeek-R1's language-consistency reward (R1 §2.3.3), by a script measure.

R1 rewards "the proportion of target language words in the CoT". Without a
language identifier we measure scripts, which needs no model and no data:

  reward = (# letters of the reasoning in the target script) / (# letters of the reasoning)

- A letter is a character with `str.isalpha()`; its script is the first word
  of its Unicode name (`LATIN`, `CYRILLIC`, `GREEK`, `CJK`, `HIRAGANA`,
  `HANGUL`, `ARABIC`, ...). Digits, punctuation and spaces are not counted.
- The target script is the `script` kwarg when given, else the script of most
  letters of the prompt (ties: the first in sorted order). The template's
  words count too: where an English template outweighs a short question in
  another script, fix the target with `script`.
- The reasoning is the text inside `<think>...</think>` (a `<think>` that ends
  the prompt counts, as for the format rewards); without that tag, the whole
  completion.
- A reasoning without letters scores 0 (there is nothing in the language).

Scripts are a proxy for languages: English and French are both LATIN, so a
reasoning that drifts from English to French is not caught; one that drifts
from a Chinese question into English is.
"""
from __future__ import annotations

import collections
import unicodedata

import numpy as np

from grpo_jax.registry import register
from grpo_jax.rewards._common import per_completion
from grpo_jax.rewards.format import THINK_CLOSE, THINK_OPEN, with_prefill


def letter_script(char: str) -> str | None:
  """The script of a letter (first word of its Unicode name), None otherwise."""
  if not char.isalpha():
    return None
  name = unicodedata.name(char, "")
  return name.split(" ", 1)[0] if name else None


def script_counts(text: str) -> collections.Counter:
  """Letters per script in `text`."""
  return collections.Counter(s for s in map(letter_script, text) if s is not None)


def main_script(text: str) -> str | None:
  """The script of most of `text`'s letters; None without letters."""
  counts = script_counts(text)
  if not counts:
    return None
  return max(sorted(counts), key=lambda s: counts[s])


def reasoning_of(prompt: str, completion: str) -> str:
  """The text inside `<think>...</think>`, else the whole completion."""
  text = with_prefill(prompt, completion)
  start = text.find(THINK_OPEN)
  if start < 0:
    return completion
  start += len(THINK_OPEN)
  end = text.find(THINK_CLOSE, start)
  return text[start:] if end < 0 else text[start:end]


def consistency(reasoning: str, script: str | None) -> float:
  """Fraction of the reasoning's letters in `script` (0 without letters)."""
  counts = script_counts(reasoning)
  total = sum(counts.values())
  if not total or script is None:
    return 0.0
  return counts[script] / total


@register("reward", "language_consistency")
def language_consistency_reward(prompts, completions, answers, completion_lengths,
                                *, script: str | None = None) -> np.ndarray:
  """Fraction of the reasoning's letters in the prompt's script (module docstring)."""
  del answers, completion_lengths
  prompts = per_completion(prompts, len(completions))
  out = [consistency(reasoning_of(p, c), script or main_script(p))
         for p, c in zip(prompts, completions)]
  return np.array(out, np.float32)
