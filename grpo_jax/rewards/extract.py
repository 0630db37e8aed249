"""Cutting the final answer out of a model's text. Pure string code.

This runs in the trainer process on raw model output, so every function here
is linear in the length of the text (no regex that can backtrack without
bound, a fixed number of scans) and never evaluates anything.

Rules, in order (`extract_answer`):
  1. the content of the last `\\boxed{...}` or `\\fbox{...}` (nested braces
     balanced; `\\boxed 5` also counts);
  2. otherwise the latest of: a final `Answer:` line, "the answer is ...",
     GSM8K's `#### 42`;
  3. otherwise the whole text (its last `TAIL_CHARS` characters), which the
     worker reads with math-verify's heuristics.
"""
from __future__ import annotations

import re
from typing import NamedTuple

TAIL_CHARS = 2000  # Unanchored text: only the end can hold the answer.
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_MAX_BOX_TRIES = 4  # Bounds the work on text full of unclosed \boxed{.
_ANSWER_LINE = re.compile(r"answer\**\s*[:\uff1a]", re.IGNORECASE)
_ANSWER_IS = re.compile(r"answer\s+is\b\s*:?", re.IGNORECASE)
# GSM8K's "#### 42"; not a markdown "#### Step 2" heading.
_HASHES = re.compile(r"####(?=\s*[-+$]?\s*\d)")
# A sentence ends at ". " or a final ".", not at the point of "3.5".
_SENTENCE_END = re.compile(r"(?<!\d)\.(?=\s|$)|\.(?=\s+[A-Z])")


class Answer(NamedTuple):
  """An extracted answer; `anchored` says a rule found it (not the fallback)."""
  text: str
  anchored: bool


def _balanced_group(text: str, open_at: int) -> str | None:
  """The content of the {...} group opening at `open_at`; None if unclosed.

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
        return text[open_at + 1:i]
    i += 1
  return None


def _box_content(text: str, start: int, command: str) -> str | None:
  """The argument of the box command at `start`: `{...}` or one bare token."""
  i = start + len(command)
  rest = text[i:i + 1]
  if rest == "{":
    return _balanced_group(text, i)
  if rest in (" ", "\t"):  # "\boxed 5": the next whitespace-delimited token.
    match = re.compile(r"\s*([^\s$]+)").match(text, i)
    return match.group(1) if match else None
  return None


def last_boxed(text: str) -> str | None:
  """The content of the last complete \\boxed{...} / \\fbox{...}, or None."""
  positions = []
  for command in _BOX_COMMANDS:
    at = len(text)
    for _ in range(_MAX_BOX_TRIES):
      at = text.rfind(command, 0, at)
      if at < 0:
        break
      positions.append((at, command))
  for at, command in sorted(positions, reverse=True)[:_MAX_BOX_TRIES]:
    content = _box_content(text, at, command)
    if content is not None and content.strip():
      return content.strip()
  return None


def last_tagged(text: str, tag: str) -> str | None:
  """The content of the last complete <tag>...</tag>, by two `rfind`s (a
  lazy regex would be quadratic on text full of unclosed <tag>s)."""
  close = text.rfind(f"</{tag}>")
  if close < 0:
    return None
  open_at = text.rfind(f"<{tag}>", 0, close)
  return None if open_at < 0 else text[open_at + len(tag) + 2:close]


def _rest_of_line(text: str, start: int) -> str:
  end = text.find("\n", start)
  line = text[start:] if end < 0 else text[start:end]
  if not line.strip(" *\t") and end >= 0:  # "Answer:\n42": take the next line.
    nxt = text.find("\n", end + 1)
    line = text[end + 1:] if nxt < 0 else text[end + 1:nxt]
  return line.strip().strip("*").strip()


def _first_sentence(span: str) -> str:
  """"$28\\%$. I hope it is correct." -> "$28\\%$"."""
  match = _SENTENCE_END.search(span)
  return span[:match.start()] if match else span


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
  last = None
  for last in pattern.finditer(text):
    pass
  return last


def anchored_span(text: str) -> str | None:
  """The latest `Answer:` line, "answer is ..." or `#### ...`; None if none."""
  found = []
  for pattern in (_ANSWER_LINE, _ANSWER_IS, _HASHES):
    match = _last_match(pattern, text)
    if match:
      found.append(match)
  if not found:
    return None
  match = max(found, key=lambda m: m.start())
  span = _first_sentence(_rest_of_line(text, match.end())).strip()
  return span or None


def extract_answer(text: str) -> Answer:
  """The final answer of `text` by the rules in the module docstring."""
  boxed = last_boxed(text)
  if boxed is not None:
    return Answer(boxed, True)
  span = anchored_span(text)
  if span is not None:
    return Answer(span, True)
  return Answer(text[-TAIL_CHARS:].strip(), False)


_SIZING = re.compile(r"\\left\b|\\right\b|\\displaystyle\b")
_SPACING = re.compile(r"(?:(?<!\\)\\[,;:! ]|\\q?quad\b|~|\s)+")


def light_normalise(answer: str) -> str:
  """Removes only what never changes meaning: delimiting `$`, `\\left`,
  spacing, a final period. Equal results are equal answers, so the parent
  can accept them without a worker; anything else goes to sympy."""
  answer = answer.strip().strip("$").strip().rstrip(".")
  answer = _SIZING.sub("", answer)
  answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  return _SPACING.sub(" ", answer).strip()
