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


def scan_layers(model_config: ModelConfig, layer: Callable, x: jax.Array,
                xs: Any, wrap: Callable = lambda f: f) -> tuple:
  """`lax.scan` of layer(layer_config, x, xs_l) -> (x, y_l) over the
  layers' stacked inputs `xs` (leading axis L). `wrap` decorates each
  bound layer function (e.g. `jax.checkpoint`). Returns x after the last
  layer and the y_l stacked on a leading L axis (None when layers give
  None)."""
  L, P = model_config.num_layers, model_config.layer_period()
  step = lambda i: wrap(functools.partial(layer,
                                          model_config.layer_config(i)))
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
