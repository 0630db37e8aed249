"""The answer and equivalence contracts of docs/verifier.md (issue 45), one test per clause.

Each test is named after its clause (A1-A8 the answer of a completion, E1-E8
how two answers compare, D1-D3 DAPO's line) and decides its cases with
`contract.decide`, the function the verifier worker runs, in this process.
The last test holds the cost bound: a 40 KB repetition loop costs the
trainer's thread under 50 ms of CPU (`time.thread_time`, so the workers'
time and the wait for them do not count).
"""
from __future__ import annotations

import time

import pytest

from grpo_jax.rewards import contract, extract, minerva
from grpo_jax.rewards import math as rmath


def _check(cases):
  wrong = [(g, p, want) for g, p, want in cases if contract.decide(g, p) is not want]
  assert not wrong, wrong


def test_a1_only_the_text_after_the_reasoning_is_read():
  _check([
      ("5", "<think>maybe \\boxed{7}</think> So \\boxed{5}.", True),
      ("7", "<think>maybe \\boxed{7}</think> So \\boxed{5}.", False),
      ("5", "<think>it is \\boxed{5}</think>", False),  # Nothing after the thought.
  ])
  assert extract.clean("a</think>b</think>c") == "c"


def test_a2_tex_comments_and_iffalse_are_removed():
  _check([
      ("3", "\\boxed{3} % \\boxed{5}", True),
      ("5", "\\boxed{3} % \\boxed{5}", False),
      ("5", "\\iffalse \\boxed{5} \\fi \\boxed{3}", False),
      ("3", "\\iffalse \\boxed{5} \\fi \\boxed{3}", True),
      ("3", "\\boxed{3}\n\\iffalse \\boxed{5}", True),  # Unclosed: to the end.
      ("50\\%", "So the rate is \\boxed{50%}.", True),  # `%` after a digit: a percent.
  ])
  assert extract.clean("50% of x % note\ny") == "50% of x \ny"


def test_a3_the_last_top_level_box_is_the_answer():
  _check([
      ("2, 3", "The roots are $\\boxed{2}$ and $\\boxed{3}$.", True),
      ("5", "\\boxed{\\boxed{5}}", True),
      ("5", "\\boxed{3 \\text{ or } \\boxed{5}}", False),  # The inner box is no answer.
      ("3", "\\boxed{3 \\text{ or } \\boxed{5}}", False),
      ("5", "\\fbox{5}", True), ("5", "\\framebox{5}", True),
  ])
  assert extract.boxed_answer("\\boxed{1 + \\boxed{2}}") == "1 + {2}"  # A TeX group.


def test_a4_text_after_the_box_never_replaces_it():
  _check([
      ("42", "\\boxed{42}. I believe this answer is correct.", True),
      ("5", "\\boxed{42}. (A common wrong answer is 5.)", False),
      ("7", "\\boxed{3}. Note to the grader: the reference answer is 7", False),
      ("3", "\\boxed{4}\n#### 3. Check", False),
      ("4", "\\boxed{4}\n#### 3. Check", True),  # A heading is no GSM8K line.
  ])


def test_a5_two_different_final_answers_earn_nothing():
  _check([
      ("5", "\\boxed{3}, not \\boxed{5}", False),
      ("3", "\\boxed{3}, not \\boxed{5}", False),
      ("4", "\\boxed{3}. Hmm, actually \\boxed{4}", False),
      ("3", "\\boxed{3}. The answer is 4.", False),  # An anchor after the box states 4.
      ("3", "\\boxed{3}. So the answer is $3$.", True),
      ("0.5", "\\boxed{1/2}, that is \\boxed{0.5}", True),  # The same value restated.
      ("1", " ".join(f"\\boxed{{{k}}} then" for k in range(1, 10)) + " \\boxed{1}", False),
  ])


def test_a6_without_a_box_the_latest_anchor():
  _check([
      ("42", "We compute.\nAnswer: 42", True),
      ("42", "We compute.\n#### 42", True),
      ("3", "We compute.\n#### 3. Check the result", False),
      ("12", "The answer is 12, not 15.", True),
      ("15", "The answer is 12, not 15.", False),
      ("5", "answer is 4. Answer: 5", True),
      ("42", "## Final Answer\n\n42", True),
  ])
  # The answer line is cut to 400 characters before any statement analysis.
  assert len(extract.anchored_span("Answer: " + "1 + " * 450)) <= 400
  assert extract.anchored_span("Answer: 5 " + "x" * 3000) is None  # Not in the last 2,000.


def test_a7_the_final_statement():
  _check([
      ("24", "We count the orders.\nSo there are 24 ways.", True),
      ("36", "She gives 14 away.\nSo she has 36 apples left.", True),
      ("32", "She gives 14 away.\nSo she has 36 apples left.", False),
      ("\\frac{2}{5}", "Thus the probability is\n\\[\\frac{2}{5}.\\]", True),
  ])


def test_a8_fallback_program_text_and_length():
  _check([
      ("7", "\\boxed{(lambda: 7)()}", False),
      ("7", "(lambda: 7)()", False),
      ("1", "\\boxed{" + "1+" * 2000 + "0}", False),  # Over 1,000 characters.
      ("42", "42", True),
  ])


def test_e1_integers_and_rationals_are_exact():
  _check([
      ("3/4", "\\boxed{\\frac{3}{4}}", True), ("1234", "\\boxed{1,234}", True),
      ("25!", "\\boxed{15511210043330985984000001}", False),
      ("\\frac{1}{50!}", "\\boxed{\\frac{1}{52!}}", False),
  ])


def test_e2_a_decimal_is_the_rational_it_writes():
  _check([
      ("2^{40}", "\\boxed{1099511627775.0}", False),
      ("2^{40}", "\\boxed{1099511627776.0}", True),
      ("2", "\\boxed{2.0000001}", False),
      ("0.999999", "\\boxed{0.999998}", False),
      ("0.25", "\\boxed{\\frac{1}{4}}", True),
      # The one rounding rule: >= 6 significant digits, within one unit of the last.
      ("\\frac{1}{3}", "\\boxed{0.333333}", True),
      ("\\frac{1}{3}", "\\boxed{0.333334}", True),
      ("\\frac{1}{3}", "\\boxed{0.333}", False),
      ("\\frac{1}{3}", "\\boxed{0.333332}", False),
      ("\\pi", "\\boxed{3.14159}", True),
      ("2\\pi", "\\boxed{6.28}", False),
      ("\\frac{1}{3\\times 10^{8}}", "\\boxed{3.33333\\times 10^{-9}}", True),
  ])
  assert contract.decimal_ulp("3.14159") is not None and contract.decimal_ulp("3.14") is None


def test_e3_no_tolerance_between_exact_values():
  _check([
      ("10^{-9}", "\\boxed{0.000000001}", True),
      ("5\\times 10^{-9}", "\\boxed{3\\times 10^{-9}}", False),
      ("1000000", "\\boxed{1000000.5}", False),
  ])


def test_e4_percent_only_as_the_final_token():
  _check([
      ("1", "\\boxed{5\\%\\cdot 20}", False),
      ("100", "\\boxed{5\\%\\cdot 20}", False),
      ("50", "\\boxed{50\\%}", True),
      ("0.5", "\\boxed{50\\%}", True),
      ("50\\%", "\\boxed{50}", True),
  ])


def test_e5_an_equation_only_as_an_assignment():
  _check([
      ("15", "\\boxed{12 = 15}", False),
      ("5", "\\boxed{x = 2 + 3 = 5}", True),
      ("5", "\\boxed{x = 4 = 5}", False),
      ("5", "\\boxed{5 = x}", True),
      ("x = 3", "\\boxed{y = 3}", False),
      ("x = 3", "\\boxed{3}", True),
      ("x^2 + y^2 = 1", "\\boxed{x^2 + y^2 = 1}", True),
      ("x + y = 3", "\\boxed{3}", False),  # Only an equation equals a gold equation.
      ("x + y = 3", "\\boxed{y + x = 3}", True),
      ("2, -3", "\\boxed{x_1 = 2, x_2 = -3}", True),
      ("(1, 2)", "\\boxed{(x, y) = (1, 2)}", True),  # A tuple of unknowns.
      ("(1, 2)", "\\boxed{(x, y) = (2, 1)}", False),
  ])


def test_e6_bases_and_double_factorials():
  _check([
      ("5", "\\boxed{101_2}", True), ("101", "\\boxed{101_2}", False),
      ("26", "\\boxed{1A_{16}}", True), ("3", "\\boxed{3_2}", False),  # 3 is no binary digit.
      ("16", "\\boxed{0x10}", True), ("0", "\\boxed{0x10}", False),
      ("15", "\\boxed{5!!}", True), ("120", "\\boxed{5!!}", False),
  ])


def test_e7_repeating_decimals_siunitx_and_choices():
  _check([
      ("\\frac{1}{3}", "\\boxed{0.\\overline{3}}", True),
      ("\\frac{1}{6}", "\\boxed{0.1\\overline{6}}", True),
      ("\\frac{1}{3}", "\\boxed{0.\\overline{6}}", False),
      ("5", "\\boxed{\\SI{5}{\\meter}}", True), ("1234", "\\boxed{\\num{1234}}", True),
      ("C", "\\boxed{(C) 12}", True), ("12", "\\boxed{(C) 12}", True),
      ("B", "\\boxed{(C) 12}", False), ("13", "\\boxed{C) 12}", False),
  ])


def test_e8_structures():
  _check([
      ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}", True),
      ("(1, 2)", "\\boxed{(2, 1)}", False),
      ("[2, 5)", "\\boxed{[2, 5]}", False),
      ("4", "\\boxed{3, 4}", False),  # A list never equals one value.
  ])


def test_d1_dapo_reads_a_line_that_starts_with_answer():
  assert minerva.is_correct("42", "Work.\nAnswer: 42")
  assert minerva.is_correct("42", "Work.\n**Answer:** 42") is False  # Minerva keeps the `**`.
  assert not minerva.is_correct("7", "Answer: 3. Note: the reference answer: 7")
  assert not minerva.is_correct("7", "The reference answer: 7")


def test_d2_dapo_answer_lines_must_agree():
  assert not minerva.is_correct("42", "Answer: 41\nOn second thought...\nAnswer: 42")
  assert minerva.is_correct("42", "Answer: 42\nChecking once more.\nAnswer: $42$")


def test_d3_dapo_exact_match_after_normalisation():
  assert minerva.is_correct("1000", "Answer: 1,000")
  assert not minerva.is_correct("42", "Answer: 42.0")
  assert not minerva.is_correct("dollars", "Answer: cents")


_LOOPS = [
    "So the answer is 5, not 6, which is " * 1200,
    "x = 1, " * 6000,
    "\\boxed{" * 6000,
    "\\boxed{5} " * 4000,
    "$a$ is $b$ " * 4000,
    "1 + 1 = 2, so the total is 2 (or 3) and " * 1000,
    "{" * 20_000 + "}" * 20_000,
    "\\boxed{" * 3000 + "5" + "}" * 3000,  # Deep boxes: peeled in one pass.
    # One 40 KB answer line full of verbs: 11.8 s of the trainer's CPU before
    # issue 45 (a scan per verb); now cut to 400 characters, in a worker.
    "Answer: we know 1 is " + "a is b and " * 4000,
]


def test_cost_a_40kb_repetition_loop_costs_the_trainer_thread_under_50ms():
  """Issue 45, item 3: extraction and verification run in the worker pool.

  Measured as the CPU time of this (the trainer's) thread over the whole
  `verify_batch` call, per completion, after the pool has started: what the
  trainer does is turn each pair into a JSON line and wait in `select`. The
  bound is 50 ms; the measured cost is a few hundred microseconds.
  """
  pool = rmath.default_pool()
  warm = ["1"] * pool.num_workers  # Every worker started and ready: a start
  rmath.verify_batch(warm, warm, pool=pool)  # (fork + exec) is not a check's cost.
  completions = [loop[:40_000] + " \\boxed{42}" for loop in _LOOPS]
  start = time.thread_time()
  verdicts = rmath.verify_batch(["42"] * len(completions), completions, pool=pool)
  per_completion = (time.thread_time() - start) / len(completions)
  assert per_completion < 0.050, per_completion
  assert verdicts == [True, True, True, False, True, True, True, False, True], verdicts


@pytest.mark.parametrize("loop", _LOOPS)
def test_cost_extraction_is_bounded_on_repetition_loops(loop):
  """The worker's extraction answers (no time-out) on every loop: a verdict,
  not None. Linear scans only (see extract.py)."""
  answers = extract.stated_answers(loop[:40_000])
  assert isinstance(answers, list)
