"""Named functions the parser does not read, evaluated on their argument.

Runs ONLY inside a verifier worker. `\\operatorname{sgn}(-3)`, `\\Re(3+4i)`,
`\\operatorname{Im}(...)` and the complex conjugate `\\overline{3+4i}` are
parsed by math-verify as unknown symbols (or not at all), so a right answer
written with them was rejected. Here the argument is parsed on its own, the
function is applied by sympy, and the call is replaced by the LaTeX of the
result: `\\operatorname{sgn}(-3)` -> `(-1)`. A call whose argument has no
value, or whose result is not a number, is left as it is (and then fails
to parse, as before).
"""
from __future__ import annotations

import re
from typing import Callable

import sympy

_NAMES = {"sgn": sympy.sign, "sign": sympy.sign, "Re": sympy.re, "Im": sympy.im}
_CALL = re.compile(
    r"\\(?:operatorname|mathrm|text|rm)\s*\{\s*(sgn|sign|Re|Im)\s*\}\s*(?=[({])"
    r"|\\(sgn|Re|Im)\b\s*(?=[({])|\\(overline|bar)\s*(?=\{)")
_MAX_CALLS = 4
_MAX_ARG = 200


def _argument(text: str, start: int) -> tuple[str, int] | None:
  """The bracketed argument at `start` and the index after it."""
  open_ = text[start]
  close = ")" if open_ == "(" else "}"
  depth = 0
  for i in range(start, min(len(text), start + _MAX_ARG)):
    depth += (text[i] == open_) - (text[i] == close)
    if depth == 0:
      return text[start + 1:i], i + 1
  return None


def _apply(name: str, value) -> sympy.Expr | None:
  if name in ("overline", "bar"):
    if not value.has(sympy.I):
      return None  # `\overline{AB}`, `0.\overline{3}`: not a conjugate.
    return sympy.conjugate(value)
  return _NAMES[name](value)


def _evaluated(name: str, argument: str, value_of: Callable[[str], object]) -> str | None:
  """The LaTeX of `name(argument)` if it is a number, else None."""
  try:
    value = value_of(argument)
    if not isinstance(value, sympy.Expr) or not value.is_number:
      return None
    result = _apply(name, value)
    result = None if result is None else sympy.simplify(result)
    return sympy.latex(result) if result is not None and result.is_number else None
  except Exception:  # pylint: disable=broad-except
    return None  # Left unread: the call then fails to parse, as before.


def read(text: str, value_of: Callable[[str], object]) -> str:
  """`text` with each call of a listed function replaced by its value."""
  if "\\" not in text:
    return text
  for _ in range(_MAX_CALLS):
    changed = False
    for match in _CALL.finditer(text):
      name = next(g for g in match.groups() if g)
      found = _argument(text, match.end())
      if found is None:
        continue
      argument, end = found
      latex = _evaluated(name, argument, value_of)
      if latex is None:
        continue
      text = f"{text[:match.start()]}\\left({latex}\\right){text[end:]}"
      changed = True
      break
    if not changed:
      return text
  return text
