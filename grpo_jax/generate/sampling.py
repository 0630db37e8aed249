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

Settings, `Samples`, token choice and its noise (a function of (key, row,
token), so chunks and schedules give the same samples) and the log-probs'
definition live in `decoding`. Continuous batching (rows take turns in a
fixed number of cache slots, `continuous.sample_slots`) is the same entry
point with two settings:

  sample(config, params, prompts, key,
         dataclasses.replace(cfg, continuous_batching=True, slots=0),
         num_generations, batch_multiple=1, layout=None) -> Samples

(slots 0: `auto_slots`; the config fields `sampling.continuous_batching` and
`sampling.slots`), with the same rows, layout and samples.

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
from grpo_jax.generate import continuous, decoding, paged_slots
from grpo_jax.models import transformer
from grpo_jax.models.config import ModelConfig

Params = transformer.Params
Layout = Optional[sharding.Layout]    # None: one device, or XLA's choice
CACHE_AXES = (sharding.BATCH, "kv_heads", None, "head_dim")  # (N, K, S, E)
SamplingConfig = decoding.SamplingConfig
Samples = decoding.Samples
choose_tokens = decoding.choose_tokens


# ----------------------------------------------------------------------------
# The two jitted stages.
# ----------------------------------------------------------------------------

class _Carry(NamedTuple):
  t: jax.Array                      # next column to fill
  tokens_nt: jax.Array
  logp_nt: jax.Array
  done_n: jax.Array
  cache: transformer.KVCache


def _pin_rows(layout: Layout, x: jax.Array) -> jax.Array:
  """Inside jit: rows (axis 0) split as the `batch` rule says."""
  return x if layout is None else layout.constrain(x, (sharding.BATCH,))


def _pin_carry(layout: Layout, c: _Carry) -> _Carry:
  """Inside jit: the decode state split along rows, KV heads as the rules
  say, so every batch shard holds and decodes only its own rows."""
  if layout is None:
    return c
  rows = functools.partial(_pin_rows, layout)
  kv = lambda x: layout.constrain(x, CACHE_AXES)
  cache = transformer.KVCache(
      tuple(map(kv, c.cache.k)), tuple(map(kv, c.cache.v)),
      rows(c.cache.valid_ns), rows(c.cache.pos_ns))
  return c._replace(tokens_nt=rows(c.tokens_nt), logp_nt=rows(c.logp_nt),
                    done_n=rows(c.done_n), cache=cache)


def prefill(model_config: ModelConfig, params: Params, prompt_bp: jax.Array,
            prompt_len_b: jax.Array, key: jax.Array, cfg: SamplingConfig,
            num_generations: int, row_offset=0) -> _Carry:
  """Runs each left-padded prompt once and returns the decode loop's start.

  prompt_bp: int32 (B, P) left-padded; prompt_len_b: int32 (B,) real lengths.
  The cache for row i = b*G + g is prompt b's cache; the first token of each
  row is sampled from prompt b's last logits with that row's own noise.
  """
  B = prompt_bp.shape[0]
  G, T = num_generations, cfg.max_new_tokens
  pp = decoding.prompt_pass(model_config, params, prompt_bp, prompt_len_b)
  rep = lambda x: jnp.repeat(x, G, axis=0)   # prompt b -> rows b*G..
  grow = lambda x: jnp.pad(rep(x), [(0, 0)] * 2 + [(0, T), (0, 0)])
  cache = transformer.KVCache(
      k=tuple(grow(pp.k[i]) for i in range(model_config.num_layers)),
      v=tuple(grow(pp.v[i]) for i in range(model_config.num_layers)),
      valid_ns=jnp.pad(rep(pp.valid_bp), [(0, 0), (0, T)]),
      pos_ns=jnp.pad(rep(pp.pos_bp), [(0, 0), (0, T)]))
  row_n = row_offset + jnp.arange(B * G, dtype=jnp.int32)
  first, logp = choose_tokens(rep(pp.logits_bv), key, cfg, row_n, 0)
  tokens_nt = jnp.full((B * G, T), cfg.pad_id, jnp.int32).at[:, 0].set(first)
  logp_nt = jnp.zeros((B * G, T), jnp.float32).at[:, 0].set(logp)
  return _Carry(jnp.int32(1), tokens_nt, logp_nt,
                decoding.is_stop(first, cfg.stop_ids), cache)


def generate(model_config: ModelConfig, params: Params, carry: _Carry,
             prompt_len_b: jax.Array, key: jax.Array, cfg: SamplingConfig,
             layout: Layout = None, row_offset=0) -> Samples:
  """Decodes until every row stopped or max_new_tokens is reached."""
  N, T = carry.tokens_nt.shape
  P = carry.cache.valid_ns.shape[1] - T
  G = N // prompt_len_b.shape[0]
  len_rows = _pin_rows(layout, jnp.repeat(prompt_len_b, G))
  row_n = row_offset + jnp.arange(N, dtype=jnp.int32)
  layers = transformer.unstack_layers(params, model_config.num_layers)  # once

  def cond(c: _Carry):
    return (c.t < T) & ~jnp.all(c.done_n)

  def body(c: _Carry):
    prev = jax.lax.dynamic_slice_in_dim(c.tokens_nt, c.t - 1, 1, axis=1)[:, 0]
    logits, cache = transformer.decode_step(
        model_config, params, c.cache, prev, len_rows + c.t - 1, P + c.t - 1,
        layers)
    tok, logp = choose_tokens(logits, key, cfg, row_n, c.t)
    tok = jnp.where(c.done_n, cfg.pad_id, tok)
    logp = jnp.where(c.done_n, 0.0, logp)
    tokens_nt = jax.lax.dynamic_update_slice(c.tokens_nt, tok[:, None], (0, c.t))
    logp_nt = jax.lax.dynamic_update_slice(c.logp_nt, logp[:, None], (0, c.t))
    done = c.done_n | decoding.is_stop(tok, cfg.stop_ids)
    return _pin_carry(layout, _Carry(c.t + 1, tokens_nt, logp_nt, done, cache))

  with jax.named_scope(decoding.DECODE_SCOPE):
    final = jax.lax.while_loop(cond, body, carry)
  return decoding.finish(final.tokens_nt, final.logp_nt, final.t - carry.t,
                         cfg)


@functools.partial(jax.jit, static_argnames=("model_config", "cfg",
                                             "num_generations", "layout"))
def sample_padded(model_config: ModelConfig, params: Params,
                  prompt_bp: jax.Array, prompt_len_b: jax.Array, key: jax.Array,
                  cfg: SamplingConfig, num_generations: int,
                  layout: Layout = None, row_offset=0) -> Samples:
  """prefill + generate as ONE jitted program on left-padded prompts.

  The KV cache is born and dies inside this program: XLA updates it in place
  through the while loop, and no cache buffer crosses the host boundary (this
  is what donating it between two jitted stages would buy, minus the copy).
  With a layout, rows are split over the batch shards (module docstring).
  row_offset (int32, traced): this call's rows are rows row_offset.. of a
  call over all rows, and draw those rows' noise (`decoding`).
  """
  prompt_bp, prompt_len_b = (_pin_rows(layout, x)
                             for x in (prompt_bp, prompt_len_b))
  carry = _pin_carry(
      layout,
      prefill(model_config, params, prompt_bp, prompt_len_b, key, cfg,
              num_generations, row_offset))
  out = generate(model_config, params, carry, prompt_len_b, key, cfg, layout,
                 row_offset)
  return Samples(*(_pin_rows(layout, x) for x in out[:-1]), steps=out.steps)


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


def kv_cache_bytes(model_config: ModelConfig, rows: int, length: int,
                   itemsize: int, layout: Layout = None) -> float:
  """Per-device bytes of the KV cache of `rows` rows of `length` positions,
  rows split over the batch shards and KV heads as the layout says."""
  row_shards = 1 if layout is None else layout.batch_shards
  head_shards = 1 if layout is None else layout.splits(
      "kv_heads", model_config.num_kv_heads)
  per_row = (2 * model_config.num_layers * model_config.num_kv_heads //
             head_shards * model_config.head_dim * length * itemsize)
  return per_row * rows / row_shards


def free_device_memory() -> Optional[float]:
  """Bytes free on the first local device, or None where the backend does
  not say (CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  if not stats or "bytes_limit" not in stats:
    return None
  return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def prompts_per_call(model_config: ModelConfig, prompts: int,
                     num_generations: int, length: int, chunk_rows: int,
                     budget: Optional[float], layout: Layout, itemsize: int,
                     multiple: int = 1) -> int:
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
  fits = lambda b: kv_cache_bytes(model_config, b * num_generations, length,
                                  itemsize, layout) <= KV_FRACTION * budget
  while b > multiple and not fits(b):
    b = up(-(-b // 2))
  return b


def sample(model_config: ModelConfig, params: Params,
           prompts: Sequence[Sequence[int]], key: jax.Array,
           cfg: SamplingConfig, num_generations: int = 1,
           batch_multiple: int = 1, layout: Layout = None,
           pools: Optional["PagePools"] = None) -> Samples:
  """G completions for each prompt (rows b*G .. b*G+G-1 belong to prompt b).

  Prompt length is padded to a power-of-two bucket and the number of prompts
  to a multiple of `batch_multiple` and then of the row shards
  (`padded_prompts`), so a run compiles a bounded number of times (see
  COMPILES). The same key gives the same output.

  With `cfg.continuous_batching`, all rows run in one call over
  `cfg.slots` cache slots (`_sample_continuous`); else rows run in calls of
  `cfg.chunk_rows` rows, or (0) as many as the
  device's free memory holds the KV cache of (`prompts_per_call`; all at
  once on CPU). Each row gets the noise it would get in one call over all
  rows, so chunking does not change the samples.

  With a `layout` (the run's mesh and rules) the rows and the KV cache are
  split over the batch mesh axes; the returned arrays are then row-sharded
  global arrays (`sharding.to_host` brings them to every host).

  pools (kv_cache "paged"): a `PagePools` made once per run; the page pool
  then lives across calls (and weight updates) instead of one call.
  """
  if not prompts:
    raise ValueError("sample() needs at least one prompt")
  if cfg.continuous_batching:
    return _sample_continuous(model_config, params, prompts, key, cfg,
                              num_generations, batch_multiple, layout, pools)
  B, G = len(prompts), num_generations
  shards = 1 if layout is None else layout.batch_shards
  P = bucket(max(len(p) for p in prompts))
  itemsize = jax.tree.leaves(params)[0].dtype.itemsize
  per_call = prompts_per_call(
      model_config, padded_prompts(B, batch_multiple, shards, G), G,
      P + cfg.max_new_tokens, cfg.chunk_rows,
      None if cfg.chunk_rows else free_device_memory(), layout, itemsize,
      prompt_multiple(1, shards, G))
  rows = -(-B // per_call) * per_call
  prompt_bp, len_b = left_pad(prompts, P, rows, cfg.pad_id)
  jit_cfg = dataclasses.replace(cfg, chunk_rows=0)
  COMPILES.note((model_config, jit_cfg, G, per_call, P, layout),
                f"rows={per_call} prompt_len={P} G={G} "
                f"T={cfg.max_new_tokens} greedy={cfg.is_greedy}")
  put = jnp.asarray if layout is None else layout.rows
  outs = [sample_padded(model_config, params, put(prompt_bp[s:s + per_call]),
                        put(len_b[s:s + per_call]), key, jit_cfg, G, layout,
                        jnp.int32(s * G))
          for s in range(0, rows, per_call)]
  out = outs[0] if len(outs) == 1 else Samples(
      *(jnp.concatenate(xs) for xs in zip(*(o[:-1] for o in outs))),
      steps=jnp.max(jnp.stack([o.steps for o in outs])))
  if rows == B:
    return out
  return Samples(*(x[:B * G] for x in out[:-1]), steps=out.steps)


# ----------------------------------------------------------------------------
# Continuous batching (grpo_jax/generate/continuous.py): the host side.
# ----------------------------------------------------------------------------

# Automatic slots where the device does not report its memory (CPU): this
# share of the call's rows (benchmarks/ragged.py measures the choice).
CPU_SLOT_SHARE = 4


def auto_slots(model_config: ModelConfig, rows: int, prompts: int,
               prompt_len: int, length: int, budget: Optional[float],
               layout: Layout, itemsize: int) -> int:
  """Slots of a continuous-batching call over `rows` rows of `prompts`
  prompts: with a memory `budget` (bytes per device), the most (up to the
  rows) whose cache of `length` columns, beside the prompts' own cache,
  takes at most KV_FRACTION of it; without one, rows / CPU_SLOT_SHARE.
  A multiple of the row shards, at least one per shard."""
  shards = 1 if layout is None else layout.batch_shards
  up = lambda m: max(shards, -(-m // shards) * shards)
  if budget is None:
    return min(up(rows), up(-(-rows // CPU_SLOT_SHARE)))
  free = KV_FRACTION * budget - kv_cache_bytes(model_config, prompts,
                                               prompt_len, itemsize, layout)
  per_slot = kv_cache_bytes(model_config, 1, length, itemsize, layout)
  return min(up(rows), up(max(int(free // per_slot) // shards * shards, 1)))


def pool_pages(cfg: SamplingConfig, real_len_b: np.ndarray, prompts: int,
               slots: int, shards: int, prompt_len: int) -> int:
  """Pages per row shard of a paged call: `cfg.pages`, or (0) what dense
  slots would hold (every slot a whole row, beside the prompts' pages),
  checked to hold the fullest shard's prompt pages plus one whole row (so
  the oldest row can always finish: `paged_slots`)."""
  Z, T = cfg.page_size, cfg.max_new_tokens
  row = paged_slots.pages_needed(prompt_len, T, Z)
  full_b = np.zeros(prompts, np.int64)
  full_b[:len(real_len_b)] = np.asarray(real_len_b) // Z
  prompt_pages = int(full_b.reshape(shards, -1).sum(1).max())
  need = prompt_pages + row
  if not cfg.pages:
    return max(need, prompts // shards * (prompt_len // Z)
               + slots // shards * row)
  if cfg.pages < need:
    raise ValueError(
        f"sampling.pages = {cfg.pages} pages of {Z} columns per row shard "
        f"cannot hold this call: its prompts take {prompt_pages} pages on "
        f"the fullest shard and one row of {prompt_len} + {T} columns "
        f"{row}; use at least {need} (or 0: automatic)")
  return cfg.pages


class PagePools:
  """The paged sampler's page pool, kept across `sample` calls (issue 26:
  allocated once per run, kept across steps and weight updates). Each call
  donates the kept pool to `paged_slots.sample_pages_reusing` and keeps the
  one it returns, so XLA reuses its buffers; the weights are an argument,
  so a weight update does not touch it, and only the page tables and
  counts (which depend on the rows) start afresh. A call needing another
  shape (another prompt bucket, slot count or dtype) allocates anew
  (`allocations` counts them). `stats`: the last call's PageStats."""

  def __init__(self):
    self.pool: Optional[paged_slots.PagePool] = None
    self.stats: Optional[paged_slots.PageStats] = None
    self.allocations = 0
    self._signature = None

  def take(self, signature, make) -> "paged_slots.PagePool":
    """The kept pool if it was made for `signature`, else `make()`; the
    holder gives it up (it is donated to the call)."""
    if self.pool is None or signature != self._signature:
      self.pool, self._signature = make(), signature
      self.allocations += 1
    pool, self.pool = self.pool, None
    return pool

  def keep(self, pool: "paged_slots.PagePool", stats) -> None:
    self.pool, self.stats = pool, stats


def _sample_continuous(model_config: ModelConfig, params: Params,
                       prompts: Sequence[Sequence[int]], key: jax.Array,
                       cfg: SamplingConfig, num_generations: int,
                       batch_multiple: int, layout: Layout,
                       pools: Optional[PagePools] = None) -> Samples:
  """`sample` by continuous batching: one call, prompts padded to a multiple
  of `batch_multiple` and of the row shards (padded rows are not decoded)."""
  B, G = len(prompts), num_generations
  shards = 1 if layout is None else layout.batch_shards
  P = bucket(max(len(p) for p in prompts))
  b = -(-B // math.lcm(batch_multiple, shards)) * math.lcm(batch_multiple,
                                                          shards)
  slots = cfg.slots or auto_slots(
      model_config, b * G, b, P, P + cfg.max_new_tokens, free_device_memory(),
      layout, jax.tree.leaves(params)[0].dtype.itemsize)
  slots = -(-slots // shards) * shards
  prompt_bp, len_b = left_pad(prompts, P, b, cfg.pad_id)
  jit_cfg = dataclasses.replace(cfg, chunk_rows=0, slots=0, pages=0)
  pool = (pool_pages(cfg, len_b[:B], b, slots, shards, P)
          if cfg.kv_cache == "paged" else 0)
  COMPILES.note((model_config, jit_cfg, G, b, P, layout, slots, pool),
                f"continuous rows={b * G} slots={slots} prompt_len={P} G={G} "
                f"T={cfg.max_new_tokens} greedy={cfg.is_greedy} "
                f"kv_cache={cfg.kv_cache} pages={pool}")
  put = jnp.asarray if layout is None else layout.rows
  args = (model_config, params, put(prompt_bp), put(len_b), key, jit_cfg, G,
          slots)
  if cfg.kv_cache == "paged" and pools is not None:
    dtype = paged_slots.pool_dtype(params)
    shape = (model_config, cfg.page_size, cfg.paged_kernel, pool, dtype,
             layout)
    kept = pools.take(shape, lambda: paged_slots.new_pool(
        model_config, jit_cfg, pool, dtype, layout))
    out, stats, kept = paged_slots.sample_pages_reusing(
        kept, *args, pool, jnp.int32(B), layout)
    pools.keep(kept, stats)
  elif cfg.kv_cache == "paged":
    out, _ = paged_slots.sample_pages(*args, pool, jnp.int32(B), layout)
  else:
    out = continuous.sample_slots(*args, jnp.int32(B), layout)
  if b == B:
    return out
  return Samples(*(x[:B * G] for x in out[:-1]), steps=out.steps)
