"""Verifiable rewards: the one host-side step of the RL loop.

Every reward is registered under kind "reward" in `grpo_jax.registry` and has
the signature

    fn(prompts, completions, answers, completion_lengths, **kwargs) -> float32[N]

with N = len(completions) = B*G, `completion_lengths` in tokens, and prompts
/ answers given per completion or per prompt (repeated G times). A config
names the rewards it wants with weights; `compute_rewards` sums them:

    specs = [("math", 1.0), ("overlong", 1.0, {"max_length": 4096, "cache_length": 512})]
    reward_n, metrics = compute_rewards(specs, prompts, completions, answers, lengths)

Registered: math, math_dapo, format_think, format_r1, language_consistency,
overlong, countdown, multiple_choice, code, last_number.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from grpo_jax import registry

# Imported for their @register side effects.
from grpo_jax.rewards import (
  choice,  # pylint: disable=unused-import
  code,  # pylint: disable=unused-import
  countdown,  # pylint: disable=unused-import
  format,  # pylint: disable=unused-import,redefined-builtin
  language,  # pylint: disable=unused-import
  last_number,  # pylint: disable=unused-import
  math,  # pylint: disable=unused-import
  process,  # pylint: disable=unused-import  # "process_reward"
)
from grpo_jax.rewards.math import verify, verify_batch, verify_dapo  # pylint: disable=g-importing-member


def _unpack(spec: Sequence[Any]) -> tuple[str, float, Mapping[str, Any]]:
  if not 2 <= len(spec) <= 3:
    raise ValueError(f"a reward spec is (name, weight[, kwargs]), got {spec!r}")
  name, weight, kwargs = (*spec, {}) if len(spec) == 2 else spec
  return str(name), float(weight), dict(kwargs or {})


def validate_specs(specs: Sequence[Sequence[Any]]) -> None:
  """Fails at start-up, naming the known rewards, if a name is unknown, or
  where a reward cannot work on this host (its `check_host()`: the code
  reward's sandbox)."""
  for spec in specs:
    fn = registry.lookup("reward", _unpack(spec)[0])
    check_host = getattr(fn, "check_host", None)
    if check_host is not None:
      check_host()


def compute_rewards(specs: Sequence[Sequence[Any]], prompts: Sequence[str],
                    completions: Sequence[str], answers: Sequence[Any],
                    completion_lengths, components: dict | None = None
                    ) -> tuple[np.ndarray, dict[str, float]]:
  """Weighted sum of the named rewards, float32[N], and per-reward metrics.

  Metrics: `reward/<name>/mean` (unweighted), `reward/<name>/seconds`, and
  `reward/total/mean`. When `components` is a dict, each reward's unweighted
  float32[N] values are stored in it by name (e.g. to read correctness).
  """
  n = len(completions)
  lengths = np.asarray(completion_lengths)
  if lengths.shape != (n,):
    raise ValueError(f"completion_lengths has shape {lengths.shape}, want ({n},)")
  total = np.zeros(n, np.float32)
  metrics: dict[str, float] = {}
  for spec in specs:
    name, weight, kwargs = _unpack(spec)
    fn = registry.lookup("reward", name)
    start = time.perf_counter()
    values = np.asarray(fn(prompts, completions, answers, lengths, **kwargs),
                        np.float32)
    if values.shape != (n,):
      raise ValueError(f"reward {name!r} returned shape {values.shape}, want ({n},)")
    metrics[f"reward/{name}/mean"] = float(values.mean()) if n else 0.0
    metrics[f"reward/{name}/seconds"] = time.perf_counter() - start
    total += np.float32(weight) * values
    if components is not None:
      components[name] = values
  metrics["reward/total/mean"] = float(total.mean()) if n else 0.0
  return total, metrics


__all__ = ["compute_rewards", "validate_specs", "verify", "verify_batch",
           "verify_dapo"]
