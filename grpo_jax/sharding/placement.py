"""Placement: arrays onto their shardings, the multi-host row helpers, and
`Layout` (a run's mesh and rules with the placements the trainer needs)."""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.models.config import ModelConfig
from grpo_jax.models.expert_parallel import ExpertParallel
from grpo_jax.sharding.mesh import make_mesh
from grpo_jax.sharding.rules import (
  BATCH,
  Params,
  Rules,
  batch_sharding,
  logical_rules,
  param_shardings,
  spec_for,
  state_shardings,
)


def _is_global(x) -> bool:
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def put(x, sharding: NamedSharding) -> jax.Array:
  """One array onto `sharding`: itself if already committed there, else new
  buffers.
  A global array is resharded; a host value (numpy, or a process-local
  jax.Array), which must be identical on every host, is cut into the shards
  this process owns.

  No partial aliasing: device_put may reuse a single-device input's buffer
  as one shard, and the update donates its state, which would then delete
  the caller's array. (Keep a tree that must outlive a donation, like the
  reference params, as its own `copy_tree`.)
  """
  # An uncommitted array (e.g. a fresh jnp.zeros) is re-placed even when its
  # sharding matches: committed and uncommitted inputs are different jit
  # signatures, so leaving it would compile the update a second time.
  if (isinstance(x, jax.Array) and x.committed
      and x.sharding.is_equivalent_to(sharding, x.ndim)):
    return x
  if jax.process_count() == 1 or _is_global(x):
    return jax.device_put(x, sharding, may_alias=False)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding,
                                      lambda index: host[index])


def shard_params(params: Params, shardings: Params) -> Params:
  """Params onto their shardings (see `put`)."""
  return jax.tree.map(put, params, shardings)


def copy_tree(tree: Any) -> Any:
  """New buffers with the same shardings: the reference model is a copy of
  the initial policy that the policy's donated updates cannot delete."""
  return jax.tree.map(
      lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def host_rows(sharding: NamedSharding, num_rows: int) -> np.ndarray:
  """Indices of the rows (axis 0) that this process's devices hold, in the
  order `make_array_from_process_local_data` expects them."""
  index_map = sharding.addressable_devices_indices_map((num_rows,))
  rows = set()
  for index in index_map.values():
    rows.update(range(num_rows)[index[0]] if index else range(num_rows))
  return np.asarray(sorted(rows), np.int64)


def global_rows(x_local, sharding: NamedSharding,
                global_shape: Sequence[int]) -> jax.Array:
  """This host's rows (as `host_rows` lists them) -> one global array."""
  return jax.make_array_from_process_local_data(sharding, np.asarray(x_local),
                                                tuple(global_shape))


def to_host(tree: Any) -> Any:
  """Arrays -> whole numpy arrays on every host. A global array (rows on
  other processes' devices) is all-gathered: a collective, so every process
  calls this in the same order."""
  def one(x):
    if _is_global(x):
      return multihost_utils.process_allgather(x, tiled=True)
    return jax.device_get(x)
  return jax.tree.map(one, tree)


def put_rows(x, mesh: Mesh, rules: Rules) -> jax.Array:
  """A batch array, row-sharded by the `batch` rule. A host value must be
  the same on every host: each host contributes only its own rows."""
  sharding = batch_sharding(mesh, rules, x.shape)
  if jax.process_count() == 1 or _is_global(x):
    return jax.device_put(x, sharding)
  host = np.asarray(x)
  return global_rows(host[host_rows(sharding, host.shape[0])], sharding,
                     host.shape)


def resolve_dispatch(dispatch: str, platform: str, experts_split: bool
                     ) -> str:
  """model.moe.dispatch on chips of `platform` whose mesh splits the
  experts (`experts_split`) or not: "auto" is all_to_all on TPU when they
  are split (one Qwen3-30B-A3B update: docs/models.md#mixtures-of-experts),
  else ragged (one chip's experts: nothing to send; CPU: the reference)."""
  if dispatch != "auto":
    return dispatch
  return "all_to_all" if platform == "tpu" and experts_split else "ragged"


@dataclasses.dataclass(frozen=True)
class Layout:
  """The mesh and the rules of a run, with the placements the trainer needs."""
  mesh: Mesh
  rules: Rules

  @classmethod
  def from_config(cls, config, devices=None) -> "Layout":
    layout = cls(make_mesh(config.mesh, devices), logical_rules(config.mesh))
    logging.info("mesh %s over %d devices", dict(layout.mesh.shape),
                 layout.mesh.size)
    return layout

  def shard_params(self, model_config: ModelConfig, params: Params) -> Params:
    return shard_params(params, param_shardings(
        self.mesh, self.rules, model_config, params))

  def place_state(self, model_config: ModelConfig, optimizer, state):
    shardings = state_shardings(self.mesh, self.rules, model_config,
                                optimizer, state)
    return jax.tree.map(put, state, shardings)

  def constrain_state(self, model_config: ModelConfig, optimizer, state):
    """Inside jit: pins a new state to the placed state's shardings, so the
    donated buffers are reused and the next call does not recompile (XLA
    would otherwise pick its own layout for e.g. the replicated norms)."""
    return jax.lax.with_sharding_constraint(state, state_shardings(
        self.mesh, self.rules, model_config, optimizer, state))

  def rows(self, x) -> jax.Array:
    return put_rows(x, self.mesh, self.rules)

  @property
  def batch_shards(self) -> int:
    """How many ways the `batch` rule splits rows (data x fsdp by default)."""
    return math.prod(self.mesh.shape[a]
                     for a in dict(self.rules).get(BATCH, ()))

  def row_shard(self, r: int) -> "Layout":
    """Row shard r's devices as a mesh of their own, the batch axes of size
    1 and the others as they are, with the same rules: where one row
    shard's own work runs (the parked engine, `generate/agent_parked.py`).
    Shard r is r's place over the batch axes in the rules' order, as rows
    are split."""
    batch = dict(self.rules).get(BATCH, ())
    at = dict(zip(batch, np.unravel_index(
        r, [self.mesh.shape[a] for a in batch])))
    index = tuple(slice(at[a], at[a] + 1) if a in at else slice(None)
                  for a in self.mesh.axis_names)
    return Layout(Mesh(self.mesh.devices[index], self.mesh.axis_names),
                  self.rules)

  def place_like(self, tree: Any) -> Any:
    """Each array of `tree` onto this layout's mesh with its own partition
    spec (replicated where it has none): e.g. a run's weights onto one row
    shard's devices (`row_shard`)."""
    def one(x):
      spec = getattr(x.sharding, "spec", PartitionSpec())
      return jax.device_put(x, NamedSharding(self.mesh, spec))
    return jax.tree.map(one, tree)

  def splits(self, logical: str, size: int) -> int:
    """How many ways the rules split a dimension of `size` named `logical`."""
    spec = spec_for((logical,), (size,), self.mesh, self.rules, logical)
    axes = spec[0] if len(spec) else None
    if axes is None:
      return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(self.mesh.shape[a] for a in axes)

  def expert_dispatch(self, dispatch: str) -> Optional[ExpertParallel]:
    """model.moe.dispatch's token dispatch: None for "ragged" (the grouped
    matmul left to the partitioner, `moe.experts`); for "all_to_all" the
    experts split over the mesh axes of the `experts` rule and the tokens
    over those and the `batch` rule's (`expert_parallel`), no drops.
    "auto": all_to_all when the mesh's chips are TPUs and split the
    experts, else ragged (docs/models.md#mixtures-of-experts)."""
    rules = dict(self.rules)
    split = lambda logical: tuple(a for a in rules.get(logical, ())
                                  if self.mesh.shape[a] > 1)
    experts = split("experts")
    if resolve_dispatch(dispatch, self.mesh.devices.flat[0].platform,
                        bool(experts)) == "ragged":
      return None
    tokens = tuple(dict.fromkeys(split(BATCH) + experts))
    return ExpertParallel(self.mesh, experts, tokens)

  def constrain(self, x: jax.Array, logical_axes: Sequence[Optional[str]]
                ) -> jax.Array:
    """Inside jit: pins `x` to the sharding its logical axes get from the
    rules (axes past the named ones: replicated)."""
    spec = spec_for(logical_axes, x.shape, self.mesh, self.rules,
                    f"{tuple(logical_axes)} {tuple(x.shape)}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
