"""Tests for format, overlong, countdown and multiple-choice rewards, the
reward registry and `compute_rewards` (the code reward: test_sandbox.py)."""
from __future__ import annotations

import random
import time
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax import registry
from grpo_jax.rewards import choice, compute_rewards, countdown, validate_specs
from grpo_jax.rewards import format as fmt

NO_LENGTHS = np.zeros(1)


def test_every_reward_is_registered():
  # Other tests register rewards of their own: every shipped one must be there.
  assert {"code", "countdown", "format_r1", "format_think", "last_number",
          "math", "math_dapo", "multiple_choice",
          "overlong"} <= set(registry.names("reward"))


# ---------------------------------------------------------------- format

@pytest.mark.parametrize("text,think,r1", [
    ("<think>add them</think> The answer is 4.", True, False),
    ("<think>add them</think><answer>4</answer>", True, True),
    ("  <think>a\nb</think>\n<answer> 4 </answer>\n", True, True),
    ("<think></think><answer>4</answer>", False, False),  # Empty thought.
    ("<think>add them</think>", False, False),  # No answer after it.
    ("<think>add them</think><answer></answer>", True, False),
    ("The answer is 4.", False, False),
    ("intro <think>x</think><answer>4</answer>", False, False),  # Not first.
    ("<think>x</think><think>y</think><answer>4</answer>", False, False),
    ("<think>x</think><answer>4</answer> trailing", True, False),
    ("<think>x</think><answer>4</answer><answer>5</answer>", True, False),
    ("<think>x<answer>4</answer>", False, False),  # Unclosed thought.
])
def test_format_checks(text, think, r1):
  assert fmt.is_think_format(text) is think
  assert fmt.is_r1_format(text) is r1


def test_format_rewards_count_a_think_tag_prefilled_by_the_prompt():
  prompts = ["User: 2+2?\nAssistant: <think>", "User: 2+2?\nAssistant:"]
  completion = "add them</think><answer>4</answer>"
  np.testing.assert_array_equal(
      fmt.format_r1_reward(prompts, [completion] * 2, ["4"], np.ones(2)), [1, 0])
  np.testing.assert_array_equal(
      fmt.format_think_reward(prompts, [completion] * 2, ["4"], np.ones(2)), [1, 0])


# ---------------------------------------------------------------- overlong

def test_overlong_matches_the_dapo_paper_check_values():
  # REFERENCE.md: L_max = 20480, L_cache = 4096.
  lengths = np.array([0, 16384, 18432, 20480, 20481, 30000])
  got = fmt.overlong_reward(None, ["c"] * 6, None, lengths)
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, [0, 0, -0.5, -1, -1, -1])


def test_overlong_ramp_is_linear_in_tokens():
  lengths = np.array([5, 6, 7, 8, 9, 10, 11])
  got = fmt.overlong_reward(None, ["c"] * 7, None, lengths, max_length=10,
                            cache_length=4)
  np.testing.assert_allclose(got, [0, 0, -0.25, -0.5, -0.75, -1, -1])


def test_overlong_rejects_a_cache_longer_than_the_limit():
  with pytest.raises(ValueError, match="cache_length"):
    fmt.overlong_penalty([1], max_length=4, cache_length=8)


# ---------------------------------------------------------------- countdown

@pytest.mark.parametrize("expression,value", [
    ("1+2*3", 7), ("(1+2)*3", 9), ("8/(3-8/3)", 24), ("10-2-3", 5),
    ("-3+5", 2), ("7/2", Fraction(7, 2)), ("  ( 4 )  ", 4), ("6\u00d77", 42),
])
def test_countdown_evaluates_arithmetic_exactly(expression, value):
  assert countdown.evaluate(expression)[0] == value


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "2**100", "1 // 2", "3 % 2", "1/0",
    "1/(2-2)", "1.5+1", "abc", "", "(" * 300 + "1" + ")" * 300, "1 +",
    "lambda: 1", "[1, 2]",
])
def test_countdown_rejects_anything_but_arithmetic(expression):
  assert countdown.evaluate(expression) is None


@pytest.mark.parametrize("completion,target,numbers,use_all,expected", [
    ("<answer>(1+2)*4</answer>", 12, [1, 2, 4], False, True),
    ("<answer>(1+2)*4 = 12</answer>", 12, [1, 2, 4], False, True),
    ("<answer>12 = 4*(2+1)</answer>", 12, [1, 2, 4], False, True),
    (r"so \boxed{8/(3-8/3)}", 24, [3, 3, 8, 8], True, True),
    ("Answer: 4*3", 12, [1, 2, 3, 4], False, True),
    ("Answer: 4*3", 12, [1, 2, 3, 4], True, False),  # Must use them all.
    ("<answer>4*3</answer>", 12, [4, 4, 3], False, True),
    ("<answer>4*4-4</answer>", 12, [4, 4, 3], False, False),  # 4 used thrice.
    ("<answer>6*2</answer>", 12, [1, 2, 4], False, False),  # 6 not given.
    ("<answer>1+2+4</answer>", 12, [1, 2, 4], False, False),  # Wrong value.
    ("<answer>1 + 2</answer> then <answer>(1+2)*4</answer>", 12, [1, 2, 4], False, True),
    ("(1+2)*4", 12, [1, 2, 4], False, False),  # No answer marker.
    ("<answer>__import__('os')</answer>", 12, [1, 2, 4], False, False),
])
def test_countdown_score(completion, target, numbers, use_all, expected):
  assert countdown.score(completion, target, numbers, use_all) is expected


def test_countdown_reward_accepts_dict_and_pair_answers():
  completions = ["<answer>3*4</answer>", "<answer>3+4</answer>"]
  answers = [{"target": 12, "numbers": [3, 4]}, (7, [3, 4])]
  got = countdown.countdown_reward(None, completions, answers, np.ones(2))
  np.testing.assert_array_equal(got, [1.0, 1.0])


def _random_tree(rng: random.Random, depth: int) -> tuple[str, Fraction]:
  if depth == 0 or rng.random() < 0.3:
    n = rng.randint(1, 99)
    return str(n), Fraction(n)
  (left, a), (right, b) = _random_tree(rng, depth - 1), _random_tree(rng, depth - 1)
  op = rng.choice("+-*/" if b != 0 else "+-*")
  value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
  return f"({left}{op}{right})", value


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32))
def test_property_countdown_evaluator_agrees_with_exact_arithmetic(seed):
  expression, value = _random_tree(random.Random(seed), depth=4)
  assert countdown.evaluate(expression)[0] == value


# ---------------------------------------------------------------- multiple choice

@pytest.mark.parametrize("completion,letter", [
    ("The answer is (B).", "B"),
    ("Answer: C", "C"),
    ("**Answer:** (d) river", "D"),
    (r"\boxed{E}", "E"),
    (r"\boxed{\text{A}}", "A"),
    ("<answer>b</answer>", "B"),
    ("B", "B"),
    ("(C).", "C"),
    ("The answer is A or B.", None),  # A hedge chooses nothing.
    ("Answer: A/B", None),
    ("I think about it a lot.", None),  # "a" the article is no choice.
    ("The answer is (F).", None),  # Not one of the letters.
])
def test_predicted_letter(completion, letter):
  assert choice.predicted_letter(completion) == letter


def test_multiple_choice_reward():
  completions = ["So the answer is (B).", "Answer: A", "A or B", "Answer: (b)"]
  golds = ["B", "(B)", "B) a river", "b"]
  got = choice.multiple_choice_reward(None, completions, golds, np.ones(4))
  np.testing.assert_array_equal(got, [1, 0, 0, 1])


@pytest.mark.parametrize("name", ["format_think", "format_r1", "countdown",
                                  "multiple_choice", "code"])
@pytest.mark.parametrize("junk", ["<answer>" * 200_000, "```python\n" * 200_000,
                                  "<think>" * 200_000, "Answer: " + "(" * 1_000_000])
def test_megabyte_junk_is_scored_zero_quickly(name, junk):
  """The parsing of every reward is linear in the text; junk scores 0."""
  answer = {"target": 1, "numbers": [1]} if name == "countdown" else "A"
  if name == "code":  # Issue 45: "A" is no test; the code reward refuses it at load.
    answer = "assert f() == 1"
  start = time.monotonic()
  got = registry.lookup("reward", name)(["p"], [junk], [answer], np.ones(1))
  assert got.tolist() == [0.0]
  assert time.monotonic() - start < 5.0  # Quadratic parsing would take minutes.


# ---------------------------------------------------------------- combiner

def test_compute_rewards_weights_and_metrics():
  prompts = ["What is 1+1?"]
  completions = ["<think>1+1</think><answer>\\boxed{2}</answer>",
                 "<think>hm</think><answer>\\boxed{3}</answer>",
                 "\\boxed{2}"]
  lengths = np.array([10, 17, 30])
  specs = [("math", 1.0), ("format_r1", 0.5),
           ("overlong", 1.0, {"max_length": 20, "cache_length": 8})]
  total, metrics = compute_rewards(specs, prompts, completions, ["2"], lengths)
  # math [1, 0, 1]; format [1, 1, 0] * 0.5; overlong [0, -0.625, -1].
  np.testing.assert_allclose(total, [1.5, -0.125, 0.0])
  assert total.dtype == np.float32
  assert metrics["reward/math/mean"] == pytest.approx(2 / 3)
  assert metrics["reward/format_r1/mean"] == pytest.approx(2 / 3)
  assert metrics["reward/overlong/mean"] == pytest.approx(-1.625 / 3)
  assert metrics["reward/total/mean"] == pytest.approx(1.375 / 3)
  assert metrics["reward/math/seconds"] >= 0.0


def test_compute_rewards_dapo_reward():
  total, _ = compute_rewards([("math_dapo", 1.0)], ["q"], ["Answer: 5", "Answer: 6"],
                             ["5"], np.array([3, 3]))
  np.testing.assert_array_equal(total, [1.0, -1.0])


def test_unknown_reward_name_lists_the_known_ones():
  with pytest.raises(KeyError, match="format_r1"):
    validate_specs([("math", 1.0), ("mathh", 1.0)])


@pytest.mark.parametrize("bad", [("math",), ("math", 1.0, {}, "extra")])
def test_malformed_spec_is_an_error(bad):
  with pytest.raises(ValueError, match="name, weight"):
    validate_specs([bad])


def test_lengths_must_have_one_entry_per_completion():
  with pytest.raises(ValueError, match="completion_lengths"):
    compute_rewards([("overlong", 1.0)], ["p"], ["a", "b"], ["x"], np.ones(3))


def test_answers_that_match_neither_prompts_nor_completions_are_an_error():
  with pytest.raises(ValueError, match="one per prompt"):
    compute_rewards([("math", 1.0)], ["p"], ["a", "b", "c"], ["1", "2"], np.ones(3))
