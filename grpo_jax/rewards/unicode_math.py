"""Unicode mathematics as LaTeX: pure string code, linear in the text.

Models write `√16`, `10⁶`, `3½`, `５`, `٣`, `–4`, `2·3`, `5‰`. Each is
rewritten to the LaTeX the parser reads, with its argument or exponent kept
(`√16` -> `\\sqrt{16}`, not `\\sqrt16` = √1·6; `10⁶` -> `10^{6}`, not `10`):

  * superscript runs -> `^{...}`, subscript runs -> `_{...}`;
  * vulgar fractions -> `\\frac{p}{q}` (`3½` is then the mixed number 7/2),
    `⁄`/`∕` -> `/`, `‰` -> /1000 and `‱` -> /10000;
  * `√`, `∛`, `∜` -> `\\sqrt{}`, `\\sqrt[3]{}`, `\\sqrt[4]{}` around the
    number, letter, command, `(...)` or `{...}` that follows;
  * NFKC (full-width and other compatibility digits and letters), then any
    remaining decimal digit (Arabic-Indic, Devanagari, ...) -> ASCII;
  * dashes that are minus signs (not the em dash of prose) -> `-`, the
    middle dots -> `\\cdot`, and the operators and relations below.

Superscripts and fractions are read before NFKC, which would turn `²` into
a plain `2` and `½` into `1⁄2`.
"""
from __future__ import annotations

import re
import unicodedata

_SUPERSCRIPTS = dict(zip(
    "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079"
    "\u207a\u207b\u207c\u207d\u207e\u207f\u2071",
    "0123456789+-=()ni"))
_SUBSCRIPTS = dict(zip("\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089\u208a\u208b\u208c\u208d\u208e",
                       "0123456789+-=()"))
_VULGAR = {
    "\u00bd": (1, 2), "\u2153": (1, 3), "\u2154": (2, 3), "\u00bc": (1, 4), "\u00be": (3, 4),
    "\u2155": (1, 5), "\u2156": (2, 5), "\u2157": (3, 5), "\u2158": (4, 5), "\u2159": (1, 6),
    "\u215a": (5, 6), "\u2150": (1, 7), "\u215b": (1, 8), "\u215c": (3, 8), "\u215d": (5, 8),
    "\u215e": (7, 8), "\u2151": (1, 9), "\u2152": (1, 10), "\u2189": (0, 3),
}
_ROOTS = {"\u221a": "\\sqrt", "\u221b": "\\sqrt[3]", "\u221c": "\\sqrt[4]"}
# After NFKC; longest first where one is a prefix of another.
_SYMBOLS = {
    "\u2212": "-", "\u2013": "-", "\u2012": "-", "\u2010": "-", "\u2011": "-", "\ufe63": "-",
    "\u00b7": "\\cdot ", "\u22c5": "\\cdot ", "\u2219": "\\cdot ", "\u2217": "*",
    "\u00d7": "\\times ", "\u00f7": "\\div ", "\u2044": "/", "\u2215": "/",
    "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u2264": "\\le ", "\u2265": "\\ge ",
    "\u2260": "\\neq ", "\u226e": "\\geq ", "\u226f": "\\leq ", "\u2270": ">", "\u2271": "<",
    "\u00b1": "\\pm ", "\u2213": "\\mp ", "\u2208": "\\in ", "\u2209": "\\notin ",
    "\u222a": "\\cup ", "\u2229": "\\cap ", "\u2205": "\\emptyset ", "\u00b0": "^\\circ",
    "\u2030": "/1000", "\u2031": "/10000",
}
_PER_MILLE = re.compile(r"(\d+(?:\.\d+)?)\s*([\u2030\u2031])")
_SCRIPT_RUN = re.compile("[" + "".join(_SUPERSCRIPTS) + "]+|[" + "".join(_SUBSCRIPTS) + "]+")
_ROOT_ARG = re.compile(r"\s*(\d+(?:\.\d+)?|\\[A-Za-z]+|[^\W\d_])")
_MAX_GROUP = 200  # A root's bracketed argument: longer is not an argument.


def _scripts(match: re.Match[str]) -> str:
  run = match.group(0)
  if run[0] in _SUPERSCRIPTS:
    return "^{" + "".join(_SUPERSCRIPTS[c] for c in run) + "}"
  return "_{" + "".join(_SUBSCRIPTS[c] for c in run) + "}"


def _group_end(text: str, start: int) -> int | None:
  """The index after the `)`/`}` closing the bracket at `start`, if near."""
  open_, close = text[start], ")" if text[start] == "(" else "}"
  depth = 0
  for i in range(start, min(len(text), start + _MAX_GROUP)):
    depth += (text[i] == open_) - (text[i] == close)
    if depth == 0:
      return i + 1
  return None


def _roots(text: str) -> str:
  """`√16` -> `\\sqrt{16}`, `∛(x+1)` -> `\\sqrt[3]{x+1}`, `√\\pi` -> `\\sqrt{\\pi}`."""
  out, i = [], 0
  while True:
    at = min((p for p in (text.find(r, i) for r in _ROOTS) if p >= 0), default=-1)
    if at < 0:
      out.append(text[i:])
      return "".join(out)
    out.append(text[i:at])
    command, j = _ROOTS[text[at]], at + 1
    while j < len(text) and text[j] == " ":
      j += 1
    if j < len(text) and text[j] in "({":
      end = _group_end(text, j)
      if end is not None:
        out.append(command + "{" + text[j + 1:end - 1] + "}")
        i = end
        continue
    arg = _ROOT_ARG.match(text, j)
    if arg:
      out.append(command + "{" + arg.group(1) + "}")
      i = arg.end()
    else:
      out.append(command)
      i = at + 1


def _digits(text: str) -> str:
  """Any remaining Unicode decimal digit (category Nd) as its ASCII digit."""
  return "".join(str(unicodedata.decimal(c)) if not c.isascii() and c.isdecimal() else c
                 for c in text)


def normalise(text: str) -> str:
  """`text` with its Unicode mathematics in LaTeX (see the module doc)."""
  if text.isascii():
    return text
  for glyph, (p, q) in _VULGAR.items():
    text = text.replace(glyph, f"\\frac{{{p}}}{{{q}}}")
  text = _PER_MILLE.sub(lambda m: f"\\frac{{{m.group(1)}}}{{{'1000' if m.group(2) == chr(0x2030) else '10000'}}}", text)
  text = _roots(_SCRIPT_RUN.sub(_scripts, text))
  text = _digits(unicodedata.normalize("NFKC", text))
  for old, new in _SYMBOLS.items():
    text = text.replace(old, new)
  return text
