"""Helpers shared by the reward functions."""
from __future__ import annotations

from typing import Any, Sequence


def per_completion(values: Sequence[Any], num_completions: int) -> list[Any]:
  """One value per completion: `values` has one per completion, or one per
  prompt (B of them for B*G completions, each repeated G times in order)."""
  values = list(values)
  if len(values) == num_completions:
    return values
  if values and num_completions % len(values) == 0:
    group = num_completions // len(values)
    return [v for v in values for _ in range(group)]
  raise ValueError(f"{len(values)} values for {num_completions} completions: "
                   "need one per completion or one per prompt")
