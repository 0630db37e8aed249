"""Generated tasks as seeded data sets.

Each example draws from its own `random.Random` seeded by (task, seed, index),
so example i is the same whatever `num_examples` is, and two seeds give two
independent sets (a held-out set is just another seed; note that small
levels have few distinct problems: level-1 arithmetic has 81).
"""
from __future__ import annotations

import random
from typing import Sequence

# Importing these registers the tasks.
from grpo_jax.data import arithmetic as _arithmetic  # noqa: F401  pylint: disable=unused-import
from grpo_jax.data import commonsense as _commonsense  # noqa: F401  pylint: disable=unused-import
from grpo_jax.data import word_problems as _word_problems  # noqa: F401  pylint: disable=unused-import
from grpo_jax.data.example import Example
from grpo_jax.registry import lookup, register


def _rng(task: str, *key: object) -> random.Random:
  """A generator seeded by a string: stable across runs and Python versions."""
  return random.Random(":".join([task, *map(str, key)]))


def generated_examples(task: str, num_examples: int, levels: int | Sequence[int] = 1,
                       seed: int = 0) -> list[Example]:
  """`num_examples` problems of a registered task; example i has level levels[i % len]."""
  make = lookup("task", task)
  levels = [levels] if isinstance(levels, int) else list(levels)
  return [make(_rng(task, seed, i), levels[i % len(levels)]) for i in range(num_examples)]


@register("dataset", "arithmetic")
def arithmetic_dataset(num_examples: int, levels: int | Sequence[int] = 1,
                       seed: int = 0) -> list[Example]:
  """Multi-digit arithmetic ("What is 47 + 8 * 3?"); see `arithmetic.arithmetic_spec`."""
  return generated_examples("arithmetic", num_examples, levels, seed)


@register("dataset", "countdown")
def countdown_dataset(num_examples: int, levels: int | Sequence[int] = 1,
                      seed: int = 0) -> list[Example]:
  """Countdown: level + 2 numbers and a reachable target; check with `countdown_check`."""
  return generated_examples("countdown", num_examples, levels, seed)


@register("dataset", "word_problems")
def word_problems_dataset(num_examples: int, levels: int | Sequence[int] = 1,
                          seed: int = 0) -> list[Example]:
  """Multi-step word problems (level = steps) with worked rationales, for STaR."""
  return generated_examples("word_problems", num_examples, levels, seed)


@register("dataset", "commonsense_mc")
def commonsense_mc_dataset(num_examples: int, levels: int | Sequence[int] = 1,
                           seed: int = 0) -> list[Example]:
  """Multiple-choice "which is heaviest/fastest/..." with a letter answer (level + 1 choices)."""
  return generated_examples("commonsense_mc", num_examples, levels, seed)
