"""The final statement of an unboxed solution, and program text. Pure string code.

Runs inside a verifier worker (`contract.py`) on spans that `extract.py`
already bounded: a line is at most `MAX_STATEMENT_CHARS` characters before
any regex here reads it, so every scan is linear in a few hundred characters.
"""
from __future__ import annotations

import re

from grpo_jax.rewards import units

TAIL_CHARS = 2000  # Unanchored text: only the end can hold the answer.
# A sentence ends at ". " or a final ".", not at the point of "3.5".
_SENTENCE_END = re.compile(r"(?<!\d)\.(?=\s|$)|\.(?=\s+[A-Z])")


# Where a stated answer gives way to a rejected value or an aside: "12, not
# 15", "12 rather than 15", "12 instead of 15", "12 (I first thought 20)" (a
# parenthesis opening words, not a tuple or a factor).
# (?<=\S) and one quantifier per run of spaces keep these linear.
_CORRECTION = re.compile(
    r"(?<=\S)(?:\s*,\s*|\s+)(?:not|rather\s+than|instead\s+of|but)\b"
    r"|(?<=\S)\s*\((?=\s*(?:[A-Za-z]+\s+[A-Za-z]|[A-Za-z]{2,}\s*\)|(?:not|or|I)\b))",
    re.IGNORECASE)
_NOT_BUT = re.compile(r"(?:not|never)\b[^.]{0,80}?\bbut\s+(?:rather\s+)?", re.IGNORECASE)


def first_sentence(span: str) -> str:
  """"$28\\%$. I hope it is correct." -> "$28\\%$"; "12 apples, not 15" -> "12
  apples": an answer span ends where a correction or an aside starts."""
  span = span[:MAX_STATEMENT_CHARS]
  match = _SENTENCE_END.search(span)
  span = span[:match.start()] if match else span
  corrected = _NOT_BUT.match(span)  # "not 12 but 15": the 15.
  span = span[corrected.end():] if corrected else span
  return _CORRECTION.split(span, maxsplit=1)[0]


# ------------------------------------------------------------ final statement
_FINAL_LINES = 3
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z_^])[A-Za-z]{2,}")
_MATH_SPAN = re.compile(r"\$\$[^$]+\$\$|\$[^$]+\$|\\\[.+?\\\]|\\\(.+?\\\)")
_VERB = re.compile(
    r"(?:\b(?:is|are|was|were|equals|be|becomes|gives|get|gets|got|obtain)\b|=|:)")
_NUMBER = re.compile(
    r"(?<![A-Za-z\d])-?\d(?:[\d,]*\d)?(?:\.\d+)?(?:\s*/\s*\d+)?(?![A-Za-z\d])")
MAX_STATEMENT_CHARS = 400
NEGATED = re.compile(r"(?:not|never|no)\b", re.IGNORECASE)
_GLUED_UNIT = re.compile(r"(-?\d[\d,]*(?:\.\d+)?)\s*(?:[A-Za-z]{1,3}[\u00b2\u00b3]|[\u20ac\u00a3\u00a5])")
_COMMAND = re.compile(r"\\(?:begin|end)\{[^{}]*\}|\\[A-Za-z]+")
# A number, then prose only (no digit, no math): "24 ways to arrange them".
_NUMBER_THEN_WORDS = re.compile(r"(-?\d[\d,]*(?:\.\d+)?)\s+([A-Za-z]+)(?![A-Za-z])[\sA-Za-z',-]*")
# Where a stated answer ends: a period, or a restatement ("0.4 (or 2/5)",
# "2/5, or 40%").
_TAIL_END = re.compile(r"\.\s|(?<=\S)\s\((?!\s*\d)|,\s+or\b|,\s+which\b"
                       r"|(?<=\S)(?:,\s*|\s+)(?:not|rather\s+than|instead\s+of)\b")


def _sentences(line: str) -> list[str]:
  out, start = [], 0
  for match in _SENTENCE_END.finditer(line):
    out.append(line[start:match.start()])
    start = match.end()
  out.append(line[start:])
  return [s for s in out if s.strip()]


def is_statement(sentence: str) -> bool:
  """Prose holding a number or formula: two words outside math, and a digit
  or a math span (a bare formula is left to the parser)."""
  bare = _COMMAND.sub(" ", _MATH_SPAN.sub(" ", sentence))
  words = [w for w in _PROSE_WORD.findall(bare) if w.lower() not in ("and", "or")]
  return (len(words) >= 2
          and (any(c.isdigit() for c in sentence) or _MATH_SPAN.search(sentence) is not None))


def answer_in(sentence: str, first: bool = False) -> str | None:
  """The part of a final sentence that states the answer; without a verb,
  its last formula or number, or its `first` (an anchored span: "Answer: 5
  apples, or maybe 6" states 5)."""
  spans = [m.span() for m in _MATH_SPAN.finditer(sentence)]
  verbs = [m for m in _VERB.finditer(sentence)
           if not any(a <= m.start() < b for a, b in spans)]
  for verb in reversed(verbs):  # "... is 45, which is odd": the 45.
    tail = _TAIL_END.split(sentence[verb.end():], maxsplit=1)[0]
    tail = tail.strip().rstrip(".").strip()
    if NEGATED.match(tail):  # "... is not 4": no answer here.
      return None
    glued = _GLUED_UNIT.fullmatch(tail)
    if glued:  # "1,000.99m²", "12€": a number and its unit.
      return glued.group(1)
    counted = _NUMBER_THEN_WORDS.fullmatch(tail)
    if counted and not any(units.changes_value(w) for w in re.findall(r"[A-Za-z]+", tail)):
      return counted.group(1)  # "24 ways to arrange the books": the 24.
    if any(c.isdigit() for c in tail) or _MATH_SPAN.search(tail):
      return tail
  pick = 0 if first else -1
  if spans:
    return sentence[slice(*spans[pick])]
  numbers = _NUMBER.findall(sentence)
  return numbers[pick] if numbers else None


def _final_display(text: str) -> str | None:
  """A display equation that ends the text (`...is\\n\\[\\frac{2}{5}.\\]`)."""
  text = text.rstrip()
  for open_, close in (("\\[", "\\]"), ("$$", "$$")):
    if text.endswith(close) and len(text) > len(open_) + len(close):
      at = text.rfind(open_, 0, len(text) - len(close))
      if at >= 0 and len(text) - at <= MAX_STATEMENT_CHARS:
        return text[at:]
  return None


def final_statement(text: str) -> str | None:
  """The answer stated by the last sentence with a number or formula among
  the last lines of `text` ("So she has 36 apples left." -> "36"); None
  when the end of the text is not prose."""
  display = _final_display(text)
  if display is not None:
    return display
  lines = [line for line in text[-TAIL_CHARS:].splitlines() if line.strip()]
  for line in reversed(lines[-_FINAL_LINES:]):
    for sentence in reversed(_sentences(line[-MAX_STATEMENT_CHARS:])):
      if is_statement(sentence):
        return answer_in(sentence)
  return None


# ------------------------------------------------------------ program text
# Text is never code: a call of a name that is no mathematical function
# (`len(`, `math.factorial(`), `lambda`, dunder names, quoted literals,
# empty call parentheses, indexing (`[1, 2][0]`) or a comprehension make an
# answer program text.
_MATH_FUNCTIONS = frozenset(
    "sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln lg exp "
    "sqrt abs max min gcd lcm det mod deg arg sgn floor ceil tr rank dim binom "
    "choose frac lim erf sign gamma zeta".split())
_CALLED = re.compile(r"(?<![\\A-Za-z_.])([A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_][A-Za-z_0-9]*)*)\(")
_PROGRAM = re.compile(
    r"\blambda\b|__|\bimport\b|\bdef\b|\breturn\b|\(\s*\)|(?<!\\)\][ \t]*\["
    r"|(?<![A-Za-z0-9)}\\])'[^'\n]*'|[(\[,=:]\s*\"[^\"\n]*\""
    r"|\[[^\]]*\bfor\b[^\]]*\bin\b")


def looks_like_program(answer: str) -> bool:
  """True if `answer` is program text (never evaluated; it earns nothing)."""
  if _PROGRAM.search(answer):
    return True
  for name in _CALLED.findall(answer):
    base = name.split("_")[0]
    if "." in name or (len(base) >= 3 and base.lower() not in _MATH_FUNCTIONS):
      return True
  return False


