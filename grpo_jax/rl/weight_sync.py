"""The sampler's devices and weights (rl/async_rollouts.py's two sides).

  split_devices   one device set -> (trainer's, sampler's): on each host its
                  last rollout.sampler_devices / P devices sample
  sampler_layout  the sampler's Layout (rollout.sampler_mesh, mesh.rules)
  WeightStore     the sampler's weights by policy version, each entered
                  whole (complete and ready) and dropped once not needed
  WeightSync      the trainer's parameters cast to the sampler's dtype,
                  copied onto its shardings (a staging copy), waited for,
                  then published; with LoRA only the adapters travel

On several processes (plain jax.distributed) each host copies its own share,
device to device on that host (`_put_by_host`); docs/async.md says what
crosses hosts.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import jax
from ml_collections import ConfigDict

from grpo_jax import sharding as sharding_lib
from grpo_jax.errors import ConfigError
from grpo_jax.models import quant
from grpo_jax.models.transformer import PROJECTION_INPUTS, cast

Params = Any


# ----------------------------------------------------------------------------
# Devices: one set, two meshes.
# ----------------------------------------------------------------------------

def split_devices(settings, devices=None) -> tuple[list, list]:
  """(trainer devices, sampler devices) for `settings` (an
  async_rollouts.RolloutSettings): on each of the P hosts its last
  sampler_devices / P devices sample (`host_shares`: where P does not
  divide it, some hosts give one more), so both meshes span every host and
  each host's weight copy stays on that host. (all, []) when colocated."""
  devices = list(jax.devices() if devices is None else devices)
  count = settings.sampler_devices
  if count == 0 and settings.max_staleness > 0 and jax.process_count() > 1:
    raise ConfigError(
        f"config field 'rollout.max_staleness' = {settings.max_staleness} "
        f"on {jax.process_count()} processes needs rollout.sampler_devices "
        "> 0: a sampler thread on the trainer's own devices would enqueue "
        "its programs between the update's in another order on each host, "
        "and their collectives would wait on each other")
  if count == 0:
    return devices, []
  hosts: dict[int, list] = {}
  for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
    hosts.setdefault(d.process_index, []).append(d)
  share = host_shares(hosts, count)
  if any(not 0 < share[p] < len(h) for p, h in hosts.items()):
    raise ConfigError(
        f"config field 'rollout.sampler_devices' = {count}: needs at least one "
        f"sampler and one trainer device on each of the {len(hosts)} "
        f"host(s) (they have {sorted({len(h) for h in hosts.values()})} "
        f"devices; {len(devices)} in all)")
  train = [d for p, h in hosts.items() for d in h[:len(h) - share[p]]]
  sample = [d for p, h in hosts.items() for d in h[len(h) - share[p]:]]
  return train, sample


def host_shares(hosts: dict[int, list], sampler_devices: int
                ) -> dict[int, int]:
  """Sampler devices per host: sampler_devices / P each; where the P hosts
  do not divide it, the remainder goes one each to the first hosts in
  block order: on a TPU slice hosts sorted by their chips' (x, y) and then
  z, so the extra chips fill whole columns along z (the axis a mesh's
  tensor axis takes), e.g. 160 of a v5p:8x8x4's 256: 3 chips on the 32
  hosts with x < 4, 2 on the others; elsewhere by process index."""
  base, extra = divmod(sampler_devices, len(hosts))

  def block(p):
    coords = [tuple(getattr(d, "coords", None) or ()) for d in hosts[p]]
    if all(len(c) == 3 for c in coords):
      return (min(c[0] for c in coords), min(c[1] for c in coords),
              min(c[2] for c in coords), p)
    return (p,)

  order = sorted(hosts, key=block)
  return {p: base + (i < extra) for i, p in enumerate(order)}


def sampler_layout(config, settings, devices
                   ) -> sharding_lib.Layout:
  """The sampler's Layout over its devices: rollout.sampler_mesh on
  mesh.axes, the same logical-axis rules as the trainer."""
  grid = ConfigDict(dict(shape=settings.sampler_mesh, axes=config.mesh.axes))
  try:
    mesh = sharding_lib.make_mesh(grid, devices)
  except ConfigError as e:
    raise ConfigError(str(e).replace("'mesh.shape'", "'rollout.sampler_mesh'")
                      ) from e
  layout = sharding_lib.Layout(mesh, sharding_lib.logical_rules(config.mesh))
  logging.info("sampler mesh %s over %d devices", dict(mesh.shape), mesh.size)
  return layout


# ----------------------------------------------------------------------------
# Weights: published whole, by version.
# ----------------------------------------------------------------------------

class WeightStore:
  """The sampler's weights by policy version. `publish` enters a complete,
  ready tree; `get` waits for a version; versions below the oldest one the
  sampler still needs are dropped (their buffers freed)."""

  def __init__(self):
    self._cond = threading.Condition()
    self._trees: dict[int, Params] = {}
    self._closed = False

  def publish(self, version: int, tree: Params) -> None:
    with self._cond:
      self._trees[version] = tree
      self._cond.notify_all()

  def versions(self) -> list[int]:
    with self._cond:
      return sorted(self._trees)

  def get(self, version: int) -> Params | None:
    """Waits until `version` is published (None once closed)."""
    with self._cond:
      self._cond.wait_for(lambda: version in self._trees or self._closed)
      return None if self._closed else self._trees[version]

  def drop_below(self, version: int) -> None:
    with self._cond:
      for v in [v for v in self._trees if v < version]:
        del self._trees[v]

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._trees.clear()
      self._cond.notify_all()


def _put(x, sharding):
  """One leaf onto the sampler's sharding, new buffers (a staging copy).
  On several processes each host fills its own sampler devices from a
  trainer copy on the same host (`_put_by_host`)."""
  if jax.process_count() == 1:
    return jax.device_put(x, sharding, may_alias=False)
  return _put_by_host(x, sharding)


def _put_by_host(x: jax.Array, sharding) -> jax.Array:
  """Several processes, plain jax.distributed: a device_put between two
  device sets that span the hosts is not offered, so the leaf is first
  replicated on the trainer's mesh (a no-op for replicated parameters; an
  all-gather over the trainer's devices for sharded ones), then each host
  copies, device to device on that host, the slice each of its sampler
  devices holds, and the slices are assembled into one global array."""
  if not x.sharding.is_fully_replicated:
    x = jax.jit(lambda a: a, out_shardings=jax.sharding.NamedSharding(
        x.sharding.mesh, jax.sharding.PartitionSpec()))(x)
  local = x.addressable_shards[0].data
  pieces = [jax.device_put(local[index], device, may_alias=False)
            for device, index in
            sharding.addressable_devices_indices_map(x.shape).items()]
  return jax.make_array_from_single_device_arrays(x.shape, sharding, pieces)


class WeightSync:
  """Publishes the trainer's parameters to the sampler (module docstring):
  the staging copy is complete and ready before the store sees it. With
  LoRA only the adapters travel; `policy(version_tree)` (called by the
  sampler thread, on its own devices) merges them into, or attaches them
  to, the sampler's own copy of the frozen base."""

  def __init__(self, dtypes: tuple[str, str], model_config,
               layout: sharding_lib.Layout,
               store: WeightStore, base: Params | None,
               attach: Callable[[Params, Params, str], Params] | None):
    # the sampler's compute dtype and weights (RunSpec.sampler_dtype,
    # .sampler_weights: "" or int8, quantised here, on the sampler's side)
    self._dtype, self._weights = dtypes
    self._model_config, self._layout = model_config, layout
    self._store, self._attach = store, attach
    self._base = None if base is None else sharding_lib.shard_params(
        base, sharding_lib.param_shardings(layout.mesh, layout.rules,
                                           model_config, base))
    self._shardings = None

  def publish(self, version: int, params: Params) -> dict[str, float]:
    """Stages `params` (the trainer's) as `version`; sync/* metrics."""
    t0 = time.perf_counter()
    tree = params if self._base is not None else cast(params, self._dtype)
    if self._shardings is None:
      self._shardings = sharding_lib.param_shardings(
          self._layout.mesh, self._layout.rules, self._model_config, tree)
    staged = jax.tree.map(_put, tree, self._shardings)
    jax.block_until_ready(staged)
    self._store.publish(version, staged)
    return {"sync/bytes": float(quant.nbytes(tree)),
            "sync/seconds": time.perf_counter() - t0}

  def policy(self, staged: Params) -> Params:
    """The sampler's policy from a published tree (sampler thread)."""
    tree = (staged if self._base is None
            else self._attach(staged, self._base, self._dtype))
    return quant.sampler_weights(tree, self._weights, PROJECTION_INPUTS)
