"""DAPO's reward: the final `Answer:` line, Minerva normalisation, exact match.

docs/verifier.md's clauses D1-D3: the answer is on a line that starts with
`Answer:` in the last 300 characters; all such lines must agree; exact match
after Minerva's normalisation. D1 and D2 are stricter than the paper's
`re.findall("Answer\\s*:", tail)[-1]`, which also read "the reference
answer: 7" mid-sentence and let a later line overrule an earlier one.

DAPO (Yu et al. 2025) scores a response +1 if the string after its last
`Answer:` equals the reference after the answer normalisation of Minerva
(Lewkowycz et al. 2022, appendix D.1), else -1. Reproducing the paper's
reward means reproducing this string procedure, not a smarter one: it is
kept separate from the symbolic verifier on purpose. Pure string code (no
parsing, no eval), so it runs in the trainer process without a worker.
"""
from __future__ import annotations

import re

# Only the end of a response is searched, as in the DAPO recipe: an
# "Answer:" early in a long chain of thought is not the final answer.
TAIL_CHARS = 300
INVALID = "[INVALID]"
_MAX_ANSWER_CHARS = 1000
# D1 (docs/verifier.md): `Answer:` at the start of a line (spaces, `*`, `#`
# and `>` allowed before it), not "the reference answer: 7" inside a sentence.
_ANSWER = re.compile(r"^[ \t*#>]*answer\s*:\s*([^\n]+)", re.IGNORECASE | re.MULTILINE)

# Minerva's normalisation tables (appendix D.1): literal replacements, then
# literal deletions (units, filler words, spacing, degree marks).
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours",
    "km", "units", "\\ldots", "sue", "points", "feet", "minutes", "digits",
    "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
    "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
    "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)


def _unwrap(answer: str) -> str:
  """Keeps the inside of $...$, \\text{}, \\textbf{}, \\overline{}, \\boxed{}."""
  answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
  for command in ("text", "textbf", "overline"):
    answer = re.sub(rf"(\\{command}\{{)(.*?)(\}})", "\\2", answer)
  return re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)


def _fix_shorthand(answer: str) -> str:
  """\\frac12 -> \\frac{1}{2}, \\sqrt2 -> \\sqrt{2}."""
  answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
  return re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)


def normalize_final_answer(answer: str) -> str:
  """Minerva's `normalize_final_answer`: a canonical string for exact match."""
  answer = answer[:_MAX_ANSWER_CHARS].split("=")[-1]
  for old, new in _SUBSTITUTIONS:
    answer = answer.replace(old, new)
  for expression in _REMOVED:
    answer = answer.replace(expression, "")
  answer = _fix_shorthand(_unwrap(answer)).replace("$", "")
  if answer.replace(",", "").isdigit():  # 100,000 -> 100000
    answer = answer.replace(",", "")
  return answer.strip()


def extract_answer_line(response: str) -> str:
  """The text after the last line-initial `Answer:` in the response's tail,
  or INVALID; INVALID too where two such lines state different answers (D2)."""
  matches = _ANSWER.findall(response[-TAIL_CHARS:])
  if not matches:
    return INVALID
  if len({normalize_final_answer(m) for m in matches}) > 1:
    return INVALID  # D2: two different final answers earn nothing.
  return matches[-1]


def is_correct(gold: str, response: str) -> bool:
  """DAPO's check: normalised final `Answer:` == normalised reference.

  A reference that normalises to nothing (`""`, `"dollars"`) matches no
  answer: in DAPO's data every reference has a value, and an empty one is a
  data error that must not pay an empty `Answer: $ $` line.
  """
  line = extract_answer_line(response)
  if line == INVALID:
    return False
  want = normalize_final_answer(str(gold))
  return bool(want) and normalize_final_answer(line) == want
