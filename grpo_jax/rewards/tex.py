"""TeX cleaning of an extracted answer (`extract.extract_answer`): the
display-math wrapper and a final period go, doubled parentheses collapse,
and `light_normalise` removes only what never changes meaning. Pure,
linear string code, as extract.py.
"""
from __future__ import annotations

import re

_FINAL_PUNCTUATION = ".,;:?!"
_FACTORIAL_BASE = re.compile(r"[\w)\]]$")
# "\boxed{\text{The answer is } 5}": the words are no part of the answer.
_ANSWER_WORDS = re.compile(
    r"^\\(?:text|textbf|mathrm|textrm)\{\s*(?:the\s+)?(?:final\s+)?answer\s*(?:is)?\s*:?\s*\}\s*",
    re.IGNORECASE)

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
      and not answer[:-1].endswith("\\")
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
