"""The jitted group sampler: G completions per prompt from one prefill.

One jitted pure function, `sample_padded`, in two stages:

  prefill   prompts (B, P), left-padded -> KV cache for B*G rows + first token
            (each prompt is run through the model ONCE; its cache is then
            repeated to its G rows)
  generate  a `lax.while_loop` over decode steps that stops as soon as every
            row has emitted a stop id or `max_new_tokens` is reached; the
            cache never leaves the program, so XLA updates it in place.

Left padding puts the last prompt token of every row in the same column, so
all rows write the cache at the same slot each step (one dynamic_update_slice,
no scatter); per-row rotary positions and a key-validity mask make padding
invisible. Rows of a batch are thus independent: mixing prompt lengths gives
the same completions as sampling each prompt alone.

Log-probs: `logp_nt[i, t]` is log softmax(logits / temperature)[token] - the
temperature-scaled distribution BEFORE top-k / top-p truncation (for greedy,
temperature 1). The trainer matches it by dividing its logits by the same
temperature and ignoring top-k/top-p (as verl and TRL do), so with unchanged
parameters the first update's ratio is exactly 1.

Sharding (with a `sharding.Layout`): every per-row array - prompts, tokens,
log-probs, done flags, the KV cache and its masks - is split along rows as
the `batch` rule says (data x fsdp by default) and the cache's KV heads as
`kv_heads` says (tensor), pinned inside the jit (`_pin_carry`). Rows are
padded to a multiple of the row shards; the G rows of one prompt may live on
different shards (the cache's repeat to G rows is then a resharding).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sharding
from grpo_jax.models import transformer
from grpo_jax.models.config import ModelConfig

Params = transformer.Params
Layout = Optional[sharding.Layout]    # None: one device, or XLA's choice
_CACHE_AXES = (sharding.BATCH, "kv_heads", None, "head_dim")  # (BG, K, S, hd)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick each token. temperature 0 (or greedy=True) is argmax."""
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0                 # 0: no top-k
  greedy: bool = False
  stop_ids: tuple[int, ...] = ()
  pad_id: int = 0

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")

  @property
  def is_greedy(self) -> bool:
    return self.greedy or self.temperature == 0 or self.top_k == 1


class Samples(NamedTuple):
  """One row i per completion: n = B*G rows (prompt b = i // G), each of
  t = max_new_tokens columns."""
  tokens_nt: jax.Array      # int32, pad after the stop token
  logp_nt: jax.Array        # float32, see module docstring; 0 on padding
  mask_nt: jax.Array        # bool, the generated tokens incl. the stop token
  length_n: jax.Array       # int32, number of generated tokens
  truncated_n: jax.Array    # bool, no stop id within max_new_tokens
  steps: jax.Array          # int32 scalar: decode iterations run (early exit)


# ----------------------------------------------------------------------------
# Token choice.
# ----------------------------------------------------------------------------

def _filter_logits(logits_bv: jax.Array, top_k: int, top_p: float):
  """Masks logits outside top-k and then outside the top-p nucleus to -inf."""
  if top_k > 0:
    kth = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
    logits_bv = jnp.where(logits_bv < kth, -jnp.inf, logits_bv)
  if top_p < 1.0:
    sorted_desc = -jnp.sort(-logits_bv, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the first).
    keep = (cum - jax.nn.softmax(sorted_desc, axis=-1)) < top_p
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1,
                     keepdims=True)
    logits_bv = jnp.where(logits_bv < cutoff, -jnp.inf, logits_bv)
  return logits_bv


def _inverse_cdf_sample(key: jax.Array, logits_bv: jax.Array) -> jax.Array:
  """Exact categorical sampling with ONE uniform per row.

  jax.random.categorical draws V Gumbel variates per row; with threefry on
  CPU that alone cost ~50 ms per decode step at B=64, V=49k. Inverting the
  CDF needs B uniforms and a cumulative sum.
  """
  cdf_bv = jnp.cumsum(jax.nn.softmax(logits_bv, axis=-1), axis=-1)
  u_b1 = jax.random.uniform(key, (logits_bv.shape[0], 1),
                            minval=jnp.finfo(jnp.float32).tiny) * cdf_bv[:, -1:]
  tokens = jnp.sum(cdf_bv < u_b1, axis=-1)
  return jnp.minimum(tokens, logits_bv.shape[-1] - 1).astype(jnp.int32)


def choose_tokens(logits_bv: jax.Array, key: jax.Array,
                  cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
  """Next token (B,) and its log-prob under softmax(logits / temperature)."""
  if cfg.is_greedy:
    tokens = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    scaled = logits_bv
  else:
    scaled = logits_bv / cfg.temperature
    filtered = _filter_logits(scaled, cfg.top_k, cfg.top_p)
    tokens = _inverse_cdf_sample(key, filtered)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _is_stop(tokens_b: jax.Array, stop_ids: Sequence[int]) -> jax.Array:
  if not stop_ids:
    return jnp.zeros(tokens_b.shape, bool)
  return jnp.isin(tokens_b, jnp.asarray(stop_ids, jnp.int32))


# ----------------------------------------------------------------------------
# The two jitted stages.
# ----------------------------------------------------------------------------

class _Carry(NamedTuple):
  t: jax.Array                      # next column to fill
  tokens_nt: jax.Array
  logp_nt: jax.Array
  done_b: jax.Array
  cache: transformer.KVCache
  key: jax.Array


def _pin_rows(layout: Layout, x: jax.Array) -> jax.Array:
  """Inside jit: rows (axis 0) split as the `batch` rule says."""
  return x if layout is None else layout.constrain(x, (sharding.BATCH,))


def _pin_carry(layout: Layout, c: _Carry) -> _Carry:
  """Inside jit: the decode state split along rows, KV heads as the rules
  say, so every batch shard holds and decodes only its own rows."""
  if layout is None:
    return c
  rows = functools.partial(_pin_rows, layout)
  kv = lambda x: layout.constrain(x, _CACHE_AXES)
  cache = transformer.KVCache(
      tuple(map(kv, c.cache.k)), tuple(map(kv, c.cache.v)),
      rows(c.cache.valid_bs), rows(c.cache.pos_bs))
  return c._replace(tokens_nt=rows(c.tokens_nt), logp_nt=rows(c.logp_nt),
                    done_b=rows(c.done_b), cache=cache)


def prefill(config: ModelConfig, params: Params, prompt_bp: jax.Array,
            prompt_len_b: jax.Array, key: jax.Array, cfg: SamplingConfig,
            num_generations: int) -> _Carry:
  """Runs each left-padded prompt once and returns the decode loop's start.

  prompt_bp: int32 (B, P) left-padded; prompt_len_b: int32 (B,) real lengths.
  The cache for row i = b*G + g is prompt b's cache; the first token of each
  row is sampled from prompt b's last logits with that row's own key.
  """
  B, P = prompt_bp.shape
  G, T = num_generations, cfg.max_new_tokens
  pad_b = P - prompt_len_b
  col_p = jnp.arange(P, dtype=jnp.int32)
  valid_bp = col_p[None, :] >= pad_b[:, None]
  pos_bp = jnp.maximum(col_p[None, :] - pad_b[:, None], 0)
  h, (k, v) = transformer.hidden_states(config, params, prompt_bp, pos_bp,
                                        valid_bp, return_kv=True)
  logits_bv = transformer.unembed(config, params, h[:, -1:])[:, 0]

  rep = lambda x, axis: jnp.repeat(x, G, axis=axis)   # prompt b -> rows b*G..
  grow = lambda x: jnp.pad(rep(x, 0), [(0, 0)] * 2 + [(0, T), (0, 0)])
  cache = transformer.KVCache(
      k=tuple(grow(k[i]) for i in range(config.num_layers)),
      v=tuple(grow(v[i]) for i in range(config.num_layers)),
      valid_bs=jnp.pad(rep(valid_bp, 0), [(0, 0), (0, T)]),
      pos_bs=jnp.pad(rep(pos_bp, 0), [(0, 0), (0, T)]))
  key, sub = jax.random.split(key)
  first, logp = choose_tokens(rep(logits_bv, 0), sub, cfg)
  tokens_nt = jnp.full((B * G, T), cfg.pad_id, jnp.int32).at[:, 0].set(first)
  logp_nt = jnp.zeros((B * G, T), jnp.float32).at[:, 0].set(logp)
  return _Carry(jnp.int32(1), tokens_nt, logp_nt, _is_stop(first, cfg.stop_ids),
                cache, key)


def generate(config: ModelConfig, params: Params, carry: _Carry,
             prompt_len_b: jax.Array, cfg: SamplingConfig,
             layout: Layout = None) -> Samples:
  """Decodes until every row stopped or max_new_tokens is reached."""
  BG, T = carry.tokens_nt.shape
  P = carry.cache.valid_bs.shape[1] - T
  G = BG // prompt_len_b.shape[0]
  len_rows = _pin_rows(layout, jnp.repeat(prompt_len_b, G))
  layers = transformer.unstack_layers(params, config.num_layers)  # once

  def cond(c: _Carry):
    return (c.t < T) & ~jnp.all(c.done_b)

  def body(c: _Carry):
    prev = jax.lax.dynamic_slice_in_dim(c.tokens_nt, c.t - 1, 1, axis=1)[:, 0]
    logits, cache = transformer.decode_step(
        config, params, c.cache, prev, len_rows + c.t - 1, P + c.t - 1,
        layers)
    key, sub = jax.random.split(c.key)
    tok, logp = choose_tokens(logits, sub, cfg)
    tok = jnp.where(c.done_b, cfg.pad_id, tok)
    logp = jnp.where(c.done_b, 0.0, logp)
    tokens_nt = jax.lax.dynamic_update_slice(c.tokens_nt, tok[:, None], (0, c.t))
    logp_nt = jax.lax.dynamic_update_slice(c.logp_nt, logp[:, None], (0, c.t))
    done = c.done_b | _is_stop(tok, cfg.stop_ids)
    return _pin_carry(layout,
                      _Carry(c.t + 1, tokens_nt, logp_nt, done, cache, key))

  final = jax.lax.while_loop(cond, body, carry)
  return _finish(final.tokens_nt, final.logp_nt, final.t - carry.t, cfg)


@functools.partial(jax.jit, static_argnames=("config", "cfg", "num_generations",
                                             "layout"))
def sample_padded(config: ModelConfig, params: Params, prompt_bp: jax.Array,
                  prompt_len_b: jax.Array, key: jax.Array, cfg: SamplingConfig,
                  num_generations: int, layout: Layout = None) -> Samples:
  """prefill + generate as ONE jitted program on left-padded prompts.

  The KV cache is born and dies inside this program: XLA updates it in place
  through the while loop, and no cache buffer crosses the host boundary (this
  is what donating it between two jitted stages would buy, minus the copy).
  With a layout, rows are split over the batch shards (module docstring).
  """
  prompt_bp, prompt_len_b = (_pin_rows(layout, x)
                             for x in (prompt_bp, prompt_len_b))
  carry = _pin_carry(layout, prefill(config, params, prompt_bp, prompt_len_b,
                                     key, cfg, num_generations))
  out = generate(config, params, carry, prompt_len_b, cfg, layout)
  return Samples(*(_pin_rows(layout, x) for x in out[:-1]), steps=out.steps)


def _finish(tokens_nt: jax.Array, logp_nt: jax.Array, steps: jax.Array,
            cfg: SamplingConfig) -> Samples:
  """Mask, length and truncation from the raw token matrix."""
  T = tokens_nt.shape[1]
  stop_nt = _is_stop(tokens_nt, cfg.stop_ids)
  has_stop = jnp.any(stop_nt, axis=1)
  first_stop = jnp.argmax(stop_nt, axis=1)
  length_n = jnp.where(has_stop, first_stop + 1, T).astype(jnp.int32)
  mask_nt = jnp.arange(T)[None, :] < length_n[:, None]
  tokens_nt = jnp.where(mask_nt, tokens_nt, cfg.pad_id)
  return Samples(tokens_nt, jnp.where(mask_nt, logp_nt, 0.0), mask_nt,
                 length_n, ~has_stop, steps)


# ----------------------------------------------------------------------------
# Host-side entry point: padding to buckets, compile counting.
# ----------------------------------------------------------------------------

def bucket(n: int, minimum: int = 16) -> int:
  """The next power of two >= n (at least `minimum`): few distinct shapes."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def left_pad(prompts: Sequence[Sequence[int]], length: int, rows: int,
             pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Prompts as int32 (rows, length) left-padded, and their lengths (rows,).

  Rows beyond len(prompts) repeat the last prompt (they are dropped later).
  """
  out = np.full((rows, length), pad_id, np.int32)
  lens = np.zeros((rows,), np.int32)
  for i in range(rows):
    p = list(prompts[min(i, len(prompts) - 1)])
    if len(p) > length:
      raise ValueError(f"prompt {i} has {len(p)} tokens > bucket {length}")
    out[i, length - len(p):] = p
    lens[i] = len(p)
  return out, lens


class CompileCounter:
  """Counts distinct (shape, setting) signatures, i.e. compilations."""

  def __init__(self):
    self.seen: set = set()

  def note(self, signature, description: str = "") -> None:
    if signature not in self.seen:
      self.seen.add(signature)
      logging.info("sampler: compiling for %s (%d signature(s) so far)",
                   description or signature, len(self.seen))

  @property
  def count(self) -> int:
    return len(self.seen)


COMPILES = CompileCounter()


def prompt_multiple(batch_multiple: int, row_shards: int,
                    num_generations: int) -> int:
  """The number of prompts is padded to a multiple of this: of
  `batch_multiple`, and such that the B*G rows divide into `row_shards`."""
  return math.lcm(batch_multiple,
                  row_shards // math.gcd(row_shards, num_generations))


def sample(config: ModelConfig, params: Params,
           prompts: Sequence[Sequence[int]], key: jax.Array,
           cfg: SamplingConfig, num_generations: int = 1,
           batch_multiple: int = 1, layout: Layout = None) -> Samples:
  """G completions for each prompt (rows b*G .. b*G+G-1 belong to prompt b).

  Prompt length is padded to a power-of-two bucket and the number of prompts
  to a multiple of `batch_multiple`, so a run compiles a bounded number of
  times (see COMPILES). The same key gives the same output.

  With a `layout` (the run's mesh and rules) the rows and the KV cache are
  split over the batch mesh axes; the returned arrays are then row-sharded
  global arrays (`sharding.to_host` brings them to every host).
  """
  if not prompts:
    raise ValueError("sample() needs at least one prompt")
  B, G = len(prompts), num_generations
  shards = 1 if layout is None else layout.batch_shards
  multiple = prompt_multiple(batch_multiple, shards, G)
  rows = -(-B // multiple) * multiple
  P = bucket(max(len(p) for p in prompts))
  prompt_bp, len_b = left_pad(prompts, P, rows, cfg.pad_id)
  COMPILES.note((config, cfg, G, rows, P, layout),
                f"rows={rows} prompt_len={P} G={G} "
                f"T={cfg.max_new_tokens} greedy={cfg.is_greedy}")
  put = jnp.asarray if layout is None else layout.rows
  out = sample_padded(config, params, put(prompt_bp), put(len_b), key, cfg,
                      G, layout)
  if rows == B:
    return out
  return Samples(*(x[:B * G] for x in out[:-1]), steps=out.steps)
