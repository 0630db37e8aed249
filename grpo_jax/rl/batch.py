"""The update's input: a step's kept groups as fixed-shape rows.

`to_rows` turns `rollout.Groups` (group axis first, host numpy) into a
`RolloutBatch`: n = b*g rows of s = p + t columns, each row a left-padded
prompt and its completion side by side, the shape the jitted scoring and
update programs consume (`step.train_step`). "Rows" here are always these
padded rows; several sequences per row is `packing.py`'s business.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from grpo_jax.algorithms import dynamic_sampling
from grpo_jax.generate import sampling
from grpo_jax.generate.rollout import Groups


class RolloutBatch(NamedTuple):
  """Fixed-shape update inputs, n = b*g rows, s = p + t columns."""
  tokens_ns: np.ndarray       # int32, [left-padded prompt | completion]
  positions_ns: np.ndarray    # int32 rotary positions
  valid_ns: np.ndarray        # bool: real (attendable) tokens
  mask_nt: np.ndarray         # float32 loss mask over the completion
  old_logp_nt: np.ndarray     # float32 log-probs from the sampler
  reward_bg: np.ndarray       # float32 [b, g]
  # routing replay: the sampler's experts of every column, per sparse
  # layer (uint8/int16, 0 on padding); None: not replayed
  routes_nslc: np.ndarray | None = None
  # partial rollouts: int32 [n, t], the policy version that sampled each
  # completion token; None: every token the batch's version
  version_nt: np.ndarray | None = None


def to_rows(groups: Groups, pad_id: int, overlong_filter: bool
            ) -> RolloutBatch:
  """Group-major arrays -> row-major fixed-shape arrays for the update."""
  B, G, T = groups.tokens_bgt.shape
  prompts = [p for p in groups.prompt_ids_b for _ in range(G)]
  P = sampling.bucket(max(len(p) for p in prompts))
  prompt_np, len_n = sampling.left_pad(prompts, P, len(prompts), pad_id)
  comp_nt = groups.tokens_bgt.reshape(B * G, T)
  mask_nt = groups.mask_bgt.reshape(B * G, T)
  tokens = np.concatenate([prompt_np, comp_nt], axis=1)
  col = np.arange(P + T)[None, :]
  pad_n = P - len_n[:, None]
  positions = np.maximum(col - pad_n, 0).astype(np.int32)
  # Env observation tokens are attended to (valid) but never trained.
  seen_nt = mask_nt if groups.observation_bgt is None else (
      mask_nt | groups.observation_bgt.reshape(B * G, T))
  valid = np.concatenate([col[:, :P] >= pad_n, seen_nt], axis=1)
  loss_mask = mask_nt.astype(np.float32)
  if overlong_filter:
    loss_mask = np.asarray(dynamic_sampling.overlong_filter(
        loss_mask, groups.truncated_bg.reshape(-1)), np.float32)
  return RolloutBatch(tokens.astype(np.int32), positions, valid, loss_mask,
                      groups.logp_bgt.reshape(B * G, T).astype(np.float32),
                      groups.reward_bg.astype(np.float32),
                      replay_routes(groups, P),
                      None if groups.version_bgt is None else
                      groups.version_bgt.reshape(B * G, T).astype(np.int32))


def replay_routes(groups: Groups, prompt_len: int) -> np.ndarray | None:
  """The recorded routes (routing replay) in the rows' columns [n, p + t,
  l, c]: each prompt's right-aligned to `prompt_len` as its tokens are,
  then the completion's; 0 on padding. None when none were recorded."""
  if groups.routes_bgtlc is None:
    return None
  B, G, T = groups.tokens_bgt.shape
  tail = groups.routes_bgtlc.reshape(B * G, T, *groups.routes_bgtlc.shape[3:])
  out = np.zeros((B * G, prompt_len + T) + tail.shape[2:], tail.dtype)
  for b, routes in enumerate(groups.prompt_routes_b):
    out[b * G:(b + 1) * G, prompt_len - len(routes):prompt_len] = routes
  out[:, prompt_len:] = tail
  return out
