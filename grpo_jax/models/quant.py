"""Int8 rollout weights (`sampling.weights_dtype = "int8"`): the sampler's
copy of the policy quantised after each sync, the trainer's kept in full
precision.

Decode is memory-bound: every step reads the chip's slice of the weights.
Stored as int8 with one float scale per output channel, they take half the
bytes of bf16. The quantisation is qwix's (`qwix.quantize`, symmetric,
absmax calibration): a weight W (layers, in..., out...) becomes a
`qwix.QArray` of int8 values q and scales s (layers, 1..., out...) with
W ≈ q·s, s = max|W over the inputs| / 127.5.

The projections (`transformer.PROJECTION_INPUTS`) run W8A8: each token's
activations are quantised the same way on the fly (one scale per token) and
`qwix.einsum` multiplies int8 by int8 into int32, then applies both scales,
the MXU's int8 path on TPU v5e / v5p / v6e, a plain-JAX dot on CPU. The
embedding rows and the logits' matmul stay weight-only (the int8 table
dequantised as it is read): logits are what sampling draws from, and a
per-token quantisation of the last hidden state would move them most.

Why qwix and not a hand-written pair of functions: it is JAX's own
quantisation library (the one tunix and MaxText use), its QArray is a
pytree that slices, reshapes and transposes like the array it stands for
(the samplers' per-layer slicing, `transformer._out_projection`'s reshape,
the tied head's transpose all work on it unchanged), and its int8 einsum is
the one that lowers to the TPU's int8 matmul.

LoRA adapters attached unmerged stay in the compute dtype (they are small);
merged adapters are quantised with the base they were merged into.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import qwix

WEIGHTS_DTYPES = ("", "int8")   # "": the sampler's compute dtype
_QTYPE = jnp.int8

Params = dict[str, Any]


def is_quantized(w) -> bool:
  return isinstance(w, qwix.QArray)


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w: jax.Array, channel_axes: tuple) -> qwix.QArray:
  """Symmetric per-channel int8 (one scale per index of `channel_axes`),
  the scales in `w`'s dtype; one compiled program per weight shape."""
  return qwix.quantize(w, _QTYPE, channelwise_axes=channel_axes,
                       scale_dtype=w.dtype)


def _output_axes(ndim: int, num_inputs: int) -> tuple:
  """The layers axis and a projection's output axes: (layers, in..., out...)
  with `num_inputs` input axes."""
  return (0,) + tuple(range(1 + num_inputs, ndim))


def quantize_params(params: Params, projection_inputs: dict) -> Params:
  """`params` with every projection (name -> its number of input axes), the
  embedding and the head as int8 QArrays; norms, biases and LoRA adapters
  as they are."""
  out = dict(params)
  out["layers"] = {
      name: (_quantize(w, _output_axes(w.ndim, projection_inputs[name]))
             if name in projection_inputs else w)
      for name, w in params["layers"].items()}
  out["embed"] = _quantize(params["embed"], (0,))          # one scale a row
  if "lm_head" in params:
    out["lm_head"] = _quantize(params["lm_head"], (1,))    # one a vocab column
  return out


def sampler_weights(params: Params, weights_dtype: str,
                    projection_inputs: dict) -> Params:
  """The sampler's weights: `params` as they are ("") or quantised (int8)."""
  if weights_dtype not in WEIGHTS_DTYPES:
    raise ValueError(f"sampling.weights_dtype={weights_dtype!r}; allowed: "
                     f"{WEIGHTS_DTYPES}")
  if not weights_dtype:
    return params
  return quantize_params(params, projection_inputs)


def einsum(equation: str, x: jax.Array, w) -> jax.Array:
  """x·W as `jnp.einsum`; for an int8 W, W8A8: x quantised per token (one
  scale for every index of x's axes that are not contracted), the product
  int8 x int8 -> int32, scaled back to x's dtype."""
  if not is_quantized(w):
    return jnp.einsum(equation, x, w)
  x_sub, rest = equation.split(",")
  w_sub = rest.split("->")[0]
  token_axes = tuple(i for i, c in enumerate(x_sub) if c not in w_sub)
  xq = qwix.quantize(x, _QTYPE, channelwise_axes=token_axes)
  return qwix.einsum(equation, xq, w).astype(x.dtype)


def head_logits(h_nsd: jax.Array, w_dv) -> jax.Array:
  """The head's float32 logits (N, S, V); an int8 head (one scale a vocab
  column) is read as int8 and its scales applied to the logits (weight-only:
  the hidden state is not quantised)."""
  if not is_quantized(w_dv):
    return jnp.einsum("nsd,dv->nsv", h_nsd, w_dv,
                      preferred_element_type=jnp.float32)
  logits = jnp.einsum("nsd,dv->nsv", h_nsd, w_dv.qvalue.astype(h_nsd.dtype),
                      preferred_element_type=jnp.float32)
  return logits * w_dv.scale.reshape(-1).astype(jnp.float32)


def take_rows(w, ids: jax.Array) -> jax.Array:
  """Rows `ids` of an embedding table (V, D), an int8 one dequantised."""
  if not is_quantized(w):
    return jnp.take(w, ids, axis=0)
  rows = jnp.take(w.qvalue, ids, axis=0).astype(w.scale.dtype)
  return rows * jnp.take(w.scale, ids, axis=0)


def nbytes(params: Params) -> int:
  """Bytes of a parameter tree (int8 values and their scales counted)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
