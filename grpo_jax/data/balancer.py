"""A difficulty balancer: keeps the share of informative groups high.

GRPO/DAPO learn only from groups with 0 < correct < G (a group that is all
right or all wrong has zero advantage, and dynamic sampling drops it). The
balancer tracks, per level, an exponential moving average of that
"mixed-outcome" rate and samples levels in proportion to it (sharpened by
`power`, with a `floor` share spread uniformly so no level is abandoned and
its estimate can recover).

The state is a small JSON-able dict, checkpointed with the run; every
function here is pure (returns a new state, never mutates) and deterministic.

    state = init_balancer([1, 2, 3])
    levels = sample_levels(state, num=64, seed=0, step=step)
    ...  # generate at those levels, sample G completions each, score
    state = update_balancer(state, zip(levels, num_correct, [G] * 64))
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

BalancerState = dict[str, Any]


def init_balancer(levels: Sequence[int], decay: float = 0.8, floor: float = 0.1,
                  power: float = 2.0, prior: float = 0.5) -> BalancerState:
  """A fresh state: every level believed `prior`-informative (so mixed uniformly).

  Args:
    levels: the difficulty levels to mix, e.g. [1, 2, 3].
    decay: weight of the old estimate in each moving-average update.
    floor: share of every batch spread uniformly over all levels.
    power: sharpening of the mix toward the most informative levels.
    prior: starting mixed-outcome (and accuracy) estimate of every level.
  """
  if not levels or len(set(levels)) != len(levels):
    raise ValueError(f"levels must be distinct and non-empty, got {list(levels)}")
  if not 0 <= decay < 1 or not 0 <= floor <= 1 or power <= 0:
    raise ValueError(f"need 0 <= decay < 1, 0 <= floor <= 1, power > 0; "
                     f"got decay={decay}, floor={floor}, power={power}")
  count = len(levels)
  return {"levels": [int(l) for l in levels], "mixed_rate": [float(prior)] * count,
          "accuracy": [float(prior)] * count, "groups_seen": [0] * count,
          "decay": float(decay), "floor": float(floor), "power": float(power)}


def _level_summaries(levels: list[int], outcomes: Iterable[tuple[int, int, int]]
                     ) -> dict[int, tuple[float, float, int]]:
  """level -> (mixed-outcome rate, accuracy, groups) over this step's groups."""
  groups: dict[int, list[tuple[int, int]]] = {}
  for level, correct, size in outcomes:
    if level not in levels:
      raise ValueError(f"outcome for unknown level {level}; levels are {levels}")
    if size < 1 or not 0 <= correct <= size:
      raise ValueError(f"need 0 <= correct <= group size, got {correct} of {size}")
    groups.setdefault(level, []).append((correct, size))
  return {level: (float(np.mean([0 < c < g for c, g in pairs])),
                  float(np.mean([c / g for c, g in pairs])), len(pairs))
          for level, pairs in groups.items()}


def update_balancer(state: BalancerState,
                    outcomes: Iterable[tuple[int, int, int]]) -> BalancerState:
  """The state after one step's groups, each `(level, num_correct, group_size)`.

  Levels with no group this step keep their estimates.
  """
  new = {k: list(v) if isinstance(v, list) else v for k, v in state.items()}
  decay = state["decay"]
  for level, (mixed, accuracy, count) in _level_summaries(state["levels"], outcomes).items():
    i = state["levels"].index(level)
    new["mixed_rate"][i] = decay * state["mixed_rate"][i] + (1 - decay) * mixed
    new["accuracy"][i] = decay * state["accuracy"][i] + (1 - decay) * accuracy
    new["groups_seen"][i] = state["groups_seen"][i] + count
  return new


def level_mix(state: BalancerState) -> dict[int, float]:
  """Sampling probability of each level: floor/L + (1 - floor) * rate^power / sum."""
  rates = np.asarray(state["mixed_rate"], dtype=np.float64) ** state["power"]
  count = len(rates)
  shares = rates / rates.sum() if rates.sum() > 0 else np.full(count, 1 / count)
  mix = state["floor"] / count + (1 - state["floor"]) * shares
  return {level: float(p) for level, p in zip(state["levels"], mix)}


def _largest_remainder(probabilities: np.ndarray, total: int) -> np.ndarray:
  """Integer counts summing to `total`, as close to probabilities * total as possible."""
  exact = probabilities * total
  counts = np.floor(exact).astype(int)
  order = np.argsort(-(exact - counts), kind="stable")
  counts[order[: total - counts.sum()]] += 1
  return counts


def sample_levels(state: BalancerState, num: int, seed: int, step: int) -> list[int]:
  """`num` levels in the proportions of `level_mix`, in an order shuffled by (seed, step).

  Counts are allotted by largest remainder, not drawn, so a batch follows the
  mix exactly (up to rounding) and the same (state, seed, step) gives the same list.
  """
  mix = level_mix(state)
  counts = _largest_remainder(np.array(list(mix.values())), num)
  levels = np.repeat(np.array(list(mix.keys())), counts)
  return [int(l) for l in np.random.default_rng([seed, step]).permutation(levels)]
