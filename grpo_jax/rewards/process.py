"""Process rewards: a reward for each reasoning step, at the token that ends
it (DeepSeekMath §4.1.3, GRPO with process supervision).

A "process_reward" registry entry maps a completion's text (and whether its
final answer is correct) to steps `[(char_end, reward), ...]`: the character
offset where each step ends and its reward. `step_rewards` turns them into
the token arrays that `advantages.grpo_process_advantages` reads:
step_reward_bgt (the reward at the step's last token) and step_end_bgt.

  "equations"  every written "a op b = c" is a step, rewarded 1 if it holds
               and 0 if not; the final answer is the last step, rewarded 1
               if correct (the accuracy reward) and 0 if not. A verifier of
               the arithmetic, standing in for DeepSeekMath's process reward
               model on the generated arithmetic / word-problem tasks.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from grpo_jax.registry import register
from grpo_jax.rewards.equations import checked_equations


@register("process_reward", "equations")
def equation_steps(text: str, correct: bool) -> list[tuple[int, float]]:
  """One step per stand-alone equation (`rewards/equations.py`; 1: holds, 0:
  does not; a chain such as "2 + 3 * 4 = 14" is no step), then the final
  answer (1: correct, 0: not) ending at the end of the text."""
  steps = [(end, 1.0 if ok else 0.0) for end, ok in checked_equations(text)]
  return steps + [(len(text), 1.0 if correct else 0.0)]


def char_ends_to_tokens(decode, ids: Sequence[int],
                        char_ends: Sequence[int]) -> list[int]:
  """For each character offset, the first token whose prefix decodes to at
  least that many characters (binary search over prefix decodes, which stay
  right for tokens that are parts of one character)."""
  cache: dict[int, int] = {}

  def chars(k):   # decoded length of the first k tokens
    if k not in cache:
      cache[k] = len(decode(list(ids[:k])))
    return cache[k]

  out = []
  for end in char_ends:
    lo, hi = 1, len(ids)
    while lo < hi:
      mid = (lo + hi) // 2
      if chars(mid) >= end:
        hi = mid
      else:
        lo = mid + 1
    out.append(lo - 1)
  return out


def step_rewards(name: str, tokenizer, tokens_bgt: np.ndarray,
                 text_len_bg: np.ndarray, correct_bg: np.ndarray, T: int
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
  """(step_reward_bgt float32, step_end_bgt bool, metrics) for B groups of G
  completions. text_len_bg: tokens that make up the text the rewards read
  (the stop token excluded). Steps that end on the same token are summed
  into one step."""
  from grpo_jax import registry  # pylint: disable=import-outside-toplevel
  fn = registry.lookup("process_reward", name)
  B, G = correct_bg.shape
  reward_bgt = np.zeros((B, G, T), np.float32)
  end_bgt = np.zeros((B, G, T), bool)
  decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
  counts, equations, values = [], [], []
  for b in range(B):
    for g in range(G):
      ids = list(tokens_bgt[b, g, :max(int(text_len_bg[b, g]), 1)])
      steps = fn(decode(ids), bool(correct_bg[b, g]))
      ends = char_ends_to_tokens(decode, ids, [e for e, _ in steps])
      for t, (_, r) in zip(ends, steps):
        reward_bgt[b, g, t] += r
        end_bgt[b, g, t] = True
      counts.append(int(end_bgt[b, g].sum()))
      equations.append(len(steps) - 1)
      values.extend(r for _, r in steps[:-1])
  metrics = {"process/steps_per_completion": float(np.mean(counts)),
             "process/equations_per_completion": float(np.mean(equations)),
             "process/equation_holds_frac": (float(np.mean(values))
                                             if values else 0.0)}
  return reward_bgt, end_bgt, metrics
