"""The R1 recipe's rewards: the tightened think format and language consistency."""
from __future__ import annotations

import numpy as np
import pytest

from grpo_jax import registry
from grpo_jax.rewards import compute_rewards, language
from grpo_jax.rewards import format as fmt


@pytest.mark.parametrize("text,boxed", [
    ("<think>2+2</think> So \\boxed{4}.", True),
    ("<think>2+2</think>\\boxed{ {4} }", True),
    ("<think>2+2</think> The answer is 4.", False),  # An answer, but not boxed.
    ("<think>2+2</think>\\boxed{}", False),  # Empty box.
    ("<think>2+2</think>\\boxed{4", False),  # Unclosed box.
    ("<think>\\boxed{4}</think> so it is 4", False),  # The box is in the thought.
    ("\\boxed{4}", False),  # No thought.
])
def test_format_think_boxed_answer(text, boxed):
  assert fmt.is_think_format(text, "boxed") is boxed
  got = registry.lookup("reward", "format_think")(["p"], [text], ["4"], np.ones(1),
                                                  answer="boxed")
  assert got.tolist() == [float(boxed)]


def test_format_think_refuses_an_unknown_answer_rule():
  with pytest.raises(ValueError, match="answer='box'"):
    fmt.format_think_reward(["p"], ["x"], ["4"], np.ones(1), answer="box")


def test_letter_scripts():
  assert [language.letter_script(c) for c in "aЖ中β7 ."] == [
      "LATIN", "CYRILLIC", "CJK", "GREEK", None, None, None]
  assert language.main_script("Сколько будет 2+2? Answer") == "CYRILLIC"
  assert language.main_script("12 + 3") is None


def test_language_consistency_by_hand():
  prompts = ["Сколько будет два плюс два?"]  # Cyrillic question.
  completions = [
      "<think>два и два</think>4",  # 7 Cyrillic letters of 7.
      "<think>два and два</think>4",  # 6 Cyrillic of 9.
      "<think>two and two</think>4",  # 0 of 9.
      "<think>2+2=4</think>4",  # No letters: 0.
      "два плюс два is 4",  # No tag: the whole completion, 10 of 12.
  ]
  got = language.language_consistency_reward(prompts, completions, ["4"], np.ones(5))
  np.testing.assert_allclose(got, [1.0, 6 / 9, 0.0, 0.0, 10 / 12], rtol=1e-6)
  assert got.dtype == np.float32


def test_language_consistency_prefilled_think_and_fixed_script():
  prompt = "问题: 二加二等于多少? 请一步一步想.\n<think>"  # 14 CJK letters, 5 Latin.
  assert language.main_script(prompt) == "CJK"
  completion = "think 思考</think>\\boxed{4}"  # Reasoning "think 思考": 2 CJK of 7 letters.
  got = language.language_consistency_reward([prompt], [completion], ["4"], np.ones(1))
  np.testing.assert_allclose(got, [2 / 7], rtol=1e-6)
  got = language.language_consistency_reward([prompt], [completion], ["4"], np.ones(1),
                                             script="LATIN")
  np.testing.assert_allclose(got, [5 / 7], rtol=1e-6)


def test_r1_rewards_combine_by_name():
  specs = [("format_think", 0.5, {"answer": "boxed"}), ("language_consistency", 0.25)]
  completions = ["<think>add two and two</think>\\boxed{4}", "<think>два</think>4"]
  total, metrics = compute_rewards(specs, ["What is 2+2?"], completions, ["4"],
                                   np.array([5, 5]))
  np.testing.assert_allclose(total, [0.75, 0.0])
  assert metrics["reward/language_consistency/mean"] == pytest.approx(0.5)


@pytest.mark.parametrize("junk", ["<think>" * 200_000, "\\boxed{" * 200_000])
def test_megabyte_junk_is_scored_quickly(junk):
  for name in ("format_think", "language_consistency"):
    got = registry.lookup("reward", name)(["p"], [junk], ["4"], np.ones(1))
    assert got.shape == (1,)
