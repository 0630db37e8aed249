"""Evaluation metrics: avg@n, unbiased pass@k, maj@k, greedy accuracy.

Pure Python/numpy over per-sample outcomes; sampling and verification happen
elsewhere. Per problem p with n samples of which c are correct:

- avg@n = c / n, the pass@1 estimate averaged over n samples (DAPO's avg@32).
- pass@k = 1 - C(n-c, k) / C(n, k), the unbiased estimator of Chen et al. 2021
  (the chance that k of the n samples, drawn without replacement, include a
  correct one), computed as a product so no large binomial is formed.
- maj@k: the answer most of the first k samples agree on, answers grouped by
  an equivalence (e.g. "1/2" and "0.5"), compared with the gold answer.
Data-set scores are means over problems.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

Equivalent = Callable[[str, str], bool]


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).

  C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), a product of numbers
  in [0, 1] that neither overflows nor loses precision for large n.
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:  # Every k-subset holds a correct sample.
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def avg_at_n(correct: Sequence[bool]) -> float:
  """Fraction of one problem's n samples that are correct (pass@1 over n samples)."""
  if len(correct) == 0:
    raise ValueError("avg@n needs at least one sample")
  return float(np.mean(np.asarray(correct, dtype=np.float64)))


def cluster_answers(answers: Sequence[str | None], equivalent: Equivalent
                    ) -> list[tuple[str, int]]:
  """Groups answers by equivalence: [(representative, count)], in first-seen order.

  Each answer joins the first earlier cluster whose representative (its first
  member) it is equivalent to, called as `equivalent(representative, answer)`;
  None (nothing extracted) joins no cluster. Exact repeats skip the call.
  """
  clusters: list[list] = []  # [representative, count]
  for answer in answers:
    if answer is None:
      continue
    for cluster in clusters:
      if answer == cluster[0] or equivalent(cluster[0], answer):
        cluster[1] += 1
        break
    else:
      clusters.append([answer, 1])
  return [(representative, count) for representative, count in clusters]


def majority_answer(answers: Sequence[str | None], equivalent: Equivalent) -> str | None:
  """The representative of the largest equivalence cluster, None if nothing was extracted.

  Ties go to the cluster seen first (the one whose earliest answer comes
  first in `answers`), so the vote is deterministic given the sample order.
  """
  clusters = cluster_answers(answers, equivalent)
  if not clusters:
    return None
  return max(clusters, key=lambda cluster: cluster[1])[0]  # max keeps the first of ties.


def maj_at_k(answers: Sequence[str | None], gold: str, equivalent: Equivalent,
             k: int | None = None) -> bool:
  """Whether the majority answer of the first k samples (all when None) matches gold.

  The gold is compared as `equivalent(gold, majority)`, the order of
  `grpo_jax.rewards.math.verify(gold, prediction)`.
  """
  k = len(answers) if k is None else k
  if not 1 <= k <= len(answers):
    raise ValueError(f"maj@k needs 1 <= k <= {len(answers)} samples, got k={k}")
  majority = majority_answer(answers[:k], equivalent)
  return majority is not None and equivalent(gold, majority)


def greedy_accuracy(correct: Sequence[bool]) -> float:
  """Fraction of problems whose one greedy (temperature 0) answer is correct."""
  if len(correct) == 0:
    raise ValueError("greedy accuracy needs at least one problem")
  return float(np.mean(np.asarray(correct, dtype=np.float64)))


def sampled_metrics(correct_per_problem: Sequence[Sequence[bool]],
                    ks: Sequence[int] = (1,)) -> dict[str, float]:
  """Means over problems of avg@n and pass@k for each k in `ks`.

  Args:
    correct_per_problem: for each problem, the correctness of its n samples
      (n may differ between problems, but must be >= max(ks)).
    ks: the k of each pass@k reported.

  Returns:
    {"avg@n": ..., "pass@1": ..., "pass@8": ...}; "avg@n" names n itself
    (e.g. "avg@32") when every problem has the same n.
  """
  if len(correct_per_problem) == 0:
    raise ValueError("no problems to score")
  sizes = {len(c) for c in correct_per_problem}
  avg_name = f"avg@{sizes.pop()}" if len(sizes) == 1 else "avg@n"
  metrics = {avg_name: float(np.mean([avg_at_n(c) for c in correct_per_problem]))}
  for k in ks:
    metrics[f"pass@{k}"] = float(np.mean(
        [pass_at_k(len(c), int(sum(c)), k) for c in correct_per_problem]))
  return metrics


def majority_metrics(answers_per_problem: Sequence[Sequence[str | None]],
                     golds: Sequence[str], equivalent: Equivalent,
                     ks: Sequence[int] = (1,)) -> dict[str, float]:
  """{"maj@k": fraction of problems whose majority of the first k answers is right}."""
  if len(answers_per_problem) != len(golds) or not golds:
    raise ValueError(f"need one gold per problem, got {len(golds)} golds for "
                     f"{len(answers_per_problem)} problems")
  return {f"maj@{k}": float(np.mean([maj_at_k(a, g, equivalent, k)
                                     for a, g in zip(answers_per_problem, golds)]))
          for k in ks}
