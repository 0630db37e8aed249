"""Mesh, logical-axis rules and placement: one code path from 1 CPU to a pod.

The model names logical axes only (`transformer.param_axes`); the config maps
them to mesh axes (`config.mesh.rules`, MaxText-style), so a parallelism plan
is a config change, not a code change. With the default rules:

  data    batch rows; parameters replicated (plain data parallelism)
  fsdp    batch rows AND the `embed` dimension of every weight (ZeRO-3: each
          layer's weights are all-gathered where used, gradients
          reduce-scattered, optimizer state stays sharded)
  tensor  query/KV heads, MLP and vocabulary dimensions (Megatron-style)

A mesh axis that does not divide a dimension is dropped for that dimension
(logged once): e.g. 2 KV heads on tensor=4 stay replicated while the 4 query
heads are split.

Placement is by committed input shardings: parameters, optimizer state and
batches are `NamedSharding`ed global arrays, so the jitted sampler and update
run SPMD over the mesh without a mesh context. Policy and reference are two
parameter trees with the same shardings on the same mesh. The sampler
splits its rows (prompts, tokens, KV cache) like a batch and the cache's KV
heads like the parameters' (`Layout.constrain` inside its jit).

Multi-host (SPMD, every host runs the same program): the processes are
joined before any other JAX call (`harness.distributed`). Each host samples its own
rows; `to_host` all-gathers them, so every host scores the same rollout
(rewards work on strings); each then hands over only the rows its devices own
(`host_rows`), and `global_rows` assembles the global batch with
`jax.make_array_from_process_local_data`. Host-side files (metrics, plots,
the run record) are written by process 0 only (`metrics.is_primary`).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo_jax.errors import ConfigError
from grpo_jax.models import transformer
from grpo_jax.models.config import ModelConfig

Params = Any
# logical axis name -> mesh axes that split it (empty: replicated).
Rules = tuple[tuple[str, tuple[str, ...]], ...]

BATCH = "batch"   # the logical name of the leading (row) axis of a batch
LENGTH = "length"  # a row's columns in the residual stream (activations)


# ----------------------------------------------------------------------------
# The mesh and the rules.
# ----------------------------------------------------------------------------

def mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """config.mesh.shape with its one -1 filled so the product is num_devices."""
  shape = tuple(int(s) for s in shape)
  free = [i for i, s in enumerate(shape) if s == -1]
  if len(free) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ConfigError(f"config field 'mesh.shape' = {shape}: positive sizes "
                      f"and at most one -1")
  known = math.prod(s for s in shape if s != -1)
  if free and num_devices % known:
    raise ConfigError(f"config field 'mesh.shape' = {shape}: its fixed axes need a "
                      f"multiple of {known} devices; there are {num_devices}")
  if free:
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ConfigError(f"config field 'mesh.shape' = {shape} needs "
                      f"{math.prod(shape)} devices; there are {num_devices}")
  return shape


def make_mesh(mesh_cfg, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """The device mesh that config.mesh describes (all devices by default).

  Axes are Auto (GSPMD propagation from the input shardings), not jax's
  Explicit sharding-in-types default.
  """
  devices = list(jax.devices() if devices is None else devices)
  axes = tuple(mesh_cfg.axes)
  if len(axes) != len(mesh_cfg.shape):
    raise ConfigError(f"config fields 'mesh.shape' = {tuple(mesh_cfg.shape)} "
                      f"and 'mesh.axes' = {axes} differ in length")
  shape = mesh_shape(mesh_cfg.shape, len(devices))
  types = (jax.sharding.AxisType.Auto,) * len(axes)
  try:
    return jax.make_mesh(shape, axes, devices=devices, axis_types=types)
  except NotImplementedError:
    # TPU slices whose physical axes do not each fit inside one mesh axis
    # (e.g. (-1, 8, 4) on v5p:4x4x4 or v6e:16x16) need a physical axis split
    # over two mesh axes.
    try:
      grid = mesh_utils.create_device_mesh(shape, devices,
                                           allow_split_physical_axes=True)
    except AssertionError:   # not a cuboid of chips: below
      grid = strided_mesh(devices, shape)
    logging.info("mesh %s: physical axes split over mesh axes", shape)
    return Mesh(grid, axes, axis_types=types)
  except AssertionError:
    # jax lays out only a cuboid of chips; one role's chips of a per-host
    # split (rl/weight_sync.split_devices) are strided, e.g. every other row.
    return Mesh(strided_mesh(devices, shape), axes, axis_types=types)


def chip_grid(devices: Sequence[Any]) -> tuple[np.ndarray, tuple] | None:
  """(TPU chips as an [X, Y, Z] array indexed by the rank of each of their
  coordinates among the set's, the set's gap between neighbours along each
  physical axis), or None where the chips are not such a grid (no
  coordinates, several cores per chip, or holes). A cuboid of chips has
  gaps (1, 1, 1); each host's last two of its 2x2 chips on a v5p, every
  other row of chips: (1, 2, 1)."""
  coords = [tuple(getattr(d, "coords", None) or ()) for d in devices]
  if (len(coords[0]) != 3 or any(len(c) != 3 for c in coords)
      or len({getattr(d, "core_on_chip", 0) for d in devices}) > 1):
    return None
  values = [sorted({c[i] for c in coords}) for i in range(3)]
  if math.prod(map(len, values)) != len(devices) or len(set(coords)) != len(
      coords):
    return None
  rank = [{v: j for j, v in enumerate(vs)} for vs in values]
  grid = np.empty(tuple(map(len, values)), dtype=object)
  for d, c in zip(devices, coords):
    grid[tuple(rank[i][c[i]] for i in range(3))] = d
  gaps = tuple(min(np.diff(vs), default=1) for vs in values)
  return grid, tuple(int(g) for g in gaps)


def strided_mesh(devices: Sequence[Any], shape: tuple) -> np.ndarray:
  """The device array of a `shape` mesh over chips that jax's mesh helper
  refuses (not a cuboid): the chips' grid (`chip_grid`) with its physical
  axes in the order that splits the fewest of them over mesh axes, and of
  those the one whose innermost physical axis (it carries the last,
  busiest mesh axis: tensor) has neighbours one link apart; reshaped to
  `shape`. Chips that are no grid keep their order (by coordinates)."""
  found = chip_grid(devices)
  if found is None:
    logging.warning("mesh %s over %d chips that are not a grid: laid out in "
                    "coordinate order", shape, len(devices))
    order = sorted(devices, key=lambda d: (tuple(getattr(d, "coords", ())),
                                           d.id))
    return np.asarray(order, dtype=object).reshape(shape)
  grid, gaps = found

  def cost(perm):
    dims = [grid.shape[i] for i in perm]
    edges = set(np.cumprod(dims).tolist())
    splits = sum(int(e not in edges) for e in np.cumprod(shape).tolist())
    return splits, gaps[perm[-1]]

  perm = min(itertools.permutations(range(3)), key=cost)
  logging.info("mesh %s over a strided set of chips (grid %s, gaps %s)",
               shape, grid.shape, gaps)
  return np.transpose(grid, perm).reshape(shape)


def _known_logical_axes() -> set[str]:
  axes = set(transformer._AXES.values())  # pylint: disable=protected-access
  return ({a for names in axes for a in names}
          | {BATCH, LENGTH, transformer.LORA_RANK})


def logical_rules(mesh_cfg) -> Rules:
  """config.mesh.rules as ((logical, (mesh axes...)), ...), checked; with
  mesh.sequence_parallel, `length` (the residual stream's columns between
  layers) split over `tensor` (Megatron-style sequence parallelism)."""
  rules = []
  if mesh_cfg.get("sequence_parallel", False):
    if "tensor" not in mesh_cfg.axes:
      raise ConfigError("config field 'mesh.sequence_parallel' splits a "
                        "row's columns over the 'tensor' mesh axis, which "
                        f"mesh.axes {tuple(mesh_cfg.axes)} lacks")
    if any(pair[0] == LENGTH for pair in mesh_cfg.rules):
      raise ConfigError("config fields 'mesh.sequence_parallel' and a "
                        "'length' entry in 'mesh.rules' both place the "
                        "sequence: set one")
    rules.append((LENGTH, ("tensor",)))
  for pair in mesh_cfg.rules:
    if len(pair) != 2:
      raise ConfigError(f"config field 'mesh.rules': {pair!r} is not a "
                        f"(logical axis, mesh axis or None) pair")
    logical, target = pair
    mesh_axes = (() if target is None else
                 (target,) if isinstance(target, str) else tuple(target))
    if logical not in _known_logical_axes():
      raise ConfigError(f"config field 'mesh.rules': unknown logical axis "
                        f"{logical!r}; allowed: "
                        f"{sorted(_known_logical_axes())}")
    for axis in mesh_axes:
      if axis not in mesh_cfg.axes:
        raise ConfigError(f"config field 'mesh.rules': {logical!r} -> "
                          f"{axis!r} is not one of mesh.axes {mesh_cfg.axes}")
    rules.append((logical, mesh_axes))
  return tuple(rules)


@functools.lru_cache(maxsize=None)
def _log_fallback(what: str, logical: str, dim: int, wanted: tuple,
                  kept: tuple) -> None:
  logging.info("sharding: %s: %r (size %d) not divisible by mesh axes %s; "
               "split over %s instead", what, logical, dim, wanted,
               kept or "nothing (replicated)")


def spec_for(logical_axes: Sequence[Optional[str]], shape: Sequence[int],
             mesh: Mesh, rules: Rules, what: str = "array") -> P:
  """The PartitionSpec of an array from its logical axes and the rules.

  Mesh axes of size 1 are left out (they split nothing). Where the product of
  a dimension's mesh axes does not divide it, the longest dividing prefix is
  used (possibly none: replicated). A mesh axis splits at most one dimension.
  """
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for logical, dim in zip(logical_axes, shape):
    wanted = tuple(a for a in table.get(logical, ())
                   if mesh.shape[a] > 1 and a not in used)
    kept = wanted
    while kept and dim % math.prod(mesh.shape[a] for a in kept):
      kept = kept[:-1]
    if kept != wanted:
      _log_fallback(what, logical, dim, wanted, kept)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


# ----------------------------------------------------------------------------
# Shardings of the parameters, the optimizer state and batches.
# ----------------------------------------------------------------------------

def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


def param_specs(mesh, rules: Rules, model_config: ModelConfig,
                params: Optional[Params] = None) -> Params:
  """A PartitionSpec per parameter, as a tree shaped like the params.

  Shapes come from `params` (arrays or ShapeDtypeStructs) when given, else
  from the config. `mesh` may be a jax.sharding.AbstractMesh (no devices).
  """
  if params is None:
    axes = transformer.param_axes(model_config)
    shapes = transformer.param_shapes(model_config)
  else:   # by leaf path: also the LoRA adapters, alone or attached
    axes = transformer.tree_axes(params)
    shapes = jax.tree.map(lambda x: tuple(x.shape), params)
  is_axes = lambda x: isinstance(x, tuple)
  flat, treedef = jax.tree_util.tree_flatten_with_path(axes, is_leaf=is_axes)
  shape_leaves = treedef.flatten_up_to(shapes)
  return jax.tree_util.tree_unflatten(treedef, [
      spec_for(names, shape, mesh, rules, _path_name(path))
      for (path, names), shape in zip(flat, shape_leaves)])


def param_shardings(mesh: Mesh, rules: Rules, model_config: ModelConfig,
                    params: Optional[Params] = None) -> Params:
  """A NamedSharding per parameter, as a tree shaped like the params."""
  specs = param_specs(mesh, rules, model_config, params)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, P))


def opt_state_shardings(mesh: Mesh, optimizer, params: Params,
                        param_sh: Params) -> Any:
  """Shardings for `optimizer.init(params)`: every sub-tree that mirrors the
  params (same structure and shapes: Adam's moments) is sharded like them;
  everything else (step counts, scalars) is replicated."""
  abstract = jax.eval_shape(optimizer.init, params)
  structure = jax.tree.structure(params)
  shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
  replicated = NamedSharding(mesh, P())

  def mirrors(sub) -> bool:
    return (jax.tree.structure(sub) == structure and
            [tuple(x.shape) for x in jax.tree.leaves(sub)] == shapes)

  return jax.tree.map(lambda sub: param_sh if mirrors(sub) else replicated,
                      abstract, is_leaf=mirrors)


def state_shardings(mesh: Mesh, rules: Rules, model_config: ModelConfig,
                    optimizer, state) -> Any:
  """Shardings of a TrainState-like NamedTuple (fields params, opt_state and
  replicated others such as step and key)."""
  replicated = NamedSharding(mesh, P())
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        state.params)
  param_sh = param_shardings(mesh, rules, model_config, params)
  return jax.tree.map(lambda _: replicated, state)._replace(
      params=param_sh,
      opt_state=opt_state_shardings(mesh, optimizer, params, param_sh))


def batch_sharding(mesh: Mesh, rules: Rules, shape: Sequence[int]
                   ) -> NamedSharding:
  """Rows (axis 0) split as the `batch` rule says; other axes replicated."""
  return NamedSharding(mesh, spec_for((BATCH,), shape[:1], mesh, rules,
                                      f"batch {tuple(shape)}"))


# ----------------------------------------------------------------------------
# Placement.
# ----------------------------------------------------------------------------

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

  def splits(self, logical: str, size: int) -> int:
    """How many ways the rules split a dimension of `size` named `logical`."""
    spec = spec_for((logical,), (size,), self.mesh, self.rules, logical)
    axes = spec[0] if len(spec) else None
    if axes is None:
      return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(self.mesh.shape[a] for a in axes)

  def constrain(self, x: jax.Array, logical_axes: Sequence[Optional[str]]
                ) -> jax.Array:
    """Inside jit: pins `x` to the sharding its logical axes get from the
    rules (axes past the named ones: replicated)."""
    spec = spec_for(logical_axes, x.shape, self.mesh, self.rules,
                    f"{tuple(logical_axes)} {tuple(x.shape)}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
