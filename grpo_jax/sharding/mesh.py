"""The device mesh that config.mesh describes: its shape, and the chips'
layout where jax's mesh helper refuses them (a split physical axis, a
strided set of chips)."""
from __future__ import annotations

import itertools
import logging
import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from grpo_jax.errors import ConfigError


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
