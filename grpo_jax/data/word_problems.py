"""Generated multi-step arithmetic word problems with worked rationales (for STaR).

Level = number of steps after the starting amount. Every intermediate amount
is a non-negative integer; the rationale walks through each step and ends
with "The answer is N.", so it can serve as a STaR hint or a few-shot example.
"""
from __future__ import annotations

import random
from typing import Any, Callable

from grpo_jax.data.example import Example
from grpo_jax.registry import register

_PEOPLE = (("Ava", "she", "her"), ("Liam", "he", "his"), ("Maya", "she", "her"),
           ("Noah", "he", "his"), ("Zoe", "she", "her"), ("Omar", "he", "his"),
           ("Lena", "she", "her"), ("Ravi", "he", "his"))
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cards", "shells", "coins", "books")

# A step: (rng, amount, name, pronoun, possessive, item, friend) -> (sentence, reasoning,
# new amount, (op, operand, ...)), or None when it does not apply to `amount`.
Step = Callable[..., "tuple[str, str, int, tuple[Any, ...]] | None"]


def _finds(rng, amount, name, pronoun, possessive, item, friend):
  n = rng.randint(2, 20)
  return (f"Then {pronoun} finds {n} more {item}.",
          f"Finding {n} more gives {amount} + {n} = {amount + n}.", amount + n, ("add", n))


def _gives(rng, amount, name, pronoun, possessive, item, friend):
  if amount < 2:
    return None
  n = rng.randint(1, min(amount - 1, 20))
  return (f"{pronoun.capitalize()} gives {n} {item} to {friend}.",
          f"Giving {n} away leaves {amount} - {n} = {amount - n}.", amount - n, ("sub", n))


def _buys_packs(rng, amount, name, pronoun, possessive, item, friend):
  packs, per_pack = rng.randint(2, 5), rng.randint(2, 10)
  gained = packs * per_pack
  return (f"{pronoun.capitalize()} buys {packs} packs with {per_pack} {item} in each pack.",
          f"{packs} packs of {per_pack} is {packs} * {per_pack} = {gained} more, "
          f"so {amount} + {gained} = {amount + gained}.", amount + gained, ("add_product", packs, per_pack))


def _doubles(rng, amount, name, pronoun, possessive, item, friend):
  if amount > 200:
    return None
  return (f"{friend} gives {name} as many {item} as {pronoun} already has.",
          f"That doubles the amount: {amount} * 2 = {2 * amount}.", 2 * amount, ("mul", 2))


def _shares(rng, amount, name, pronoun, possessive, item, friend):
  parts = [k for k in (2, 3, 4, 5) if amount % k == 0 and amount // k > 0]
  if not parts:
    return None
  k = rng.choice(parts)
  return (f"{pronoun.capitalize()} splits {possessive} {item} equally into {k} bags "
          f"and keeps only one bag.",
          f"One of {k} equal bags holds {amount} / {k} = {amount // k}.", amount // k, ("div", k))


_STEPS: tuple[Step, ...] = (_finds, _gives, _buys_packs, _doubles, _shares)


@register("task", "word_problems")
def word_problem(rng: random.Random, level: int) -> Example:
  """A story of `level` steps about one person's items; the answer is the final count.

  meta["steps"] lists the operations, e.g. [("add", 5), ("div", 3)], so the
  answer can be recomputed without reading the text.
  """
  if level < 1:
    raise ValueError(f"word_problems level must be >= 1, got {level}")
  (name, pronoun, possessive), item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
  friend = rng.choice([p[0] for p in _PEOPLE if p[0] != name])
  amount = start = rng.randint(5, 30)
  sentences, reasoning, steps = [f"{name} has {start} {item}."], [f"{name} starts with {start}."], []
  while len(steps) < level:
    outcome = rng.choice(_STEPS)(rng, amount, name, pronoun, possessive, item, friend)
    if outcome is None or outcome[0] in sentences:  # Not applicable, or a repeat.
      continue
    sentence, thought, amount, op = outcome
    sentences.append(sentence)
    reasoning.append(thought)
    steps.append(op)
  question = " ".join(sentences) + f" How many {item} does {name} have now?"
  rationale = " ".join(reasoning) + f" The answer is {amount}."
  return Example(question=question, answer=str(amount), rationale=rationale,
                 meta={"level": level, "start": start, "steps": steps})
