"""The sampler's entry point: G completions for each prompt of a list.

`Sampler(model_config, sampling, layout, pools).sample(params, prompts,
key, num_generations, batch_multiple) -> Samples` (and `sample`, the same
on one device without a kept page pool) pads the prompts to a bucket, picks
the jitted program and its static settings (`decoding.CallSpec`) and runs
it:

  lockstep     `padded.sample_padded`: every row of a call decodes in
               lockstep; rows run in calls of `sampling.chunk_rows` rows,
               or (0) as many as the device's free memory holds the KV
               cache of (`prompts_per_call`; all at once on CPU)
  continuous   `sampling.continuous_batching`: all rows in one call over
               `sampling.slots` cache slots (0: `auto_slots`), dense
               (`continuous.sample_slots`) or over a page pool
               (`sampling.kv_cache = "paged"`, `paged_slots`; the pool
               kept across calls in `PagePools`)

Each row gets the noise it would get in one call over all rows
(`decoding`), so chunks, slots and pages give the same samples. Prompt
lengths are padded to a power-of-two bucket and prompt counts to a
multiple of the row shards, so a run compiles a bounded number of times
(`COMPILES` counts them).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sharding
from grpo_jax.errors import ConfigError
from grpo_jax.generate import continuous, decoding, padded, page_pool, paged_slots
from grpo_jax.models import decode, int8_pages, paged, transformer
from grpo_jax.models.config import ModelConfig

Params = transformer.Params
Layout = Optional[sharding.Layout]    # None: one device, or XLA's choice
SamplingConfig = decoding.SamplingConfig
Samples = decoding.Samples
CallSpec = decoding.CallSpec


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
                   itemsize: int, layout: Layout = None, arrays: int = 2
                   ) -> float:
  """Per-device bytes of the KV cache of `rows` rows of `length` positions,
  rows split over the batch shards and KV heads as the layout says;
  `arrays` per layer (keys and values; 1: MLA's latent,
  `decode.cache_arrays`)."""
  row_shards = 1 if layout is None else layout.batch_shards
  head_shards = 1 if layout is None else layout.splits(
      "kv_heads", model_config.num_kv_heads)
  per_row = (arrays * model_config.num_layers * model_config.num_kv_heads //
             head_shards * model_config.head_dim * length * itemsize)
  return per_row * rows / row_shards


def free_device_memory() -> Optional[float]:
  """Bytes free on the first local device, or None where the backend does
  not say (CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  if not stats or "bytes_limit" not in stats:
    return None
  return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


@dataclasses.dataclass(frozen=True)
class CacheSize:
  """KV caches of a model whose keys and values take `itemsize` bytes,
  rows split over the batch shards and KV heads as the layout says."""
  model_config: ModelConfig
  itemsize: int
  layout: Layout = None
  arrays: int = 2            # per layer: keys and values (1: MLA latent)

  def bytes(self, rows: int, length: int) -> float:
    """Per-device bytes of `rows` rows of `length` positions."""
    return kv_cache_bytes(self.model_config, rows, length, self.itemsize,
                          self.layout, self.arrays)

  @property
  def shards(self) -> int:
    return 1 if self.layout is None else self.layout.batch_shards


def prompts_per_call(size: CacheSize, prompts: int, num_generations: int,
                     length: int, chunk_rows: int, budget: Optional[float],
                     multiple: int = 1) -> int:
  """Prompts per sampler call, a multiple of `multiple`.

  chunk_rows > 0: that many rows (whole groups); else, with a memory
  `budget` (bytes per device), the largest of prompts, prompts/2, ... whose
  KV cache of `length` columns takes at most KV_FRACTION of it; without
  one, all prompts.
  """
  up = lambda b: max(multiple, -(-b // multiple) * multiple)
  if chunk_rows:
    return min(up(prompts), up(max(chunk_rows // num_generations, 1)))
  b = up(prompts)
  if budget is None:
    return b
  fits = lambda b: size.bytes(b * num_generations,
                              length) <= KV_FRACTION * budget
  while b > multiple and not fits(b):
    b = up(-(-b // 2))
  return b


# Automatic slots where the device does not report its memory (CPU): this
# share of the call's rows (benchmarks/ragged.py measures the choice).
CPU_SLOT_SHARE = 4


def auto_slots(size: CacheSize, rows: int, prompts: int, prompt_len: int,
               length: int, budget: Optional[float]) -> int:
  """Slots of a continuous-batching call over `rows` rows of `prompts`
  prompts: with a memory `budget` (bytes per device), the most (up to the
  rows) whose cache of `length` columns, beside the prompts' own cache,
  takes at most KV_FRACTION of it; without one, rows / CPU_SLOT_SHARE.
  A multiple of the row shards, at least one per shard."""
  shards = size.shards
  up = lambda m: max(shards, -(-m // shards) * shards)
  if budget is None:
    return min(up(rows), up(-(-rows // CPU_SLOT_SHARE)))
  free = KV_FRACTION * budget - size.bytes(prompts, prompt_len)
  per_slot = size.bytes(1, length)
  return min(up(rows), up(max(int(free // per_slot) // shards * shards, 1)))


def kv_ratio(model_config: ModelConfig, itemsize: int, kv_dtype: str
             ) -> float:
  """The dense cache's bytes per key column / a pool's (1 unless int8)."""
  E = model_config.head_dim
  return itemsize * E / int8_pages.column_bytes(itemsize, kv_dtype, E)


def pool_pages(sampling: SamplingConfig, real_len_b: np.ndarray, prompts: int,
               slots: int, shards: int, prompt_len: int,
               kv_ratio: float = 1.0) -> int:
  """Pages per row shard of a paged call: `sampling.pages`, or (0) what dense
  slots would hold (every slot a whole row, beside the prompts' pages;
  kv_ratio: the dense cache's bytes per column / the pool's, over 1 for
  int8 pages, so the pool takes the same bytes), checked to hold the fullest shard's prompt pages plus one whole row (so
  the oldest row can always finish: `paged_slots`)."""
  Z, T = sampling.page_size, sampling.max_new_tokens
  row = page_pool.pages_needed(prompt_len, T, Z)
  full_b = np.zeros(prompts, np.int64)
  full_b[:len(real_len_b)] = np.asarray(real_len_b) // Z
  prompt_pages = int(full_b.reshape(shards, -1).sum(1).max())
  need = prompt_pages + row
  if not sampling.pages:
    return max(need, int(kv_ratio * (prompts // shards * (prompt_len // Z)
                                     + slots // shards * row)))
  if sampling.pages < need:
    raise ConfigError(   # a user error (one line), a ValueError too
        f"config field 'sampling.pages' = {sampling.pages} pages of {Z} columns per row shard "
        f"cannot hold this call: its prompts take {prompt_pages} pages on "
        f"the fullest shard and one row of {prompt_len} + {T} columns "
        f"{row}; use at least {need} (or 0: automatic)")
  return sampling.pages


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
    self.pool: Optional[paged.PagePool] = None
    self.stats: Optional[paged_slots.PageStats] = None
    self.allocations = 0
    self._signature = None

  def take(self, signature, make) -> "paged.PagePool":
    """The kept pool if it was made for `signature`, else `make()`; the
    holder gives it up (it is donated to the call)."""
    if self.pool is None or signature != self._signature:
      self.pool, self._signature = make(), signature
      self.allocations += 1
    pool, self.pool = self.pool, None
    return pool

  def keep(self, pool: "paged.PagePool", stats) -> None:
    self.pool, self.stats = pool, stats


@dataclasses.dataclass(frozen=True)
class Sampler:
  """The run's sampler: the model, the sampler settings and where it runs.

  layout: the run's mesh and rules: the rows and the KV cache are split
  over the batch mesh axes, and `sample` returns row-sharded global arrays
  (`sharding.to_host` brings them to every host); None: one device, or
  XLA's choice. pools (kv_cache "paged"): a `PagePools` made once per run;
  the page pool then lives across calls (and weight updates) instead of
  one call."""
  model_config: ModelConfig
  sampling: SamplingConfig
  layout: Layout = None
  pools: Optional[PagePools] = None

  @property
  def shards(self) -> int:
    return 1 if self.layout is None else self.layout.batch_shards

  def sample(self, params: Params, prompts: Sequence[Sequence[int]],
             key: jax.Array, num_generations: int = 1,
             batch_multiple: int = 1) -> Samples:
    """G completions for each prompt (rows b*G .. b*G+G-1 belong to prompt
    b), the number of prompts padded to a multiple of `batch_multiple` (a
    caller's fixed chunk shape) and then of the row shards
    (`padded_prompts`). The same key gives the same output (module
    docstring)."""
    if not prompts:
      raise ValueError("sample() needs at least one prompt")
    if self.sampling.continuous_batching:
      return self._continuous(params, prompts, key, num_generations,
                              batch_multiple)
    return self._lockstep(params, prompts, key, num_generations,
                          batch_multiple)

  def _put(self, x: np.ndarray) -> jax.Array:
    return jnp.asarray(x) if self.layout is None else self.layout.rows(x)

  def _lockstep(self, params, prompts, key, G: int, batch_multiple: int
                ) -> Samples:
    """`sample` by `padded.sample_padded`, in calls of whole groups."""
    sampling, shards, B = self.sampling, self.shards, len(prompts)
    P = bucket(max(len(p) for p in prompts))
    size = CacheSize(self.model_config,
                     jax.tree.leaves(params)[0].dtype.itemsize, self.layout,
                     decode.cache_arrays(self.model_config))
    per_call = prompts_per_call(
        size, padded_prompts(B, batch_multiple, shards, G), G,
        P + sampling.max_new_tokens, sampling.chunk_rows,
        None if sampling.chunk_rows else free_device_memory(),
        prompt_multiple(1, shards, G))
    rows = -(-B // per_call) * per_call
    prompt_bp, len_b = left_pad(prompts, P, rows, sampling.pad_id)
    call = CallSpec(self.model_config,
                    dataclasses.replace(sampling, chunk_rows=0), G,
                    self.layout)
    COMPILES.note((call, per_call, P),
                  f"rows={per_call} prompt_len={P} G={G} "
                  f"T={sampling.max_new_tokens} greedy={sampling.is_greedy}")
    outs = [padded.sample_padded(call, params,
                                 self._put(prompt_bp[s:s + per_call]),
                                 self._put(len_b[s:s + per_call]), key,
                                 jnp.int32(s * G))
            for s in range(0, rows, per_call)]
    out = outs[0] if len(outs) == 1 else decoding.concat_rows(outs)
    return _first_rows(out, B * G)

  def _continuous(self, params, prompts, key, G: int, batch_multiple: int
                  ) -> Samples:
    """`sample` by continuous batching: one call, prompts padded to a
    multiple of `batch_multiple` and of the row shards (padded rows are not
    decoded)."""
    sampling, shards, B = self.sampling, self.shards, len(prompts)
    P = bucket(max(len(p) for p in prompts))
    b = -(-B // math.lcm(batch_multiple, shards)) * math.lcm(batch_multiple,
                                                            shards)
    slots = sampling.slots or auto_slots(
        CacheSize(self.model_config,
                  jax.tree.leaves(params)[0].dtype.itemsize, self.layout,
                  decode.cache_arrays(self.model_config)),
        b * G, b, P, P + sampling.max_new_tokens, free_device_memory())
    slots = -(-slots // shards) * shards
    prompt_bp, len_b = left_pad(prompts, P, b, sampling.pad_id)
    is_paged = sampling.kv_cache == "paged"
    itemsize = jax.tree.leaves(params)[0].dtype.itemsize
    pool = (pool_pages(sampling, len_b[:B], b, slots, shards, P,
                       kv_ratio(self.model_config, itemsize, sampling.kv_dtype))
            if is_paged else 0)
    call = CallSpec(self.model_config, dataclasses.replace(
        sampling, chunk_rows=0, slots=0, pages=0), G, self.layout, slots, pool)
    COMPILES.note((call, b, P),
                  f"continuous rows={b * G} slots={slots} prompt_len={P} "
                  f"G={G} T={sampling.max_new_tokens} "
                  f"greedy={sampling.is_greedy} kv_cache={sampling.kv_cache} "
                  f"pages={pool}")
    args = (call, params, self._put(prompt_bp), self._put(len_b), key,
            jnp.int32(B))
    if is_paged and self.pools is not None:
      dtype = page_pool.pool_dtype(params)
      shape = (self.model_config, sampling.page_size, sampling.paged_kernel,
               sampling.kv_dtype, pool, dtype, self.layout)
      kept = self.pools.take(shape, lambda: page_pool.new_pool(call, dtype))
      out, stats, kept = paged_slots.sample_pages_reusing(kept, *args)
      self.pools.keep(kept, stats)
    elif is_paged:
      out, _ = paged_slots.sample_pages(*args)
    else:
      out = continuous.sample_slots(*args)
    return _first_rows(out, B * G)


def _first_rows(out: Samples, n: int) -> Samples:
  """The first n rows of `out` (the rest pad the call)."""
  if out.tokens_nt.shape[0] == n:
    return out
  return decoding.map_rows(lambda x: x[:n], out)


def sample(model_config: ModelConfig, params: Params,
           prompts: Sequence[Sequence[int]], key: jax.Array,
           sampling: SamplingConfig, num_generations: int = 1,
           batch_multiple: int = 1) -> Samples:
  """`Sampler(model_config, sampling).sample(...)`: one device (or XLA's
  choice of placement), no page pool kept across calls."""
  return Sampler(model_config, sampling).sample(
      params, prompts, key, num_generations, batch_multiple)
