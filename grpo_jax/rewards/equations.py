"""Written arithmetic "a op b = c": where a text states one, and whether it holds.

One definition for its two readers: the "equations" process reward
(`grpo_jax/rewards/process.py`, each equation is a step rewarded 1 if it
holds) and STaR's rationale check (`arithmetic_holds` below, used by
`grpo_jax/star/collect.py`: every equation of a kept rationale must hold).
"""
from __future__ import annotations

import fractions
import re

# "a op b = c" standing alone (op: + - * / x ×; a, b, c integers or
# decimals, c may be negative): not preceded by a number or an operator, c
# not followed by one, so a chain such as "2 + 3 * 4 = 14" is not read as
# "3 * 4 = 14" (it is not read at all).
EQUATION = re.compile(
    r"(?<![\d.\-+*/\u00d7])(?<![\-+*/\u00d7] )(\d+(?:\.\d+)?)\s*"
    r"([-+*/x\u00d7])\s*(\d+(?:\.\d+)?)\s*=\s*(-?\d+(?:\.\d+)?)"
    r"(?!\.?\d|\s*[-+*/x\u00d7]\s*\d)")


def equation_holds(a: str, op: str, b: str, c: str) -> bool:
  """Exact rational arithmetic; a c written with decimals may be rounded to
  them ("10 / 3 = 3.33" holds, "10 / 3 = 3.4" does not); x / 0 never holds."""
  x, y = fractions.Fraction(a), fractions.Fraction(b)
  if op == "/" and y == 0:
    return False
  value = {"+": x + y, "-": x - y, "/": x / y}.get(op, x * y)
  decimals = len(c.partition(".")[2])
  tolerance = fractions.Fraction(1, 2 * 10 ** decimals) if decimals else 0
  return abs(value - fractions.Fraction(c)) <= tolerance


def checked_equations(text: str) -> list[tuple[int, bool]]:
  """(character offset just past c, whether it holds) for each stand-alone
  equation of `text`, in order."""
  return [(m.end(), equation_holds(*m.groups()))
          for m in EQUATION.finditer(text)]


def arithmetic_holds(text: str) -> bool:
  """Whether every stand-alone "a op b = c" in `text` holds (STaR's
  rationale check). A hint can pull the hinted number into a false equation
  ("23 + 4 = 19. The answer is 19."): the answer is then asserted, not
  derived."""
  return all(ok for _, ok in checked_equations(text))
