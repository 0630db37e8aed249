"""Plain notations read as the numbers they write (docs/verifier.md, E4, E6, E7).

Pure string rewrites on an extracted answer (a few hundred characters at most),
applied in the verifier worker before any parsing. `rewrite` returns None for
an answer that is unreadable by contract: a `%` that is not its final token,
or a numeral with digits that its base subscript does not have.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

_MAX_DOUBLE_FACTORIAL = 300
# E6: `101_2`, `(1A)_{16}`, `FF_{16}`: a numeral (a digit, or capital letters
# in a base above 10) with a base subscript.
_BASE = re.compile(
    r"(?<![\w\\.])\(?([0-9A-Za-z]*[0-9][0-9A-Za-z]*|[A-Z]{2,})\)?_\{?(\d{1,2})\}?(?![\w.])")
_PREFIXED = re.compile(r"(?<![\w.])0([xXbBoO])([0-9A-Fa-f]+)(?![\w.])")
_PREFIX_BASE = {"x": 16, "b": 2, "o": 8}
_DOUBLE_FACTORIAL = re.compile(r"(?<![\w.])(\d{1,4})!!")
# E7: `0.\overline{3}`, `0.1\overline{6}`, `2.\overline{142857}`.
_REPEATING = re.compile(r"(?<![\d.])(\d*)\.(\d*)\\overline\s*\{\s*(\d+)\s*\}")
_SIUNITX = re.compile(r"\\(?:SI|qty)\s*\{([^{}]*)\}\s*\{[^{}]*\}|\\num\s*\{([^{}]*)\}")
# E4: the answer's final token may be a percent sign.
_FINAL_PERCENT = re.compile(r"\s*\\?%\s*\$?\s*$")
# E7: "(C) 12", "C) 12", "C: 12", "\text{(C)} 12": a choice letter with its value.
_CHOICE = re.compile(
    r"^\s*(?:\\text(?:bf)?\s*\{\s*)?\(?([A-E])\)\}?\s*[:.]?\s*(.+)$|^\s*([A-E])\s*[:.]\s+(.+)$",
    re.DOTALL)
_LETTER = re.compile(r"^\s*(?:\\text(?:bf)?\s*\{\s*)?\(?\s*([A-E])\s*\)?\s*\}?\s*$")


class Unreadable(ValueError):
  """An answer the contract gives no value."""


def _in_base(match: re.Match[str]) -> str:
  numeral, base = match.group(1), int(match.group(2))
  if not 2 <= base <= 36 or (numeral.isalpha() and base <= 10):  # `AB_2`: indices.
    return match.group(0)
  try:
    return str(int(numeral, base))
  except ValueError as error:
    raise Unreadable(f"{numeral} is not a base-{base} numeral") from error


def _prefixed(match: re.Match[str]) -> str:
  try:
    return str(int(match.group(2), _PREFIX_BASE[match.group(1).lower()]))
  except ValueError as error:
    raise Unreadable(match.group(0)) from error


def _double_factorial(match: re.Match[str]) -> str:
  n = int(match.group(1))
  if n > _MAX_DOUBLE_FACTORIAL:
    raise Unreadable("double factorial too large")
  return str(math.prod(range(n, 0, -2)))


def _repeating(match: re.Match[str]) -> str:
  whole, fixed, period = match.groups()
  value = Fraction(int(whole or "0")) + Fraction(int(fixed or "0"), 10 ** len(fixed))
  value += Fraction(int(period), 10 ** len(fixed) * (10 ** len(period) - 1))
  return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def check_percent(answer: str) -> None:
  """E4: a `%` only as the final token."""
  if "%" in _FINAL_PERCENT.sub("", answer):
    raise Unreadable("a percent sign that is not the final token")


def rewrite(answer: str) -> str | None:
  """The answer with E6/E7 notations replaced by plain numbers; None if the
  contract gives it no value."""
  try:
    check_percent(answer)
    answer = _SIUNITX.sub(lambda m: m.group(1) if m.group(1) is not None else m.group(2), answer)
    answer = _REPEATING.sub(_repeating, answer)
    answer = _PREFIXED.sub(_prefixed, answer)
    answer = _BASE.sub(_in_base, answer)
    return _DOUBLE_FACTORIAL.sub(_double_factorial, answer)
  except Unreadable:
    return None


def choice_letter(answer: str) -> str | None:
  """"C", "(C)", "\\text{(C)}" -> "C"; None if the answer is no lone letter."""
  match = _LETTER.match(answer)
  return match.group(1) if match else None


def split_choice(answer: str) -> tuple[str, str] | None:
  """E7: "(C) 12" -> ("C", "12"); None if the answer is not a letter with a value."""
  match = _CHOICE.match(answer)
  if match is None:
    return None
  letter, value = (match.group(1), match.group(2)) if match.group(1) else match.group(3, 4)
  return letter, value.strip()
