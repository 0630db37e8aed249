"""Logical-axis rules (config.mesh.rules) and the shardings they give the
parameters, the optimizer state and batches."""
from __future__ import annotations

import functools
import logging
import math
from typing import Any, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.errors import ConfigError
from grpo_jax.models import transformer
from grpo_jax.models.config import ModelConfig

Params = Any
# logical axis name -> mesh axes that split it (empty: replicated).
Rules = tuple[tuple[str, tuple[str, ...]], ...]

BATCH = "batch"   # the logical name of the leading (row) axis of a batch
LENGTH = "length"  # a row's columns in the residual stream (activations)


def _known_logical_axes() -> set[str]:
  axes = set(transformer._AXES.values())  # pylint: disable=protected-access
  return ({a for names in axes for a in names if a}
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
