"""Rows that leave the device loop with their pages and come back: the paged
engine of multi-turn episodes (docs/agents.md, "Rows that wait"), and the
mechanism partial rollouts reuse (docs/async.md rule 4).

`paged_slots.sample_pages` runs every row of a call to its end inside one
`while_loop`. Here the loop is cut into calls and a row's life into turns:

  admit     `Engine.admit(Parked(row, tokens, cached, pages), ...)`: a
            slot, and pages for the row's columns up to the end of this
            turn's budget. The tokens past `cached` (those whose keys and
            values are not yet on the row's pages) are prefilled onto its
            pages in one call for every row admitted since the last
            (`_prefill`); the history before `cached` is never prefilled
            again. cached 0 with no pages is a row recomputed from its
            first token: a row whose pages were released (`release`),
            e.g. after a weight switch (partial rollouts).
  decode    `Engine.step`: one jitted loop of at most `steps_per_call`
            decode steps over the slots, left as soon as `return_after`
            rows have ended their turn (a stop id, or the turn's budget).
            The host reads the slots once per call, never per step.
  park      a row whose turn ended leaves its slot: its tokens (the turn
            appended) and its cached length go to the host, its pages up
            to that length stay allocated in the pool (`Turn.parked`), the
            pages reserved past it return. The caller runs its tool, then
            admits it again with the observation appended (only the turn's
            last token and the observation are prefilled), or releases it.
  routes    `sampling.record_routes` (MoE routing replay): each column's
            experts per sparse layer, recorded when its token is fed (the
            prefill's for the new tokens, each decode step's for the token
            it feeds) and kept on the host beside the column's page
            (`Engine.routes`): a row sharing a page shares its routes, a
            released row records them again when it is recomputed. A row's
            last sampled token is fed by one more admission of at most one
            token, whose sample is dropped (`agent_parked`).

The pool is one `models.paged` pool on one row shard's devices (a mesh of
more row shards runs an engine per shard, `agent_parked`), its pages
handed out on the host (`free_pages`): a row holds its own pages,
reserved at admission, and may share the leading full pages of its tokens
with rows of the same tokens (`share`: a group's prompt, never written
again, so nothing is copied on write); the decode loop never waits for a
page and nobody is preempted inside it. A caller that finds no room and nothing decoding
releases parked rows' pages (they come back with cached 0).

Noise: a token is drawn with `decoding.token_uniforms(key, noise, t)`,
`noise` the caller's number for the (row, turn), so samples do not depend on
which slot, call or order served a row. Shape letters as in `grpo_jax` and
`models.paged`: M slots, A rows admitted in one call, L their new tokens
(padded), J table entries, W pages, Z columns per page.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.generate import decoding, page_pool, sampling
from grpo_jax.models import attention, decode, moe, paged, transformer
from grpo_jax.models.config import ModelConfig

_LAYOUT = paged.REFERENCE_LAYOUT


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """What the engine's programs are compiled for: the model, the sampler
  settings (max_new_tokens is a turn's budget), M slots, W pages of
  sampling.page_size columns, at most `context` columns per row, at most
  `steps_per_call` decode steps per call, a call left once `return_after`
  turns have ended."""
  model_config: ModelConfig
  sampling: decoding.SamplingConfig
  slots: int
  pages: int
  context: int
  steps_per_call: int = 16
  return_after: int = 1
  max_buckets: int = 16     # decode attention branches a layer, at most

  def __post_init__(self):
    J = self.table_width
    if self.pages < J:
      raise ValueError(f"a pool of {self.pages} pages cannot hold one row of "
                       f"{self.context} columns ({J} pages)")
    if min(self.slots, self.steps_per_call, self.return_after,
           self.max_buckets) < 1:
      raise ValueError("slots, steps_per_call, return_after and max_buckets "
                       "must be >= 1")

  @property
  def table_width(self) -> int:
    """J: page-table entries of a row."""
    return -(-self.context // self.sampling.page_size)

  @property
  def block(self) -> int:
    """Key columns per bucket of the decode's attention: `paged.BLOCK_S`,
    or coarser so a layer has at most `max_buckets` `lax.switch` branches
    (`paged.bucketed_attention`; a step reads up to a bucket past its
    longest row): at a 16K context, 512 branches of 32 columns a layer made
    a 7B decode step too big to compile (aot.py)."""
    Z = self.sampling.page_size
    pages = max(paged.BLOCK_S // Z, -(-self.table_width // self.max_buckets),
                1)
    return pages * Z


class Parked(NamedTuple):
  """A row off the device: every token so far (the columns it attends
  over once admitted), how many leading ones have their keys and values on
  `pages` (its pages in table order), and the caller's id."""
  row: int
  tokens: tuple
  cached: int = 0
  pages: tuple = ()


class Turn(NamedTuple):
  """A turn that ended (or was cut: `Engine.park_all`): its ids and
  log-probs as sampled, whether it ended in a stop id, and the row parked
  after it (tokens + ids, cached all but the last id, whose keys the next
  admission writes)."""
  row: int
  ids: list
  logp: list
  stopped: bool
  parked: Parked
  cut: bool = False         # left mid-turn: continue it (admit's first_t)


class _Slots(NamedTuple):
  """The slots as the decode loop carries them (host numpy between calls)."""
  noise_m: np.ndarray       # int32: the noise number of the slot's turn
  t0_m: np.ndarray          # int32: the turn's tokens before this admission
  t_m: np.ndarray           # int32: tokens chosen since this admission
  column_m: np.ndarray      # int32: the column of the last chosen token
  limit_m: np.ndarray       # int32: this turn's token budget
  live_m: np.ndarray        # bool: decoding
  table_mj: np.ndarray      # int32 page ids (W: none)
  tokens_mt: np.ndarray     # int32 this turn's tokens
  logp_mt: np.ndarray       # float32 their log-probs
  routes_mtlc: np.ndarray   # record_routes: token t's experts when fed
                            # (L_sparse, C); else (M, 0, 0, 0)


class Stats(NamedTuple):
  prefilled: int = 0        # tokens prefilled onto pages
  decode_calls: int = 0     # device calls of the decode loop
  decode_steps: int = 0     # decode steps run
  peak_pages: int = 0       # most pages allocated at once


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="pool")
def _prefill(spec: EngineSpec, params, pool: paged.PagePool, tokens_al,
             start_a, count_a, table_aj, noise_a, t0_a, key) -> tuple:
  """Row a's count_a[a] new tokens at columns start_a[a]... written onto its
  pages, each attending over its columns up to itself; the turn's first
  token chosen from the last one's logits. Returns (pool, first_a, logp_a,
  the new tokens' experts (A, L, L_sparse, C) or None: record_routes)."""
  mc, Z = spec.model_config, spec.sampling.page_size
  A, L = tokens_al.shape
  W, J = spec.pages, table_aj.shape[1]
  col_al = start_a[:, None] + jnp.arange(L)[None]
  real_al = jnp.arange(L)[None] < count_a[:, None]
  page_al = jnp.where(real_al, jnp.take_along_axis(
      table_aj, jnp.minimum(col_al // Z, J - 1), 1), W)
  write = lambda pool, new: jax.vmap(_LAYOUT.write)(
      pool, new.reshape(1, A * L, *new.shape[2:]), page_al.reshape(1, -1),
      (col_al % Z).reshape(1, -1))
  key_s = jnp.arange(J * Z)
  weights = decode.weights(mc, params)
  x = transformer.embed(params, tokens_al, mc)
  ks, vs, routes = list(pool.k), list(pool.v), []
  for i, lp in enumerate(weights.layers):
    c = mc.layer_config(i)
    q, k, v = transformer.qkv(c, lp, x, col_al)       # k, v: (A, K, L, E)
    ks[i] = write(ks[i], jnp.swapaxes(k, 1, 2))
    if vs:                             # else the values are the keys (MLA)
      vs[i] = write(vs[i], jnp.swapaxes(v, 1, 2))
    gather = lambda p: jax.vmap(lambda p, t: _LAYOUT.gather(p, t, q.dtype))(
        p, table_aj[None])[0]                       # (A, K, J*Z, E)
    mask_als = key_s[None, None] <= col_al[:, :, None]
    if c.sliding_window is not None:
      mask_als &= key_s[None, None] > col_al[:, :, None] - c.sliding_window
    k_gathered = gather(ks[i])
    attn = attention.attention(
        q, k_gathered, gather(vs[i]) if vs else k_gathered, mask_als,
        c.attn_softcap)
    x, routing = transformer.attn_out_and_routed_mlp(c, lp, x, attn)
    if routing is not None:
      routes.append(routing.experts_nc.reshape(A, L, -1))
  last = jnp.take_along_axis(x, jnp.maximum(count_a - 1, 0)[:, None, None], 1)
  first_a, logp_a = decoding.choose_tokens(
      decode.logits(mc, params, last), key, spec.sampling, noise_a, t0_a)
  routes_allc = (jnp.stack(routes, 2).astype(moe.routes_dtype(
      mc.moe.num_experts)) if spec.sampling.record_routes else None)
  return paged.PagePool(tuple(ks), tuple(vs)), first_a, logp_a, routes_allc


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="pool")
def _decode(spec: EngineSpec, params, pool: paged.PagePool, s: _Slots, key
            ) -> tuple:
  """DECODE: at most spec.steps_per_call steps, left once return_after
  turns have ended or nothing is live. Returns (pool, slots, steps)."""
  mc, cfg = spec.model_config, spec.sampling
  Z, W = cfg.page_size, spec.pages
  M, J = s.table_mj.shape
  m = jnp.arange(M)
  weights = decode.weights(mc, params)

  def step(carry):
    i, ended, pool, s = carry
    j_m = s.column_m // Z
    page_m = jnp.where(s.live_m, s.table_mj[m, jnp.minimum(j_m, J - 1)], W)
    filled = jnp.max(jnp.where(s.live_m, j_m + 1, 0))
    settings = paged.DecodeSettings(
        paged.reference_fn(mc, filled, _LAYOUT, spec.block), 1, _LAYOUT)
    logits_mv, pool, *taken = paged.decode_step(
        mc, weights, pool, s.tokens_mt[m, s.t_m - 1],
        paged.RowPages(s.column_m, page_m, s.table_mj), settings,
        cfg.record_routes)
    if taken:                          # the fed token's (t_m - 1) experts
      s = s._replace(routes_mtlc=s.routes_mtlc.at[
          m, jnp.where(s.live_m, s.t_m - 1, s.tokens_mt.shape[1])].set(
              jnp.moveaxis(taken[0], 0, 1).astype(s.routes_mtlc.dtype),
              mode="drop"))
    tok_m, logp_m = decoding.choose_tokens(logits_mv, key, cfg, s.noise_m,
                                           s.t0_m + s.t_m)
    at_m = jnp.where(s.live_m, s.t_m, s.tokens_mt.shape[1])    # dead: drop
    end_m = s.live_m & (decoding.is_stop(tok_m, cfg.stop_ids)
                        | (s.t_m + 1 >= s.limit_m))
    s = s._replace(
        t_m=s.t_m + s.live_m, column_m=s.column_m + s.live_m,
        live_m=s.live_m & ~end_m,
        tokens_mt=s.tokens_mt.at[m, at_m].set(tok_m, mode="drop"),
        logp_mt=s.logp_mt.at[m, at_m].set(logp_m, mode="drop"))
    return i + 1, ended + end_m.sum(), pool, s

  def going(carry):
    i, ended, _, s = carry
    return ((i < spec.steps_per_call) & (ended < spec.return_after)
            & jnp.any(s.live_m))

  with jax.named_scope(decoding.DECODE_SCOPE):
    steps, _, pool, s = jax.lax.while_loop(
        going, step, (jnp.int32(0), jnp.int32(0), pool, s))
  return pool, s, steps


def routes_shape(spec: EngineSpec) -> tuple:
  """A slot's `_Slots.routes_mtlc` (T, L_sparse, C) and their dtype
  (`moe.routes_dtype`); (0, 0, 0) when not recording."""
  c, cfg = spec.model_config, spec.sampling
  if not cfg.record_routes:
    return (0, 0, 0), np.uint8
  return ((cfg.max_new_tokens, len(c.sparse_layers()),
           c.moe.experts_per_token), moe.routes_dtype(c.moe.num_experts))


def _pages_for(columns: int, Z: int) -> int:
  return -(-columns // Z)


class Engine:
  """The paged engine of rows that wait (module docstring): `admit` rows,
  `step` until turns end, `release` a row's pages when it is done."""

  def __init__(self, spec: EngineSpec, params, key: jax.Array,
               mesh: jax.sharding.Mesh | None = None):
    """mesh: the devices the pool is made on (one row shard's, with params
    on them: `agent_parked`); None: the default device."""
    c, cfg = spec.model_config, spec.sampling
    self.spec, self.params, self.key = spec, params, key
    zeros = functools.partial(
        page_pool.zero_pool, c, spec.pages, cfg.page_size, 1,
        page_pool.pool_dtype(params), None, _LAYOUT, cfg.kv_dtype)
    self.pool = zeros() if mesh is None else jax.jit(
        zeros, out_shardings=jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec()))()
    M, J, T = spec.slots, spec.table_width, cfg.max_new_tokens
    self._free = list(range(spec.pages - 1, -1, -1))   # free page ids
    self._holders_w = np.zeros(spec.pages, np.int32)   # rows holding a page
    zeros_m = lambda: np.zeros(M, np.int32)
    (T_r, *lc), dtype = routes_shape(spec)
    self._slots = _Slots(
        zeros_m(), zeros_m(), np.ones(M, np.int32), zeros_m(),
        np.ones(M, np.int32), np.zeros(M, bool),
        np.full((M, J), spec.pages, np.int32),
        np.full((M, T), cfg.pad_id, np.int32), np.zeros((M, T), np.float32),
        np.zeros((M, T_r, *lc), dtype))
    # record_routes: column z of page w's token's experts (`routes`)
    self._routes_wzlc = (np.zeros((spec.pages, cfg.page_size, *lc), dtype)
                         if cfg.record_routes else None)
    self._held: list = [None] * M      # slot -> Parked with the turn's pages
    self._pending: list = []           # (slot, Parked, noise, limit, t0)
    self.stats = Stats()

  @property
  def free_pages(self) -> int:
    return len(self._free)

  @property
  def free_slots(self) -> int:
    return sum(h is None for h in self._held)

  @property
  def busy(self) -> bool:
    """A row holds a slot (decoding, or admitted and not yet prefilled)."""
    return any(h is not None for h in self._held)

  def admit(self, row: Parked, noise: int, max_new: int, first_t: int = 0
            ) -> Parked | None:
    """Takes `row` for a turn of at most max_new tokens (within the
    context) if a slot and its pages are free: the row with its pages (as
    `share` reads them); None (nothing taken) if not. Its tokens past
    row.cached are prefilled at the next `step`.
    first_t: the turn's tokens already sampled (a cut turn continued), so
    its tokens draw the noise of (noise, first_t + i) as uncut."""
    spec, Z = self.spec, self.spec.sampling.page_size
    n = len(row.tokens)
    if not 0 <= row.cached < n or len(row.pages) != _pages_for(row.cached, Z):
      raise ValueError(f"row {row.row}: {n} tokens, {row.cached} cached on "
                       f"{len(row.pages)} pages")
    if any(h is not None and h.row == row.row for h in self._held):
      raise ValueError(f"row {row.row} already holds a slot")
    limit = min(max_new, spec.sampling.max_new_tokens, spec.context + 1 - n)
    if limit < 1:
      raise ValueError(f"row {row.row}: {n} tokens leave no room in a "
                       f"context of {spec.context}")
    extra = _pages_for(n + limit - 1, Z) - len(row.pages)
    slot = next((m for m, h in enumerate(self._held) if h is None), None)
    if slot is None or extra > len(self._free):
      return None
    row = row._replace(pages=row.pages + self._take(extra))
    self._held[slot] = row
    self._pending.append((slot, row, noise, limit, first_t))
    self.stats = self.stats._replace(peak_pages=max(
        self.stats.peak_pages, spec.pages - len(self._free)))
    return row

  def routes(self, row: Parked) -> np.ndarray:
    """record_routes: the experts of row's cached columns, (row.cached,
    L_sparse, C), as recorded when each was fed (on the pages holding its
    keys: shared pages' by the row that wrote them)."""
    Z = self.spec.sampling.page_size
    col = np.arange(row.cached)
    return self._routes_wzlc[np.asarray(row.pages, np.int32)[col // Z],
                             col % Z]

  def _record(self, pages: tuple, start: int, routes_slc: np.ndarray
              ) -> None:
    """Columns start... of a row on `pages` were fed with these experts."""
    Z = self.spec.sampling.page_size
    col = start + np.arange(len(routes_slc))
    self._routes_wzlc[np.asarray(pages, np.int32)[col // Z],
                      col % Z] = routes_slc

  def share(self, row: Parked, count: int) -> tuple:
    """The first `count` pages of an admitted `row`, held by one more row
    (e.g. a group's other rows: the same prompt): a row whose tokens begin
    with row's first count * page_size tokens is admitted with these pages
    and cached = count * page_size, so only its tail is prefilled, onto its
    own pages. They are written once, by row's prefill (at the same call's
    prefill, before any row reads them, or earlier), and never again: each
    row writes only its columns past its `cached`. A page returns to the
    pool when its last holder gives it back."""
    pages = row.pages[:count]
    self._holders_w[list(pages)] += 1
    return pages

  def release(self, row: Parked) -> Parked:
    """A parked row's pages back to the pool: the row, cached 0."""
    self._give(row.pages)
    return row._replace(cached=0, pages=())

  def _give(self, pages) -> None:
    if not (self._holders_w[list(pages)] > 0).all():
      raise ValueError(f"pages {sorted(pages)}: some are already free")
    self._holders_w[list(pages)] -= 1       # a row's pages are distinct
    self._free.extend(p for p in pages if not self._holders_w[p])

  def _take(self, count: int) -> tuple:
    pages = tuple(self._free.pop() for _ in range(count))
    self._holders_w[list(pages)] = 1
    return pages

  def step(self) -> list:
    """PREFILL the rows admitted since the last call, then one DECODE call;
    returns the turns that ended (their rows parked)."""
    if self._pending:
      self._prefill_pending()
    s = self._slots
    if s.live_m.any():
      self.pool, s, steps = _decode(self.spec, self.params, self.pool,
                                    jax.tree.map(jnp.asarray, s), self.key)
      self._slots = _Slots(*map(np.array, jax.device_get(tuple(s))))
      self.stats = self.stats._replace(
          decode_calls=self.stats.decode_calls + 1,
          decode_steps=self.stats.decode_steps + int(steps))
    return [self._park(m) for m, h in enumerate(self._held)
            if h is not None and not self._slots.live_m[m]]

  def _prefill_pending(self) -> None:
    """PREFILL: the pending rows' new tokens, A rows (a power of 4, at most
    the slots) of L columns (`sampling.bucket`): few distinct shapes, since
    how many rows come back between calls depends on the tools' timing."""
    spec, cfg = self.spec, self.spec.sampling
    rows = self._pending
    A = min(4 ** -(-(len(rows) - 1).bit_length() // 2), spec.slots)
    L = sampling.bucket(max(len(r.tokens) - r.cached for _, r, *_ in rows))
    tokens_al = np.full((A, L), cfg.pad_id, np.int32)
    start_a, count_a, noise_a, t0_a = (np.zeros(A, np.int32) for _ in range(4))
    table_aj = np.full((A, spec.table_width), spec.pages, np.int32)
    for a, (_, row, noise, _, t0) in enumerate(rows):
      new = row.tokens[row.cached:]
      tokens_al[a, :len(new)] = new
      start_a[a], count_a[a], noise_a[a], t0_a[a] = (row.cached, len(new),
                                                     noise, t0)
      table_aj[a, :len(row.pages)] = row.pages
    self.pool, first_a, logp_a, routes_allc = _prefill(
        spec, self.params, self.pool, tokens_al, start_a, count_a, table_aj,
        noise_a, t0_a, self.key)
    first_a, logp_a, routes_allc = jax.device_get(
        (first_a, logp_a, routes_allc))
    s = self._slots
    for a, (m, row, noise, limit, t0) in enumerate(rows):
      if routes_allc is not None:
        self._record(row.pages, row.cached, routes_allc[a, :count_a[a]])
      s.tokens_mt[m] = cfg.pad_id
      s.tokens_mt[m, 0], s.logp_mt[m, 0] = first_a[a], logp_a[a]
      s.noise_m[m], s.t0_m[m], s.t_m[m], s.limit_m[m] = noise, t0, 1, limit
      s.column_m[m] = len(row.tokens)
      s.live_m[m] = limit > 1 and int(first_a[a]) not in cfg.stop_ids
      s.table_mj[m] = spec.pages
      s.table_mj[m, :len(row.pages)] = row.pages
    self.stats = self.stats._replace(
        prefilled=self.stats.prefilled + int(count_a.sum()))
    self._pending = []

  def park_all(self) -> list:
    """Every row holding a slot leaves it now (a step boundary of partial
    rollouts): the turns that ended, and the live ones cut (`Turn.cut`),
    each row parked with its pages."""
    if self._pending:
      self._prefill_pending()
    return [self._park(m) for m, h in enumerate(self._held) if h is not None]

  def _park(self, m: int) -> Turn:
    """Slot m's turn; the row leaves the slot with the pages of its cached
    columns, the rest back to the pool."""
    s, row, Z = self._slots, self._held[m], self.spec.sampling.page_size
    t = int(s.t_m[m])
    ids = [int(x) for x in s.tokens_mt[m, :t]]
    tokens = row.tokens + tuple(ids)
    cached = len(tokens) - 1
    keep = _pages_for(cached, Z)
    if self._routes_wzlc is not None:      # its turn's fed tokens
      self._record(row.pages, len(row.tokens), s.routes_mtlc[m, :t - 1])
    self._give(row.pages[keep:])
    self._held[m] = None
    cut = bool(s.live_m[m])
    s.live_m[m], s.table_mj[m] = False, self.spec.pages
    return Turn(row.row, ids, [float(x) for x in s.logp_mt[m, :t]],
                ids[-1] in self.spec.sampling.stop_ids,
                Parked(row.row, tokens, cached, row.pages[:keep]), cut)
