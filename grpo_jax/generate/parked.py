"""Rows that leave the device loop with their pages and come back: the paged
engine of multi-turn episodes (docs/agents.md, "Rows that wait"), and the
mechanism partial rollouts reuse (docs/async.md rule 4).

`paged_slots.sample_pages` runs every row of a call to its end inside one
`while_loop`. Here the loop is cut into calls and a row's life into turns:

  admit     `Engine.admit(Parked(row, tokens, cached, pages), ...)`: a
            slot, and pages for the row's columns up to the end of this
            turn's budget. The tokens past `cached` (those whose keys and
            values are not yet on the row's pages) are prefilled onto its
            pages for the rows admitted since the last call, a call per
            length bucket (`parked_programs`); the history before
            `cached` is never prefilled again. cached 0 with no pages is a
            row recomputed from its first token: a row whose pages were
            released (`release`), e.g. after a weight switch (partial
            rollouts).
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
  routes    each column's experts when fed (`parked_routes`).

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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sharding
from grpo_jax.generate import page_pool, parked_programs, parked_routes, sampling
from grpo_jax.generate.parked_programs import EngineSpec

_Slots = parked_programs.Slots


class Parked(NamedTuple):
  """A row off the device: every token so far (the columns it attends
  over once admitted), how many leading ones have their keys and values on
  `pages` (its pages in table order), and the caller's id; record_routes:
  a released row's leading columns' experts as first fed (`release`)."""
  row: int
  tokens: tuple
  cached: int = 0
  pages: tuple = ()
  routes: object = None     # np.ndarray (columns, L_sparse, C) or None


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


class Stats(NamedTuple):
  prefilled: int = 0        # tokens prefilled onto pages
  decode_calls: int = 0     # device calls of the decode loop
  decode_steps: int = 0     # decode steps run
  peak_pages: int = 0       # most pages allocated at once


def _pages_for(columns: int, Z: int) -> int:
  return -(-columns // Z)


class Engine:
  """The paged engine of rows that wait (module docstring): `admit` rows,
  `step` until turns end, `release` a row's pages when it is done."""

  def __init__(self, spec: EngineSpec, params, key: jax.Array,
               layout: sharding.Layout | None = None):
    """layout: the devices and rules the pool is made with (one row shard's,
    with params on its devices: `agent_parked`); None: the default device."""
    c, cfg = spec.model_config, spec.sampling
    self.spec, self.params, self.key = spec, params, key
    self.pool = parked_programs.pool_maker(
        spec, page_pool.pool_dtype(params), layout)()
    M, J, T = spec.slots, spec.table_width, cfg.max_new_tokens
    self._free = list(range(spec.pages - 1, -1, -1))   # free page ids
    self._holders_w = np.zeros(spec.pages, np.int32)   # rows holding a page
    zeros_m = lambda: np.zeros(M, np.int32)
    shape_tlc, dtype = parked_routes.slot_shape(c, cfg)
    self._slots = _Slots(
        zeros_m(), zeros_m(), np.ones(M, np.int32), zeros_m(),
        np.ones(M, np.int32), np.zeros(M, bool),
        np.full((M, J), spec.pages, np.int32),
        np.full((M, T), cfg.pad_id, np.int32), np.zeros((M, T), np.float32),
        np.zeros((M, *shape_tlc), dtype))
    self._routes = (parked_routes.PageRoutes(c, cfg, spec.pages)
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
    """record_routes: row's cached columns' experts (`parked_routes`)."""
    return self._routes.of(row.pages, row.cached)

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
    """A parked row's pages back to the pool: the row, cached 0, with its
    cached columns' routes (record_routes): a recompute keeps them."""
    if self._routes is not None and row.cached:
      row = row._replace(routes=self.routes(row))
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
      self.pool, s, steps = parked_programs.decode_steps(self.spec, self.params, self.pool,
                                    jax.tree.map(jnp.asarray, s), self.key)
      self._slots = _Slots(*map(np.array, jax.device_get(tuple(s))))
      self.stats = self.stats._replace(
          decode_calls=self.stats.decode_calls + 1,
          decode_steps=self.stats.decode_steps + int(steps))
    return [self._park(m) for m, h in enumerate(self._held)
            if h is not None and not self._slots.live_m[m]]

  def _prefill_pending(self) -> None:
    """PREFILL: the pending rows' new tokens, a call per length bucket
    (`sampling.bucket`), longest first: a row sharing a prompt's pages
    prefills its tail at its own length, after the row writing them."""
    by_length: dict = {}
    for p in self._pending:     # (slot, row, ...)
      by_length.setdefault(sampling.bucket(len(p[1].tokens) - p[1].cached),
                           []).append(p)
    for L in sorted(by_length, reverse=True):
      self._prefill_rows(by_length[L], L)
    self._pending = []

  def _prefill_rows(self, rows: list, L: int) -> None:
    """A prefill call of A pending `rows` (a power of 4, at most the slots)
    of L columns: few shapes, though how many come back varies."""
    spec, cfg = self.spec, self.spec.sampling
    A = min(4 ** -(-(len(rows) - 1).bit_length() // 2), spec.slots)
    tokens_al = np.full((A, L), cfg.pad_id, np.int32)
    start_a, count_a, noise_a, t0_a = (np.zeros(A, np.int32) for _ in range(4))
    table_aj = np.full((A, spec.table_width), spec.pages, np.int32)
    for a, (_, row, noise, _, t0) in enumerate(rows):
      new = row.tokens[row.cached:]
      tokens_al[a, :len(new)] = new
      start_a[a], count_a[a], noise_a[a], t0_a[a] = (row.cached, len(new),
                                                     noise, t0)
      table_aj[a, :len(row.pages)] = row.pages
    self.pool, first_a, logp_a, routes_allc = parked_programs.prefill(
        spec, self.params, self.pool, tokens_al, start_a, count_a, table_aj,
        noise_a, t0_a, self.key)
    first_a, logp_a, routes_allc = jax.device_get(
        (first_a, logp_a, routes_allc))
    s = self._slots
    for a, (m, row, noise, limit, t0) in enumerate(rows):
      if routes_allc is not None:
        self._routes.record(row.pages, row.cached, routes_allc[a, :count_a[a]])
        if row.routes is not None:     # recomputed: as first fed
          self._routes.record(row.pages, 0, row.routes)
      s.tokens_mt[m] = cfg.pad_id
      s.tokens_mt[m, 0], s.logp_mt[m, 0] = first_a[a], logp_a[a]
      s.noise_m[m], s.t0_m[m], s.t_m[m], s.limit_m[m] = noise, t0, 1, limit
      s.column_m[m] = len(row.tokens)
      s.live_m[m] = limit > 1 and int(first_a[a]) not in cfg.stop_ids
      s.table_mj[m] = spec.pages
      s.table_mj[m, :len(row.pages)] = row.pages
    self.stats = self.stats._replace(
        prefilled=self.stats.prefilled + int(count_a.sum()))

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
    if self._routes is not None:      # its turn's fed tokens
      self._routes.record(row.pages, len(row.tokens), s.routes_mtlc[m, :t - 1])
    self._give(row.pages[keep:])
    self._held[m] = None
    cut = bool(s.live_m[m])
    s.live_m[m], s.table_mj[m] = False, self.spec.pages
    return Turn(row.row, ids, [float(x) for x in s.logp_mt[m, :t]],
                ids[-1] in self.spec.sampling.stop_ids,
                Parked(row.row, tokens, cached, row.pages[:keep]), cut)
