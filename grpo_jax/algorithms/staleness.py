"""Per-token policy versions: host-side numpy helpers (partial rollouts,
docs/async.md).

With partial rollouts a row's tokens may come from several policy versions:
a row cut at a step boundary continues under the next weights. Each token
records the version that sampled it (`version_nt`, int32 [n, t]); its
behaviour log-prob is that version's, so the rollout correction's
ρ_t = π_old / π_rollout (rollout_correction.py) is already per token and
per version: nothing in the correction changes. What the versions add:

  row version   a row's first token's (versions only grow along a row:
                the oldest), the age the staleness bound k applies to.
  the bound     the update that makes version u + 1 trains on rows whose
                first token is at most k versions older than u. A row
                older than that is dropped from the loss (its mask set to
                0; its group keeps its place, and the advantages, computed
                from the whole group's rewards, do not change) and counted
                (`partial/stale_dropped`). The built sampler never hands
                one over (docs/async.md rule 2 finishes a row before it can
                age past k, since dropping the rows that run longest would
                bias the batch toward short answers); the rule is the
                objective's, whatever the source.
"""
from __future__ import annotations

import numpy as np


def row_versions(version_nt: np.ndarray, valid_nt: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
  """(first [n], last [n]): the oldest and newest version among each row's
  generated tokens (valid_nt); rows with none get the row's version 0."""
  valid = np.asarray(valid_nt, bool)
  big = np.iinfo(np.int32).max
  first = np.where(valid, version_nt, big).min(axis=1)
  last = np.where(valid, version_nt, -1).max(axis=1)
  empty = ~valid.any(axis=1)
  return (np.where(empty, 0, first).astype(np.int32),
          np.where(empty, 0, last).astype(np.int32))


def bound_rows(version_nt: np.ndarray, valid_nt: np.ndarray,
               mask_nt: np.ndarray, trained: int, max_staleness: int
               ) -> tuple[np.ndarray, dict[str, float]]:
  """The loss mask with rows older than the bound dropped (module
  docstring), and the version metrics: the staleness of the tokens
  (`trained` - version: mean, max), each row's span of versions (last -
  first: mean, max) and the rows dropped."""
  valid = np.asarray(valid_nt, bool)
  first, last = row_versions(version_nt, valid)
  stale_n = (trained - first > max_staleness) & valid.any(axis=1)
  age_nt = (trained - np.asarray(version_nt, np.int64))[valid]
  span_n = (last - first)[valid.any(axis=1)]
  metrics = {
      "staleness/token_mean": float(age_nt.mean()) if age_nt.size else 0.0,
      "staleness/token_max": float(age_nt.max()) if age_nt.size else 0.0,
      "partial/version_span": float(span_n.mean()) if span_n.size else 0.0,
      "partial/version_span_max": float(span_n.max()) if span_n.size else 0.0,
      "partial/stale_dropped": float(stale_n.sum()),
  }
  mask = np.asarray(mask_nt) * ~stale_n[:, None]
  return mask.astype(np.asarray(mask_nt).dtype), metrics
