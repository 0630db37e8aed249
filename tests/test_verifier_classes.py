"""The math verifier on the failure classes of issue 17, and its properties.

Cases are written from the class descriptions (not from any suite, and not
from benchmarks/verifier_heldout.jsonl, which is held out). All table cases
run in one `verify_batch` so the file costs a few worker start-ups.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_jax.rewards import contract, extract, numeric
from grpo_jax.rewards import math as rmath

_SOLUTION_45 = ("First, 3 shirts cost 3 * 10 = 30 dollars.\nThen 3 hats cost 3 * 5 = 15 "
                "dollars.\nSo in total she spends 30 + 15 = 45 dollars.")
_TRAIN = ("The train covers 60 km in the first hour and 40 km in the second.\n"
          "It then rests for 2 hours.\nTherefore, the train travels a total of 100 km.")

# (class, gold, prediction, right?)
CLASSES = [
    # Wrong answers that an absolute tolerance accepted.
    ("tiny", r"5\times10^{-9}", r"3\times10^{-9}", False),
    ("tiny", "1.2e-8", r"\boxed{1.3e-8}", False),
    ("tiny", "0.0000003", "0.0000004", False),
    ("tiny", r"10^{-9}", "0.000000001", True),
    ("tiny", r"2.5\times10^{-10}", "2.5e-10", True),
    ("tiny", r"\frac{1}{10^{7}}", "0.0000001", True),
    # Values that floating point makes equal.
    ("float_collapse", r"\frac{1}{50!}", r"\frac{1}{52!}", False),
    ("float_collapse", "2^{-80}", "2^{-79}", False),
    ("float_collapse", r"\frac{1}{2^{80}}", "2^{-80}", True),
    ("float_collapse", "3^{50}", "3^{50}+1", False),
    ("float_collapse", r"\frac{2^{70}+1}{2^{70}}", "1", False),
    ("float_collapse", r"\frac{7^{40}}{3^{30}+1}", r"\frac{7^{40}}{3^{30}}", False),
    ("float_collapse", "25!", "15511210043330985984000000", True),
    ("float_collapse", "25!", "15511210043330985984000001", False),
    ("float_collapse", r"1.5\times 10^{20}", r"1.6\times10^{20}", False),
    ("float_collapse", r"1.5\times10^{20}", "1.5e20", True),
    ("float_collapse", "12345678901234567", r"\boxed{12345678901234567.5}", False),
    ("float_collapse", "0.1234567890123456789", "0.1234567890123456788", False),
    ("float_collapse", r"\frac{1234567890123456789}{10^{19}}", "0.1234567890123456789", True),
    ("float_collapse", r"\frac{1}{3}", "0.3333333333333333", True),
    # The gold is a part of the prediction.
    ("part", "3", "3^{4}", False),
    ("part", "1", "1/5", False),
    ("part", "5", r"5\sqrt(3)", False),
    ("part", "5", r"\boxed{5\sqrt(3)}", False),
    ("part", "2", r"2\pi", False),
    ("part", "4", "4!", False),
    ("part", "6", r"\frac{6}{7}", False),
    ("part", "10", r"The answer is $10^{2}$.", False),
    ("part", r"5\sqrt{3}", r"\boxed{5\sqrt(3)}", True),
    # A sign flipped inside a transcendental expression.
    ("sign", r"2 - 1/\pi", r"2 + 1/\pi", False),
    ("sign", r"2 - \frac{1}{\pi}", r"\boxed{2 + \frac{1}{\pi}}", False),
    ("sign", "e - 1", "1 - e", False),
    ("sign", r"\ln 3 + 1", r"\ln 3 - 1", False),
    ("sign", r"\sqrt{2}-\pi", r"\pi-\sqrt{2}", False),
    ("sign", r"2-\frac{1}{\pi}", r"\frac{2\pi-1}{\pi}", True),
    # Program text is never evaluated.
    ("program", "7", r"\boxed{(lambda: 7)()}", False),
    ("program", "7", "(lambda: 7)()", False),
    ("program", "3", r"\boxed{len('abc')}", False),
    ("program", "6", r"\boxed{sum([1,2,3])}", False),
    ("program", "4", "[x for x in range(5)][4]", False),
    ("program", "24", r"\boxed{math.factorial(4)}", False),
    # Digit groups written with LaTeX spacing.
    ("digit_groups", "12345678", r"12,\!345,\!678", True),
    ("digit_groups", "1234", r"\boxed{1,\!234}", True),
    ("digit_groups", "1234", r"1,\!235", False),
    ("digit_groups", "5000000", "5{,}000{,}000", True),
    ("digit_groups", "20500", r"So the total is $20,\!500$ dollars.", True),
    ("digit_groups", r"12,\!345,\!678", "12345678", True),
    ("digit_groups", "11111111100", r"is $\boxed{11,\! 111,\! 111,\! 100}$", True),
    # Several boxes that together are the gold list (and the reverse).
    ("boxes", "1, 2", r"\boxed{1} and \boxed{2}", True),
    ("boxes", "(1, 2)", r"$x=\boxed{1}$, $y=\boxed{2}$", True),
    ("boxes", "(1,2)", r"\boxed{2}, \boxed{1}", False),
    ("boxes", r"\{3,4\}", r"\boxed{4} or \boxed{3}", True),
    ("boxes", r"\boxed{3}, \boxed{4}", r"\boxed{3, 4}", True),
    ("boxes", "4", r"\boxed{3} and \boxed{4}", False),
    # A5 (issue 45): two different boxed answers are two final answers, no credit.
    ("boxes", "4", r"\boxed{3}. Hmm, let me recheck. Actually \boxed{4}", False),
    ("boxes", "1, 2, 3", r"$\boxed{1,2,3}$", True),
    ("boxes", "4", r"So $x = \boxed{5}$. Note that the answer is not 4.", False),
    ("boxes", "5", r"So $x = \boxed{5}$. Note that the answer is not 4.", True),
    ("boxes", "$1$ and $2$ and $3$", r"$\boxed{1,2,3}$", True),
    # A5 (issue 45): an anchor after the box is one more stated answer; the
    # two differ, so neither earns (it used to replace the box).
    ("boxes", "10455", r"so the interest is $\boxed{255}$, and the total is $10,455. "
     r"Final Answer: The final answer is $10,455$. I hope it is correct.", False),
    ("boxes", "255", r"so the interest is $\boxed{255}$, and the total is $10,455. "
     r"Final Answer: The final answer is $10,455$. I hope it is correct.", False),
    # Named solutions and equivalent polynomial forms.
    ("named", "1, 4", "x_1 = 1, x_2 = 4", True),
    ("named", "1,4", "x_1=1, x_2=5", False),
    ("named", "3,-2", "y_1 = 3; y_2 = -2", True),
    ("named", "-1, 6", r"\boxed{x_{1} = -1 \text{ and } x_{2} = 6}", True),
    ("named", "-2(x-1)^2+5", "-2x^2+4x+3", True),
    ("named", "-2(x-1)^2+5", r"\boxed{y = -2x^2+4x+3}", True),
    ("named", "(x-1)(x+2)", "x^2-x-2", False),
    ("named", "2(x+3)^2-7", "y=2x^2+12x+11", True),
    ("named", "(1, 2)", r"\boxed{x = 2, y = 1}", False),
    ("named", "2, -3", r"\boxed{x_1=2 \quad x_2=-3}", True),
    ("named", "f(x) = -2(x-1)^2+5", r"\boxed{-2x^2+4x+3}", True),
    ("named", "-2(x-1)^2+5", r"\boxed{g(x) = -2x^2+4x+5}", False),
    # The empty set.
    ("empty_set", r"\emptyset", r"\varnothing", True),
    ("empty_set", r"\varnothing", r"\boxed{\emptyset}", True),
    ("empty_set", r"\emptyset", r"\{\}", True),
    ("empty_set", r"\varnothing", r"\{1\}", False),
    ("empty_set", r"\emptyset", "\u2205", True),
    # Euler's identity.
    ("euler", "-1", r"e^{i\pi}", True),
    ("euler", r"e^{i\pi}", "-1", True),
    ("euler", "1", r"e^{i\pi}", False),
    ("euler", "-1", r"\boxed{e^{\pi i}}", True),
    # Mixed numbers.
    ("mixed", r"\frac{13}{4}", "3 1/4", True),
    ("mixed", "13/4", r"3\frac{1}{4}", True),
    ("mixed", r"\frac{3}{4}", "3 1/4", False),
    ("mixed", r"\frac{5}{2}", r"\boxed{2 \frac{1}{2}}", True),
    ("mixed", "1", r"2\frac{1}{2}", False),  # Not the product 2 * 1/2.
    ("mixed", "3 1/4", "13/4", True),
    ("mixed", "13/4", r"3\ 1/4", True),
    ("mixed", r"-\frac{13}{4}", r"\boxed{-3\frac14}", True),
    # A trailing period inside display math.
    ("display_period", r"\frac{2}{5}", "Thus the answer is\n\\[\\frac{2}{5}.\\]", True),
    ("display_period", "7", "\\[x = 7.\\]", True),
    ("display_period", r"\frac{2}{5}", "\\[\\frac{3}{5}.\\]", False),
    ("display_period", "9", "Answer:\n\\[\n 9.\n\\]", True),
    # A long solution with no box: its final statement carries the answer.
    ("final_statement", "45", _SOLUTION_45, True),
    ("final_statement", "45", _TRAIN, False),
    ("final_statement", "100", _TRAIN, True),
    ("final_statement", r"\frac{2}{5}", r"Dividing, we get $\frac{2}{5}.$", True),
    ("final_statement", "14", "Step 3: multiply 7 by 2 to get 14.", True),
    ("final_statement", "3", "Final Answer: Jane started the garden 3 hours ago.", True),
    ("final_statement", "1000.99", "so the number is 10 which is 1,000.99m\u00b2", True),
    ("final_statement", "2", "so the area is 2x.", False),
    ("final_statement", r"\frac{1}{6}", "There are 6 favourable outcomes out of 36.\n"
     "Hence the probability of a sum of 7 is $\\frac{1}{6}$.", True),
    # Exact cancellation of astronomically large terms; deep parentheses.
    ("huge_exact", "0", "3^{3^{50}} - 3^{3^{50}}", True),
    ("huge_exact", "1", r"\frac{2^{2^{60}}}{2^{2^{60}}}", True),
    ("huge_exact", "1", "3^{3^{50}} - 3^{3^{50}}", False),
    ("huge_exact", "1", r"\boxed{7^{7^{40}} - 7^{7^{40}} + 1}", True),
    ("deep_parens", "7", "(" * 500 + "7" + ")" * 500, True),
    ("deep_parens", "7", r"\boxed{" + "(" * 400 + "8" + ")" * 400 + "}", False),
    ("deep_parens", "3", r"\boxed{" + "{" * 500 + "3" + "}" * 500 + "}", True),
    ("deep_parens", "-2", r"\boxed{" + r"\left(" * 60 + "-2" + r"\right)" * 60 + "}", True),
]


@pytest.fixture(scope="module")
def class_verdicts():
  return rmath.verify_batch([g for _, g, _, _ in CLASSES], [p for _, _, p, _ in CLASSES])


@pytest.mark.parametrize("index", range(len(CLASSES)),
                         ids=[f"{c}-{i}" for i, (c, _, _, _) in enumerate(CLASSES)])
def test_failure_classes(class_verdicts, index):
  _, gold, prediction, right = CLASSES[index]
  assert class_verdicts[index] is right, (gold, prediction)


# ---------------------------------------------------------------- pure parts

@pytest.mark.parametrize("text,answer", [
    (r"The roots are $\boxed{2}$ and $\boxed{3}$.", "2, 3"),
    (r"\boxed{2} wait, no: \boxed{3}", "3"),
    (r"$a = \boxed{1}$, $b = \boxed{5}$", "1, 5"),
    (r"\boxed{1} \text{ or } \boxed{6}", "1, 6"),
    (r"\boxed{\boxed{3}}", "3"),
    (r"\boxed{2} and then \boxed{3", "2"),
])
def test_boxed_answer_joins_only_listed_boxes(text, answer):
  assert extract.boxed_answer(text) == answer


@pytest.mark.parametrize("text,answer", [
    ("So she has 36 apples left.", "36"),
    ("Therefore, there are 24 ways to arrange them.", "24"),  # A counted noun goes.
    ("Thus, the value of $x$ is 4.", "4"),
    ("It is $\\frac{1}{6}$.\nWe are done with 2 checks, which gives $\\frac{1}{6}$.", "$\\frac{1}{6}$"),
    ("So the total is 45, which is odd.", "45"),
    ("The probability is 0.4 (or 2/5).", "0.4"),
    ("The probability is 2/5, or 40%.", "2/5"),
    ("The point is (2, 3).", "(2, 3)"),
    ("So the result is (x+1)^2.", "(x+1)^2"),
    ("\\frac{1}{2}", None),  # A bare formula is not prose.
    ("no idea", None),
])
def test_final_statement(text, answer):
  assert extract.final_statement(text) == answer


@pytest.mark.parametrize("answer,program", [
    ("(lambda: 7)()", True), ("int('12')", True), ("pow(3, 2)", True),
    ("np.sqrt(16)", True), ("__import__('os')", True), ("sum(range(6))", True),
    ("f(x)=x^2", False), ("f'(2)", False), (r"\sin(x)+\max(1,2)", False),
    ("ab(a+b)", False), ("P(A)", False), (r"\log_2(8)", False), (r"\text{Evelyn}", False),
])
def test_looks_like_program(answer, program):
  assert extract.looks_like_program(answer) is program


def test_collapse_parens_keeps_one_pair_and_tuples():
  assert extract.collapse_parens("(" * 300 + "7" + ")" * 300) == "(7)"
  assert extract.collapse_parens("((1, 2))") == "(1, 2)"
  assert extract.collapse_parens("(1)(2)") == "(1)(2)"
  assert extract.collapse_parens(r"\left(\left(2\right)\right)") == "(2)"
  assert extract.collapse_parens(r"\frac{{1}}{{2}}") == r"\frac{1}{2}"
  assert extract.collapse_parens(r"\{{1}\}") == r"\{{1}\}"  # Set braces stay.


def test_strip_display_drops_wrapper_and_final_period():
  assert extract.strip_display(r"\[\frac{2}{5}.\]") == r"\frac{2}{5}"
  assert extract.strip_display("$$17.$$") == "17"
  assert extract.strip_display("$a$ and $b$") == "$a$ and $b$"
  assert extract.strip_display("1, 2, 3, ...") == "1, 2, 3, ..."


def test_program_check_runs_only_on_capped_answers():
  """A huge boxed answer is refused by length before any regex runs on it
  (`[` without `]` would make the comprehension pattern quadratic)."""
  huge = r"\boxed{" + "[" * 200_000 + "}"
  assert contract.decide("1", huge) is False


@pytest.mark.parametrize("a,b,equal", [
    (sympy.Float("3e-9"), sympy.Float("5e-9"), False),
    # E2 (issue 45): a decimal is the rational it writes; the rounding rule
    # for 1/3 and pi is contract.rounded_verdict's, on the written digits.
    (sympy.Rational(1, 3), sympy.Float("0.333333"), False),
    (sympy.Rational(1, 2), sympy.Float("0.4999"), False),
    (1 / sympy.factorial(50), 1 / sympy.factorial(52), False),
    (sympy.sqrt(2) - 1, 1 / (sympy.sqrt(2) + 1), True),
    (2 - 1 / sympy.pi, 2 + 1 / sympy.pi, False),
    (sympy.Integer(0), sympy.Float("1e-12"), False),
    (sympy.Float("1.5e20"), sympy.Integer(150000000000000000000), True),
    (sympy.Float("6.02214076e23"), sympy.Integer(602214076 * 10**15), True),
    (sympy.Float("1000000.5"), sympy.Integer(10**6), False),
    (sympy.Float("2.333333"), sympy.Rational(7, 3), False),
    (sympy.Float("3.33333e-9"), sympy.Rational(1, 3 * 10**8), False),
    (sympy.Float("3.3333e-9"), sympy.Rational(1, 3 * 10**8), False),
])
def test_numbers_equal(a, b, equal):
  assert numeric.numbers_equal(a, b) is equal
  assert numeric.numbers_equal(b, a) is equal


def test_tame_makes_huge_powers_opaque_and_i_imaginary():
  huge = sympy.Pow(3, sympy.Pow(3, 50, evaluate=False), evaluate=False)
  assert numeric.tame(sympy.Add(huge, -huge, evaluate=False)) == 0
  assert numeric.tame(sympy.exp(sympy.pi * sympy.Symbol("i"))) == -1
  small = sympy.Pow(2, 100, evaluate=False)
  assert numeric.tame(small) is small  # Computable: left as it is.


# ---------------------------------------------------------------- properties

_PROPERTY = settings(max_examples=12, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
_FRACTIONS = st.fractions(min_value=-10**6, max_value=10**6, max_denominator=999)
_SCALES = st.integers(-30, 30)


def _renderings(value: Fraction) -> list[str]:
  """Ways a model writes `value` (all exact renderings)."""
  p, q = value.numerator, value.denominator
  out = [f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}", f"\\boxed{{\\dfrac{{{p}}}{{{q}}}}}",
         f"The answer is ${p}/{q}$."]
  if q == 1:
    out += [f"{p:,}", f"{p:,}".replace(",", ",\\!"), f"\\boxed{{{p}}}"]
  if p > q > 1:
    out.append(f"{p // q} \\frac{{{p % q}}}{{{q}}}" if p % q else str(p // q))
  if 1000 % q == 0 or q in (1, 2, 4, 5, 8, 10, 16, 20, 25):
    out.append(f"{float(value):.10g}" if abs(value) < 10**6 else str(p // q))
  return out


def _scaled(value: Fraction, exponent: int) -> tuple[str, str]:
  """(exact LaTeX of value * 10^exponent, the same in scientific notation)."""
  p, q = value.numerator, value.denominator
  return (f"\\frac{{{p}}}{{{q}}} \\cdot 10^{{{exponent}}}",
          f"\\frac{{{p}}}{{{q}}} \\times 10^{{{exponent}}}")


@_PROPERTY
@given(st.lists(st.tuples(_FRACTIONS, st.data()), min_size=1, max_size=8))
def test_property_a_right_value_in_any_rendering_is_accepted(items):
  golds, predictions = [], []
  for value, data in items:
    rendering = data.draw(st.sampled_from(_renderings(value)))
    golds.append(f"\\frac{{{value.numerator}}}{{{value.denominator}}}")
    predictions.append(rendering)
  assert rmath.verify_batch(golds, predictions) == [True] * len(golds), predictions


@_PROPERTY
@given(st.lists(st.tuples(_FRACTIONS, _FRACTIONS.filter(lambda d: d != 0), _SCALES),
                min_size=1, max_size=8))
def test_property_a_wrong_value_is_never_accepted(items):
  """value vs value + delta, at any scale 10^-30 .. 10^30 (tiny deltas too)."""
  golds, predictions = [], []
  for value, delta, exponent in items:
    wrong = value + delta * Fraction(1, 10**6)
    golds.append(_scaled(value, exponent)[0])
    predictions.append(rf"\boxed{{{_scaled(wrong, exponent)[1]}}}")
  assert not any(rmath.verify_batch(golds, predictions)), predictions


@_PROPERTY
@given(st.lists(st.tuples(st.integers(-10**15, 10**15), st.integers(-3, 3)),
                min_size=1, max_size=8))
def test_property_a_wrong_integer_is_never_accepted(items):
  golds = [str(n) for n, k in items if k]
  predictions = [rf"The answer is $\boxed{{{n + k}}}$." for n, k in items if k]
  assert not any(rmath.verify_batch(golds, predictions))


_BARE = st.one_of(
    st.integers(-10**9, 10**9).map(str),
    _FRACTIONS.map(lambda f: f"\\frac{{{f.numerator}}}{{{f.denominator}}}"),
    st.decimals(-10**4, 10**4, places=3, allow_nan=False).map(str),
    st.integers(-40, 40).map(lambda e: f"2^{{{e}}}"))


@_PROPERTY
@given(st.lists(st.tuples(_BARE, _BARE), min_size=1, max_size=8))
def test_property_verify_is_symmetric_on_bare_values(pairs):
  forward = rmath.verify_batch([a for a, _ in pairs], [b for _, b in pairs])
  backward = rmath.verify_batch([b for _, b in pairs], [a for a, _ in pairs])
  assert forward == backward, pairs


@pytest.mark.parametrize("gold,prediction,verdict", [
    ("1,234", "1234", True), ("5", "6", False), ("0.5", "1/2", True),
    ("1/3", "0.333333", True),  # E2 (issue 45): the one rounding rule, decided here.
    ("1000", "1.000", False),  # E2: the decimal 1.000 is 1.
    ("-2,1", "-2", None), ("28", "28/100", False),
    (r"-\frac{6}{8}", "-0.75", True), (r"\frac{1}{3}", r"\frac{2}{6}", True),
    (r"\frac{1}{3}", "1/4", False), (r"\frac{1}{0}", "1", None),
])
def test_plain_numbers_are_decided_exactly_without_sympy(gold, prediction, verdict):
  assert contract._plain_verdict(gold, prediction) is verdict  # pylint: disable=protected-access
