"""Partial rollouts' stream of rows on the parked engine (docs/async.md,
"Partial rollouts"; the loop that drives it: rl/partial_rollouts.py).

Rows enter in order (step u's n = b*g rows, then step u + 1's) and take the
engine's slots as they free, so slots never drain at a step's end. A
weight `switch` takes every row off the engine (`parked.Engine.park_all`):
the cut ones go back to the head of the queue with their tokens so far and
their pages released (rule 4: the state at a boundary is the rows' tokens
only), to be prefilled again under the new weights; each later token
records the version that sampled it. A step's rows are ready once its last
row has ended (`ready`, `samples`).

Noise: row i of step u draws (key, u * n + i, t) (`decoding.token_uniforms`
through the engine's `noise` number, a cut row continuing at its t), so
its tokens do not depend on slots, calls, or where it was cut. The engine
is built afresh at each switch (and when a step's prompts need more
context), sized by the rows it will hold, so its shapes, and hence its
samples, are a function of the stream's state at the switch: what a
checkpoint keeps (`state`, `Stream.restore`).
"""
from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

from grpo_jax.generate import decoding, parked, sampling


class Row(NamedTuple):
  """A row of the stream (host only): its step, its index i in the step's
  rows (prompt i // g), its prompt ids and what it has sampled so far, each
  token's log-prob and policy version."""
  step: int
  index: int
  prompt: tuple
  ids: tuple = ()
  logp: tuple = ()
  versions: tuple = ()


class Stats(NamedTuple):
  prefilled: int = 0        # tokens prefilled since the stream started
  decode_steps: int = 0     # decode steps run since the stream started


class Stream:
  """The rows of a run's steps on one parked engine (module docstring)."""

  def __init__(self, sampler: sampling.Sampler, rows_per_step: int, key):
    self.sampler, self.cfg = sampler, sampler.sampling
    self.n, self.key = rows_per_step, key
    self.queue: collections.deque = collections.deque()   # waiting rows
    self.live: dict = {}       # (step, index) -> Row as admitted
    self.ended: dict = {}      # step -> {index: (Row, stopped)}
    self.engine: parked.Engine | None = None
    self.params, self.version = None, None
    self.stats = Stats()

  # -- state -------------------------------------------------------------

  def state(self) -> dict:
    """The rows at a switch (nothing live): JSON data, exact."""
    if self.live:
      raise ValueError("a stream's state is taken at a switch")
    row = lambda r: [r.step, r.index, list(r.prompt), list(r.ids),
                     list(map(float.hex, r.logp)), list(r.versions)]
    return {"queue": [row(r) for r in self.queue],
            "ended": [[row(r), stopped] for rows in self.ended.values()
                      for r, stopped in rows.values()]}

  def restore(self, state: dict) -> None:
    row = lambda d: Row(int(d[0]), int(d[1]), tuple(d[2]), tuple(d[3]),
                        tuple(map(float.fromhex, d[4])), tuple(d[5]))
    self.queue = collections.deque(row(d) for d in state["queue"])
    for r in self.queue:
      self.ended.setdefault(r.step, {})
    for d, stopped in state["ended"]:
      r = row(d)
      self.ended.setdefault(r.step, {})[r.index] = (r, bool(stopped))

  # -- rows in, rows out -------------------------------------------------

  def add(self, step: int, prompt_ids) -> None:
    """Step `step`'s rows, g per prompt, at the end of the queue; a context
    too small for them rebuilds the engine (a switch to the same version)."""
    g = self.n // len(prompt_ids)
    self.queue.extend(Row(step, i, tuple(prompt_ids[i // g]))
                      for i in range(self.n))
    self.ended.setdefault(step, {})
    if self.engine is not None and self._context() > self.engine.spec.context:
      self.switch(self.params, self.version)

  def switch(self, params, version: int) -> None:
    """Every row off the engine: ended turns recorded, cut rows back to the
    head of the queue in stream order, all pages released; then `params`
    (policy `version`) sample from here on."""
    carried = []
    if self.engine is not None:
      for turn in self.engine.park_all():
        row = self._extend(turn)
        self.engine.release(turn.parked)
        if turn.cut:
          carried.append(row)
        else:
          self._end(row, turn.stopped)
      self._count_engine()
    self.live.clear()
    carried.sort(key=lambda r: (r.step, r.index))
    self.queue.extendleft(reversed(carried))
    self.engine, self.params, self.version = None, params, version

  def admit(self, through_step: int) -> None:
    """Queued rows of steps <= through_step into free slots, in order."""
    while self.queue and self.queue[0].step <= through_step:
      row = self.queue[0]
      engine = self._engine()
      noise = row.step * self.n + row.index
      if not engine.admit(parked.Parked(noise, row.prompt + row.ids), noise,
                          self.cfg.max_new_tokens - len(row.ids),
                          first_t=len(row.ids)):
        return
      self.live[row.step, row.index] = self.queue.popleft()

  def decode(self) -> None:
    """One engine call (prefill of the rows admitted since, then at most
    steps_per_call decode steps, left when a row ends)."""
    for turn in self._engine().step():
      row = self._extend(turn)
      self.engine.release(turn.parked)
      self._end(row, turn.stopped)

  @property
  def slot_free(self) -> bool:
    return self.engine is None or self.engine.free_slots > 0

  def admitted_all(self, step: int) -> bool:
    return not any(r.step <= step for r in self.queue)

  def in_flight(self, below: int) -> bool:
    """Whether a row of a step < below has not ended."""
    return any(s < below and len(rows) < self.n
               for s, rows in self.ended.items())

  def ready(self, step: int) -> bool:
    return len(self.ended.get(step, ())) == self.n

  def samples(self, step: int) -> tuple[decoding.Samples, np.ndarray]:
    """A ready step's rows as the sampler returns them, and each token's
    version [n, t] (0 on padding); the step leaves the stream."""
    T, rows = self.cfg.max_new_tokens, self.ended.pop(step)
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
                            np.int32(0)), version

  # -- the engine --------------------------------------------------------

  def _extend(self, turn: parked.Turn) -> Row:
    row = self.live.pop(divmod(turn.row, self.n))
    return row._replace(ids=row.ids + tuple(turn.ids),
                        logp=row.logp + tuple(turn.logp),
                        versions=row.versions + (self.version,) * len(turn.ids))

  def _end(self, row: Row, stopped: bool) -> None:
    self.ended[row.step][row.index] = (row, stopped)

  def _context(self) -> int:
    rows = list(self.queue) + list(self.live.values())
    return (sampling.bucket(max((len(r.prompt) for r in rows), default=1))
            + self.cfg.max_new_tokens)

  def _engine(self) -> parked.Engine:
    """The engine, built at the first use after a switch for the rows the
    stream holds: slots (sampling.slots, 0: a step's rows), a whole
    context's pages per slot, so no admitted row waits for a page."""
    if self.engine is None:
      slots = min(self.cfg.slots or self.n, self.n)
      context = self._context()
      pages = slots * -(-context // self.cfg.page_size)
      self.engine = parked.Engine(parked.EngineSpec(
          self.sampler.model_config, self.cfg, slots, pages, context),
          self.params, self.key)
    return self.engine

  def counts(self) -> tuple[int, int]:
    """(tokens prefilled, decode steps run) since the stream started."""
    s = self.engine.stats if self.engine is not None else parked.Stats()
    return (self.stats.prefilled + s.prefilled,
            self.stats.decode_steps + s.decode_steps)

  def _count_engine(self) -> None:
    s = self.engine.stats
    self.stats = self.stats._replace(
        prefilled=self.stats.prefilled + s.prefilled,
        decode_steps=self.stats.decode_steps + s.decode_steps)
