"""The scan over a decoder's stacked layers, when layers differ (Gemma).

Gemma's layers alternate kinds: sliding-window and full attention, each
kind with its own RoPE base (`ModelConfig.layer_types`). Both are static
(a window decides which key blocks are visited; a RoPE base is a constant),
so a plain `lax.scan` over all L layers cannot carry them. The pattern
repeats every P = `layer_period()` layers (2 for Gemma 2, 6 for Gemma 3):
`scan_layers` scans the L // P groups of P layers, each group's P layers
unrolled with their own `layer_config(i)`, then the last L % P layers
(the pattern's first L % P) unrolled. A model whose layers are alike
(P = 1) gets the one scan it always had; nothing is copied per family.

A mixture-of-experts model may have dense layers too (`MoeConfig.
dense_layers`): the sparse layers' expert weights stack over the sparse
layers only and the dense MLP's over the dense ones (`layer_index`), so the
layers are scanned in runs of one MLP kind (`ModelConfig.mlp_segments`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_jax.models.attention import attend_fn
from grpo_jax.models.config import ModelConfig


def _stack(ys: list) -> Any:
  return jax.tree.map(lambda *y: jnp.stack(y), *ys)


# Leaves stacked over the sparse layers only / the dense MLP's over the
# dense layers only (in an MoE model; every leaf stacks all L otherwise).
SPARSE_LEAVES = frozenset({"router", "router_bias", "expert_gate",
                           "expert_up", "expert_down", "shared_gate",
                           "shared_up", "shared_down", "routes"})
DENSE_LEAVES = frozenset({"w_gate", "w_up", "w_down"})


def leaf_kind(path) -> str:
  """"sparse", "dense" or "layer": which layers a leaf's axis 0 stacks."""
  keys = {getattr(k, "key", None) for k in path}
  if keys & SPARSE_LEAVES:
    return "sparse"
  return "dense" if keys & DENSE_LEAVES else "layer"


def layer_index(model_config: ModelConfig, kind: str, i: int) -> int:
  """Layer i's index on the axis 0 of a leaf of `kind` (`leaf_kind`)."""
  moe = model_config.moe
  if moe is None or kind == "layer":
    return i
  dense_before = sum(d < i for d in moe.dense_layers)
  return dense_before if kind == "dense" else i - dense_before


def slice_layers(model_config: ModelConfig, xs: Any, start: int,
                 stop: int) -> Any:
  """Layers [start, stop) (all of one MLP kind) of every leaf of `xs`;
  None for the leaves of the other MLP kind."""
  sparse = model_config.layer_config(start).moe is not None
  other = "dense" if sparse else "sparse"

  def take(path, a):
    kind = leaf_kind(path)
    if kind == other:
      return None
    lo = layer_index(model_config, kind, start)
    return a[lo:lo + stop - start]
  return jax.tree_util.tree_map_with_path(take, xs)


def take_layer(model_config: ModelConfig, xs: Any, i: int) -> Any:
  """Layer i's slice of every leaf of `xs` (the decoders' `unstack`)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, a: a[layer_index(model_config, leaf_kind(path), i)], xs)


def scan_layers(model_config: ModelConfig, layer: Callable, x: jax.Array,
                xs: Any, wrap: Callable = lambda f: f) -> tuple:
  """`lax.scan` of layer(layer_config, x, xs_l) -> (x, y_l) over the
  layers' stacked inputs `xs` (leading axis L). `wrap` decorates each
  bound layer function (e.g. `jax.checkpoint`). Returns x after the last
  layer and the y_l stacked on a leading L axis (None when layers give
  None)."""
  segments = model_config.mlp_segments()
  if len(segments) == 1:
    return _scan_run(model_config, layer, x, xs, wrap, 0,
                     model_config.num_layers)
  ys = []
  for start, stop in segments:
    x, y = _scan_run(model_config, layer, x,
                     slice_layers(model_config, xs, start, stop), wrap,
                     start, stop)
    ys.append(y)
  ys = [y for y in ys if y is not None]   # e.g. routes: sparse layers only
  if not ys:
    return x, None
  return x, jax.tree.map(lambda *y: jnp.concatenate(y), *ys)


def _scan_run(model_config: ModelConfig, layer: Callable, x: jax.Array,
              xs: Any, wrap: Callable, start: int, stop: int) -> tuple:
  """`scan_layers` over layers [start, stop), whose MLPs are alike."""
  L, P = stop - start, model_config.layer_period(start, stop)
  step = lambda i: wrap(functools.partial(
      layer, model_config.layer_config(start + i)))
  if P == 1:
    return jax.lax.scan(step(0), x, xs)
  steps = [step(i) for i in range(P)]
  G = L // P
  take = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  ys = None
  if G:
    def group(x, xs_g):
      outs = []
      for j in range(P):
        x, y = steps[j](x, take(xs_g, j))
        outs.append(y)
      return x, _stack(outs)

    grouped = jax.tree.map(lambda a: a[:G * P].reshape((G, P) + a.shape[1:]),
                           xs)
    x, ys = jax.lax.scan(group, x, grouped)
    ys = jax.tree.map(lambda a: a.reshape((G * P,) + a.shape[2:]), ys)
  tail = []
  for i in range(G * P, L):
    x, y = steps[i - G * P](x, take(xs, i))
    tail.append(y)
  if tail:
    tail = _stack(tail)
    ys = tail if ys is None else jax.tree.map(
        lambda a, b: jnp.concatenate([a, b]), ys, tail)
  return x, ys


def remat(policy) -> Callable:
  """`wrap` for `scan_layers`: each layer under `jax.checkpoint(policy)`;
  None: no remat."""
  if policy is None:
    return lambda f: f
  return functools.partial(jax.checkpoint, policy=policy)


def attends_per_layer(model_config: ModelConfig, impl: str,
                      *mask_inputs) -> dict:
  """layer config -> its attention (`attend_fn(config, impl, *mask_inputs)`),
  one per distinct layer config, each mask built once outside the scan."""
  configs = {model_config.layer_config(i)
             for i in range(model_config.num_layers)}
  return {c: attend_fn(c, impl, *mask_inputs) for c in configs}
