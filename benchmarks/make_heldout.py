"""Writes benchmarks/verifier_heldout_2.jsonl: the issue-29 held-out set.

Unlike the issue-17 set (pairs written by hand), every pair here is made by a
template from a random value and labelled by construction:

  * right: the gold's value in a rendering the verifier claims to read (a real
    unit, a multiplier word, Unicode digits/roots/superscripts/fractions, a
    wrapper such as \\operatorname{sgn} or \\color, a negated relation, a
    trailing punctuation mark, the answer stated before a correction);
  * wrong: the right digits with something that changes the value: an extra
    constant (e, i, pi), an operator or power, a quantifier or hedge word
    ("or more", "million" against the bare number), a flipped sign or
    relation, the corrected value of a sentence ("12, not 15" for 15), two
    boxes joined by a hedge, a partial formula, an empty or NaN gold.

One class per mechanism of issue 29. The file is written once and committed
before the verifier is changed; it is never used to tune the fixes.

  python benchmarks/make_heldout.py [--seed 29] [--per-template 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random

_HERE = os.path.dirname(os.path.abspath(__file__))
_SUPERSCRIPT = str.maketrans("0123456789-", "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b")
_FULLWIDTH = str.maketrans("0123456789", "".join(chr(0xFF10 + d) for d in range(10)))
_ARABIC_INDIC = str.maketrans("0123456789", "".join(chr(0x0660 + d) for d in range(10)))
_VULGAR = {(1, 2): "\u00bd", (1, 4): "\u00bc", (3, 4): "\u00be", (1, 3): "\u2153",
           (2, 3): "\u2154", (1, 8): "\u215b", (3, 8): "\u215c", (1, 5): "\u2155"}


def _frame(rng: random.Random, answer: str) -> str:
  """The answer at the end of a short solution, in one of the anchored forms."""
  return rng.choice([
      f"Adding the two parts gives the result.\nTherefore the answer is $\\boxed{{{answer}}}$.",
      f"\\boxed{{{answer}}}",
      f"We simplify step by step.\nAnswer: ${answer}$",
      f"So the final answer is ${answer}$.",
  ])


# Each template: rng -> (gold, prediction-answer, label, framed?). Unframed
# predictions are whole texts.
def _units(rng):
  v = rng.randint(2, 99)
  unit = rng.choice([r"\text{ cm}", r"\,\mathrm{m/s^2}", r"\text{ km/h}", r"\ \mathrm{kg}",
                     " meters", r"\text{ dollars}", r"\text{ cm}^2", r"\,\mathrm{km}",
                     r"\text{ square units}", r"\text{ hours}", r"\,\mathrm{N\cdot m}",
                     r"\text{ ml}", r"~\mathrm{g/cm^3}", " inches", r"\text{ mph}"])
  return str(v), f"{v}{unit}", True


def _multiplier_right(rng):
  v = rng.randint(2, 99)
  word, power = rng.choice([("million", 6), ("thousand", 3), ("billion", 9), ("hundred", 2)])
  form = rng.choice([rf"{v}\text{{ {word}}}", f"{v} {word}", rf"{v}\ \text{{{word}}}"])
  return str(v * 10**power), form, True


def _constant_wrong(rng):
  """The right digits times a constant or with a non-unit word: not the number."""
  v = rng.randint(3, 99)
  tail = rng.choice([r"\mathrm{e}", r"\mathrm{i}", " pi", r"\pi", r"\,\pi", "i", r"\text{ or more}",
                     r"\text{ or less}", r"\text{ at least}", " or more", r"\text{ million}",
                     " thousand", r"\text{ squared}", r"\text{ times}", r"\,\mathrm{e}^{2}",
                     r"\text{ dozen}", r"\sqrt{2}", "!", "^{2}", r"\text{ percent of } 50"])
  return str(v), f"{v}{tail}", False


def _complex(rng):
  a, b = rng.randint(1, 9), rng.randint(2, 9)
  right = rng.random() < 0.5
  gold = f"{a}+{b}i" if right else str(a + b)
  return gold, f"{a}+{b}\\mathrm{{i}}", right


def _euler_constant(rng):
  a, b = rng.randint(1, 9), rng.randint(2, 9)
  sign = rng.choice("+-")
  flipped = "-" if sign == "+" else "+"
  right = rng.random() < 0.5
  pred = f"{a} {sign if right else flipped} \\frac{{{b}}}{{\\mathrm{{e}}}}"
  return f"{a} {sign} \\frac{{{b}}}{{e}}", pred, right


def _unicode_right(rng):
  v = rng.randint(2, 30)
  kind = rng.randrange(9)
  if kind == 0:
    return str(v), f"\u221a{v * v}", True
  if kind == 1:
    return str(v), f"\u221b{v ** 3}", True
  if kind == 2:
    k = rng.randint(2, 9)
    return str(10**k), f"10{str(k).translate(_SUPERSCRIPT)}", True
  if kind == 3:
    (p, q), glyph = rng.choice(sorted(_VULGAR.items()))
    return f"\\frac{{{v * q + p}}}{{{q}}}", f"{v}{glyph}", True
  if kind == 4:
    return f"\\frac{{{v}}}{{1000}}", f"{v}\u2030", True
  if kind == 5:
    return str(v * 37), str(v * 37).translate(_FULLWIDTH), True
  if kind == 6:
    return str(v * 37), str(v * 37).translate(_ARABIC_INDIC), True
  if kind == 7:
    return f"-{v}", f"\u2013{v}", True
  a = rng.randint(2, 9)
  return str(a * v), f"{a}\u00b7{v}", True


def _unicode_wrong(rng):
  v = rng.randint(2, 30)
  kind = rng.randrange(7)
  if kind == 0:  # √16 is 4, not 16 and not 1·6.
    return rng.choice([str(v * v), str(int(str(v * v)[0]) * int(str(v * v)[1:] or 1))]), f"\u221a{v * v}", False
  if kind == 1:
    return str(v ** 3), f"\u221b{v ** 3}", False
  if kind == 2:
    k = rng.randint(2, 9)
    return rng.choice(["10", f"10{k}"]), f"10{str(k).translate(_SUPERSCRIPT)}", False
  if kind == 3:
    (p, q), glyph = rng.choice(sorted(_VULGAR.items()))
    return rng.choice([str(v), f"{v}{p}/{q}"]), f"{v}{glyph}", False
  if kind == 4:
    return str(v), f"{v}\u2030", False
  if kind == 5:
    return str(v), f"\u2013{v}", False
  k = rng.randint(2, 5)
  return str(v), f"{v}{str(k).translate(_SUPERSCRIPT)}", False


def _partial_parse(rng):
  """Unanchored math whose parse keeps only its leading number."""
  a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(11, 59)
  return rng.choice([
      (str(a), f"${a}\\sqrt[3]({b})$", False),
      (str(a), f"${a}\\text{{ hours }} {c}\\text{{ minutes}}$", False),
      (str(a), f"${a}^{{{b}}},$", False),
      (str(a), f"So $x = {a}\\sqrt{{", False),
      (str(a), f"We get $x = {a}\\frac{{", False),
      (str(a ** b), f"${a}^{{{b}}},$", True),
      (str(a ** b), f"${a}^{{{b}}};$", True),
      (f"{a}\\sqrt[3]{{{b}}}", f"${a}\\sqrt[3]({b})$", True),
  ])


def _punctuation(rng):
  a, b = rng.randint(2, 9), rng.randint(2, 6)
  mark = rng.choice(",;:?!")
  ending = rng.choice([f"Answer: {a}^{{{b}}}{mark}", f"The answer is ${a}^{{{b}}}{mark}$",
                       f"Answer: ${a}^{{{b}}}${mark}"])
  right = rng.random() < 0.6
  return (str(a ** b) if right else str(a)), ending, right


def _negation(rng):
  a = rng.randint(1, 20)
  var = rng.choice("xyn")
  neg = rng.choice([r"\not=", r"\neq", r"\ne", "\u2260", r"\not =" ])
  kind = rng.randrange(3)
  if kind == 0:
    return f"{var} = {a}", f"{var} {neg} {a}", False
  if kind == 1:
    return f"{var} \\neq {a}", f"{var} {neg} {a}", True
  rel, negated = rng.choice([("<", r"\not<"), (">", r"\not>"), (r"\le", r"\not\le"),
                             (r"\ge", r"\not\ge")])
  return f"{var} {rel} {a}", f"{var} {negated} {a}", False


def _correction(rng):
  """The answer sentence names the answer, then a rejected value."""
  a = rng.randint(2, 60)
  b = a + rng.randint(1, 9)
  noun = rng.choice(["apples", "cookies", "marbles", "students"])
  sentence = rng.choice([
      f"The answer is {a} {noun}, not {b}.",
      f"The answer is {a}, not {b}.",
      f"The answer is {a} rather than {b}.",
      f"The answer is ${a}$ rather than ${b}$.",
      f"The answer is {a} instead of {b}.",
      f"The answer is {a} (I first thought {b}).",
      f"Answer: {a} (not {b})",
      f"Answer: {a}, not {b}",
  ])
  if rng.random() < 0.3:
    sentence = f"<think>\nLet me count again. It could be {b}.\n</think>\n{sentence}"
  right = rng.random() < 0.5
  return (str(a) if right else str(b)), sentence, right


def _hedged_boxes(rng):
  a = rng.randint(2, 60)
  b = a + rng.randint(1, 9)
  join = rng.choice([r" \lor ", "/", " or ", r" \text{ or } ", r" \vee ", r"$ or $"])
  text = f"So $\\boxed{{{a}}}{join}\\boxed{{{b}}}$."
  return str(rng.choice([a, b])), text, False


def _wrappers_right(rng):
  a, b = rng.randint(2, 9), rng.randint(2, 9)
  k = rng.randint(2, 6)
  return rng.choice([
      ("-1", f"\\operatorname{{sgn}}(-{a})"),
      ("1", f"\\operatorname{{sgn}}({a})"),
      (str(a), f"\\operatorname{{Re}}({a}+{b}i)"),
      (str(b), f"\\operatorname{{Im}}({a}+{b}i)"),
      (str(math.gcd(a * k, b * k)), f"\\mathrm{{gcd}}({a * k}, {b * k})"),
      (str(math.gcd(a * k, b * k)), f"\\operatorname{{gcd}}({a * k}, {b * k})"),
      (str((a * 7 + b) % 7), f"{a * 7 + b} \\bmod 7"),
      (f"({a},{b})", f"\\Big({a}, {b}\\Big)"),
      (f"({a},{b})", f"\\bigl({a}, {b}\\bigr)"),
      (f"\\{{{a},{a + b}\\}}", f"\\lbrace {a}, {a + b}\\rbrace"),
      (f"-{a}", f"\\text{{negative }} {a}"),
      (str(a), f"\\color{{red}}{{{a}}}"),
      (str(a), f"\\textcolor{{blue}}{{{a}}}"),
      (str(a), f"\\underline{{{a}}}"),
      (str(a), f"\\text{{The answer is }} {a}"),
      (f"{a}+{b}i", f"{a}+{b}\\mathrm{{i}}"),
      (f"{a}-{b}i", f"\\overline{{{a}+{b}i}}"),
      (f"{a} < x < {a + b}", f"{a + b} > x > {a}"),
      (f"\\begin{{pmatrix}}{a}&{b}\\\\{b}&{a}\\end{{pmatrix}}",
       f"\\left(\\begin{{smallmatrix}}{a}&{b}\\\\{b}&{a}\\end{{smallmatrix}}\\right)"),
      (str(a * 3), f"{a * 3}\\,\\mathrm{{m/s^2}}"),
  ]) + (True,)


def _wrappers_wrong(rng):
  a, b = rng.randint(2, 9), rng.randint(2, 9)
  return rng.choice([
      (f"-{a}", f"\\operatorname{{sgn}}(-{a})"),
      (f"{a}+{b}i", f"\\operatorname{{Re}}({a}+{b}i)"),
      (str(a * 7 + b), f"{a * 7 + b} \\bmod 7"),
      (str(a), f"\\text{{negative }} {a}"),
      (f"{a}+{b}i", f"\\overline{{{a}+{b}i}}"),
      (f"{a} < x < {a + b + 1}", f"{a + b} > x > {a}"),
      (f"{a} < x < {a + b}", f"{a + b} < x < {a}"),
      (str(a + 1), f"\\underline{{{a}}}"),
      (str(a + 1), f"\\color{{red}}{{{a}}}"),
      (f"\\{{{a},{a + b + 1}\\}}", f"\\lbrace {a}, {a + b}\\rbrace"),
  ]) + (False,)


def _framebox(rng):
  a = rng.randint(2, 99)
  right = rng.random() < 0.5
  return str(a if right else a + 1), f"So the total is $\\framebox{{{a}}}$.", right


def _empty_gold(rng):
  gold = rng.choice(["", " ", "nan", "NaN", float("nan"), "None"])
  pred = rng.choice(["", "nan", "NaN", r"\boxed{}", "Answer: ", r"\boxed{nan}", "None"])
  return gold, pred, False


_TEMPLATES = {
    # class: (generator, framed, rows)
    "units": (_units, True, 30),
    "multiplier": (_multiplier_right, True, 20),
    "constant": (_constant_wrong, True, 50),
    "complex": (_complex, True, 16),
    "euler_constant": (_euler_constant, True, 12),
    "unicode_right": (_unicode_right, True, 40),
    "unicode_wrong": (_unicode_wrong, True, 35),
    "partial_parse": (_partial_parse, False, 30),
    "punctuation": (_punctuation, False, 20),
    "negation": (_negation, True, 24),
    "correction": (_correction, False, 40),
    "hedged_boxes": (_hedged_boxes, False, 24),
    "wrappers_right": (_wrappers_right, True, 45),
    "wrappers_wrong": (_wrappers_wrong, True, 25),
    "framebox": (_framebox, False, 8),
    "empty_gold": (_empty_gold, False, 12),
}


def make_rows(seed: int, scale: float = 1.0) -> list[dict]:
  rng = random.Random(seed)
  rows, seen = [], set()
  for name, (generate, framed, count) in _TEMPLATES.items():
    for _ in range(max(1, round(count * scale))):
      gold, answer, label = generate(rng)
      prediction = _frame(rng, answer) if framed else answer
      key = (str(gold), prediction)
      if key in seen:
        continue
      seen.add(key)
      rows.append({"class": name, "gold": gold, "prediction": prediction, "label": label})
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seed", type=int, default=29)
  parser.add_argument("--scale", type=float, default=1.0, help="rows per template, relative")
  parser.add_argument("--out", default=os.path.join(_HERE, "verifier_heldout_2.jsonl"))
  args = parser.parse_args()
  rows = make_rows(args.seed, args.scale)
  with open(args.out, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  print(f"{len(rows)} rows ({sum(r['label'] for r in rows)} right) -> {args.out}")


if __name__ == "__main__":
  main()
