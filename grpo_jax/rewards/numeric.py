"""Comparing numbers exactly, and floats relatively. Runs ONLY in a worker.

math-verify compares two numbers by rounding both to 6 decimal places, or by
`(a - b).evalf(chop=True) == 0`, which chops any difference below ~1e-15 to
zero. Both are absolute tolerances: `3e-9` equals `5e-9`, `2^{-80}` equals
`2^{-79}`, and `1/(50!)` equals `1/(52!)`. Here (docs/verifier.md, E1-E3):

  * every written decimal is the exact rational it writes (`tame` turns the
    parser's floats back into them: `2.0000001` is not 2);
  * two exact numbers are equal only if their difference is exactly zero,
    or, for irrational values that sympy does not cancel, zero to 50
    significant digits relative to their size;
  * a relative tolerance (`close`) only between two values that both still
    hold a float after `tame` (E3: both inexact).
E2's one rounding rule (a precise decimal against 1/3 or pi) is decided
before parsing, in `contract.py`.

`tame` first replaces numbers too large to compute (`3^{3^{50}}`, `(10^6)!`)
by opaque positive symbols, one per distinct expression, so that exact
cancellation (`3^{3^{50}} - 3^{3^{50}} = 0`) is decided without computing
them; it also reads a free `i` as the imaginary unit (`e^{i\\pi} = -1`).
"""
from __future__ import annotations

import math

import sympy
from sympy import Basic, Float, Pow, Symbol, UnevaluatedExpr, factorial

SMALL_REL_TOL = 2e-6  # Below 1: six significant digits.
BINARY_REL_TOL = 1e-12  # Above 1: only a binary float's own rounding ...
ROUNDED_ABS_TOL = 1e-6  # ... or math-verify's "equal to 6 decimals", and
ROUNDED_REL_TOL = 1e-4  # that only where it is not most of the value,
ROUNDED_MIN_SIZE = 1e-2  # nor for values written in scientific notation.
_EXACT_DIGITS = 50
_MAX_POWER_BITS = 1_000_000
_MAX_FACTORIAL = 20_000


def _log2_abs(value: Basic) -> float:
  """log2 |value| from a 15-digit evaluation; inf if it overflows."""
  try:
    number = abs(complex(value.evalf(15)))
  except (OverflowError, TypeError, ValueError):
    return math.inf
  return math.log2(number) if number > 0 else -math.inf


def _is_huge(node: Basic) -> bool:
  """A power or factorial whose exact value would take too long to compute."""
  if isinstance(node, Pow) and node.is_number:
    base, exponent = node.args
    base_bits = abs(_log2_abs(base))
    if base_bits == 0 or math.isinf(base_bits):  # A huge base is made opaque inside.
      return False
    return _log2_abs(exponent) + math.log2(base_bits) > math.log2(_MAX_POWER_BITS)
  if isinstance(node, factorial) and node.args[0].is_number:
    return _log2_abs(node.args[0]) > math.log2(_MAX_FACTORIAL)
  return False


def _replacements(expr: Basic, found: dict) -> None:
  """Collects huge sub-expressions (outermost first, not inside them)."""
  if _is_huge(expr):
    found[expr] = Symbol(f"<{expr}>", positive=True)
    return
  for arg in expr.args:
    if isinstance(arg, Basic):
      _replacements(arg, found)


def _exact_decimals(expr: Basic) -> dict:
  """E2: every written decimal (a Float from the parser) as the exact rational
  it writes: `Float('2.0000001')` -> 20000001/10000000."""
  out = {}
  for value in expr.atoms(Float):
    try:
      out[value] = sympy.Rational(str(value))
    except (TypeError, ValueError):
      pass
  return out


def tame(expr):
  """`expr` with huge numbers made opaque and a free `i` read as I."""
  if not isinstance(expr, Basic):
    return expr
  found: dict = {}
  _replacements(expr, found)
  found.update(_exact_decimals(expr))
  found.update({s: sympy.I for s in expr.free_symbols
                if isinstance(s, Symbol) and s.name == "i"})
  if not found:
    return expr
  try:
    return expr.xreplace(found)
  except Exception:  # pylint: disable=broad-except
    return expr


def is_plain_number(expr) -> bool:
  """A finite scalar with no symbols, not a percentage (math-verify's
  percentages carry an UnevaluatedExpr(1/100) factor)."""
  return (isinstance(expr, sympy.Expr) and not isinstance(expr, sympy.MatrixBase)
          and expr.is_number and not expr.has(UnevaluatedExpr)
          and not expr.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan))


def exact_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
  """Two exact numbers: zero difference, or zero to 50 digits of their size."""
  diff = a.doit() - b.doit()
  if diff == 0:
    return True
  if diff.is_Rational:
    return False
  value = diff.evalf(_EXACT_DIGITS)
  if not value.is_number:
    return False
  scale = max(abs(a.evalf(20)), abs(b.evalf(20)), 1)
  return bool(abs(value) <= scale * sympy.Rational(10) ** (10 - _EXACT_DIGITS))


def close(a: sympy.Expr, b: sympy.Expr) -> bool:
  """A float against a number: relative tolerance (see the module doc)."""
  va, vb = a.evalf(30), b.evalf(30)
  if not (va.is_number and vb.is_number):
    return False
  diff, size = abs(va - vb), max(abs(va), abs(vb))
  if size == 0:
    return True
  rel_tol = SMALL_REL_TOL if size < 1 else BINARY_REL_TOL
  if diff <= rel_tol * size:
    return True
  return bool(size >= ROUNDED_MIN_SIZE and diff <= ROUNDED_ABS_TOL
              and diff <= ROUNDED_REL_TOL * size)


def numbers_equal(a, b) -> bool | None:
  """Equality of two plain numbers; None if either is not one. Decimals are
  exact (E2, `tame`); a relative tolerance only between two inexact values,
  both still holding a float (E3)."""
  if not (is_plain_number(a) and is_plain_number(b)):
    return None
  if a.has(Float) and b.has(Float):
    return close(a, b)
  return exact_equal(tame(a), tame(b))
