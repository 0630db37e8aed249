"""Partial rollouts' stream of rows on the parked engine, one per row shard
(docs/async.md, "Partial rollouts"; the loop that drives it:
rl/partial_rollouts.py).

Rows come in generation batches of n = b*g rows, numbered by the caller
(rl/partial_rollouts.py: step u's first batch, then its refills, before
step u + 1's): the queue is kept in (batch, index) order, so a refill added
late still goes ahead of later batches' rows, and rows take the engine's
slots as they free, so slots never drain at a step's end. A weight `switch`
takes every row off the engine (`parked.Engine.park_all`): the cut ones go
back into the queue in order with their tokens so far and their pages
released (rule 4: the state at a boundary is the rows' tokens only), to be
prefilled again under the new weights; each later token records the
version that sampled it. A batch's rows are ready once its last row has
ended (`ready`, `samples`). On a sampler mesh of R row shards row i of
every batch goes to shard i // ceil(n / R) (`agent_parked.shard_rows`'
blocks: a group's rows together), each shard's engine with its own slots,
pool and copy of the weights (`agent_parked.engines`, the episodes' own).
A fresh row shares the full prompt pages of a live fresh row of its prompt
on its engine (`_admit`), so a group's prompt is prefilled about once.

Noise: row i of batch c draws (key, c * n + i, t) (`decoding.token_uniforms`
through the engine's `noise` number, a cut row continuing at its t), so
its tokens do not depend on slots, calls, or where it was cut. The engine
is built afresh at each switch (and when a batch's prompts need more
context), sized by the rows it will hold, so its shapes, and hence its
samples, are a function of the stream's state at the switch: what a
checkpoint keeps (`state`, `Stream.restore`).

Recording routes (`sampling.record_routes`, MoE routing replay;
`parked_routes`): each column's experts as first fed. A cut row takes its
fed columns' with it (`Row.routes`) and keeps them when it is prefilled
again under the new weights; a row that ended is admitted once more for a
one-token turn that feeds its last token under the weights that sampled it
(its sample dropped, before any switch), then ends with every column's
(`samples`: `Samples.routes_nslc`).
"""
from __future__ import annotations

import collections
import concurrent.futures
from typing import NamedTuple

import numpy as np

from grpo_jax import checkpoint
from grpo_jax.generate import agent_parked, decoding, parked, parked_routes, sampling


class Row(NamedTuple):
  """A row of the stream (host only): its generation batch, its index i in
  the batch's rows (prompt i // g), its prompt ids and what it has sampled
  so far, each token's log-prob and policy version; record_routes: its fed
  columns' experts (columns, L_sparse, C), every column's once it ended."""
  batch: int
  index: int
  prompt: tuple
  ids: tuple = ()
  logp: tuple = ()
  versions: tuple = ()
  routes: object = None     # np.ndarray or None


class Stats(NamedTuple):
  prefilled: int = 0        # tokens prefilled since the stream started
  decode_steps: int = 0     # decode steps run since the stream started


class Stream:
  """The rows of a run's generation batches on a parked engine per row
  shard (module docstring)."""

  def __init__(self, sampler: sampling.Sampler, rows_per_batch: int, key):
    self.sampler, self.cfg = sampler, sampler.sampling
    self.n, self.key = rows_per_batch, key
    self.queue: collections.deque = collections.deque()   # waiting rows
    self.live: dict = {}       # (batch, index) -> Row as admitted
    self.feeding: dict = {}    # (batch, index) -> (Row, stopped) ended
    self._unfed: list = []     # (shard, Parked) ended, last token unfed
    self.ended: dict = {}      # batch -> {index: (Row, stopped)}
    self.engines: list | None = None    # parked.Engine per row shard
    self._lenders: list = []            # per engine: prompt -> live Parked
    self.per_shard = -(-rows_per_batch // sampler.shards)   # rows i // it
    self.params, self.version = None, None
    self.stats = Stats()

  # -- state -------------------------------------------------------------

  def state(self) -> dict:
    """The rows at a switch (nothing live): JSON data, exact."""
    if self.live or self.feeding:
      raise ValueError("a stream's state is taken at a switch")
    row = lambda r: [r.batch, r.index, list(r.prompt), list(r.ids),
                     list(map(float.hex, r.logp)), list(r.versions),
                     *([] if r.routes is None else [checkpoint.array_text(r.routes)])]
    return {"queue": [row(r) for r in self.queue],
            "ended": [[row(r), stopped] for rows in self.ended.values()
                      for r, stopped in rows.values()]}

  def restore(self, state: dict) -> None:
    row = lambda d: Row(int(d[0]), int(d[1]), tuple(d[2]), tuple(d[3]),
                        tuple(map(float.fromhex, d[4])), tuple(d[5]),
                        checkpoint.text_array(d[6]) if len(d) > 6 else None)
    self.queue = collections.deque(row(d) for d in state["queue"])
    for r in self.queue:
      self.ended.setdefault(r.batch, {})
    for d, stopped in state["ended"]:
      r = row(d)
      self.ended.setdefault(r.batch, {})[r.index] = (r, bool(stopped))

  # -- rows in, rows out -------------------------------------------------

  def add(self, batch: int, prompt_ids) -> None:
    """Generation batch `batch`'s rows, g per prompt, into the queue in
    order; a context too small for them rebuilds the engine (a switch to the
    same version)."""
    g = self.n // len(prompt_ids)
    self._enqueue([Row(batch, i, tuple(prompt_ids[i // g]))
                   for i in range(self.n)])
    self.ended.setdefault(batch, {})
    if self.engines and self._context() > self.engines[0].spec.context:
      self.switch(self.params, self.version)

  def switch(self, params, version: int) -> None:
    """Every row off the engine: ended turns recorded (record_routes:
    their last tokens fed first, under the weights that sampled them), cut
    rows back into the queue in order with their fed columns' routes, all
    pages released; then `params` (policy `version`) sample from here on."""
    carried = []
    while self.engines and (self.feeding or self._unfed
                            or any(e.busy for e in self.engines)):
      for shard, engine in enumerate(self.engines):
        for turn in engine.park_all():
          if self._fed(engine, turn):
            continue
          row = self._extend(turn)
          if turn.cut:
            routes = engine.release(turn.parked).routes
            carried.append(row._replace(routes=routes))
          else:
            self._ended(shard, engine, row, turn)
      if self._feed() and not any(e.busy for e in self.engines):
        raise RuntimeError("an ended row cannot get its pages to feed its "
                           "last token in an idle engine")
    self.stats = Stats(*self.counts())
    self.live.clear()
    self._enqueue(carried)
    self.engines, self.params, self.version = None, params, version

  def _enqueue(self, rows: list) -> None:
    """`rows` into the queue, kept in (batch, index) order: without refills
    the carried rows and a new batch's go to its head and end."""
    self.queue = collections.deque(sorted(
        [*self.queue, *rows], key=lambda r: (r.batch, r.index)))

  def admit(self, through: int) -> None:
    """Queued rows of batches <= through into free slots of their row
    shard's engine (row i: shard i // per_shard), in order within a shard:
    a row that finds its shard full holds back that shard's later rows;
    ended rows waiting to feed their last token go first."""
    self._feed()
    full, waiting = set(), []
    while (self.queue and self.queue[0].batch <= through
           and len(full) < len(self._engines())):
      row = self.queue.popleft()
      shard = row.index // self.per_shard
      if shard in full or not self._admit(shard, row):
        full.add(shard)
        waiting.append(row)
      else:
        self.live[row.batch, row.index] = row
    self.queue.extendleft(reversed(waiting))

  def _admit(self, shard: int, row: Row) -> bool:
    """`row` into a slot of its shard's engine; a fresh row (nothing
    sampled) whose prompt a live fresh row there holds takes that row's
    full prompt pages (`Engine.share`: a group's prompt), so only its
    prompt's tail is prefilled."""
    engine, noise = self.engines[shard], row.batch * self.n + row.index
    parked_row = parked.Parked(noise, row.prompt + row.ids,
                               routes=row.routes)
    lender = self._lenders[shard].get(row.prompt) if not row.ids else None
    count = (len(row.prompt) - 1) // self.cfg.page_size
    if lender is not None and count and engine.free_slots:
      parked_row = parked_row._replace(cached=count * self.cfg.page_size,
                                       pages=engine.share(lender, count))
    held = engine.admit(parked_row, noise,
                        self.cfg.max_new_tokens - len(row.ids),
                        first_t=len(row.ids))
    if held is None:
      engine.release(parked_row)     # the shared pages given back
    elif not row.ids and lender is None:
      self._lenders[shard][row.prompt] = held
    return held is not None

  def decode(self) -> None:
    """One call of each row shard's engine (prefill of the rows admitted
    since, then at most steps_per_call decode steps, left when a row ends;
    the shards' calls in threads: a device call releases the GIL), their
    ended rows taken in shard order."""
    engines = self._engines()
    if len(engines) == 1:
      turns = [engines[0].step()]
    else:
      with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        turns = list(pool.map(lambda e: e.step(), engines))
    for shard, (engine, lenders, ended) in enumerate(
        zip(engines, self._lenders, turns)):
      for turn in ended:
        if self._fed(engine, turn):
          continue
        row = self._extend(turn)
        if row.prompt in lenders and lenders[row.prompt].row == turn.row:
          del lenders[row.prompt]      # its pages go back with it
        self._ended(shard, engine, row, turn)
    self._feed()

  @property
  def slot_free(self) -> bool:
    return self.engines is None or any(e.free_slots for e in self.engines)

  def admitted_all(self, batch: int) -> bool:
    return not any(r.batch <= batch for r in self.queue)

  def in_flight(self, below: int) -> bool:
    """Whether a batch < below is in the stream (a row not ended, or a
    ready batch not yet taken by `samples`)."""
    return any(c < below for c in self.ended)

  def ready(self, batch: int) -> bool:
    return len(self.ended.get(batch, ())) == self.n

  def samples(self, batch: int) -> tuple[decoding.Samples, np.ndarray]:
    """A ready batch's rows as the sampler returns them, and each token's
    version [n, t] (0 on padding); the batch leaves the stream.
    record_routes: each row's columns' experts in `Samples.routes_nslc`
    (n, P + T, L_sparse, C), prompts left-padded to the batch's longest."""
    T, rows = self.cfg.max_new_tokens, self.ended.pop(batch)
    tokens = np.full((self.n, T), self.cfg.pad_id, np.int32)
    logp, version = np.zeros((self.n, T), np.float32), np.zeros((self.n, T),
                                                                np.int32)
    length, stopped = np.zeros(self.n, np.int32), np.zeros(self.n, bool)
    for i in range(self.n):
      r, stopped[i] = rows[i]
      length[i] = len(r.ids)
      tokens[i, :length[i]], logp[i, :length[i]] = r.ids, r.logp
      version[i, :length[i]] = r.versions
    mask = np.arange(T)[None] < length[:, None]
    return decoding.Samples(tokens, logp, mask, length, ~stopped,
                            np.int32(0), self._routes(rows)), version

  def _routes(self, rows: dict) -> np.ndarray | None:
    """The ended rows' routes (n, P + T, L_sparse, C), each prompt's
    right-aligned to P, the longest; 0 on padding. None when not
    recorded."""
    if not self.cfg.record_routes:
      return None
    (T, *lc), dtype = parked_routes.slot_shape(self.sampler.model_config,
                                               self.cfg)
    P = max(len(r.prompt) for r, _ in rows.values())
    out = np.zeros((self.n, P + T, *lc), dtype)
    for i in range(self.n):
      r = rows[i][0]
      out[i, P - len(r.prompt):P + len(r.ids)] = r.routes
    return out

  # -- the engine --------------------------------------------------------

  def _extend(self, turn: parked.Turn) -> Row:
    row = self.live.pop(divmod(turn.row, self.n))
    return row._replace(ids=row.ids + tuple(turn.ids),
                        logp=row.logp + tuple(turn.logp),
                        versions=row.versions + (self.version,) * len(turn.ids))

  def _end(self, row: Row, stopped: bool) -> None:
    self.ended[row.batch][row.index] = (row, stopped)

  def _ended(self, shard: int, engine: parked.Engine, row: Row,
             turn: parked.Turn) -> None:
    """`row`'s last turn ended: it ends (its pages released), or with
    record_routes waits to feed its last token (`_feed`)."""
    if not self.cfg.record_routes:
      engine.release(turn.parked)
      self._end(row, turn.stopped)
      return
    self.feeding[row.batch, row.index] = (row, turn.stopped)
    self._unfed.append((shard, turn.parked))

  def _feed(self) -> bool:
    """The ended rows waiting to feed their last token admitted for a
    one-token turn where their engine has room; whether some still wait."""
    waiting = []
    for shard, row in self._unfed:
      if self.engines[shard].admit(row, row.row, 1) is None:
        waiting.append((shard, row))
    self._unfed = waiting
    return bool(waiting)

  def _fed(self, engine: parked.Engine, turn: parked.Turn) -> bool:
    """Whether `turn` fed an ended row's last token: then the row ends with
    every column's routes (its sample dropped), its pages released."""
    key = divmod(turn.row, self.n)
    if key not in self.feeding:
      return False
    row, stopped = self.feeding.pop(key)
    self._end(row._replace(routes=engine.routes(turn.parked)), stopped)
    engine.release(turn.parked)
    return True

  def _context(self) -> int:
    rows = list(self.queue) + list(self.live.values())
    return (sampling.bucket(max((len(r.prompt) for r in rows), default=1))
            + self.cfg.max_new_tokens)

  def _engines(self) -> list:
    """An engine per row shard (`agent_parked.engines`), built at the first
    use after a switch for the rows the stream holds, each for per_shard
    rows: `agent_parked.pool_spec`'s slots and pages (sampling.pages, 0: a
    whole context per slot, since a row gives its pages back when it leaves
    its slot, so no admitted row waits for a page)."""
    if self.engines is None:
      spec = agent_parked.pool_spec(
          self.sampler.model_config, self.cfg, self.sampler.shards,
          self.per_shard, self._context(), parked_hold_pages=False)
      used = -(-self.n // self.per_shard)     # shards that get rows
      self.engines = agent_parked.engines(self.sampler, self.params, self.key,
                                          spec)[:used]
      self._lenders = [{} for _ in self.engines]  # prompt -> a live Parked
    return self.engines

  def counts(self) -> tuple[int, int]:
    """(tokens prefilled, decode steps run) since the stream started, summed
    over the row shards."""
    engines = self.engines or ()
    return (self.stats.prefilled + sum(e.stats.prefilled for e in engines),
            self.stats.decode_steps + sum(e.stats.decode_steps
                                          for e in engines))
