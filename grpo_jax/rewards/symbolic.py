"""Symbolic answer comparison. Runs ONLY inside a verifier worker process.

Built on `math-verify` (Hugging Face, MIT), which parses LaTeX with
`latex2sympy2_extended` (an ANTLR grammar for LaTeX to sympy) and compares
the results. Why that and not `latex2sympy2_extended` alone or sympy's
`parse_latex`: the parser is only half of a verifier; math-verify adds the
comparison layer that RL rewards need and that we would otherwise rewrite
(sets vs tuples vs intervals, `x=3` vs `3`, relations and their flips,
matrices, percentages, floats against exact values at a fixed rounding, text
answers), it is maintained and used by TRL and open-r1, and its behaviour is
pinned by a large public regression suite. sympy's own `parse_latex` covers
less notation (no sets or intervals, no `\\pm`) and compares nothing.

What this module adds on top: it parses an answer that the parent already
cut out of the model's text (`extract.py`), first as one whole LaTeX
expression so that a hedge like "3 or 4" is a set and not "4", and it
rewrites notation math-verify reads wrongly (thin-space and `,\\!`
thousands separators, `1.5e3`, `°`, unicode operators, trailing unit words,
`\\varnothing`, mixed numbers `3 1/4`, `\\sqrt(3)`, lists of named solutions
`x_1 = 2, x_2 = -3`). A formula whose parse leaves digits out (`5\\sqrt(3)`
read as `5`) has no value: a part of an answer is not the answer. Numbers
are compared by `numeric.py` (exact for exact inputs, relative for floats),
installed in place of math-verify's absolute-tolerance comparison, and
parsed expressions pass through `numeric.tame` (huge powers made opaque,
`i` the imaginary unit) before any comparison.
math-verify's own `signal.alarm` timeouts are switched off: the worker's
soft deadline and the parent's hard kill bound the time instead.
"""
from __future__ import annotations

import collections
import functools
import re

import math_verify
import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, grader
from sympy import multiplicity

from grpo_jax.rewards import functions, numeric, unicode_math, units

_CONFIGS = (LatexExtractionConfig(), ExprExtractionConfig())
# Negated relations, read as their negation (`\\not=` is not `=`); a `\\not`
# left over is kept as a word, so that no parse can drop it.
_NEGATIONS = (
    (re.compile(r"\\not\s*=|\\not\s*\\equiv\b"), r"\\neq "),
    (re.compile(r"\\not\s*<|\\nless\b"), r"\\geq "),
    (re.compile(r"\\not\s*>|\\ngtr\b"), r"\\leq "),
    (re.compile(r"\\not\s*\\le(?:q|qslant)?\b|\\nleq(?:slant)?\b"), ">"),
    (re.compile(r"\\not\s*\\ge(?:q|qslant)?\b|\\ngeq(?:slant)?\b"), "<"),
    (re.compile(r"\\not\s*\\in\b"), r"\\notin "),
    (re.compile(r"\\not\b"), r"\\text{not}"),
)
# Wrappers that only present their content, and commands the parser knows
# under another name.
_WRAPPERS = (
    (re.compile(r"\\(?:color|colorbox)\s*\{[A-Za-z!0-9]*\}"), ""),
    (re.compile(r"\\textcolor\s*\{[A-Za-z!0-9]*\}"), ""),
    (re.compile(r"\\(?:underline|uline|mathbf|boldsymbol|bm|textbf|emph)\s*(?=\{)"), ""),
    (re.compile(r"\\[Bb]igg?[lrm]?\b|\\middle\b"), ""),
    (re.compile(r"\\lbrace\b"), r"\\{"), (re.compile(r"\\rbrace\b"), r"\\}"),
    (re.compile(r"\\lbrack\b"), "["), (re.compile(r"\\rbrack\b"), "]"),
    (re.compile(r"\\bmod\b"), r"\\mod "),
    (re.compile(r"\\(?:operatorname|mathrm|text|rm)\s*\{\s*(gcd|lcm|max|min|sin|cos|tan|log|ln|exp|det)\s*\}"),
     r"\\\1"),
    (re.compile(r"\{smallmatrix\}"), r"{matrix}"),
    (re.compile(r"\\(?:mathrm|text|operatorname|rm|mathit)\s*\{\s*([ei])\s*\}"), r"\1"),
    (re.compile(r"(?:\\text\s*\{\s*negative\s*\}|\bnegative\b)\s*(?=[\d.\\])"), "-"),
)
# Punctuation closing a math span ("$2^{10},$"): not part of the formula.
# A `!` glued to a number, a letter or a bracket is a factorial (`5!`, `(n+1)!`);
# after a power's closing brace (`2^{10}!`) it is punctuation.
_PUNCTUATION_IN_SPAN = re.compile(r"(?<![\\.])(?:[,;:?.]|(?<![\w)\]])!)(?=\$|\\\]|\\\))")
_FINAL_PUNCTUATION = re.compile(r"(?<!\\)(?:[.,;:?]|(?<![\w)\]])!)+$")
_SPACE = r"(?:(?<!\\)\\[,;: ]|~| )"  # Not ",": (100,200) is a pair.
# 1\,000\,000 -> 1000000: exactly three digits after every separator.
_THOUSANDS = re.compile(rf"(?<![\d.])\d{{1,3}}(?:{_SPACE}\d{{3}})+(?![\d])")
_SCIENTIFIC = re.compile(r"^(-?\d+(?:\.\d+)?)\s*[eE]\s*([+-]?\d+)$")
_NEGATIVE_SPACE = re.compile(r"(?<!\\)\\!")  # Joins: 1,\!000 and 1\!2 are one number.
# (?<!\\): "\\ " is a matrix row break followed by a space, not "\ ".
_LATEX_SPACING = re.compile(r"(?<!\\)\\[,;: ]|\\q?quad\b|~")
_DEGREES = re.compile(r"\\degree\b|\\text\{\s*degrees?\s*\}|\s+degrees?\b")
_PERCENT_WORD = re.compile(
    r"(?<=\d)\s*(?:\\text\{\s*)?(?:percent(?:age)?|pct)\b\}?")
_PERCENT_SIGN = re.compile(r"\\?%")
_MEMBERSHIP = re.compile(r"^[A-Za-z]\s*\\in\s*")
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[")  # Not \$, a dollar sign.
_SPACED_GROUP = re.compile(r",\s*\\!\s*(?=\d{3}(?!\d))")  # "11,\! 111" is 11111.
_EMPTY_SET = re.compile(r"\\varnothing\b|\\\{\s*\\\}")
# \sqrt(3) -> \sqrt{3}, \sqrt[3](5) -> \sqrt[3]{5}
_SQRT_PAREN = re.compile(r"\\sqrt\s*(\[[^\[\]]*\])?\s*\(([^()]*)\)")
# Mixed numbers: "3 1/4" and "3\frac{1}{4}" (a proper fraction of digits).
_MIXED = re.compile(
    r"(?<![\w^_.}\\])(\d+)(?:\s+(\d+)\s*/\s*(\d+)"
    r"|\s*\\[dt]?frac(?:\{(\d+)\}\{(\d+)\}|(\d)(\d)))(?![\d.])")
# "x_1 = 2, x_2 = -3" / "x = 2 or x = -3": one unknown's values, a list.
_LIST_SPLIT = re.compile(
    r"\s*(?:[,;]|\\text\{\s*(?:and|or)\s*\}|\b(?:and|or)\b)\s*"
    r"|\s+(?=[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\s*=)")
# "f(x) = x^2 + 1": the function's name is no part of the answer.
_FUNCTION_LHS = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*\(\s*[A-Za-z]\s*\)\s*=(?=[^=]*$)")
_NAMED = re.compile(r"([A-Za-z])(?:_\{?([A-Za-z0-9]+)\}?)?\s*=\s*([^=]+)")
_MAX_DIGITS_MIXED = 12
# A decimal longer than a float's repr is an exact statement: keep it exact
# (`12345678901234567.5` must not round to `12345678901234568`).
_LONG_DECIMAL = re.compile(r"(?<![\d.])(\d+)\.(\d+)(?![\d.])")
_FLOAT_DIGITS = 15  # E2: longer decimals are written as exact fractions before parsing.
_MAX_TAIL = 400  # Where a cut-off formula can start.


def _exact_long_decimal(match: re.Match[str]) -> str:
  whole, frac = match.groups()
  if len((whole + frac).lstrip("0")) <= _FLOAT_DIGITS:
    return match.group(0)
  return f"\\frac{{{(whole + frac).lstrip('0') or '0'}}}{{1{'0' * len(frac)}}}"


def _mixed_number(match: re.Match[str]) -> str:
  whole = match.group(1)
  num, den = next((match.group(i), match.group(i + 1)) for i in (2, 4, 6)
                  if match.group(i))
  if max(len(whole), len(num), len(den)) > _MAX_DIGITS_MIXED or not 0 < int(num) < int(den):
    return match.group(0)
  return f"\\frac{{{int(whole) * int(den) + int(num)}}}{{{den}}}"


def _named_values(answer: str) -> str:
  """`x_1 = 2, x_2 = -3` -> `2, -3` when every item names the same unknown
  (indexed or not); `x = 1, y = 2` keeps its names (they carry meaning)."""
  items = [item for item in _LIST_SPLIT.split(_LATEX_SPACING.sub(" ", answer).strip())
           if item.strip()]
  if len(items) < 2:
    return answer
  matches = [_NAMED.fullmatch(item.strip()) for item in items]
  if not all(matches) or len({m.group(1) for m in matches}) != 1:
    return answer
  indices = [m.group(2) for m in matches]
  if any(indices) and len(set(indices)) != len(indices):
    return answer
  if not any(indices) and len(matches) < 2:
    return answer
  return ", ".join(m.group(3).strip() for m in matches)


def safe_normalise(text: str) -> str:
  """Edits that are right anywhere, even in a whole solution: Unicode
  mathematics (`unicode_math`), digit groups (`12,\\!345`), the empty set,
  negated relations, presentation wrappers, punctuation closing a span."""
  text = unicode_math.normalise(text)
  for pattern, new in _NEGATIONS + _WRAPPERS:
    text = pattern.sub(new, text)
  text = _join_thousands(_NEGATIVE_SPACE.sub("", _SPACED_GROUP.sub(",", text)))
  text = _PUNCTUATION_IN_SPAN.sub("", text)
  return _EMPTY_SET.sub(r"\\emptyset ", text)


def _join_thousands(text: str) -> str:
  return _THOUSANDS.sub(lambda m: re.sub(r"\D", "", m.group(0)), text)


def normalise(answer: str) -> str:
  """Rewrites notation that the parser reads wrongly; pure string edits."""
  answer = _FINAL_PUNCTUATION.sub("", safe_normalise(answer).strip()).strip()
  answer = _SCIENTIFIC.sub(r"\1\\times 10^{\2}", answer)
  answer = _DEGREES.sub("^\\\\circ", answer)
  answer = _PERCENT_WORD.sub("\\\\%", answer)
  answer = units.strip_units(answer)
  answer = _MEMBERSHIP.sub("", answer)
  answer = _SQRT_PAREN.sub(lambda m: f"\\sqrt{m.group(1) or ''}{{{m.group(2)}}}", answer)
  answer = _MIXED.sub(_mixed_number, _LATEX_SPACING.sub(" ", answer))
  answer = _LONG_DECIMAL.sub(_exact_long_decimal, answer)
  answer = _named_values(_FUNCTION_LHS.sub("", answer))
  return _LATEX_SPACING.sub(" ", answer).strip()


def _parse(text: str, whole: bool) -> list:
  """math-verify parse: as one boxed expression (whole) or by its heuristics."""
  source = "\\boxed{" + text + "}" if whole else text
  return math_verify.parse(source, extraction_config=_CONFIGS,
                           parsing_timeout=None)


def _has_value(parsed: list) -> bool:
  return any(not isinstance(p, str) for p in parsed)


_COMMAND_NAME = re.compile(r"\\[A-Za-z]+")
# Words math-verify itself rewrites into symbols (`infinity` -> `\\infty`,
# `and` -> `,`) or drops as units: their letters need not reappear.
_REWRITTEN_WORDS = re.compile(
    r"\b(?:and|or|infinity|inf|percent(?:age)?|pct|sqrt|th)\b|\\mathrm\{th\}")


def _content(text: str) -> collections.Counter:
  """The digits and letters of `text` outside command names."""
  bare = _COMMAND_NAME.sub(" ", _REWRITTEN_WORDS.sub(" ", text))
  return collections.Counter(c for c in bare if c.isascii() and c.isalnum())


def _covers(parsed: list, text: str) -> bool:
  """False if the parse read only a part of a formula: digits or letters of
  `text` are missing from the matched string (`5\\sqrt(3)` read as `5`,
  `3\\text{ or more}` as `3`)."""
  matched = "".join(p for p in parsed if isinstance(p, str))
  return not _content(text) - _content(matched)


@functools.lru_cache(maxsize=4096)
def candidates(text: str, anchored: bool) -> tuple:
  """Parsed forms of one extracted answer, best reading first.

  `anchored` answers (from \\boxed, `Answer:`, `####`, "the answer is") are
  read as one expression first. Unanchored text (the model's whole output)
  goes to math-verify's heuristics unless it is a short formula. A formula
  that must be read whole and is read only in part gives no value.
  """
  if _truncated(text, anchored):
    return ()  # "So $x = 3\\sqrt{": the answer was cut off.
  if _UNREAD_NEGATION.search(text):
    return ()  # `x \\not\\approx 1`: a negation that no rewrite reads.
  if not anchored:
    span = _single_span(text)
    text = text if span is None else span
  delimited = bool(_DELIMITED.search(text))
  formula = _looks_like_formula(text)
  if anchored and not delimited:
    order = (True, False)
  elif not anchored and not delimited and formula:
    order = (True, False)
  else:
    order = (False, True) if anchored else (False,)
  fallback = ()
  for whole in order:
    source = normalise(text) if whole else safe_normalise(text)
    source = functions.read(source, _value_of) if whole else source
    parsed = _parse(source, whole)
    if _has_value(parsed) and (anchored or formula) and not _covers(parsed, source):
      continue  # A part of the answer: not its value.
    if _has_value(parsed):
      return tuple(_canonical(numeric.tame(p)) for p in parsed)
    fallback = fallback or tuple(parsed)
  return fallback  # Unparsable: math-verify then compares the strings.


def near(text: str, value, ulp) -> bool | None:
  """E2's rounding rule against the exact number `text` denotes: None when it
  is no plain number or a finite decimal, else |text - value| < ulp."""
  parsed = [p for p in candidates(text, True) if numeric.is_plain_number(p)]
  if not parsed:
    return None
  exact = parsed[0]
  if exact.is_Rational and exact.q == 2 ** multiplicity(2, exact.q) * 5 ** multiplicity(5, exact.q):
    return None
  diff = (exact - sympy.Rational(value.numerator, value.denominator)).evalf(60)
  return bool(diff.is_number and abs(diff) < sympy.Rational(ulp.numerator, ulp.denominator))


def _value_of(text: str):
  """The value of a small formula (a function's argument), or None."""
  parsed = _parse(normalise(text), True)
  values = [numeric.tame(p) for p in parsed if not isinstance(p, str)]
  return values[0] if values and _covers(parsed, normalise(text)) else None


def _canonical(expr):
  """Relations written with `>`/`\\ge` as `<`/`\\le` (`3 > x > 1` is `1 < x < 3`)."""
  if not isinstance(expr, sympy.Basic) or not expr.has(sympy.StrictGreaterThan, sympy.GreaterThan):
    return expr
  flips = {r: (sympy.StrictLessThan if isinstance(r, sympy.StrictGreaterThan) else sympy.LessThan)(
      r.rhs, r.lhs, evaluate=False)
           for r in expr.atoms(sympy.StrictGreaterThan, sympy.GreaterThan)}
  try:
    return expr.xreplace(flips)
  except Exception:  # pylint: disable=broad-except
    return expr


_UNREAD_NEGATION = re.compile(r"\\not(?!in\b)(?!\s*(?:=|<|>|\\equiv\b|\\[lg]e(?:q|qslant)?\b|\\in\b))")
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_SPAN = re.compile(r"\s*(?:\$\$(?P<a>[^$]+)\$\$|\$(?P<b>[^$]+)\$|\\\[(?P<c>.+?)\\\]|\\\((?P<d>.+?)\\\))\s*[.,;:?!]?\s*",
                   re.DOTALL)


def _opens_more(text: str) -> bool:
  return text.count("{") > text.count("}")


def _truncated(text: str, anchored: bool) -> bool:
  """The answer ends inside a formula: it opens more braces than it closes
  (an anchored answer, or a whole text's last line), or an unclosed `$`,
  `\\[` or `\\(` near the end of a whole text does."""
  if anchored:
    return _opens_more(text)
  tail, opens = text[-_MAX_TAIL:], []
  if _opens_more(tail.rstrip().rsplit("\n", 1)[-1]):
    return True
  if len(_UNESCAPED_DOLLAR.findall(text)) % 2:
    opens.append(tail.rfind("$"))
  for open_, close in (("\\[", "\\]"), ("\\(", "\\)")):
    at = tail.rfind(open_)
    if at >= 0 and close not in tail[at:]:
      opens.append(at)
  return any(at >= 0 and _opens_more(tail[at:]) for at in opens)


def _single_span(text: str) -> str | None:
  """The formula of a text that is one math span (`$2^{10},$` -> `2^{10}`)."""
  match = _SPAN.fullmatch(text) if len(text) <= 400 else None
  if match is None:
    return None
  return next(g for g in match.groups() if g is not None).strip()


def _looks_like_formula(text: str) -> bool:
  """Short, one line, and no English words outside LaTeX commands."""
  if len(text) > 200 or "\n" in text.strip():
    return False
  bare = re.sub(r"\\[A-Za-z]+(\{[^{}]*\})?", " ", text)
  return len(re.findall(r"[A-Za-z]{3,}", bare)) <= 1


def _numeric_eq(a, b, float_rounding: int, numeric_precision: int) -> bool:
  """math-verify's number comparison, exact/relative where both are plain
  numbers (`numeric.numbers_equal`), its own otherwise (matrices recurse
  into this, percentages keep their rules)."""
  verdict = numeric.numbers_equal(a, b)
  if verdict is None:
    return _MATH_VERIFY_NUMERIC_EQ(a, b, float_rounding, numeric_precision)
  return verdict


# Installed once per worker process; math-verify is pinned (requirements.txt),
# and tests/test_verifier_classes.py checks that the hook is still called.
_MATH_VERIFY_NUMERIC_EQ = grader.sympy_numeric_eq
grader.sympy_numeric_eq = _numeric_eq


def _same(gold: str, gold_anchored: bool, prediction: str,
          pred_anchored: bool) -> bool:
  gold_parsed = candidates(gold, gold_anchored)
  pred_parsed = candidates(prediction, pred_anchored)
  if not gold_parsed or not pred_parsed:
    return False
  return bool(math_verify.verify(
      list(gold_parsed), list(pred_parsed), float_rounding=6,
      numeric_precision=15, strict=True, allow_set_relation_comp=True,
      timeout_seconds=None))


def _without_percent(text: str) -> str:
  return _PERCENT_SIGN.sub("", text)


def equivalent(gold: str, gold_anchored: bool, prediction: str,
               pred_anchored: bool) -> bool:
  """True if the two extracted answers denote the same mathematical object.

  A percentage p% also matches the bare p (math-verify already matches it
  to p/100, and to p for integers only).
  """
  if _same(gold, gold_anchored, prediction, pred_anchored):
    return True
  gold_bare, pred_bare = _without_percent(gold), _without_percent(prediction)
  if (gold_bare, pred_bare) == (gold, prediction):
    return False
  return _same(gold_bare, gold_anchored, pred_bare, pred_anchored)
