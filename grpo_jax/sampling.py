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
_CACHE_AXES = (sharding.BATCH, "kv_heads", None, "head_dim")  # (N, K, S, E)


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
  chunk_rows: int = 0            # rows per sampler call (0: automatic)

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if self.chunk_rows < 0:
      raise ValueError(f"chunk_rows must be >= 0, got {self.chunk_rows}")

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

def _filter_logits(logits_nv: jax.Array, top_k: int, top_p: float):
  """Masks logits outside top-k and then outside the top-p nucleus to -inf."""
  if top_k > 0:
    kth = jax.lax.top_k(logits_nv, top_k)[0][:, -1:]
    logits_nv = jnp.where(logits_nv < kth, -jnp.inf, logits_nv)
  if top_p < 1.0:
    sorted_desc = -jnp.sort(-logits_nv, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the first).
    keep = (cum - jax.nn.softmax(sorted_desc, axis=-1)) < top_p
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1,
                     keepdims=True)
    logits_nv = jnp.where(logits_nv < cutoff, -jnp.inf, logits_nv)
  return logits_nv


def _row_uniforms(key: jax.Array, rows: int, row_offset, total_rows: int
                  ) -> jax.Array:
  """Row i's uniform is entry row_offset + i of one (total_rows, 1) draw.
  Threefry is partitionable (jax's default): entry j of a draw does not
  depend on the draw's length, so a chunk of rows gets the uniforms that
  one call over all rows gives them (`sample`'s chunks)."""
  u_n1 = jax.random.uniform(key, (max(total_rows, rows), 1),
                            minval=jnp.finfo(jnp.float32).tiny)
  if total_rows <= rows:
    return u_n1
  return jax.lax.dynamic_slice_in_dim(u_n1, row_offset, rows, axis=0)


def _inverse_cdf_sample(key: jax.Array, logits_nv: jax.Array,
                        row_offset=0, total_rows: int = 0) -> jax.Array:
  """Exact categorical sampling with ONE uniform per row.

  jax.random.categorical draws V Gumbel variates per row; with threefry on
  CPU that alone cost ~50 ms per decode step at N=64, V=49k. Inverting the
  CDF needs N uniforms and a cumulative sum.
  """
  cdf_nv = jnp.cumsum(jax.nn.softmax(logits_nv, axis=-1), axis=-1)
  u_n1 = _row_uniforms(key, logits_nv.shape[0], row_offset,
                       total_rows) * cdf_nv[:, -1:]
  tokens = jnp.sum(cdf_nv < u_n1, axis=-1)
  return jnp.minimum(tokens, logits_nv.shape[-1] - 1).astype(jnp.int32)


def choose_tokens(logits_nv: jax.Array, key: jax.Array, cfg: SamplingConfig,
                  row_offset=0, total_rows: int = 0
                  ) -> tuple[jax.Array, jax.Array]:
  """Next token (N,) and its log-prob under softmax(logits / temperature).
  row_offset / total_rows: these N rows are rows row_offset.. of a call
  over total_rows (0: just these), whose noise they then get."""
  if cfg.is_greedy:
    tokens = jnp.argmax(logits_nv, axis=-1).astype(jnp.int32)
    scaled = logits_nv
  else:
    scaled = logits_nv / cfg.temperature
    filtered = _filter_logits(scaled, cfg.top_k, cfg.top_p)
    tokens = _inverse_cdf_sample(key, filtered, row_offset, total_rows)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _is_stop(tokens_n: jax.Array, stop_ids: Sequence[int]) -> jax.Array:
  if not stop_ids:
    return jnp.zeros(tokens_n.shape, bool)
  return jnp.isin(tokens_n, jnp.asarray(stop_ids, jnp.int32))


# ----------------------------------------------------------------------------
# The two jitted stages.
# ----------------------------------------------------------------------------

class _Carry(NamedTuple):
  t: jax.Array                      # next column to fill
  tokens_nt: jax.Array
  logp_nt: jax.Array
  done_n: jax.Array
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
      rows(c.cache.valid_ns), rows(c.cache.pos_ns))
  return c._replace(tokens_nt=rows(c.tokens_nt), logp_nt=rows(c.logp_nt),
                    done_n=rows(c.done_n), cache=cache)


def prefill(config: ModelConfig, params: Params, prompt_bp: jax.Array,
            prompt_len_b: jax.Array, key: jax.Array, cfg: SamplingConfig,
            num_generations: int, row_offset=0, total_rows: int = 0
            ) -> _Carry:
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
      valid_ns=jnp.pad(rep(valid_bp, 0), [(0, 0), (0, T)]),
      pos_ns=jnp.pad(rep(pos_bp, 0), [(0, 0), (0, T)]))
  key, sub = jax.random.split(key)
  first, logp = choose_tokens(rep(logits_bv, 0), sub, cfg, row_offset,
                              total_rows)
  tokens_nt = jnp.full((B * G, T), cfg.pad_id, jnp.int32).at[:, 0].set(first)
  logp_nt = jnp.zeros((B * G, T), jnp.float32).at[:, 0].set(logp)
  return _Carry(jnp.int32(1), tokens_nt, logp_nt, _is_stop(first, cfg.stop_ids),
                cache, key)


def generate(config: ModelConfig, params: Params, carry: _Carry,
             prompt_len_b: jax.Array, cfg: SamplingConfig,
             layout: Layout = None, row_offset=0, total_rows: int = 0
             ) -> Samples:
  """Decodes until every row stopped or max_new_tokens is reached."""
  N, T = carry.tokens_nt.shape
  P = carry.cache.valid_ns.shape[1] - T
  G = N // prompt_len_b.shape[0]

  len_rows = _pin_rows(layout, jnp.repeat(prompt_len_b, G))
  layers = transformer.unstack_layers(params, config.num_layers)  # once

  def cond(c: _Carry):
    return (c.t < T) & ~jnp.all(c.done_n)

  def body(c: _Carry):
    prev = jax.lax.dynamic_slice_in_dim(c.tokens_nt, c.t - 1, 1, axis=1)[:, 0]
    logits, cache = transformer.decode_step(
        config, params, c.cache, prev, len_rows + c.t - 1, P + c.t - 1,
        layers)
    key, sub = jax.random.split(c.key)
    tok, logp = choose_tokens(logits, sub, cfg, row_offset, total_rows)
    tok = jnp.where(c.done_n, cfg.pad_id, tok)
    logp = jnp.where(c.done_n, 0.0, logp)
    tokens_nt = jax.lax.dynamic_update_slice(c.tokens_nt, tok[:, None], (0, c.t))
    logp_nt = jax.lax.dynamic_update_slice(c.logp_nt, logp[:, None], (0, c.t))
    done = c.done_n | _is_stop(tok, cfg.stop_ids)
    return _pin_carry(layout,
                      _Carry(c.t + 1, tokens_nt, logp_nt, done, cache, key))

  final = jax.lax.while_loop(cond, body, carry)
  return _finish(final.tokens_nt, final.logp_nt, final.t - carry.t, cfg)


@functools.partial(jax.jit, static_argnames=("config", "cfg", "num_generations",
                                             "layout", "total_rows"))
def sample_padded(config: ModelConfig, params: Params, prompt_bp: jax.Array,
                  prompt_len_b: jax.Array, key: jax.Array, cfg: SamplingConfig,
                  num_generations: int, layout: Layout = None,
                  row_offset=0, total_rows: int = 0) -> Samples:
  """prefill + generate as ONE jitted program on left-padded prompts.

  The KV cache is born and dies inside this program: XLA updates it in place
  through the while loop, and no cache buffer crosses the host boundary (this
  is what donating it between two jitted stages would buy, minus the copy).
  With a layout, rows are split over the batch shards (module docstring).
  row_offset (int32, traced) / total_rows (static): this call's rows are
  rows row_offset.. of a call over total_rows, and sample as they would
  there (0: a call of its own).
  """
  prompt_bp, prompt_len_b = (_pin_rows(layout, x)
                             for x in (prompt_bp, prompt_len_b))
  carry = _pin_carry(layout, prefill(config, params, prompt_bp, prompt_len_b,
                                     key, cfg, num_generations, row_offset,
                                     total_rows))
  out = generate(config, params, carry, prompt_len_b, cfg, layout,
                 row_offset, total_rows)
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
  """A multiple of `batch_multiple` such that its B*G rows divide into
  `row_shards` (what a call's prompt count is padded to)."""
  return math.lcm(batch_multiple,
                  row_shards // math.gcd(row_shards, num_generations))


def padded_prompts(prompts: int, batch_multiple: int, row_shards: int,
                   num_generations: int) -> int:
  """Prompts of a sampler call after padding: up to a multiple of
  `batch_multiple` (callers' fixed chunk shape), then of the row shards.
  (Not their lcm: 30 evaluation prompts on 64 row shards are 64 rows, not
  960.)"""
  up = lambda n, m: -(-n // m) * m
  return up(up(prompts, batch_multiple),
            prompt_multiple(1, row_shards, num_generations))


# The automatic chunk gives the KV cache this share of the device memory that
# is free when sampling starts; the rest is for the decode step's temporaries
# (logits, the prefill's activations).
KV_FRACTION = 0.5


def kv_cache_bytes(config: ModelConfig, rows: int, length: int, itemsize: int,
                   layout: Layout = None) -> float:
  """Per-device bytes of the KV cache of `rows` rows of `length` positions,
  rows split over the batch shards and KV heads as the layout says."""
  row_shards = 1 if layout is None else layout.batch_shards
  head_shards = 1 if layout is None else layout.splits("kv_heads",
                                                       config.num_kv_heads)
  per_row = (2 * config.num_layers * config.num_kv_heads // head_shards
             * config.head_dim * length * itemsize)
  return per_row * rows / row_shards


def free_device_memory() -> Optional[float]:
  """Bytes free on the first local device, or None where the backend does
  not say (CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  if not stats or "bytes_limit" not in stats:
    return None
  return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def prompts_per_call(config: ModelConfig, prompts: int, num_generations: int,
                     length: int, chunk_rows: int, budget: Optional[float],
                     layout: Layout, itemsize: int, multiple: int = 1) -> int:
  """Prompts per sampler call, a multiple of `multiple`.

  chunk_rows > 0: that many rows (whole groups); else, with a memory
  `budget` (bytes per device), the largest of prompts, prompts/2, ... whose
  KV cache takes at most KV_FRACTION of it; without one, all prompts.
  """
  up = lambda b: max(multiple, -(-b // multiple) * multiple)
  if chunk_rows:
    return min(up(prompts), up(max(chunk_rows // num_generations, 1)))
  b = up(prompts)
  if budget is None:
    return b
  fits = lambda b: kv_cache_bytes(config, b * num_generations, length,
                                  itemsize, layout) <= KV_FRACTION * budget
  while b > multiple and not fits(b):
    b = up(-(-b // 2))
  return b


def sample(config: ModelConfig, params: Params,
           prompts: Sequence[Sequence[int]], key: jax.Array,
           cfg: SamplingConfig, num_generations: int = 1,
           batch_multiple: int = 1, layout: Layout = None) -> Samples:
  """G completions for each prompt (rows b*G .. b*G+G-1 belong to prompt b).

  Prompt length is padded to a power-of-two bucket and the number of prompts
  to a multiple of `batch_multiple` and then of the row shards
  (`padded_prompts`), so a run compiles a bounded number of times (see
  COMPILES). The same key gives the same output.

  Rows run in calls of `cfg.chunk_rows` rows, or (0) as many as the
  device's free memory holds the KV cache of (`prompts_per_call`; all at
  once on CPU). Each row gets the noise it would get in one call over all
  rows, so chunking does not change the samples.

  With a `layout` (the run's mesh and rules) the rows and the KV cache are
  split over the batch mesh axes; the returned arrays are then row-sharded
  global arrays (`sharding.to_host` brings them to every host).
  """
  if not prompts:
    raise ValueError("sample() needs at least one prompt")
  B, G = len(prompts), num_generations
  shards = 1 if layout is None else layout.batch_shards
  P = bucket(max(len(p) for p in prompts))
  itemsize = jax.tree.leaves(params)[0].dtype.itemsize
  per_call = prompts_per_call(
      config, padded_prompts(B, batch_multiple, shards, G), G,
      P + cfg.max_new_tokens, cfg.chunk_rows,
      None if cfg.chunk_rows else free_device_memory(), layout, itemsize,
      prompt_multiple(1, shards, G))
  rows = -(-B // per_call) * per_call
  prompt_bp, len_b = left_pad(prompts, P, rows, cfg.pad_id)
  jit_cfg = dataclasses.replace(cfg, chunk_rows=0)
  total = 0 if per_call == rows else rows * G
  COMPILES.note((config, jit_cfg, G, per_call, P, layout, total),
                f"rows={per_call} prompt_len={P} G={G} "
                f"T={cfg.max_new_tokens} greedy={cfg.is_greedy}")
  put = jnp.asarray if layout is None else layout.rows
  outs = [sample_padded(config, params, put(prompt_bp[s:s + per_call]),
                        put(len_b[s:s + per_call]), key, jit_cfg, G, layout,
                        jnp.int32(s * G), total)
          for s in range(0, rows, per_call)]
  out = outs[0] if len(outs) == 1 else Samples(
      *(jnp.concatenate(xs) for xs in zip(*(o[:-1] for o in outs))),
      steps=jnp.max(jnp.stack([o.steps for o in outs])))
  if rows == B:
    return out
  return Samples(*(x[:B * G] for x in out[:-1]), steps=out.steps)
