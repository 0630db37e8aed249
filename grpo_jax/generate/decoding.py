"""What both samplers share: settings, the Samples they return, the prompt
pass, and token choice with noise that is a function of (row, token).

`padded` (the static sampler: every row of a call decodes in lockstep),
`continuous` (continuous batching: rows take turns in a fixed set of
cache slots) and `paged_slots` (the same over a paged cache) build on
this, each a jitted program whose static settings are one `CallSpec`;
`sampling` (the host side) re-exports the public names.

Noise: row r's token t is drawn with the uniform
`uniform(fold_in(fold_in(key, t), r))`, whatever call, chunk, slot or decode
step computes it. So splitting rows into chunks, or scheduling them over
slots in any order, gives the samples of one call over all rows wherever
the logits agree (the float rounding of other matmul shapes aside).

Log-probs: `logp_nt[i, t]` is log softmax(logits / temperature)[token] - the
temperature-scaled distribution BEFORE top-k / top-p truncation (for greedy,
temperature 1). The trainer matches it by dividing its logits by the same
temperature and ignoring top-k/top-p (as verl and TRL do), so with unchanged
parameters the first update's ratio is exactly 1.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from grpo_jax import sharding
from grpo_jax.models import int8_pages, paged, transformer
from grpo_jax.models.config import ModelConfig

KV_CACHES = ("dense", "paged")
# Every sampler's decode loop runs under this name scope, so a compiled
# program's ops of one decode step are found by their op_name
# (aot/programs.decode_collectives).
DECODE_SCOPE = "decode"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick each token. temperature 0 (or greedy=True) is argmax.

  continuous_batching: decode with `slots` cache slots that rows take in
  turn (`grpo_jax.generate.continuous`) instead of all rows of a call in lockstep;
  slots 0 is automatic (`sampling.auto_slots`); chunk_rows is then not used
  (the slots bound the cache).

  kv_cache (continuous batching): "dense", a cache of P + T columns per
  slot (`continuous`), or "paged", a pool of `pages` pages of `page_size`
  columns per row shard that rows take as they grow, a prompt's pages
  shared by its rows (`paged_slots`; pages 0: as many as dense slots would
  hold, so rows never wait). stop_check_every: the decode loop checks
  whether any row is still live every that many steps (finished slots stay
  masked meanwhile; the samples do not change). paged_kernel (paged): the
  decode attention over pages, "reference" (plain JAX), "pallas" (the TPU
  kernel; int8 pages: `models.int8_kernel`) or "auto" (the kernel on
  TPU). kv_dtype (paged): "" (the compute dtype) or "int8", pages of int8
  keys and values with a float32 scale per head and column
  (`models.paged.Int8Pages`)."""
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0                 # 0: no top-k
  greedy: bool = False
  stop_ids: tuple[int, ...] = ()
  pad_id: int = 0
  chunk_rows: int = 0            # rows per sampler call (0: automatic)
  continuous_batching: bool = False
  slots: int = 0                 # continuous batching's slots (0: automatic)
  kv_cache: str = "dense"        # continuous batching's cache: KV_CACHES
  page_size: int = 16            # columns per page (kv_cache "paged")
  pages: int = 0                 # pages per row shard (0: automatic)
  stop_check_every: int = 1      # decode steps per check of "any row live"
  paged_kernel: str = "auto"     # paged decode attention: models.paged.KERNELS
  kv_dtype: str = ""             # paged pools: models.int8_pages.KV_DTYPES
  record_routes: bool = False    # MoE routing replay: Samples.routes_nslc

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
    if self.slots < 0:
      raise ValueError(f"slots must be >= 0 (0: automatic), got {self.slots}")
    if self.kv_cache not in KV_CACHES:
      raise ValueError(f"kv_cache must be one of {KV_CACHES}, got "
                       f"{self.kv_cache!r}")
    if self.kv_cache == "paged" and not self.continuous_batching:
      raise ValueError("kv_cache 'paged' is continuous batching's cache: "
                       "set continuous_batching=True")
    if self.paged_kernel not in paged.KERNELS:
      raise ValueError(f"paged_kernel must be one of {paged.KERNELS}, got "
                       f"{self.paged_kernel!r}")
    if self.kv_dtype not in int8_pages.KV_DTYPES:
      raise ValueError(f"kv_dtype must be one of {int8_pages.KV_DTYPES}, got "
                       f"{self.kv_dtype!r}")
    if self.kv_dtype and self.kv_cache != "paged":
      raise ValueError(f"kv_dtype {self.kv_dtype!r} is the paged pool's: set "
                       "kv_cache='paged'")
    if self.page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {self.page_size}")
    if self.pages < 0:
      raise ValueError(f"pages must be >= 0 (0: automatic), got {self.pages}")
    if self.stop_check_every < 1:
      raise ValueError(f"stop_check_every must be >= 1, got "
                       f"{self.stop_check_every}")

  @property
  def is_greedy(self) -> bool:
    return self.greedy or self.temperature == 0 or self.top_k == 1


@dataclasses.dataclass(frozen=True)
class CallSpec:
  """What one jitted sampler call is compiled for (its static argument):
  the model, the sampler settings, G rows per prompt, the mesh and rules
  (None: one device, or XLA's choice) and, for continuous batching, the
  slots, the page pool's pages per row shard (kv_cache "paged") and
  whether to count page conflicts every step (tests)."""
  model_config: ModelConfig
  sampling: SamplingConfig
  num_generations: int
  layout: Optional[sharding.Layout] = None
  slots: int = 0
  pool_pages: int = 0
  check_pages: bool = False

  @property
  def shards(self) -> int:
    """R: the row shards (1 without a layout)."""
    return 1 if self.layout is None else self.layout.batch_shards


class Samples(NamedTuple):
  """One row i per completion: n = B*G rows (prompt b = i // G), each of
  t = max_new_tokens columns."""
  tokens_nt: jax.Array      # int32, pad after the stop token
  logp_nt: jax.Array        # float32, see module docstring; 0 on padding
  mask_nt: jax.Array        # bool, the generated tokens incl. the stop token
  length_n: jax.Array       # int32, number of generated tokens
  truncated_n: jax.Array    # bool, no stop id within max_new_tokens
  steps: jax.Array          # int32 scalar: decode iterations run (early exit)
  # record_routes: every column's experts per sparse layer, (n, P + T,
  # L_sparse, C) in `moe.routes_dtype` (P: the call's prompt bucket, left
  # padded; 0 on padding); None otherwise
  routes_nslc: Optional[jax.Array] = None


def map_rows(f, out: Samples) -> Samples:
  """`out` with f applied to each per-row field that is not None (all but
  `steps`)."""
  return out._replace(**{k: f(v) for k, v in out._asdict().items()
                         if k != "steps" and v is not None})


def concat_rows(outs: Sequence[Samples]) -> Samples:
  """Samples of consecutive calls as one: their rows concatenated, the most
  decode steps any took."""
  return map_rows(lambda _: None, outs[0])._replace(
      **{k: jnp.concatenate([getattr(o, k) for o in outs])
         for k, v in outs[0]._asdict().items()
         if k != "steps" and v is not None},
      steps=jnp.max(jnp.stack([o.steps for o in outs])))


# ----------------------------------------------------------------------------
# The prompt pass.
# ----------------------------------------------------------------------------

class PromptPass(NamedTuple):
  """Each left-padded prompt run through the model once."""
  logits_bv: jax.Array      # float32, the last column's: the first token's
  k: jax.Array              # (L, B, K, P, E) keys of every layer
  v: jax.Array              # (L, B, K, P, E)
  valid_bp: jax.Array       # bool: real (non-padding) prompt columns
  pos_bp: jax.Array         # int32 rotary positions
  routes_lbpc: Optional[jax.Array] = None   # record_routes: sparse layers'


def prompt_pass(model_config: ModelConfig, params: transformer.Params,
                prompt_bp: jax.Array, prompt_len_b: jax.Array,
                record_routes: bool = False) -> PromptPass:
  """prompt_bp: int32 (B, P) left-padded; prompt_len_b: int32 (B,) lengths.
  Left padding puts every prompt's last token in column P - 1.
  record_routes: also each sparse layer's experts (L_sparse, B, P, C)."""
  P = prompt_bp.shape[1]
  pad_b = P - prompt_len_b
  col_p = jnp.arange(P, dtype=jnp.int32)
  valid_bp = col_p[None, :] >= pad_b[:, None]
  pos_bp = jnp.maximum(col_p[None, :] - pad_b[:, None], 0)
  h, (k, v), *routes = transformer.hidden_states_and_kv(
      model_config, params, prompt_bp, pos_bp, valid_bp,
      return_routes=record_routes)
  logits_bv = transformer.unembed(model_config, params, h[:, -1:])[:, 0]
  return PromptPass(logits_bv, k, v, valid_bp, pos_bp,
                    routes[0] if routes else None)


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


def token_uniforms(key: jax.Array, row_n: jax.Array, t_n: jax.Array
                   ) -> jax.Array:
  """Uniform (0, 1] of row row_n[i]'s token t_n[i]: a function of (key,
  row, token) only (module docstring)."""
  def one(row, t):
    k = jax.random.fold_in(jax.random.fold_in(key, t), row)
    return jax.random.uniform(k, minval=jnp.finfo(jnp.float32).tiny)
  return jax.vmap(one)(row_n, jnp.broadcast_to(t_n, row_n.shape))


# Vocabulary columns per block of the two-level inverse CDF.
CDF_BLOCK = 256


def _inverse_cdf_sample(logits_nv: jax.Array, u_n: jax.Array) -> jax.Array:
  """Exact categorical sampling with ONE uniform per row.

  jax.random.categorical draws V Gumbel variates per row; with threefry on
  CPU that alone cost ~50 ms per decode step at N=64, V=49k. Inverting the
  CDF needs N uniforms. It is done in two levels so that no cumulative sum
  runs over the whole vocabulary (a (64, 49152) cumsum took 8 ms on CPU,
  this 2 ms): the running mass of blocks of CDF_BLOCK tokens picks the
  block where u falls, then a cumulative sum inside that block alone picks
  the token, the first whose running mass reaches u times the total.
  """
  N, V = logits_nv.shape
  C = CDF_BLOCK
  nb = -(-V // C)
  probs = jax.nn.softmax(logits_nv, axis=-1)
  block_probs = jnp.pad(probs, [(0, 0), (0, nb * C - V)]).reshape(N, nb, C)
  block_cdf = jnp.cumsum(block_probs.sum(-1), axis=-1)
  target_n = u_n * block_cdf[:, -1]
  block_n = jnp.minimum(jnp.sum(block_cdf < target_n[:, None], axis=-1), nb - 1)
  probs_in_block = jnp.take_along_axis(block_probs, block_n[:, None, None], axis=1)[:, 0]
  before_n = jnp.take_along_axis(block_cdf, jnp.maximum(block_n - 1, 0)[:, None],
                                 axis=1)[:, 0]
  before_n = jnp.where(block_n > 0, before_n, 0.0)
  cdf_in_block = before_n[:, None] + jnp.cumsum(probs_in_block, axis=-1)
  col_n = jnp.sum(cdf_in_block < target_n[:, None], axis=-1)
  # Rounding can leave u past the block's last running mass: take its last
  # token of non-zero probability (the block holds some: it was chosen).
  last_n = C - 1 - jnp.argmax((probs_in_block > 0)[:, ::-1], axis=-1)
  tokens = block_n * C + jnp.minimum(col_n, last_n)
  return jnp.minimum(tokens, V - 1).astype(jnp.int32)


def choose_tokens(logits_nv: jax.Array, key: jax.Array,
                  sampling: SamplingConfig, row_n: jax.Array, t_n
                  ) -> tuple[jax.Array, jax.Array]:
  """Next token (N,) and its log-prob under softmax(logits / temperature).
  row_n: each row's index in its sampler call over all rows; t_n: the index
  of the token being chosen (scalar or per row). Together with the key they
  fix the noise (`token_uniforms`)."""
  if sampling.is_greedy:
    tokens = jnp.argmax(logits_nv, axis=-1).astype(jnp.int32)
    scaled = logits_nv
  else:
    scaled = logits_nv / sampling.temperature
    filtered = _filter_logits(scaled, sampling.top_k, sampling.top_p)
    tokens = _inverse_cdf_sample(filtered, token_uniforms(key, row_n, t_n))
  logp = jax.nn.log_softmax(scaled, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def is_stop(tokens_n: jax.Array, stop_ids: Sequence[int]) -> jax.Array:
  if not stop_ids:
    return jnp.zeros(tokens_n.shape, bool)
  return jnp.isin(tokens_n, jnp.asarray(stop_ids, jnp.int32))


def finish(tokens_nt: jax.Array, logp_nt: jax.Array, steps: jax.Array,
           sampling: SamplingConfig, routes_nslc=None) -> Samples:
  """Mask, length and truncation from the raw token matrix (recorded routes
  passed through)."""
  T = tokens_nt.shape[1]
  stop_nt = is_stop(tokens_nt, sampling.stop_ids)
  has_stop = jnp.any(stop_nt, axis=1)
  first_stop = jnp.argmax(stop_nt, axis=1)
  length_n = jnp.where(has_stop, first_stop + 1, T).astype(jnp.int32)
  mask_nt = jnp.arange(T)[None, :] < length_n[:, None]
  tokens_nt = jnp.where(mask_nt, tokens_nt, sampling.pad_id)
  return Samples(tokens_nt, jnp.where(mask_nt, logp_nt, 0.0), mask_nt,
                 length_n, ~has_stop, steps, routes_nslc)
