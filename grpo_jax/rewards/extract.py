"""The answer of a completion: the answer contract of docs/verifier.md (A1-A8).

Pure string code. It runs inside a verifier worker (`contract.py`), never on
the trainer's thread, and every scan is linear: braces are matched in one pass,
boxes found by one regex scan, anchors searched in the last `TAIL_CHARS`
characters, and an anchored line cut to `statement.MAX_STATEMENT_CHARS`
before any statement analysis.

  A1 only the text after the last `</think>` is read;
  A2 TeX comments (`%` not after a digit) and `\\iffalse...\\fi` are removed;
  A3 the answer is the last top-level box (boxes joined only by list words
     are one list answer; a box inside a box is its content);
  A4 nothing after a box changes it;
  A5 every top-level box group is a stated final answer (`stated_answers`);
  A6 without a box: the latest `Answer:`, "the answer is", `#### n` line or
     "Final Answer" heading in the last `TAIL_CHARS` characters;
  A7 otherwise the final statement (`statement.final_statement`);
  A8 otherwise the last `TAIL_CHARS` characters, unanchored.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from grpo_jax.rewards import statement
from grpo_jax.rewards.statement import final_statement, looks_like_program  # noqa: F401  (extract's API)

TAIL_CHARS = statement.TAIL_CHARS
MAX_BOXED_ANSWERS = 8  # A5: more different boxed answers than this earn nothing.
_THINK_CLOSE = "</think>"
_BOX = re.compile(r"\\(?:boxed|fbox|framebox)(?![A-Za-z])")
_BARE_TOKEN = re.compile(r"[ \t]+([^\s$]+)")
# A2: `%` after a digit is a percent sign ("50%"); `\%` is escaped.
_COMMENT = re.compile(r"(?<![\\\d])%[^\n]*")
_IFFALSE, _FI = re.compile(r"\\iffalse(?![A-Za-z])"), re.compile(r"\\fi(?![A-Za-z])")
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
# GSM8K's "#### 42" as a whole line; not a markdown "#### 3. Check" heading.
_HASHES = re.compile(r"^[ \t]*####(?=[ \t]*[-+$]?[ \t]*\d[^A-Za-z\n]*$)", re.MULTILINE)
_FINAL_PUNCTUATION = ".,;:?!"
_FACTORIAL_BASE = re.compile(r"[\w)\]]$")
# "\boxed{\text{The answer is } 5}": the words are no part of the answer.
_ANSWER_WORDS = re.compile(
    r"^\\(?:text|textbf|mathrm|textrm)\{\s*(?:the\s+)?(?:final\s+)?answer\s*(?:is)?\s*:?\s*\}\s*",
    re.IGNORECASE)


class Answer(NamedTuple):
  """An extracted answer; `anchored` says a rule found it (not the fallback)."""
  text: str
  anchored: bool


class _Box(NamedTuple):
  """One complete top-level box command: where it starts and ends, and its content."""
  start: int
  end: int
  content: str


def clean(text: str) -> str:
  """A1 and A2: the text after the last `</think>`, without TeX comments."""
  at = text.rfind(_THINK_CLOSE)
  text = text[at + len(_THINK_CLOSE):] if at >= 0 else text
  if "\\iffalse" in text:
    parts, pos = [], 0
    for start in _IFFALSE.finditer(text):
      if start.start() < pos:
        continue
      parts.append(text[pos:start.start()])
      end = _FI.search(text, start.end())
      pos = len(text) if end is None else end.end()
    text = "".join(parts) + text[pos:]
  return _COMMENT.sub("", text) if "%" in text else text


def _brace_pairs(text: str) -> dict[int, int]:
  """Every unescaped `{` with its closing `}`, in one pass."""
  pairs, stack, i, n = {}, [], 0, len(text)
  while i < n:
    char = text[i]
    if char == "\\":
      i += 2
      continue
    if char == "{":
      stack.append(i)
    elif char == "}" and stack:
      pairs[stack.pop()] = i
    i += 1
  return pairs


def _inner(content: str) -> str:
  """A box inside a box is read as its content: `\\boxed{\\boxed{3}}` is 3.
  The groups the inner box commands leave are peeled in one pass."""
  inner = _BOX.sub("", content).strip()
  if inner == content.strip():
    return inner
  pairs, i, j = _brace_pairs(inner), 0, len(inner) - 1
  while i < j and inner[i] == "{" and pairs.get(i) == j:
    i, j = i + 1, j - 1
  return inner[i:j + 1].strip()


def _boxes(text: str) -> list[_Box]:
  """A3: the complete, non-empty top-level boxes, in text order. A box inside
  another is part of its content; an unclosed box is skipped."""
  pairs = _brace_pairs(text) if "{" in text else {}
  boxes: list[_Box] = []
  end = 0
  for match in _BOX.finditer(text):
    if match.start() < end:
      continue  # Inside the previous box.
    i = match.end()
    if text[i:i + 1] == "{" and i in pairs:
      box = _Box(match.start(), pairs[i] + 1, text[i + 1:pairs[i]])
    else:
      bare = _BARE_TOKEN.match(text, i)  # "\boxed 5": the next token.
      if bare is None:
        continue
      box = _Box(match.start(), bare.end(), bare.group(1))
    end = box.end
    content = _inner(box.content)
    if content:
      boxes.append(box._replace(content=content))
  return boxes


def _box_groups(text: str, boxes: list[_Box]) -> list[str]:
  """Boxes joined only by list words are one answer (`2, 3`), in order."""
  groups: list[list[_Box]] = []
  for box in boxes:
    if groups:
      between = text[groups[-1][-1].end:box.start]
      if len(between) <= _MAX_CONNECTOR_CHARS and _LIST_CONNECTOR.fullmatch(between):
        groups[-1].append(box)
        continue
    groups.append([box])
  return [", ".join(box.content for box in group) for group in groups]


def last_boxed(text: str) -> str | None:
  """The content of the last complete top-level box, or None."""
  boxes = _boxes(clean(text))
  return boxes[-1].content if boxes else None


def boxed_answer(text: str) -> str | None:
  """The last box, or the list of final boxes joined only by list words
  (`$\\boxed{2}$ and $\\boxed{3}$` -> `2, 3`); None without a box."""
  text = clean(text)
  groups = _box_groups(text, _boxes(text))
  return groups[-1] if groups else None


def last_tagged(text: str, tag: str) -> str | None:
  """The content of the last complete <tag>...</tag>, by two `rfind`s (a
  lazy regex would be quadratic on text full of unclosed <tag>s)."""
  close = text.rfind(f"</{tag}>")
  if close < 0:
    return None
  open_at = text.rfind(f"<{tag}>", 0, close)
  return None if open_at < 0 else text[open_at + len(tag) + 2:close]


_BLANK_LINES = 3


def _line_at(text: str, start: int) -> tuple[int, int]:
  end = text.find("\n", start)
  return start, len(text) if end < 0 else end


def _rest_of_line(text: str, start: int) -> str:
  start, end = _line_at(text, start)
  for _ in range(_BLANK_LINES):  # "Answer:\n\n42": the next non-blank line.
    if text[start:end].strip(" *\t") or end >= len(text):
      break
    start, end = _line_at(text, end + 1)
  line = text[start:min(end, start + statement.MAX_STATEMENT_CHARS)]
  return line.strip().strip("*").strip()


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
  last = None
  for last in pattern.finditer(text):
    pass
  return last


def _last_anchor(text: str) -> re.Match[str] | None:
  """A6: the latest `Answer:`, "answer is", `####` or "Final Answer" heading."""
  found = [m for m in (_last_match(p, text) for p in
                       (_ANSWER_LINE, _ANSWER_IS, _HASHES, _ANSWER_HEADING)) if m]
  return max(found, key=lambda m: m.start()) if found else None


def anchored_span(text: str, match: re.Match[str] | None = None) -> str | None:
  """The latest anchor's line (A6), cut at its first sentence; None if none."""
  if match is None:
    text = clean(text)[-TAIL_CHARS:]
    match = _last_anchor(text)
  if match is None:
    return None
  rest = _rest_of_line(text, match.end())
  if rest in ("\\[", "$$"):  # "Answer:\n\\[\n x = 7.\n\\]": the display block.
    at = text.find(rest, match.end())
    close = text.find("\\]" if rest == "\\[" else "$$", at + 2, at + statement.MAX_STATEMENT_CHARS)
    if close >= 0:
      return text[at:close + 2]
  span = statement.first_sentence(rest).strip()
  return span or None


_DISPLAY = (("\\[", "\\]"), ("$$", "$$"), ("\\(", "\\)"), ("$", "$"))


def strip_display(answer: str) -> str:
  """`\\[\\frac{2}{5}.\\]` -> `\\frac{2}{5}`: one math wrapper around the whole
  answer and a final period go; `$a$ and $b$` keeps its dollars."""
  answer = _ANSWER_WORDS.sub("", _strip_punctuation(answer.strip()))
  for open_, close in _DISPLAY:
    inner = answer[len(open_):len(answer) - len(close)]
    if (len(answer) >= len(open_) + len(close) and answer.startswith(open_)
        and answer.endswith(close) and close not in inner):
      answer = inner.strip()
      break
  return _strip_punctuation(answer)


def _strip_punctuation(answer: str) -> str:
  """One final `.,;:?!` goes; not "1, 2, ...", not LaTeX's `\\!`, and not
  the `!` of a factorial (`5!`, `(n+1)!`: glued to a number, a letter or a
  bracket; after a closing brace, `2^{10}!`, it is punctuation)."""
  answer = answer.rstrip()
  if (answer[-1:] and answer[-1] in _FINAL_PUNCTUATION and not answer.endswith("..")
      and not answer[:-1].endswith("\\") and not answer.endswith("!!")
      and not (answer[-1] == "!" and _FACTORIAL_BASE.search(answer[:-1]))):
    answer = answer[:-1]
  return answer.strip()


def collapse_parens(answer: str) -> str:
  """Drops parentheses (and TeX groups) that directly wrap another pair:
  `((7))` -> `(7)`, `{{x}}` -> `{x}`.

  Linear. Deep wrappers cost the parser time and recursion, and mean
  nothing: `(1, 2)` keeps its pair; `\\{`, `\\(` are not grouping.
  """
  answer = answer.replace("\\left(", "(").replace("\\right)", ")")
  if "((" not in answer and "{{" not in answer:
    return answer
  stacks: dict[str, list[int]] = {"(": [], "{": []}
  closing: dict[int, int] = {}
  for i, char in enumerate(answer):
    escaped = i > 0 and answer[i - 1] == "\\"
    if char in stacks and not escaped:
      stacks[char].append(i)
    elif char in ")}" and not escaped and stacks["(" if char == ")" else "{"]:
      closing[stacks["(" if char == ")" else "{"].pop()] = i
  drop = set()
  for open_at, close_at in closing.items():
    if closing.get(open_at + 1) == close_at - 1:
      drop.update((open_at, close_at))
  return "".join(c for i, c in enumerate(answer) if i not in drop)


def _unboxed_answer(text: str) -> Answer:
  """A6-A8 for a text with no box."""
  tail = text[-TAIL_CHARS:]
  anchor = _last_anchor(tail)
  span = anchored_span(tail, anchor) if anchor else None
  negated = span is not None and statement.NEGATED.match(span) is not None
  if negated:  # "the answer is not 4": no answer here.
    span = None
  if span is not None and statement.is_statement(span):  # "Answer: she has 3 left".
    span = statement.answer_in(span, first=True) or span
  if span is None and not negated:
    span = final_statement(tail)
  if span is not None and strip_display(span):
    return Answer(strip_display(span), True)
  if negated:  # Not the whole text: its heuristics would find the 4.
    return Answer("", False)
  return Answer(tail.strip(), False)


def _answer_after(text: str) -> Answer | None:
  """A5: the latest anchor after the last box (`\\boxed{3}. The answer is 5.`)
  whose span holds a digit or a formula, one more stated answer; else None."""
  tail = text[-TAIL_CHARS:]
  anchor = _last_anchor(tail)
  span = anchored_span(tail, anchor) if anchor else None
  if span is None or statement.NEGATED.match(span):
    return None
  if statement.is_statement(span):
    span = statement.answer_in(span, first=True) or span
  span = strip_display(span)
  holds_value = any(c.isdigit() or c in "\\$^" for c in span)
  return Answer(span, True) if holds_value else None  # "this answer is correct": none.


def stated_answers(text: str) -> list[Answer]:
  """A5: every final answer the text states, last first: each top-level box
  group (distinct ones, at most `MAX_BOXED_ANSWERS`; more give `[]`) and an
  anchor after the last box, else the one answer of A6-A8."""
  text = clean(text)
  boxes = _boxes(text)
  if not boxes:
    return [_unboxed_answer(text)]
  groups = [strip_display(g) for g in reversed(_box_groups(text, boxes))]
  after = _answer_after(text[boxes[-1].end:])
  distinct = list(dict.fromkeys(groups + ([after.text] if after else [])))
  return [] if len(distinct) > MAX_BOXED_ANSWERS else [Answer(g, True) for g in distinct]


def extract_answer(text: str) -> Answer:
  """The final answer of `text` (A1-A8): its last box group, else A6-A8."""
  text = clean(text)
  groups = _box_groups(text, _boxes(text))
  return Answer(strip_display(groups[-1]), True) if groups else _unboxed_answer(text)


_SIZING = re.compile(r"\\left\b|\\right\b|\\displaystyle\b|\\[Bb]igg?[lrm]?\b")
_SPACING = re.compile(r"(?:(?<!\\)\\[,;:! ]|\\q?quad\b|~|\s)+")


def light_normalise(answer: str) -> str:
  """Removes only what never changes meaning: delimiting `$`, `\\left`,
  spacing, a final period. Equal results are equal answers, so the parent
  can accept them without a worker; anything else goes to sympy."""
  answer = answer.strip().strip("$").strip().rstrip(".")
  answer = _SIZING.sub("", answer)
  answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  return _SPACING.sub(" ", answer).strip()
