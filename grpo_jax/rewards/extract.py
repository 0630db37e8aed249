"""Cutting the final answer out of a model's text. Pure string code.

This runs in the trainer process on raw model output, so every function here
is linear in the length of the text (no regex that can backtrack without
bound, a fixed number of scans) and never evaluates anything.

Rules, in order (`extract_answer`):
  1. the content of the last `\\boxed{...}` or `\\fbox{...}`, unless an
     answer anchor (rule 2) follows it (nested braces
     balanced; `\\boxed 5` also counts); boxes joined only by list words
     (`$\\boxed{2}$ and $\\boxed{3}$`, `x=\\boxed{1}, y=\\boxed{2}`) are one
     answer, the list `2, 3`; boxes with other words between them are a
     correction, and the last one counts;
  2. otherwise the latest of: a final `Answer:` line, "the answer is ...",
     GSM8K's `#### 42`, a "Final Answer" heading; a span that is prose is
     read like a final statement (rule 3);
  3. otherwise the final statement: the last sentence that holds a number or
     formula, read after its last "is"/"="/"are" ("So there are 24 ways.");
  4. otherwise the whole text (its last `TAIL_CHARS` characters), which the
     worker reads with math-verify's heuristics.
An answer wrapped in display math loses the wrapper and a final period
(`\\[\\frac{2}{5}.\\]`), and doubled parentheses collapse (`((7))` -> `(7)`):
tex.py, whose functions this module re-exports.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from grpo_jax.rewards import units
from grpo_jax.rewards.tex import (collapse_parens, light_normalise,  # pylint: disable=unused-import  (extract's API)
                                  strip_display)

TAIL_CHARS = 2000  # Unanchored text: only the end can hold the answer.
_BOX_COMMANDS = ("\\boxed", "\\fbox", "\\framebox")
_MAX_BOX_TRIES = 8  # Bounds the work on text full of unclosed \boxed{.
_BARE_TOKEN = re.compile(r"\s*([^\s$]+)")
# What may stand between boxes that together are one list answer: spacing,
# math delimiters, commas, "and"/"or" (also `\lor`, `\vee`, a slash: a hedge
# between boxes is a list, never its last box), and a variable being named
# (`y =`).
_MAX_CONNECTOR_CHARS = 80
_LIST_CONNECTOR = re.compile(
    r"(?:\s|\$|\\[()]|[,;&/]|\\q?quad\b|\\[,;:! ]|\\(?:lor|vee)\b"
    r"|\\(?:text|mathrm|textrm)\{\s*(?:and|or)?\s*\}|\band\b|\bor\b"
    r"|[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\s*=)*")
_ANSWER_LINE = re.compile(r"answer\**\s*[:\uff1a]", re.IGNORECASE)
# A "**Final Answer**" heading with the answer on the next line.
_ANSWER_HEADING = re.compile(r"final answer[*#\s]*?(?=\n)", re.IGNORECASE)
_ANSWER_IS = re.compile(r"answer\s+is\b\s*:?", re.IGNORECASE)
# GSM8K's "#### 42"; not a markdown "#### Step 2" heading.
_HASHES = re.compile(r"####(?=\s*[-+$]?\s*\d)")
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


class Answer(NamedTuple):
  """An extracted answer; `anchored` says a rule found it (not the fallback)."""
  text: str
  anchored: bool


class _Box(NamedTuple):
  """One complete box command: where it starts and ends, and its content."""
  start: int
  end: int
  content: str


def _closing_brace(text: str, open_at: int) -> int | None:
  """The index of the `}` closing the `{` at `open_at`; None if unclosed.

  `\\{` and `\\}` are LaTeX set braces, not grouping, and are skipped.
  """
  depth, i, n = 0, open_at, len(text)
  while i < n:
    char = text[i]
    if char == "\\":
      i += 2
      continue
    if char == "{":
      depth += 1
    elif char == "}":
      depth -= 1
      if depth == 0:
        return i
    i += 1
  return None


def _box_at(text: str, start: int, command: str) -> _Box | None:
  """The box command at `start` with its argument: `{...}` or one bare token."""
  i = start + len(command)
  rest = text[i:i + 1]
  if rest == "{":
    close = _closing_brace(text, i)
    return None if close is None else _Box(start, close + 1, text[i + 1:close])
  if rest in (" ", "\t"):  # "\boxed 5": the next whitespace-delimited token.
    match = _BARE_TOKEN.match(text, i)
    return _Box(start, match.end(), match.group(1)) if match else None
  return None


def _boxes(text: str) -> list[_Box]:
  """The complete, non-empty boxes among the last `_MAX_BOX_TRIES` box
  commands, in text order; a box inside another counts, not the outer one."""
  positions = []
  for command in _BOX_COMMANDS:
    at = len(text)
    for _ in range(_MAX_BOX_TRIES):
      at = text.rfind(command, 0, at)
      if at < 0:
        break
      positions.append((at, command))
  boxes: list[_Box] = []
  for at, command in sorted(positions)[-_MAX_BOX_TRIES:]:
    box = _box_at(text, at, command)
    if box is None or not box.content.strip():
      continue
    if boxes and box.start < boxes[-1].end:  # Nested: keep the inner box.
      boxes[-1] = box
    else:
      boxes.append(box)
  return boxes


def last_boxed(text: str) -> str | None:
  """The content of the last complete \\boxed{...} / \\fbox{...}, or None."""
  boxes = _boxes(text)
  return boxes[-1].content.strip() if boxes else None


def boxed_answer(text: str, boxes: list[_Box] | None = None) -> str | None:
  """The last box, or the list of final boxes joined only by list words
  (`$\\boxed{2}$ and $\\boxed{3}$` -> `2, 3`); None without a box."""
  boxes = _boxes(text) if boxes is None else boxes
  if not boxes:
    return None
  group = [boxes[-1]]
  for box in reversed(boxes[:-1]):
    between = text[box.end:group[0].start]
    if len(between) > _MAX_CONNECTOR_CHARS or not _LIST_CONNECTOR.fullmatch(between):
      break
    group.insert(0, box)
  return ", ".join(box.content.strip() for box in group)


def last_tagged(text: str, tag: str) -> str | None:
  """The content of the last complete <tag>...</tag>, by two `rfind`s (a
  lazy regex would be quadratic on text full of unclosed <tag>s)."""
  close = text.rfind(f"</{tag}>")
  if close < 0:
    return None
  open_at = text.rfind(f"<{tag}>", 0, close)
  return None if open_at < 0 else text[open_at + len(tag) + 2:close]


_BLANK_LINES = 3


def _rest_of_line(text: str, start: int) -> str:
  end = text.find("\n", start)
  line = text[start:] if end < 0 else text[start:end]
  for _ in range(_BLANK_LINES):  # "Answer:\n\n42": the next non-blank line.
    if line.strip(" *\t") or end < 0:
      break
    start, end = end + 1, text.find("\n", end + 1)
    line = text[start:] if end < 0 else text[start:end]
  return line.strip().strip("*").strip()


def _first_sentence(span: str) -> str:
  """"$28\\%$. I hope it is correct." -> "$28\\%$"; "12 apples, not 15" -> "12
  apples": an answer span ends where a correction or an aside starts."""
  match = _SENTENCE_END.search(span)
  span = span[:match.start()] if match else span
  corrected = _NOT_BUT.match(span)  # "not 12 but 15": the 15.
  span = span[corrected.end():] if corrected else span
  return _CORRECTION.split(span, maxsplit=1)[0]


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
  last = None
  for last in pattern.finditer(text):
    pass
  return last


def _last_anchor(text: str) -> re.Match[str] | None:
  """The latest `Answer:`, "answer is", `####` or "Final Answer" heading."""
  found = []
  for pattern in (_ANSWER_LINE, _ANSWER_IS, _HASHES, _ANSWER_HEADING):
    match = _last_match(pattern, text)
    if match:
      found.append(match)
  return max(found, key=lambda m: m.start()) if found else None


def anchored_span(text: str, match: re.Match[str] | None = None) -> str | None:
  """The latest `Answer:` line, "answer is ..." or `#### ...`; None if none."""
  match = match or _last_anchor(text)
  if match is None:
    return None
  rest = _rest_of_line(text, match.end())
  if rest in ("\\[", "$$"):  # "Answer:\n\\[\n x = 7.\n\\]": the display block.
    close = text.find("\\]" if rest == "\\[" else "$$", text.find(rest, match.end()) + 2)
    if close >= 0:
      return text[text.find(rest, match.end()):close + 2]
  span = _first_sentence(rest).strip()
  return span or None


# ------------------------------------------------------------ final statement
_FINAL_LINES = 3
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z_^])[A-Za-z]{2,}")
_MATH_SPAN = re.compile(r"\$\$[^$]+\$\$|\$[^$]+\$|\\\[.+?\\\]|\\\(.+?\\\)")
_VERB = re.compile(
    r"(?:\b(?:is|are|was|were|equals|be|becomes|gives|get|gets|got|obtain)\b|=|:)")
_NUMBER = re.compile(
    r"(?<![A-Za-z\d])-?\d(?:[\d,]*\d)?(?:\.\d+)?(?:\s*/\s*\d+)?(?![A-Za-z\d])")
_MAX_STATEMENT_CHARS = 400
_NEGATED = re.compile(r"(?:not|never|no)\b", re.IGNORECASE)
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


def _is_statement(sentence: str) -> bool:
  """Prose holding a number or formula: two words outside math, and a digit
  or a math span (a bare formula is left to the parser)."""
  bare = _COMMAND.sub(" ", _MATH_SPAN.sub(" ", sentence))
  words = [w for w in _PROSE_WORD.findall(bare) if w.lower() not in ("and", "or")]
  return (len(words) >= 2
          and (any(c.isdigit() for c in sentence) or _MATH_SPAN.search(sentence) is not None))


def _answer_in(sentence: str, first: bool = False) -> str | None:
  """The part of a final sentence that states the answer; without a verb,
  its last formula or number, or its `first` (an anchored span: "Answer: 5
  apples, or maybe 6" states 5)."""
  spans = [m.span() for m in _MATH_SPAN.finditer(sentence)]
  verbs = [m for m in _VERB.finditer(sentence)
           if not any(a <= m.start() < b for a, b in spans)]
  for verb in reversed(verbs):  # "... is 45, which is odd": the 45.
    tail = _TAIL_END.split(sentence[verb.end():], maxsplit=1)[0]
    tail = tail.strip().rstrip(".").strip()
    if _NEGATED.match(tail):  # "... is not 4": no answer here.
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
      if at >= 0 and len(text) - at <= _MAX_STATEMENT_CHARS:
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
    for sentence in reversed(_sentences(line[-_MAX_STATEMENT_CHARS:])):
      if _is_statement(sentence):
        return _answer_in(sentence)
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


def extract_answer(text: str) -> Answer:
  """The final answer of `text` by the rules in the module docstring."""
  boxes = _boxes(text)
  anchor = _last_anchor(text)
  span = anchored_span(text, anchor) if anchor else None
  negated = span is not None and _NEGATED.match(span) is not None
  if negated:  # "the answer is not 4": no answer here.
    anchor = span = None
  if boxes and (anchor is None or anchor.start() < boxes[-1].end):
    return Answer(strip_display(boxed_answer(text, boxes)), True)
  if span is not None and _is_statement(span):  # "Answer: she has 3 left".
    span = _answer_in(span, first=True) or span
  if span is None:
    span = final_statement(text)
  if span is not None and strip_display(span):
    return Answer(strip_display(span), True)
  if boxes:  # An empty answer line after the box.
    return Answer(strip_display(boxed_answer(text, boxes)), True)
  if negated:  # Not the whole text: its heuristics would find the 4.
    return Answer("", False)
  return Answer(text[-TAIL_CHARS:].strip(), False)
