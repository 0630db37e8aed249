"""Evaluation metrics against hand-computed values and the reference formulas."""
import fractions
import math

import numpy as np
import pytest

from grpo_jax import evaluation


def fraction_equivalent(a: str, b: str) -> bool:
  """A simple test equivalence: equal as exact fractions ("1/2" == "0.5"), else as text."""
  try:
    return fractions.Fraction(a.strip()) == fractions.Fraction(b.strip())
  except (ValueError, ZeroDivisionError):
    return a.strip() == b.strip()


def string_equal(a: str, b: str) -> bool:
  return a == b


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),   # 1 - C(3,1)/C(5,1) = 1 - 3/5
    (5, 2, 2, 0.7),   # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 4, 1.0),   # only 3 wrong samples: every 4-subset has a correct one
    (10, 0, 1, 0.0),
    (10, 0, 10, 0.0),
    (10, 10, 1, 1.0),
    (10, 10, 10, 1.0),
    (4, 1, 2, 0.5),   # 1 - C(3,2)/C(4,2) = 1 - 3/6
])
def test_pass_at_k_hand_computed(n, c, k, expected):
  assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_the_binomial_formula():
  for n in range(1, 21):
    for c in range(n + 1):
      for k in range(1, n + 1):
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert evaluation.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
  # C(10000, 100) has ~240 digits: the product form must still be exact to 1e-12.
  n, c, k = 10_000, 37, 100
  exact = 1 - fractions.Fraction(math.comb(n - c, k), math.comb(n, k))
  assert evaluation.pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)
  assert evaluation.pass_at_k(1000, 1, 1) == pytest.approx(0.001, abs=1e-15)


def test_pass_at_1_equals_avg_at_n():
  rng = np.random.default_rng(0)
  for _ in range(20):
    correct = list(rng.random(16) < 0.3)
    assert evaluation.pass_at_k(16, sum(correct), 1) == pytest.approx(evaluation.avg_at_n(correct))


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
  with pytest.raises(ValueError):
    evaluation.pass_at_k(n, c, k)


def test_avg_at_n_and_greedy_accuracy():
  assert evaluation.avg_at_n([True, False, True, True]) == 0.75
  assert evaluation.greedy_accuracy([True, False, False, False, True]) == 0.4
  with pytest.raises(ValueError):
    evaluation.avg_at_n([])


def test_sampled_metrics_aggregate_over_problems():
  correct = [[1, 0, 0, 0, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
  metrics = evaluation.sampled_metrics(correct, ks=(1, 2))
  assert metrics["avg@5"] == pytest.approx((0.4 + 0 + 1) / 3)
  assert metrics["pass@1"] == pytest.approx((0.4 + 0 + 1) / 3)
  assert metrics["pass@2"] == pytest.approx((0.7 + 0 + 1) / 3)
  uneven = evaluation.sampled_metrics([[1, 0], [1, 0, 0, 0]], ks=(2,))
  assert uneven["avg@n"] == pytest.approx((0.5 + 0.25) / 2)
  assert uneven["pass@2"] == pytest.approx((1.0 + 0.5) / 2)


def test_majority_groups_equivalent_answers_written_differently():
  answers = ["1/2", "3", "0.5", "3", "2/4"]
  # By plain string equality "3" wins 2 to 1; grouped by value, 1/2 wins 3 to 2.
  assert evaluation.majority_answer(answers, string_equal) == "3"
  assert evaluation.majority_answer(answers, fraction_equivalent) == "1/2"
  assert evaluation.cluster_answers(answers, fraction_equivalent) == [("1/2", 3), ("3", 2)]
  assert evaluation.maj_at_k(answers, "0.5", fraction_equivalent)
  assert not evaluation.maj_at_k(answers, "0.5", string_equal)


def test_majority_ties_go_to_the_answer_seen_first():
  assert evaluation.majority_answer(["2", "3", "3", "2"], fraction_equivalent) == "2"
  assert evaluation.majority_answer(["3", "2", "2", "3"], fraction_equivalent) == "3"
  assert evaluation.majority_answer(["0.5", "1", "1/2", "1.0"], fraction_equivalent) == "0.5"


def test_maj_at_k_votes_over_the_first_k_samples_only():
  answers = ["3", "3", "1/2", "0.5", "0.5"]
  assert evaluation.maj_at_k(answers, "3", fraction_equivalent, k=2)
  assert not evaluation.maj_at_k(answers, "3", fraction_equivalent, k=5)
  assert evaluation.maj_at_k(answers, "1/2", fraction_equivalent, k=5)
  with pytest.raises(ValueError):
    evaluation.maj_at_k(answers, "3", fraction_equivalent, k=6)


def test_unextracted_answers_do_not_vote():
  assert evaluation.majority_answer([None, None, "4"], fraction_equivalent) == "4"
  assert evaluation.majority_answer([None, None], fraction_equivalent) is None
  assert not evaluation.maj_at_k([None, None], "4", fraction_equivalent)


def test_equivalence_is_called_representative_first_and_gold_first():
  calls = []

  def recording(a, b):
    calls.append((a, b))
    return fraction_equivalent(a, b)

  evaluation.maj_at_k(["0.5", "1/2"], "2/4", recording)
  assert calls == [("0.5", "1/2"), ("2/4", "0.5")]


def test_majority_metrics():
  answers = [["1/2", "0.5", "7"], ["7", "8", "8"], [None, None, None]]
  metrics = evaluation.majority_metrics(answers, ["0.5", "7", "1"], fraction_equivalent, ks=(1, 3))
  assert metrics == {"maj@1": pytest.approx(2 / 3), "maj@3": pytest.approx(1 / 3)}
  with pytest.raises(ValueError):
    evaluation.majority_metrics(answers, ["0.5"], fraction_equivalent)
