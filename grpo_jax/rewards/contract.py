"""The whole `math` decision for one (gold, completion) pair. Runs ONLY in a worker.

`decide` is the worker task "decide" (`_worker.TASKS`): the trainer sends the
two texts and reads back a bool, so extraction, the fast path and sympy all run
off the trainer's thread, under the pool's hard time-out (docs/verifier.md,
"The answer contract" A1-A8 and "The equivalence contract" E1-E8):

  1. the gold's answer (`extract.extract_answer`) and every final answer the
     completion states (`extract.stated_answers`, A5): all must be equal;
  2. E4/E6/E7 notation (`notation.rewrite`); a multiple-choice letter;
  3. the fast path: equal after light normalisation, or two plain numbers
     compared exactly (E1, E2 with its one rounding rule);
  4. E5: an equation only as an assignment;
  5. otherwise `symbolic.equivalent` (math-verify, exact numbers).
"""
from __future__ import annotations

import fractions
import re
from typing import NamedTuple

from grpo_jax.rewards import extract, notation, symbolic

MAX_ANSWER_CHARS = 1000
MIN_ROUNDED_DIGITS = 6  # E2: a decimal this precise may stand for 1/3 or pi.
_PLAIN_NUMBER = re.compile(
    r"(?P<sign>[-+]?)(?:(?P<decimal>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)"
    r"|(?P<p>\d+)/(?P<q>[1-9]\d*)|\\frac\{(?P<fp>\d+)\}\{(?P<fq>[1-9]\d*)\})")
# A decimal in plain or scientific notation: `3.33333e-9`, `1.5\times 10^{20}`.
_DECIMAL = re.compile(
    r"(?P<sign>[-+]?)(?P<int>\d+)(?:\.(?P<frac>\d+))?"
    r"(?:\s*(?:[eE]|\\(?:times|cdot)\s*10\s*\^)\s*\{?(?P<exp>[-+]?\d{1,4})\}?)?")
_MAX_PLAIN_CHARS = 100
_MAX_BARE_CHARS = 200  # A8: a completion with no anchor is read only if this short.
# E5: one unknown alone on a side: `x`, `x_1`, `\theta`, `f(x)`, `a_{n}`.
_ONE_UNKNOWN = (r"(?:[A-Za-z]|\\(?!pi\b|infty\b)[a-z]+)(?:_\{?[A-Za-z0-9]+\}?)?'*"
                r"(?:\s*\(\s*[A-Za-z]\s*\))?")
# ... or a tuple of them: `(x, y) = (1, 2)`.
_UNKNOWN = re.compile(rf"{_ONE_UNKNOWN}|\(\s*{_ONE_UNKNOWN}(?:\s*,\s*{_ONE_UNKNOWN})+\s*\)")
_TEXT_LIST_WORD = re.compile(r"\\text\{\s*(?:and|or)\s*\}")
_LIST_WORD = re.compile(r"[,;]|\\q?quad\b|\\text\{\s*(?:and|or)\s*\}|\b(?:and|or)\b")


def _plain_value(text: str) -> fractions.Fraction | None:
  match = _PLAIN_NUMBER.fullmatch(text) if len(text) <= _MAX_PLAIN_CHARS else None
  if match is None:
    return None
  if match["decimal"]:
    value = fractions.Fraction(match["decimal"].replace(",", ""))
  else:
    value = fractions.Fraction(int(match["p"] or match["fp"]), int(match["q"] or match["fq"]))
  return -value if match["sign"] == "-" else value


def decimal_ulp(text: str) -> tuple[fractions.Fraction, fractions.Fraction] | None:
  """E2: (value, one unit of its last written digit) of a decimal with at
  least `MIN_ROUNDED_DIGITS` significant digits; None for anything else."""
  match = _DECIMAL.fullmatch(text) if len(text) <= _MAX_PLAIN_CHARS else None
  if match is None or match["frac"] is None:
    return None
  digits = (match["int"] + match["frac"]).lstrip("0")
  if len(digits) < MIN_ROUNDED_DIGITS:
    return None
  scale = fractions.Fraction(10) ** int(match["exp"] or 0)
  ulp = scale / 10 ** len(match["frac"])
  value = fractions.Fraction(f"{match['int']}.{match['frac']}") * scale
  return (-value if match["sign"] == "-" else value), ulp


def _finite_decimal(value: fractions.Fraction) -> bool:
  q = value.denominator
  for p in (2, 5):
    while q % p == 0:
      q //= p
  return q == 1


def rounded_verdict(a: str, b: str) -> bool | None:
  """E2's one rounding rule, where one side is a precise decimal and the
  other an exact number that no finite decimal writes (1/3, sqrt 2, pi):
  equal when they differ by less than one unit of the decimal's last digit."""
  for decimal, other in ((a, b), (b, a)):
    found = decimal_ulp(decimal)
    if found is None:
      continue
    exact = _plain_value(other)
    if exact is not None:
      return None if _finite_decimal(exact) else abs(exact - found[0]) < found[1]
    return symbolic.near(other, found[0], found[1])
  return None


def _plain_verdict(gold: str, prediction: str) -> bool | None:
  """E1/E2 in plain numbers: exactly equal, or the rounding rule; else not."""
  gold_value, pred_value = _plain_value(gold), _plain_value(prediction)
  if gold_value is None or pred_value is None:
    return None
  if gold_value == pred_value:
    return True
  return bool(rounded_verdict(gold, prediction))


def _top_level_sides(text: str) -> list[str]:
  """`x = 2 + 3 = 5` -> ["x", "2 + 3", "5"]: split at `=` outside brackets."""
  sides, depth, start = [], 0, 0
  for i, char in enumerate(text):
    if char in "{([":
      depth += 1
    elif char in "})]":
      depth -= 1
    elif (char == "=" and depth == 0 and text[i - 1:i] not in ("<", ">", "!", "=")
          and text[i + 1:i + 2] != "=" and not text[max(0, i - 6):i].rstrip().endswith("\\not")):
      sides.append(text[start:i])
      start = i + 1
  sides.append(text[start:])
  return [side.strip().rstrip(":").strip() for side in sides]


def _top_level(text: str) -> str:
  """`text` without what brackets hold: `(x, y) = (1, 2)` has no top-level comma."""
  out, depth = [], 0
  for char in text:
    depth += char in "{(["
    if depth == 0:
      out.append(char)
    depth -= char in "})]" and depth > 0
  return "".join(out)


def _assignment(text: str) -> tuple[str, list[str]] | None:
  """E5: the unknown and the value sides of an assignment (`x = 2+3 = 5` ->
  ("x", ["2+3", "5"])), ("", []) for an equation with no lone unknown, None
  for a text with no `=` (or a list of named values, which `symbolic` reads)."""
  sides = _top_level_sides(text)
  listed = _LIST_WORD.search(_top_level(text)) or _TEXT_LIST_WORD.search(text)
  if len(sides) < 2 or (len(sides) > 2 and listed):
    return None
  if _UNKNOWN.fullmatch(sides[0]):
    return re.sub(r"\s", "", sides[0]), sides[1:]
  if _UNKNOWN.fullmatch(sides[-1]):
    return re.sub(r"\s", "", sides[-1]), sides[:-1]
  return "", []


def _values_equal(gold: extract.Answer, prediction: str, anchored: bool) -> bool:
  """E1-E4, E6-E8 on two answers with no equation left to read."""
  gold_light, pred_light = extract.light_normalise(gold.text), extract.light_normalise(prediction)
  if gold_light == pred_light:
    return True
  verdict = _plain_verdict(gold_light, pred_light)
  if verdict is None:
    verdict = rounded_verdict(gold_light, pred_light)
  if verdict is not None:
    return verdict
  return symbolic.equivalent(gold.text, gold.anchored, prediction, anchored)


def _equal(gold: Gold, answer: extract.Answer) -> bool:
  """One stated answer against the gold's answer (both extracted)."""
  text = extract.collapse_parens(answer.text)
  if not text or (answer.anchored and len(text) > max(MAX_ANSWER_CHARS, 4 * len(gold.answer.text))):
    return False
  if answer.anchored and extract.looks_like_program(text):
    return False  # Text is never code: `(lambda: 7)()` earns nothing.
  if not answer.anchored and (len(text) > _MAX_BARE_CHARS or "\n" in text):
    return False  # A8: only a short one-line text is read whole.
  text = notation.rewrite(text)
  if text is None:
    return False
  letter, choice = notation.choice_letter(gold.answer.text), notation.split_choice(text)
  if choice is not None:  # E7: "(C) 12" is C for a letter gold, else 12.
    return choice[0] == letter if letter else _equal(gold, answer._replace(text=choice[1]))
  if gold.equation and len(_top_level_sides(text)) < 2:
    return False  # E5: only an equation equals a gold equation (`3` is not `x + y = 3`).
  found = _assignment(text) if not gold.equation else None
  if found is not None:
    unknown, values = found
    if gold.unknown and unknown != gold.unknown:
      return False  # `y = 3` does not answer `x = 3`.
    return bool(values) and all(_values_equal(gold.answer, v, answer.anchored) for v in values)
  return _values_equal(gold.answer, text, answer.anchored)


class Gold(NamedTuple):
  """The gold's answer; an assignment gold `x = 5` is the value 5 with its
  unknown; `equation` marks a gold equation with no lone unknown."""
  answer: extract.Answer
  unknown: str = ""
  equation: bool = False


def _gold_answer(gold: str) -> Gold | None:
  answer = extract.extract_answer(gold)
  text = notation.rewrite(extract.collapse_parens(answer.text)) if answer.text else None
  if not text:
    return None
  found = _assignment(text)
  if found is None:
    return Gold(answer._replace(text=text))
  unknown, values = found
  if unknown and len(values) == 1:
    return Gold(answer._replace(text=values[0]), unknown)
  return Gold(answer._replace(text=text), equation=True)


def decide(gold: str, prediction: str) -> bool:
  """True if every final answer `prediction` states equals `gold`'s answer."""
  gold_answer = _gold_answer(gold)
  if gold_answer is None:
    return False
  if len(prediction) <= 200 and "\n" not in prediction and extract.looks_like_program(prediction):
    return False
  answers = extract.stated_answers(prediction)
  return bool(answers) and all(_equal(gold_answer, a) for a in answers)
