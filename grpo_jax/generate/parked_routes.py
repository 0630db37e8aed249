"""The parked engine's recorded routes (`sampling.record_routes`, MoE
routing replay; docs/models.md): each column's experts per sparse layer,
recorded when its token is fed (the prefill's for the new tokens, each
decode step's for the token it feeds), kept on the host beside the
column's page: a row sharing a page shares its routes, a released row
takes its columns' with it (`Parked.routes`) and keeps them, as first
fed, when its keys are recomputed. A row's last sampled token is
fed by one more admission of a one-token turn, its sample dropped
(`agent_parked`). W pages of Z columns, L_sparse sparse layers, C experts
per token.
"""
from __future__ import annotations

import numpy as np

from grpo_jax.models import moe


def slot_shape(model_config, cfg) -> tuple:
  """A slot's routes (T, L_sparse, C) and their dtype
  (`moe.routes_dtype`); (0, 0, 0) when cfg does not record routes."""
  if not cfg.record_routes:
    return (0, 0, 0), np.uint8
  c = model_config
  return ((cfg.max_new_tokens, len(c.sparse_layers()),
           c.moe.experts_per_token), moe.routes_dtype(c.moe.num_experts))


class PageRoutes:
  """Column z of page w's token's experts, (W, Z, L_sparse, C)."""

  def __init__(self, model_config, cfg, pages: int):
    (_, *lc), dtype = slot_shape(model_config, cfg)
    self.Z = cfg.page_size
    self.routes_wzlc = np.zeros((pages, self.Z, *lc), dtype)

  def record(self, pages: tuple, start: int, routes_slc: np.ndarray) -> None:
    """Columns start... of a row on `pages` were fed with these experts."""
    w, z = self._at(pages, start + np.arange(len(routes_slc)))
    self.routes_wzlc[w, z] = routes_slc

  def of(self, pages: tuple, columns: int) -> np.ndarray:
    """A row's first `columns` columns' experts (columns, L_sparse, C)."""
    return self.routes_wzlc[self._at(pages, np.arange(columns))]

  def _at(self, pages: tuple, col: np.ndarray) -> tuple:
    return np.asarray(pages, np.int32)[col // self.Z], col % self.Z
