"""Analytic FLOPs and roofline times of a training step.

XLA's `cost_analysis()` counts a while loop's body once (the sampler's
decode loop, the update's micro-batch scan), so the step is counted here
from the model's shapes: a matmul of an (m, k) by (k, n) operand is 2mkn
FLOPs; attention costs 4 * heads * head_dim FLOPs per (query, key) pair
that it computes (q.k and p.v). Attention is counted over the causal
triangle (what blockwise attention computes; dense attention does twice
that, masked).

Shapes: b prompts, g generations, n = b * g rows, p prompt tokens, t
completion tokens, l layers.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from grpo_jax.models import decode
from grpo_jax.models.config import ModelConfig


def body_weights(c: ModelConfig) -> int:
  """Matmul weights per token of the decoder body (no embedding lookup,
  no LM head)."""
  attn = c.dim * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
  attn += c.num_heads * c.head_dim * c.dim
  return c.num_layers * (attn + 3 * c.dim * c.mlp_dim)


def head_weights(c: ModelConfig) -> int:
  return c.dim * c.vocab_size


def attention_flops(c: ModelConfig, pairs: float) -> float:
  """FLOPs of attention over `pairs` (query, key) pairs, all layers."""
  return 4.0 * c.num_layers * c.num_heads * c.head_dim * pairs


def causal_pairs(queries: int, context: int) -> float:
  """(query, key) pairs of `queries` new tokens after `context` earlier
  ones, each attending to all before it and itself."""
  return queries * context + queries * (queries + 1) / 2


def forward_flops(c: ModelConfig, body_tokens: float, head_tokens: float,
                  pairs: float) -> float:
  return (2.0 * body_weights(c) * body_tokens
          + 2.0 * head_weights(c) * head_tokens + attention_flops(c, pairs))


class StepShape(NamedTuple):
  """The shape of a step's rows: b prompts x g generations, p prompt
  tokens, t completion tokens."""
  b: int
  g: int
  p: int
  t: int


def sampler_flops(c: ModelConfig, shape: StepShape) -> float:
  """One sampler call at full length: prefill b prompts once, decode n rows."""
  b, g, p, t = shape
  prefill = forward_flops(c, b * p, b, b * causal_pairs(p, 0))
  decode = forward_flops(c, b * g * t, b * g * t, b * g * causal_pairs(t, p))
  return prefill + decode


# Forward passes that one forward+backward costs: backward ~2x forward, and
# remat recomputes the forward (full) or the unsaved non-batch dots (dots:
# attention's batched dots are recomputed).
_PASSES = {"none": (3, 3), "dots": (3, 4), "full": (4, 4)}   # (body, attn)


def _rows(n: int, p: int, t: int, lengths_n) -> tuple[float, float]:
  """(completion tokens, their (query, key) pairs after the prompt) of n
  rows: each at t, or at its own length (`lengths_n`, packed rows)."""
  if lengths_n is None:
    return n * t, n * causal_pairs(t, p)
  x = np.asarray(lengths_n, np.float64)
  return float(x.sum()), float(causal_pairs(x, p).sum())


def update_flops(c: ModelConfig, shape: StepShape, remat: str,
                 shared_prompt: bool, lengths_n=None) -> float:
  """Forward + backward over n rows of [prompt | completion]; with a shared
  prompt each group's prompt runs once. The chunked head recomputes its
  logits in the backward (jax.checkpoint): 4 passes. lengths_n: the rows'
  completion lengths (packed rows compute only those), else t each."""
  body, attn = _PASSES[remat]
  b, g, p, t = shape
  n = b * g
  done, pairs_t = _rows(n, p, t, lengths_n)
  if shared_prompt:
    tokens = b * p + done
    pairs = b * causal_pairs(p, 0) + pairs_t
  else:
    tokens = n * p + done
    pairs = n * causal_pairs(p, 0) + pairs_t
  return (body * 2.0 * body_weights(c) * tokens
          + 4 * 2.0 * head_weights(c) * done
          + attn * attention_flops(c, pairs))


def score_flops(c: ModelConfig, shape: StepShape, shared_prompt: bool,
                lengths_n=None) -> float:
  b, g, p, t = shape
  n = b * g
  done, pairs_t = _rows(n, p, t, lengths_n)
  prompts = b if shared_prompt else n
  return forward_flops(c, prompts * p + done, done,
                       prompts * causal_pairs(p, 0) + pairs_t)


class Roofline(NamedTuple):
  flops: float
  seconds: float          # max(compute, memory) lower bound
  bound: str              # "compute" or "memory"


def roofline(flops: float, chips: int, peak_flops: float,
             bytes_per_chip: float = 0.0, bandwidth: float = 1.0
             ) -> Roofline:
  """Lower bound on time: all chips at peak FLOP/s, or each chip streaming
  `bytes_per_chip` from HBM at `bandwidth`, whichever is slower."""
  compute = flops / (chips * peak_flops)
  memory = bytes_per_chip / bandwidth
  if memory > compute:
    return Roofline(flops, memory, "memory")
  return Roofline(flops, compute, "compute")


def _columns_between(p: int, t: int, window=None) -> float:
  """One layer's key columns read over t decode steps after p columns,
  each step all of its row's so far (the integral of x from p to p + t),
  or with a `window` at most the window's (of min(x, window))."""
  if window is None or window >= p + t:
    return t * p + t * t / 2
  if window <= p:
    return float(t * window)
  return (window * window - p * p) / 2 + (p + t - window) * window


def layer_windows(c: ModelConfig) -> list:
  """Each layer's sliding window (None: it reads every column)."""
  return [c.layer_config(i).sliding_window for i in range(c.num_layers)]


def kv_columns(c: ModelConfig, p: int, t: int, skip_windows: bool = False
               ) -> float:
  """Key columns, summed over layers, one row reads over t decode steps
  after a p-token prompt: every layer all of the row's columns (the
  samplers that mask a window without skipping its columns), or with
  `skip_windows` a sliding layer only its window's (Gemma's layer_types;
  the paged reference, `paged.window_attention`, to within a page)."""
  windows = layer_windows(c) if skip_windows else [None] * c.num_layers
  return sum(_columns_between(p, t, w) for w in windows)


def decode_bytes_per_chip(c: ModelConfig, rows_per_chip: float,
                          kv_heads_per_chip: float, p: int, t: int,
                          weight_bytes_per_chip: float,
                          kv_itemsize: int, skip_windows: bool = False
                          ) -> float:
  """HBM bytes a chip reads over t decode steps: its weight shard every step
  and its rows' KV cache, which grows from p to p + t positions (sliding
  layers only their windows with `skip_windows`: `kv_columns`; MLA's
  latent once, `decode.cache_arrays`)."""
  kv_per_column = (decode.cache_arrays(c) * kv_heads_per_chip * c.head_dim
                   * kv_itemsize)
  kv = rows_per_chip * kv_per_column * kv_columns(c, p, t, skip_windows)
  return t * weight_bytes_per_chip + kv
