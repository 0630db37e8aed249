"""The math verifier on the classes of issue 29, and properties over them.

Cases are written from the issue's class descriptions (not taken from
benchmarks/verifier_heldout_2.jsonl, which is held out). The table runs in one
`verify_batch`; the properties batch their examples too.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_jax.rewards import extract, last_number, unicode_math, units
from grpo_jax.rewards import math as rmath

# (class, gold, prediction, right?)
CLASSES = [
    # A unit is dropped only if it is one; e, i, pi and words that change the value stay.
    ("units", "3", r"\boxed{3\mathrm{e}}", False),
    ("units", "3", r"\boxed{3 pi}", False),
    ("units", "7", r"\boxed{4+3\mathrm{i}}", False),
    ("units", "4+3i", r"\boxed{4+3\mathrm{i}}", True),
    ("units", "3", r"\boxed{3\text{ or more}}", False),
    ("units", "8", r"\boxed{8 \text{ at most}}", False),
    ("units", "5000000", r"\boxed{5\text{ million}}", True),
    ("units", "5", r"\boxed{5\text{ million}}", False),
    ("units", "2400", r"The answer is $2.4$ thousand.", True),
    ("units", "1 - \\frac{1}{e}", r"\boxed{1 + \frac{1}{\mathrm{e}}}", False),
    ("units", "1 - \\frac{1}{e}", r"\boxed{1 - \frac{1}{\mathrm{e}}}", True),
    ("units", "12", r"\boxed{12\,\mathrm{m/s^2}}", True),
    ("units", "9.8", r"\boxed{9.8 \text{ m/s}^2}", True),
    ("units", "40", r"\boxed{40 \text{ students}}", True),
    ("units", "7", r"\boxed{7 \text{ squared}}", False),
    # Unicode, with each symbol's argument.
    ("unicode", "4", "\\boxed{\u221a16}", True),
    ("unicode", "6", "\\boxed{\u221a16}", False),
    ("unicode", "3", "\\boxed{\u221b27}", True),
    ("unicode", "1000000", "\\boxed{10\u2076}", True),
    ("unicode", "10", "\\boxed{10\u2076}", False),
    ("unicode", r"\frac{7}{2}", "\\boxed{3\u00bd}", True),
    ("unicode", "3", "\\boxed{3\u00bd}", False),
    ("unicode", "0.007", "\\boxed{7\u2030}", True),
    ("unicode", "42", "\\boxed{\uff14\uff12}", True),
    ("unicode", "42", "\\boxed{\u0664\u0662}", True),
    ("unicode", "-5", "\\boxed{\u20135}", True),
    ("unicode", "12", "\\boxed{3\u00b74}", True),
    ("unicode", r"2\sqrt{3}", "\\boxed{2\u221a3}", True),
    # Partial parses and trailing punctuation.
    ("partial", "2", r"$2\sqrt[3](5)$", False),
    ("partial", r"2\sqrt[3]{5}", r"$2\sqrt[3](5)$", True),
    ("partial", "4", r"$4\text{ hours } 30\text{ minutes}$", False),
    ("partial", "2", "$2^{10},$", False),
    ("partial", "1024", "$2^{10},$", True),
    ("partial", "3", "So $x = 3\\sqrt{", False),
    ("partial", "1024", "Answer: $2^{10}$;", True),
    ("partial", "81", r"The answer is $3^{4}$?", True),
    ("partial", "120", r"\boxed{5!}", True),  # Glued `!` is a factorial.
    ("partial", "1024", "Answer: $2^{10}$!", True),
    ("partial", "1024", "Answer: 2^{10}!", True),  # After a power's brace: punctuation.
    ("partial", "6", "Answer: $3!$", True),
    # Negated relations.
    ("negation", "x = 2", r"\boxed{x \not= 2}", False),
    ("negation", r"x \neq 2", r"\boxed{x \not= 2}", True),
    ("negation", r"x \neq 2", "\\boxed{x \u2260 2}", True),
    ("negation", "x < 2", r"\boxed{x \not< 2}", False),
    ("negation", r"x \geq 2", r"\boxed{x \not< 2}", True),
    # The answer sentence: its first formula, not the corrected one.
    ("correction", "15", "The answer is 12 apples, not 15.", False),
    ("correction", "12", "The answer is 12 apples, not 15.", True),
    ("correction", "15", "The answer is 12 rather than 15.", False),
    ("correction", "15", "The answer is 12 instead of 15.", False),
    ("correction", "20", "The answer is 12 (I first thought 20).", False),
    ("correction", "12", "The answer is 12 (I first thought 20).", True),
    ("correction", "15", "<think>\nmaybe 15\n</think>\nThe answer is 12, not 15.", False),
    ("correction", "15", "So the total is 12, not 15.", False),
    ("correction", "6", "The answer is 5 apples, or maybe 6.", False),
    ("correction", "6", "The answer is 5, but it could be 6.", False),
    ("correction", "12", "The answer is not 12 but 15.", False),
    ("correction", "15", "The answer is not 12 but 15.", True),
    ("correction", "12", "The answer is not 12.", False),
    ("partial", "3", "So x = 3\\sqrt{", False),
    ("negation", "x = 1", r"\boxed{x \not\approx 1}", False),
    ("units", "6", r"\boxed{6^{\circ}\text{F}}", True),
    # Hedged boxes are a list, never the last box.
    ("hedge", "5", r"$\boxed{4} \lor \boxed{5}$", False),
    ("hedge", "4", r"$\boxed{4} \lor \boxed{5}$", False),
    ("hedge", "5", r"$\boxed{4}/\boxed{5}$", False),
    ("hedge", "5", r"$\boxed{4}$ or $\boxed{5}$", False),
    # Wrappers that are read.
    ("wrappers", "-1", r"\boxed{\operatorname{sgn}(-3)}", True),
    ("wrappers", "-3", r"\boxed{\operatorname{sgn}(-3)}", False),
    ("wrappers", "3", r"\boxed{\operatorname{Re}(3+4i)}", True),
    ("wrappers", "4", r"\boxed{\operatorname{Im}(3+4i)}", True),
    ("wrappers", "6", r"\boxed{\mathrm{gcd}(12,18)}", True),
    ("wrappers", "2", r"\boxed{17 \bmod 5}", True),
    ("wrappers", "17", r"\boxed{17 \bmod 5}", False),
    ("wrappers", "(1,2)", r"\boxed{\Big(1, 2\Big)}", True),
    ("wrappers", r"\{1,2\}", r"\boxed{\lbrace 1, 2\rbrace}", True),
    ("wrappers", "-8", r"\boxed{\text{negative } 8}", True),
    ("wrappers", "8", r"\boxed{\text{negative } 8}", False),
    ("wrappers", "5", r"So it is $\framebox{5}$.", True),
    ("wrappers", "5", r"\boxed{\color{red}{5}}", True),
    ("wrappers", "5", r"\boxed{\underline{5}}", True),
    ("wrappers", "5", r"\boxed{\text{The answer is } 5}", True),
    ("wrappers", "3-4i", r"\boxed{\overline{3+4i}}", True),
    ("wrappers", "3+4i", r"\boxed{\overline{3+4i}}", False),
    ("wrappers", "1 < x < 3", r"\boxed{3 > x > 1}", True),
    ("wrappers", "1 < x < 4", r"\boxed{3 > x > 1}", False),
    ("wrappers", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}",
     r"\boxed{\left(\begin{smallmatrix}1&2\\3&4\end{smallmatrix}\right)}", True),
    # A missing gold matches nothing.
    ("missing_gold", float("nan"), "nan", False),
    ("missing_gold", np.float64("nan"), r"\boxed{nan}", False),
    ("missing_gold", "nan", "nan", False),
    ("missing_gold", "", "", False),
    ("missing_gold", " NaN ", "NaN", False),
    ("missing_gold", float("inf"), "inf", False),
    ("missing_gold", 5.0, r"\boxed{5}", True),
]


@pytest.fixture(scope="module")
def class_verdicts():
  return rmath.verify_batch([g for _, g, _, _ in CLASSES], [p for _, _, p, _ in CLASSES])


@pytest.mark.parametrize("index", range(len(CLASSES)),
                         ids=[f"{c}-{i}" for i, (c, _, _, _) in enumerate(CLASSES)])
def test_issue29_classes(class_verdicts, index):
  _, gold, prediction, right = CLASSES[index]
  assert class_verdicts[index] is right, (gold, prediction)


# ---------------------------------------------------------------- pure parts

@pytest.mark.parametrize("text,latex", [
    ("\u221a16", r"\sqrt{16}"), ("\u221a(x+1)", r"\sqrt{x+1}"), ("\u221b27", r"\sqrt[3]{27}"),
    ("2\u221a3", r"2\sqrt{3}"), ("\u221a\u03c0", r"\sqrt{\pi }"),
    ("10\u2076", "10^{6}"), ("x\u207b\u00b9", "x^{-1}"), ("a\u2081", "a_{1}"),
    ("3\u00bd", r"3\frac{1}{2}"), ("\u00be", r"\frac{3}{4}"), ("5\u2030", r"\frac{5}{1000}"),
    ("\uff11\uff12", "12"), ("\u0661\u0662", "12"), ("\u0967\u0968", "12"),
    ("\u20134", "-4"), ("2\u00b73", r"2\cdot 3"), ("1\u20442", "1/2"), ("abc", "abc"),
])
def test_unicode_math_normalise(text, latex):
  assert unicode_math.normalise(text) == latex


@pytest.mark.parametrize("answer,stripped", [
    (r"10\text{ cm}", "10"), (r"12\,\mathrm{m/s^2}", "12"), ("5 m/s", "5"),
    (r"6\,\mathrm{N\cdot m}", "6"), (r"15\mbox{ cm}^2", "15"), ("36 apples", "36"),
    (r"\frac{1}{2}\text{ cm}", r"\frac{1}{2}"), (r"$20,500$ dollars", "$20,500$"),
    ("5 m", "5 m"), (r"3\mathrm{e}", r"3\mathrm{e}"), ("3 pi", "3 pi"),
    (r"3\text{ or more}", r"3\text{ or more}"), ("3 times", "3 times"), ("2x", "2x"),
    (r"\text{Evelyn}", r"\text{Evelyn}"), (r"x\text{ cm}", r"x\text{ cm}"),
    (r"5\text{ million}", r"5\times 10^{6}"), ("2 dozen", r"2\times 12"),
    ("5 million dollars", r"5\times 10^{6}"),
    (r"12 \text{ red marbles}", "12"), ("12 or more marbles", "12 or more marbles"),
    (r"5\text{ twelfths}", r"5\text{ twelfths}"), (r"5\text{ months}", "5"),
])
def test_strip_units(answer, stripped):
  assert units.strip_units(answer) == stripped


@pytest.mark.parametrize("text,answer", [
    ("The answer is 12 apples, not 15.", "12 apples"),
    ("Answer: 12, not 15", "12"),
    ("The answer is $12$ rather than $15$.", "12"),
    ("The answer is 12 (I first thought 20).", "12"),
    ("Answer: (1, 2)", "(1, 2)"),
    ("Answer: f(x) = (x+1)^2", "f(x) = (x+1)^2"),
    ("So the total is 12, not 15.", "12"),
    (r"$\boxed{4} \lor \boxed{5}$", "4, 5"),
    (r"\boxed{4}/\boxed{5}", "4, 5"),
    (r"\boxed{\text{The answer is } 5}", "5"),
    (r"So $\framebox{7}$.", "7"),
    ("Answer: $2^{10}$,", "2^{10}"),
    (r"\boxed{5!}", "5!"),
    ("Therefore, there are 24 ways to arrange the books.", "24"),
    ("The answer is 5 apples, or maybe 6.", "5"),
    ("The result is 2 to the power of ten.", "2 to the power of ten"),
])
def test_extract_issue29(text, answer):
  assert extract.extract_answer(text).text == answer


@pytest.mark.parametrize("text,value", [
    ("so 15", 15), ("The answer is 15.", 15), ("a total of 15", 15), ("1,234 apples", 1234),
    (r"\boxed{2^{15}}", None), (r"\frac{3}{15}", None), (r"\sqrt{15}", None), ("15!", None),
    (r"15\pi", None), ("10\u2076", None), ("15 million", None), ("12, not 15", None),
    ("12 instead of 15", None), ("x_{15}", None), ("3/15", None), (r"x \neq 15", None),
    ("x < 15", None), (r"x \geq 15", None), (r"15 \text{ or more}", None), ("at least 15", 15),
])
def test_last_number_is_a_whole_number(text, value):
  assert last_number.last_number(text) == (None if value is None else Fraction(value))


@pytest.mark.parametrize("gold,response,expected", [
    ("", "Answer: $ $", False), ("dollars", "Answer: cents", False),
    (float("nan"), "Answer: nan", False), ("nan", "Answer: nan", False),
    (5.0, "Answer: 5", True), ("5", "Answer: 5", True),
    ("5", "Answer: x = 5", True),  # DAPO's own rule: the text after the last "=".
    ("5", "Answer: $5$ or $6$", True),  # DAPO's own rule: the first $...$ of the line.
])
def test_dapo_missing_gold_and_own_rules(gold, response, expected):
  assert rmath.verify_dapo(gold, response) is expected


def test_math_dapo_reward_scores_a_missing_gold_wrong():
  rewards = rmath.math_dapo_reward(["p"], ["Answer: ", "Answer: $$"], [""], np.ones(2))
  np.testing.assert_array_equal(rewards, [-1.0, -1.0])


# ---------------------------------------------------------------- properties

_PROPERTY = settings(max_examples=10, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
_UNIT = st.sampled_from([r"\text{ cm}", r"\,\mathrm{kg}", " meters", r"\text{ dollars}",
                         r"\,\mathrm{m/s^2}", r"\text{ km/h}", " apples", r"\text{ hours}"])
_FRAME = st.sampled_from([r"\boxed{{{}}}", "The answer is ${}$.", "Answer: {}",
                          r"So $x = \boxed{{{}}}$."])
_WIDE = str.maketrans("0123456789", "".join(chr(0xFF10 + d) for d in range(10)))
_ARABIC = str.maketrans("0123456789", "".join(chr(0x0660 + d) for d in range(10)))
_SUP = str.maketrans("0123456789", "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079")


def _right(n: int, kind: int, unit: str, k: int) -> tuple[str, str]:
  """(gold, answer) with the answer in a supported rendering of the gold."""
  renderings = [
      (str(n), f"{n}{unit}"),
      (str(n * 10**6), rf"{n}\text{{ million}}"),
      (str(n), str(n).translate(_WIDE)),
      (str(n), str(n).translate(_ARABIC)),
      (str(n % 97 + 2), f"\u221a{(n % 97 + 2) ** 2}"),
      (str(10**k), f"10{str(k).translate(_SUP)}"),
      (str(n), rf"\underline{{{n}}}"),
      (str(n), rf"\color{{blue}}{{{n}}}"),
      (f"-{n}", rf"\text{{negative }} {n}"),
  ]
  return renderings[kind % len(renderings)]


@_PROPERTY
@given(st.lists(st.tuples(st.integers(2, 10**6), st.integers(0, 99), _UNIT,
                          st.integers(2, 9), _FRAME), min_size=1, max_size=8))
def test_property_a_right_value_in_a_supported_rendering_is_accepted(items):
  golds, predictions = [], []
  for n, kind, unit, k, frame in items:
    gold, answer = _right(n, kind, unit, k)
    golds.append(gold)
    predictions.append(frame.format(answer))
  assert rmath.verify_batch(golds, predictions) == [True] * len(golds), predictions


_EXTRA = st.sampled_from([
    r"{}\mathrm{{e}}", r"{}\mathrm{{i}}", "{} pi", r"{}\pi", "{}i", r"{}\text{{ or more}}",
    "{} or less", r"{}\text{{ million}}", "{} thousand", r"{}\text{{ squared}}",
    r"{}\text{{ times}}", "{}!", "{}^{{2}}", r"\sqrt{{{}}}", "-{}", "{}\u00b2", "{}\u00bd",
    "\u221a{}", "{}\u2030", r"{}\sqrt{{2}}", r"x \not= {}", "{}, not {}1", "{} (not {}1)",
])


@_PROPERTY
@given(st.lists(st.tuples(st.integers(3, 10**6), _EXTRA, _FRAME), min_size=1, max_size=8))
def test_property_the_right_digits_with_an_extra_part_are_never_accepted(items):
  """n against n times a constant, with an operator, a power, a non-unit word,
  a sign, a negated relation, or named before a rejected value (gold n1)."""
  golds, predictions = [], []
  for n, extra, frame in items:
    answer = extra.format(n, n)
    corrected = ", not" in extra or "(not" in extra
    golds.append(f"{n}1" if corrected else str(n) if "not=" not in extra else f"x = {n}")
    predictions.append(f"The answer is {answer}." if corrected else frame.format(answer))
  assert not any(rmath.verify_batch(golds, predictions)), predictions


_MISSING = st.sampled_from(["", " ", "nan", "NaN", None, float("nan"), np.float32("nan"),
                            float("inf")])


@_PROPERTY
@given(st.lists(st.tuples(_MISSING, st.one_of(
    st.sampled_from(["", "nan", "NaN", "None", r"\boxed{}", "Answer: ", "inf"]),
    st.text(max_size=20))), min_size=1, max_size=8))
def test_property_a_missing_gold_matches_nothing(pairs):
  assert not any(rmath.verify_batch([g for g, _ in pairs], [p for _, p in pairs]))
  assert not any(rmath.verify_dapo(g, "Answer: " + str(p)) for g, p in pairs)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**12), st.sampled_from([0xFF10, 0x0660, 0x0966, 0x1D7CE]))
def test_property_unicode_digits_read_as_ascii(n, zero):
  digits = "".join(chr(zero + int(d)) for d in str(n))
  assert unicode_math.normalise(digits) == str(n)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10**6), st.integers(2, 99))
def test_property_last_number_is_never_an_exponent_or_denominator(a, b):
  assert last_number.last_number(f"so it is {a}.") == a
  for bound in (f"{a}^{{{b}}}", f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"\\sqrt{{{b}}}", f"{b}!"):
    assert last_number.last_number(f"The answer is ${bound}$") is None, bound


def test_missing_gold_helper():
  assert rmath.gold_text(float("nan")) is None and rmath.gold_text(" nan ") is None
  assert rmath.gold_text(5.0) == "5" and rmath.gold_text(0.5) == "0.5"
  assert rmath.gold_text(np.float64(2.5)) == "2.5" and rmath.gold_text("0") == "0"
