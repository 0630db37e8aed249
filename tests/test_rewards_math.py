"""Tests for the math verifier: extraction, equivalence, DAPO mode, safety.

All verifications share the process-wide worker pool (`default_pool`), and
the two big tables are verified in ONE batch, so the file costs a couple of
worker start-ups, not hundreds of round trips.
"""
from __future__ import annotations

import builtins
import os
import subprocess
import sys
import time
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_jax.rewards import contract, extract, minerva
from grpo_jax.rewards import math as rmath

# (category, gold, prediction): the prediction is right.
EQUIVALENT = [
    # Integers with thousands separators.
    ("thousands", "1000", "1,000"),
    ("thousands", "1000000", "1,000,000"),
    ("thousands", "7425000", r"\boxed{7,425,000}"),
    ("thousands", "1000", r"1\,000"),
    ("thousands", "1234567", r"1\,234\,567"),
    ("thousands", "1000", "1{,}000"),
    ("thousands", "12000", "12 000"),
    ("thousands", "1000.5", "1,000.5"),
    ("thousands", "16386.20", r"\boxed{\$16,\!386.20}"),
    ("thousands", "1000", r"1\ 000"),
    ("thousands", "12000023", "Final Answer: The final answer is 12,000,023. I hope it is correct."),
    # Decimals and fractions.
    ("fraction", "0.5", r"\frac{1}{2}"),
    ("fraction", r"\frac{1}{2}", "0.5"),
    ("fraction", r"\frac12", "1/2"),
    ("fraction", r"\dfrac{3}{4}", "0.75"),
    ("fraction", r"\tfrac{3}{4}", "3/4"),
    ("fraction", "1/3", r"\frac{1}{3}"),
    ("fraction", r"\frac{2}{4}", r"\frac{1}{2}"),
    ("fraction", r"-\frac{10}{9}", "-10/9"),
    ("fraction", r"\frac{1}{3}", "0.333333"),
    ("fraction", "2.5", r"\frac{5}{2}"),
    ("fraction", ".4", "0.4"),
    ("fraction", r"\frac{7}{2}", "3.5"),
    ("fraction", r"\frac{1}{12}", "0.0833333333333333"),
    ("fraction", "5", "5.00"),
    ("fraction", r"\cfrac{1}{3}", "1/3"),
    # Percentages.
    ("percent", r"50\%", "50"),
    ("percent", r"50\%", r"50\%"),
    ("percent", r"28\%", "28 percent"),
    ("percent", r"12.5\%", "12.5"),
    ("percent", r"10\%", r"\boxed{10\%}"),
    ("percent", r"50\%", "0.5"),
    ("percent", r"28\%", r"\boxed{28 pct}"),
    # Square roots.
    ("sqrt", r"2\sqrt{2}", r"\sqrt{8}"),
    ("sqrt", r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"),
    ("sqrt", r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"),
    ("sqrt", r"\sqrt{3}", r"\sqrt3"),
    ("sqrt", r"3\sqrt{13}", r"\sqrt{117}"),
    ("sqrt", r"\sqrt[3]{8}", "2"),
    ("sqrt", r"\sqrt{2}+\sqrt{5}", r"\sqrt 5+\sqrt 2"),
    ("sqrt", r"1 \pm \sqrt{19}", r"$x = \boxed{1 \pm \sqrt{19}}.$"),
    # Pi.
    ("pi", r"\pi", r"\pi"),
    ("pi", r"\frac{\pi}{2}", r"\pi/2"),
    ("pi", r"2\pi", r"2 \pi"),
    ("pi", r"\frac{9}{4}\pi", r"\frac94\pi"),
    ("pi", r"\frac{\pi}{6}", r"\frac{1}{6}\pi"),
    ("pi", r"\pi r^2", r"r^2\pi"),
    # Expressions equal after simplification.
    ("simplify", "x^2+2x+1", "(x+1)^2"),
    ("simplify", r"\frac{x+2}{7}", r"\frac{x}{7}+\frac{2}{7}"),
    ("simplify", "2x+2", "2(x+1)"),
    ("simplify", r"\tan^2(y)+1", r"\sec^2(y)"),
    ("simplify", r"\sin^2 x+\cos^2 x", "1"),
    ("simplify", "(a+b)^2", "a^2+2ab+b^2"),
    ("simplify", "2^{10}", "1024"),
    ("simplify", r"\binom{5}{2}", "10"),
    ("simplify", "5!", "120"),
    ("simplify", r"\log_2 8", "3"),
    ("simplify", "2-2p", r"Thus $x-p=\boxed{2-2p}$."),
    ("simplify", r"2 \sin b \cos a", r"\boxed{2 \cos a \sin b}"),
    # Equations.
    ("equation", "3", "x=3"),
    ("equation", "x=3", "3"),
    ("equation", "k=1", "1"),
    ("equation", "y=2x+1", "y = 1 + 2x"),
    ("equation", "2x+4y-3=0", r"y=-\frac{1}{2}x+\frac{3}{4}"),
    ("equation", "x^2/4 + y^2/3 = 1", "x^2/16 + y^2/12 = 1/4"),
    ("equation", r"x \geq 5", r"5 \leq x"),
    ("equation", "x<1", "-x>-1"),
    ("equation", "-3", "x=-3"),
    # Intervals.
    ("interval", "[1,2]", "[1, 2]"),
    ("interval", "(1,2]", r"\left(1, 2\right]"),
    ("interval", r"(-\infty, 3)", r"(-\infty,3)"),
    ("interval", "[0,1)", "[0, 1)"),
    ("interval", r"(-\infty,3]", r"x \le 3"),
    ("interval", r"[-1, -\frac{1}{2}) \cup (0, 1)", r"[-1,-\tfrac12)\cup(0,1)"),
    ("interval", r"(\frac{3}{5}, 2]", "(0.6, 2]"),
    ("interval", r"x \in [2,5]", "[2,5]"),
    ("interval", r"\{-1\} \cup [0,7)", r"x \in \boxed{\{-1\} \cup [0,7)}"),
    # Sets and tuples.
    ("set", r"\{1,2\}", r"\{2,1\}"),
    ("set", "1,2", "2,1"),
    ("set", "(1,2)", "(1, 2)"),
    ("set", "(6,31,-1)", r"\left(6, 31, -1\right)"),
    ("set", r"(1,\frac{9}{2})", "(1,4.5)"),
    ("set", r"\{-2, 1\}", "-2, 1"),
    ("set", r"\pm 2", r"\{-2, 2\}"),
    ("set", r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)"),
    ("set", r"\{1\pm\sqrt{5},-2\}", r"the answer is $\boxed{\{1\pm\sqrt{5},-2\}}.$"),
    ("set", "19, 46, 82", r"19, 46, \text{ and } 82"),
    # Matrices.
    ("matrix", r"\begin{pmatrix}1&0\\0&1\end{pmatrix}", r"\begin{bmatrix}1 & 0 \\ 0 & 1\end{bmatrix}"),
    ("matrix", r"\begin{pmatrix}\frac12\\3\end{pmatrix}", r"\begin{pmatrix}0.5\\3\end{pmatrix}"),
    ("matrix", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\left[\begin{array}{cc}1 & 2 \\3 & 4\end{array}\right]"),
    ("matrix", r"\begin{pmatrix}6&8\\10&12\end{pmatrix}",
     r"The sum is $\begin{pmatrix}1&2\\3&4\end{pmatrix}+\begin{pmatrix}5&6\\7&8\end{pmatrix}$"),
    ("matrix", r"\begin{pmatrix} 0 & 3 \\ 0 & -1 \end{pmatrix}", r"\boxed{\begin{pmatrix}0&3\\0&-1\end{pmatrix}}"),
    # Scientific notation.
    ("scientific", "1500", r"1.5\times10^{3}"),
    ("scientific", "1500", r"1.5 \times 10^3"),
    ("scientific", "1500", "1.5e3"),
    ("scientific", "0.0015", r"1.5\times 10^{-3}"),
    ("scientific", r"3\times10^{8}", "300000000"),
    ("scientific", r"6.02\times 10^{23}", "6.02e23"),
    ("scientific", r"1.5\cdot 10^{3}", "1500"),
    # Infinity.
    ("infinity", r"\infty", r"\infty"),
    ("infinity", r"-\infty", r"-\infty"),
    ("infinity", r"\infty", "\u221e"),
    ("infinity", r"(0,\infty)", r"(0, \infty)"),
    # Units and \text{}.
    ("units", "10", r"10\text{ cm}"),
    ("units", "10", "10 cm"),
    ("units", "5", r"5\text{ dollars}"),
    ("units", "125", r"The distance is $\boxed{125\textnormal{ miles}}.$"),
    ("units", "15", r"\boxed{15\mbox{ cm}^2}"),
    ("units", r"\text{Evelyn}", "Evelyn"),
    ("units", r"\text{Evelyn}", r"Therefore, $\boxed{\text{Evelyn}}$ is our answer."),
    ("units", "5", r"\$5"),
    ("units", "1000.99", r"\$1,000.99"),
    ("units", "3.5", "The answer is 3.5 meters."),
    # Degrees.
    ("degrees", r"30^\circ", "30"),
    ("degrees", "30", r"30^{\circ}"),
    ("degrees", r"90^\circ", "90\u00b0"),
    ("degrees", "45", "45 degrees"),
    ("degrees", r"90^\circ", r"\angle BAC = \boxed{90^\circ}."),
    # \left( and \right).
    ("leftright", "(1,2)", r"\left(1,2\right)"),
    ("leftright", r"\frac{1}{3}", r"\left( \frac{1}{3} \right)"),
    ("leftright", "[0,1]", r"\left[0,1\right]"),
    ("leftright", r"\{1,2\}", r"\left\{1,2\right\}"),
    ("leftright", r"(\frac{4}{5},\frac{1}{5})", r"$(t,u) = \boxed{\left( \frac{4}{5}, \frac{1}{5} \right)}.$"),
    # LaTeX spacing commands.
    ("spacing", r"\frac{1}{2}", r"\frac{1}{2}\,"),
    ("spacing", "x+1", r"x\;+\;1"),
    ("spacing", "3", r"\quad 3"),
    ("spacing", r"2\pi", r"2\,\pi"),
    ("spacing", r"\frac{1}{2}", r"\displaystyle\frac{1}{2}"),
    ("spacing", "10000", r"10,\!000"),
    # Negative numbers.
    ("negative", "-5", "-5"),
    ("negative", "-5", "\u22125"),
    ("negative", r"-\frac{1}{2}", "-0.5"),
    ("negative", "-2.5", r"-\frac{5}{2}"),
    ("negative", "-1", "(-1)"),
    ("negative", "-2,1", r"the only integer roots are $\boxed{-2,1}.$"),
    # Extraction from whole solutions.
    ("extract", "2", r"The answer is \boxed{2}."),
    ("extract", "7", r"\fbox{7}"),
    ("extract", r"\frac{1}{\sqrt{2}}", r"so \boxed{\frac{1}{\sqrt{2}}}."),
    ("extract", r"\{1,2\}", r"\boxed{\{1,2\}}"),
    ("extract", "42", "#### 42"),
    ("extract", "1234", "Natalia sold 1,234 clips.\n#### 1,234"),
    ("extract", "42", "Answer: 42"),
    ("extract", "42", "**Answer:** $42$"),
    ("extract", "42", "Answer:\n42"),
    ("extract", r"28\%", "Final Answer: The final answer is $28 \\%$. I hope it is correct."),
    ("extract", "18", "So the answer is 18."),
    ("extract", "18", "I think it is 17. Actually the total is 18"),
    ("extract", "189", "So area is 189.\n\\boxed{189}\n</think>\nThe area is \\(\\boxed{189}\\) square centimeters."),
    ("extract", "5", r"\boxed 5"),
    ("extract", "2/3", "P(A) = (1/2) * (4/3) = 2/3. Therefore, the probability that "
     "Alice wins is 2/3. <|im_start|>user"),
    ("extract", r"x \geq 5", r"Therefore $x \geq 5$ is the solution."),
    ("extract", "9", r"Answer \[ 9 \]"),
    ("extract", r"\frac{14}{3}", r"$f(-2)+f(-1)+f(0)=2+\frac{5}{3}+1=\boxed{\frac{14}{3}}$"),
    ("extract", r"Thus $x-p=\boxed{2-2p}$.", r"\boxed{2-2p}"),
    ("extract", r"$\frac{1}{2}$", "$0.5$"),
    ("extract", "$120$", "The volume is $5 \\times 6 \\times 4 = 120$. Final Answer: "
     "The volume of $ABCDEFGH$ is 120. I hope it is correct."),
    ("extract", "x=3", "Solving gives x = 3.\nThe answer is $x=3$."),
    ("extract", "42", "Let me compute.\n\n" + "blah " * 3000 + "\nAnswer: 42"),
]

# (category, gold, prediction): the prediction is wrong.
NOT_EQUIVALENT = [
    ("near", r"\frac{1}{2}", "0.49"),
    ("near", "1/2", "0.4999"),
    ("near", r"\pi", "3.14"),
    ("near", r"\sqrt{2}", "1.41"),
    ("near", r"\frac{1}{3}", "0.33"),
    ("digits", "3", "33"),
    ("digits", "33", "3"),
    ("digits", "1000", "100"),
    ("digits", "1000", "10000"),
    ("digits", "1000", "1.000"),
    ("digits", "0.5", "5"),
    ("digits", "12:00", "1:00"),
    ("sign", "x+1", "x-1"),
    ("sign", "-5", "5"),
    ("sign", "5", "-5"),
    ("sign", r"\infty", r"-\infty"),
    ("sign", r"\pm 2", "2"),
    ("sign", r"\pm 2021", "2021"),
    ("interval", "[1,2]", "(1,2)"),
    ("interval", "(1,2)", "[1,2]"),
    ("interval", "[1,2)", "[1,2]"),
    ("interval", "(0,9)", "[0,9)"),
    ("interval", "[0,1)", "Final Answer: The final answer is $(0, 1)$. I hope it is correct."),
    ("interval", "[-3,2]", r"which is $\boxed{(-\infty, -3] \cup [2, \infty)}$."),
    ("interval", "1", r"-[0,1)"),
    ("set", "(1,2)", "(2,1)"),
    ("set", r"\{1,2\}", r"\{1,2,3\}"),
    ("set", r"\{1,2\}", r"\{1\}"),
    ("set", "-2,1", "-2"),
    ("set", "19, 46, 82", "21, 36, 82"),
    ("expression", "x^2", "x^3"),
    ("expression", r"2\sqrt{2}", r"2\sqrt{3}"),
    ("expression", "x+2n+1", "x+1"),
    ("expression", "(a+5)(b+2)", "(+5)(b+2)"),
    ("expression", "2", r"\frac{1+\sqrt{5}}{2}"),
    ("expression", r"1\sqrt{19}", "1"),
    ("expression", "2x+1", "2x+2"),
    ("equation", "x=3", "y=3"),
    ("equation", "x > 5", "x < 5"),
    ("equation", r"x \geq 5", r"x \leq 5"),
    ("equation", "a+3z = 0", "0"),
    ("equation", "2x + z = 1", "1"),
    ("equation", "7 = 11a+c", "11a+c"),
    ("matrix", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix}1&2\\3&5\end{pmatrix}"),
    ("matrix", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix}1&3\\2&4\end{pmatrix}"),
    ("matrix", r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix}2\\1\end{pmatrix}"),
    ("percent", "0.28", "28"),
    ("percent", "28/100", "28"),
    ("percent", "28", "28/100"),
    ("scientific", r"1.5\times10^{3}", "150"),
    ("scientific", "1500", "1.5e4"),
    ("degrees", r"30^\circ", "60"),
    ("units", r"\text{Evelyn}", "Carla"),
    ("units", "10", r"100\text{ cm}"),
    ("extract", "2", r"\boxed{3}"),
    ("extract", "2", r"\boxed{2} wait, no: \boxed{3}"),
    # E5 (issue 45): every side of a chain must equal the answer (7 is not 11).
    ("equation", "x = 11", "x = 5+5+1 = 7 = 11"),
    # A5 (issue 45): a corrected box is a second final answer; neither earns.
    ("extract", "3", r"\boxed{2} wait, no: \boxed{3}"),
    ("extract", "42", "#### 41"),
    ("extract", "42", "Answer: 41"),
    ("extract", "42", "The answer is 42? No. Answer: 43"),
    ("extract", "2", "AZYUK2A"),
    ("empty", "42", ""),
    ("empty", "42", "   "),
    ("empty", "42", "no idea"),
    ("empty", "42", r"\boxed{}"),
    ("empty", "", "42"),
    ("hedge", "4", r"\boxed{3 or 4}"),
    ("hedge", "4", r"\boxed{3, 4}"),
    ("hedge", "4", "3, 4"),
    ("hedge", "4", "Answer: 3 or 4"),
]

CASES = [(c, g, p, True) for c, g, p in EQUIVALENT] + [
    (c, g, p, False) for c, g, p in NOT_EQUIVALENT]


@pytest.fixture(scope="module")
def verdicts():
  """All table cases verified in one parallel batch (order preserved)."""
  golds = [g for _, g, _, _ in CASES]
  predictions = [p for _, _, p, _ in CASES]
  return rmath.verify_batch(golds, predictions)


def test_table_has_200_cases_in_every_category():
  assert len(CASES) >= 200
  categories = {c for c, _, _, _ in CASES}
  assert {"thousands", "fraction", "percent", "sqrt", "pi", "simplify",
          "equation", "interval", "set", "matrix", "scientific", "infinity",
          "units", "degrees", "leftright", "spacing", "negative",
          "extract"} <= categories


@pytest.mark.parametrize(
    "index", range(len(CASES)),
    ids=[f"{'eq' if e else 'ne'}-{c}-{i}" for i, (c, _, _, e) in enumerate(CASES)])
def test_verify_table(verdicts, index):
  _, gold, prediction, expected = CASES[index]
  assert verdicts[index] is expected, (gold, prediction)


def test_verify_single_call_matches_batch(verdicts):
  """`verify` and `verify_batch` agree (a few cases, one call each)."""
  for index in (0, 20, len(EQUIVALENT) + 5):
    _, gold, prediction, _ = CASES[index]
    assert rmath.verify(gold, prediction) is verdicts[index]


# ---------------------------------------------------------------- extraction

@pytest.mark.parametrize("text,answer,anchored", [
    (r"so \boxed{\frac{1}{\sqrt{2}}}.", r"\frac{1}{\sqrt{2}}", True),
    (r"first \boxed{1} then \fbox{2}", "2", True),
    (r"\boxed{\{1,2\}}", r"\{1,2\}", True),
    (r"\boxed{2} and then \boxed{3", "2", True),  # The unclosed one is skipped.
    ("**Answer:** 42", "42", True),
    ("Answer:\n42", "42", True),
    ("## Final Answer\n\n42", "42", True),
    ("**Final Answer**\n$\\frac{1}{2}$", "\\frac{1}{2}", True),
    ("The answer is: 7", "7", True),
    ("The answer is 3.5 meters.", "3.5 meters", True),
    ("answer is 4. Answer: 5", "5", True),  # The latest anchor wins.
    ("#### 1,234", "1,234", True),
    ("#### Step 2\nwe get 5", "5", True),  # A heading, then the final statement.
    (r"\boxed{}", r"\boxed{}", False),
    ("just 42", "just 42", False),
])
def test_extract_answer(text, answer, anchored):
  assert extract.extract_answer(text) == extract.Answer(answer, anchored)


def test_extract_keeps_only_the_tail_of_unanchored_text():
  text = "x" * 10_000 + " 42"
  assert extract.extract_answer(text).text == text[-extract.TAIL_CHARS:]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab1{}\\$:#xboed ,.\n"), max_size=300))
def test_extract_is_total_on_any_text(text):
  answer = extract.extract_answer(text)
  assert isinstance(answer.text, str)
  boxed = extract.last_boxed(text + r" \boxed{" + "7}")
  assert boxed is not None


@settings(max_examples=60, deadline=None)
@given(st.recursive(st.text(alphabet="0123456789+-x ", min_size=1, max_size=5),
                    lambda inner: st.builds(lambda a, b: "{" + a + "}" + b, inner, inner),
                    max_leaves=8).filter(str.strip))
def test_last_boxed_returns_balanced_content(content):
  assert extract.last_boxed(f"blah \\boxed{{{content}}}. Done") == content.strip()


# ---------------------------------------------------------------- properties

_PROPERTY = settings(max_examples=15, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@_PROPERTY
@given(st.lists(st.integers(-10**9, 10**9), min_size=1, max_size=12))
def test_property_integers_with_separators(numbers):
  golds = [f"{n:,}" for n in numbers]
  predictions = [f"The answer is $\\boxed{{{n}}}$." for n in numbers]
  assert all(rmath.verify_batch(golds, predictions))


@_PROPERTY
@given(st.lists(st.tuples(st.integers(-999, 999), st.integers(1, 999)),
                min_size=1, max_size=12))
def test_property_fractions(pairs):
  golds = [f"\\frac{{{p}}}{{{q}}}" for p, q in pairs]
  predictions = [str(Fraction(p, q)) for p, q in pairs]
  assert all(rmath.verify_batch(golds, predictions))


@_PROPERTY
@given(st.lists(st.tuples(st.integers(-30, 30), st.integers(-30, 30)),
                min_size=1, max_size=8))
def test_property_expanded_polynomials(roots):
  golds = [f"(x+{a})(x+{b})".replace("+-", "-") for a, b in roots]
  predictions = [f"x^2+{a + b}x+{a * b}".replace("+-", "-") for a, b in roots]
  assert all(rmath.verify_batch(golds, predictions))


@_PROPERTY
@given(st.lists(st.tuples(st.integers(-10**6, 10**6), st.integers(1, 10**6)),
                min_size=1, max_size=12))
def test_property_different_numbers_do_not_match(pairs):
  golds = [str(n) for n, _ in pairs]
  predictions = [f"\\boxed{{{n + k}}}" for n, k in pairs]
  assert not any(rmath.verify_batch(golds, predictions))


_NUMBER = st.one_of(
    st.integers(-10**12, 10**12).map(str),
    st.fractions(max_denominator=10**4).map(
        lambda f: f"\\frac{{{f.numerator}}}{{{f.denominator}}}"),
    st.decimals(-10**6, 10**6, places=4, allow_nan=False).map(str))
_EXPRESSION = st.builds(
    lambda a, b, c, op: f"{a}x^{{{b}}} {op} \\sqrt{{{c}}}",
    st.integers(1, 50), st.integers(1, 5), st.integers(1, 50),
    st.sampled_from(["+", "-"]))


@_PROPERTY
@given(st.lists(st.one_of(_NUMBER, _EXPRESSION), min_size=1, max_size=12))
def test_property_verify_is_reflexive(answers):
  """verify(a, a) — through the sympy worker too, not just the fast path."""
  assert all(rmath.verify_batch(answers, answers))
  worker_args = [(a, True, a, True) for a in answers]
  assert all(v is True for v in rmath.default_pool().run("math", worker_args, 5.0))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=60), st.text(max_size=60)),
                min_size=1, max_size=10))
def test_property_never_raises_on_any_text(pairs):
  result = rmath.verify_batch([g for g, _ in pairs], [p for _, p in pairs])
  assert len(result) == len(pairs) and all(isinstance(r, bool) for r in result)


# ---------------------------------------------------------------- contract

@pytest.mark.parametrize("gold,prediction,expected", [
    (None, "42", False), ("42", None, False), ("42", b"42", False),
    (42, "42", True), (0.5, r"\frac12", True), (True, "1", False),
])
def test_verify_accepts_any_input_type(gold, prediction, expected):
  assert rmath.verify(gold, prediction) is expected


def test_verify_batch_length_mismatch_is_all_false_not_an_error():
  assert rmath.verify_batch(["1", "2"], ["1"]) == [False, False]


def test_anchored_answer_over_the_length_cap_is_refused_before_parsing():
  long_answer = r"\boxed{" + "1+" * 2000 + "1}"
  assert contract._equal(contract.Gold(extract.Answer("4001", False)),  # pylint: disable=protected-access
                         extract.Answer(long_answer[7:-1], True)) is False


# ---------------------------------------------------------------- safety

def _elapsed(fn):
  start = time.monotonic()
  value = fn()
  return value, time.monotonic() - start


@pytest.mark.parametrize("prediction", [
    r"\boxed{10^{10^{10}}}",  # Exact big-int power: only the kill or the memory cap stops it.
    r"\boxed{9^{9^{9^{9}}}}",
    "1+" * 500_000 + "1",  # A 1 MB string.
    r"\boxed{" + "(" * 5000 + "2" + ")" * 5000 + "}",  # 5,000-deep nesting.
    r"\boxed{" + r"\frac{1}{" * 450 + "1" + "}" * 450 + "}",  # Deep, under the cap.
    "$" + "{" * 5000 + "x" + "}" * 5000 + "$",
])
def test_pathological_input_returns_false_in_time(prediction):
  timeout = 2.0
  verdict, seconds = _elapsed(lambda: rmath.verify("1", prediction, timeout=timeout))
  assert verdict is False
  assert seconds < timeout + 5.0  # Slack for a loaded machine; the point is "bounded".


def test_deep_parentheses_around_the_right_number_verify_in_time():
  prediction = r"\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}"
  verdict, seconds = _elapsed(lambda: rmath.verify("1", prediction, timeout=2.0))
  assert verdict is True
  assert seconds < 2.0 + 5.0


def test_hard_timeout_kills_a_worker_stuck_in_c_and_the_pool_recovers():
  pool = rmath.default_pool()
  restarts = pool.restarts
  (stuck,), seconds = _elapsed(lambda: pool.run("probe", [["spin"]], timeout=0.5))
  assert stuck is None and seconds < 5.0
  assert pool.restarts == restarts + 1
  assert pool.run("probe", [["echo", 7]], timeout=30.0) == [7]


def test_crashed_worker_is_replaced_and_other_tasks_are_unaffected():
  pool = rmath.default_pool()
  restarts = pool.restarts
  results = pool.run("probe", [["echo", 1], ["crash"], ["echo", 3]], timeout=30.0)
  assert results == [1, None, 3]
  assert pool.restarts == restarts + 1
  assert rmath.verify("0.5", r"\frac{1}{2}")


def test_batch_preserves_order_when_tasks_finish_out_of_order():
  args = [["sleep", 0.4], ["echo", "b"], ["sleep", 0.1], ["echo", "d"]]
  assert rmath.default_pool().run("probe", args, timeout=30.0) == [True, "b", True, "d"]


def test_model_text_is_never_evaluated_in_the_trainer_process(monkeypatch, tmp_path):
  """eval/exec/sympify/parse_expr all raise here; verification still works,
  so none of them is called in this process. The injection attempt must not
  run in the worker either."""
  def boom(*args, **kwargs):
    raise AssertionError("called in the trainer process")
  import sympy  # pylint: disable=g-import-not-at-top
  from sympy.parsing import sympy_parser  # pylint: disable=g-import-not-at-top
  marker = tmp_path / "pwned"
  injection = rf"\boxed{{__import__('os').system('touch {marker}')}}"
  for target, name in ((builtins, "eval"), (builtins, "exec"),
                       (sympy, "sympify"), (sympy_parser, "parse_expr")):
    monkeypatch.setattr(target, name, boom)
  verdicts = rmath.verify_batch(["x^2+2x+1", "1", "0"], ["(x+1)^2", injection, "1-1"])
  assert verdicts == [True, False, True]
  assert not marker.exists()


def test_trainer_process_never_imports_sympy():
  """The parent only cuts strings; sympy lives in the workers."""
  code = ("import sys; from grpo_jax.rewards import verify; "
          "ok = verify('1/2', r'\\boxed{0.5}'); "
          "print(ok, 'sympy' in sys.modules, 'math_verify' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.stdout.split() == ["True", "False", "False"], out.stderr


# ---------------------------------------------------------------- DAPO mode

@pytest.mark.parametrize("raw,normalised", [
    (r"\boxed{\frac12}", r"\frac{1}{2}"),
    ("$100,000$", "100000"),
    ("10 dollars", "10"),
    ("x = 5", "5"),
    (r"\text{(A)}", "(A)"),
    (r"5^\circ", "5"),
    (r"\sqrt2", r"\sqrt{2}"),
    ("an apple", "apple"),
    (r"\$3.50", "3.50"),
    (r"\dfrac{1}{2}", r"\dfrac{1}{2}"),  # Minerva leaves \dfrac alone: exact match.
])
def test_minerva_normalisation(raw, normalised):
  assert minerva.normalize_final_answer(raw) == normalised


@pytest.mark.parametrize("gold,response,expected", [
    ("42", "Let me think.\nAnswer: 42", True),
    ("42", "Answer: 42.0", False),  # Exact match: no numeric equivalence.
    ("0.5", r"Answer: \frac{1}{2}", False),
    (r"\frac{1}{2}", r"Answer: \frac12", True),
    ("42", r"The answer is \boxed{42}", False),  # No "Answer:" line.
    # D2 (issue 45): two different answer lines earn nothing (was True).
    ("42", "Answer: 41\nOn second thought...\nAnswer: 42", False),
    ("42", "Answer: 42\n" + "more text " * 40, False),  # Not in the last 300 chars.
    ("1000", "Answer: 1,000", True),
    ("5", "Answer: $x = 5$", True),
    ("42", "answer : 42", True),
])
def test_verify_dapo(gold, response, expected):
  assert rmath.verify_dapo(gold, response) is expected


def test_math_dapo_reward_is_plus_minus_one():
  rewards = rmath.math_dapo_reward(["p"], ["Answer: 3", "Answer: 4"], ["3"],
                                   np.array([5, 5]))
  assert rewards.dtype == np.float32
  np.testing.assert_array_equal(rewards, [1.0, -1.0])


def test_math_reward_broadcasts_answers_per_prompt():
  completions = [r"\boxed{2}", r"\boxed{3}", r"\boxed{5}", r"\boxed{5}"]
  rewards = rmath.math_reward(["p1", "p2"], completions, ["2", "5"], np.ones(4))
  assert rewards.dtype == np.float32
  np.testing.assert_array_equal(rewards, [1.0, 0.0, 1.0, 1.0])
