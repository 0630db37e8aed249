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
rewrites notation math-verify reads wrongly (thin-space thousands
separators, `1.5e3`, `°`, unicode operators, trailing unit words).
math-verify's own `signal.alarm` timeouts are switched off: the worker's
soft deadline and the parent's hard kill bound the time instead.
"""
from __future__ import annotations

import functools
import re

import math_verify
from math_verify import ExprExtractionConfig, LatexExtractionConfig

_CONFIGS = (LatexExtractionConfig(), ExprExtractionConfig())
_UNICODE = {
    "\u2212": "-", "\u00d7": "\\times ", "\u00f7": "\\div ", "\u22c5": "\\cdot ",
    "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u2264": "\\le ", "\u2265": "\\ge ",
    "\u2260": "\\neq ", "\u221a": "\\sqrt", "\u00b0": "^\\circ", "\u2009": " ",
    "\u202f": " ", "\u00a0": " ",
}
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
# "5 dollars", "10 cm^2", "3\\text{ feet}." after a number: drop the unit.
_TRAILING_UNIT = re.compile(
    r"(?<=[\d}])\s*(?:\\(?:text|mbox|textnormal|textrm|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}"
    r"|[A-Za-z]{2,}(?:\s+[A-Za-z]{2,})*)(?:\^\{?[23]\}?)?\s*$")
_PERCENT_SIGN = re.compile(r"\\?%")
_MEMBERSHIP = re.compile(r"^[A-Za-z]\s*\\in\s*")
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[")  # Not \$, a dollar sign.


def _join_thousands(text: str) -> str:
  return _THOUSANDS.sub(lambda m: re.sub(r"\D", "", m.group(0)), text)


def normalise(answer: str) -> str:
  """Rewrites notation that the parser reads wrongly; pure string edits."""
  for old, new in _UNICODE.items():
    answer = answer.replace(old, new)
  answer = answer.strip().rstrip(".").strip()
  answer = _join_thousands(_NEGATIVE_SPACE.sub("", answer))
  answer = _SCIENTIFIC.sub(r"\1\\times 10^{\2}", answer)
  answer = _DEGREES.sub("^\\\\circ", answer)
  answer = _PERCENT_WORD.sub("\\\\%", answer)
  answer = _TRAILING_UNIT.sub("", answer)
  answer = _MEMBERSHIP.sub("", answer)
  return _LATEX_SPACING.sub(" ", answer).strip()


def _parse(text: str, whole: bool) -> list:
  """math-verify parse: as one boxed expression (whole) or by its heuristics."""
  source = "\\boxed{" + text + "}" if whole else text
  return math_verify.parse(source, extraction_config=_CONFIGS,
                           parsing_timeout=None)


def _has_value(parsed: list) -> bool:
  return any(not isinstance(p, str) for p in parsed)


@functools.lru_cache(maxsize=4096)
def candidates(text: str, anchored: bool) -> tuple:
  """Parsed forms of one extracted answer, best reading first.

  `anchored` answers (from \\boxed, `Answer:`, `####`, "the answer is") are
  read as one expression first. Unanchored text (the model's whole output)
  goes to math-verify's heuristics unless it is a short formula.
  """
  delimited = bool(_DELIMITED.search(text))
  if anchored and not delimited:
    order = (True, False)
  elif not anchored and not delimited and _looks_like_formula(text):
    order = (True, False)
  else:
    order = (False, True) if anchored else (False,)
  fallback = ()
  for whole in order:
    parsed = _parse(normalise(text) if whole else text, whole)
    if _has_value(parsed):
      return tuple(parsed)
    fallback = fallback or tuple(parsed)
  return fallback  # Unparsable: math-verify then compares the strings.


def _looks_like_formula(text: str) -> bool:
  """Short, one line, and no English words outside LaTeX commands."""
  if len(text) > 200 or "\n" in text.strip():
    return False
  bare = re.sub(r"\\[A-Za-z]+(\{[^{}]*\})?", " ", text)
  return len(re.findall(r"[A-Za-z]{3,}", bare)) <= 1


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
