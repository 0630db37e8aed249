"""A generated multiple-choice commonsense set with a verifiable letter answer.

"Which of these is the heaviest?" over objects from small attribute tables.
Every table lists objects whose typical values are far apart (a factor of
two or more, or tens of degrees), so the right choice is unambiguous. Level L
shows L + 1 choices (at most 6); choices are shuffled by the seed.
"""
from __future__ import annotations

import random
import string

from grpo_jax.data.example import Example
from grpo_jax.registry import register

# attribute -> (superlative for max, superlative for min, unit phrase, {object: typical value}).
ATTRIBUTE_TABLES: dict[str, tuple[str, str, str, dict[str, float]]] = {
    "weight": ("heaviest", "lightest", "weighs about {} kg", {
        "a feather": 0.0001, "a paper clip": 0.001, "a coin": 0.007, "a pencil": 0.02,
        "an apple": 0.2, "a book": 1.0, "a brick": 3.0, "a bicycle": 15.0,
        "an adult person": 70.0, "a horse": 500.0, "a car": 1500.0, "an elephant": 6000.0,
        "a blue whale": 150000.0}),
    "length": ("longest", "shortest", "is about {} m long", {
        "an ant": 0.005, "a coin": 0.02, "a pencil": 0.18,
        "a cat": 0.5, "a bicycle": 1.8, "a car": 4.5, "a bus": 12.0, "a blue whale": 25.0,
        "a football field": 100.0, "the Eiffel Tower": 300.0}),
    "speed": ("fastest", "slowest", "moves at about {} km/h", {
        "a snail": 0.05, "a tortoise": 0.3, "a walking person": 5.0, "a cyclist": 20.0,
        "a running dog": 40.0, "a cheetah": 110.0, "a high-speed train": 300.0,
        "an airliner": 900.0, "a rocket": 28000.0}),
    "temperature": ("hottest", "coldest", "is about {} °C", {
        "dry ice": -78.0, "a snowball": -5.0, "tap water": 15.0, "a healthy person": 37.0,
        "a cup of hot coffee": 80.0, "boiling water": 100.0, "a hot oven": 220.0,
        "a candle flame": 1000.0, "the surface of the Sun": 5500.0}),
}
MAX_CHOICES = 6


def letter(index: int) -> str:
  """0 -> "A", 1 -> "B", ..."""
  return string.ascii_uppercase[index]


def format_choices(question: str, choices: tuple[str, ...]) -> str:
  """The question followed by "(A) ..." lines and a request for the letter."""
  lines = [question] + [f"({letter(i)}) {choice}" for i, choice in enumerate(choices)]
  return "\n".join(lines) + "\nAnswer with the letter of the correct choice."


def _value_text(value: float) -> str:
  return f"{value:g}"


@register("task", "commonsense_mc")
def commonsense_choice(rng: random.Random, level: int) -> Example:
  """One "which is the most/least X" question; the answer is the letter."""
  if level < 1:
    raise ValueError(f"commonsense_mc level must be >= 1, got {level}")
  attribute = rng.choice(sorted(ATTRIBUTE_TABLES))
  most, least, unit, table = ATTRIBUTE_TABLES[attribute]
  direction = rng.choice(("max", "min"))
  objects = rng.sample(sorted(table), min(level + 1, MAX_CHOICES, len(table)))
  pick = max if direction == "max" else min
  correct = pick(objects, key=table.__getitem__)
  choices = tuple(objects)  # rng.sample already returns them in random order.
  answer = letter(choices.index(correct))
  superlative = most if direction == "max" else least
  facts = "; ".join(f"{o} {unit.format(_value_text(table[o]))}" for o in choices)
  rationale = (f"{facts[0].upper()}{facts[1:]}. So the {superlative} is ({answer}) {correct}. "
               f"The answer is {answer}.")
  return Example(question=format_choices(f"Which of these is the {superlative}?", choices),
                 answer=answer, choices=choices, rationale=rationale,
                 meta={"level": level, "attribute": attribute, "direction": direction})
