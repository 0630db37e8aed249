"""Partial rollouts (rollout.partial, docs/async.md "Partial rollouts"): the
sampler thread of async_rollouts.py on a stream of rows (generate/partial.py)
whose slots never drain at a step's end.

    for step u:                       (version w(u), async_rollouts' schedule)
      if w(u) is not the stream's version:
        DRAIN   decode, admitting nothing, until every row of the steps
                before w(u) has ended (version w(u) is trained on them)
        SWITCH  (snapshot for checkpoints) wait for w(u), take every row
                off the engine: cut rows keep their tokens, their pages are
                released, and they continue under w(u)
      ADMIT + DECODE  step u's rows (after the carried ones) until all are
                admitted and a slot is free: the next step's rows start
      a step whose rows have all ended is scored and handed over

A row's first token comes from w(u) (its step's version) and later tokens
from newer ones, so its age is within the bound k by construction: a row
is never dropped or restarted for staleness, it finishes (the DRAIN), since
dropping the rows that run longest would bias each batch toward short
answers. Everything is a function of the config and the stream's state at
a switch, never of timing, so checkpoints are exact: checkpoint s holds the
stream at the switch into version s (carried rows' tokens, log-probs and
versions; the rows of unfinished steps that ended) and the batches finished
before it that the trainer has not taken; resume switches into s with the
same rows, as the uninterrupted run did.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from grpo_jax.data import templates
from grpo_jax.generate import partial, rollout, sampling
from grpo_jax.rl import async_rollouts


@dataclasses.dataclass(frozen=True)
class PartialSampling:
  """What the stream samples with: the run's sampler, tokenizer and group
  settings, b prompts a step, and the key every row's noise comes from."""
  sampler: sampling.Sampler
  tokenizer: Any
  groups: rollout.GroupSettings
  prompts: int
  key: Any

  def stream(self) -> partial.Stream:
    """A new stream (on one row shard: preflight.check_engine)."""
    return partial.Stream(self.sampler,
                          self.prompts * self.groups.num_generations, self.key)


def _step_info(version: int, texts, prompt_ids, answers, key_data,
               data_after, carried: list) -> dict:
  """What scoring a step needs once its rows end (JSON data): the version
  its rows start with, its prompts, answers and key, the data position
  after its prompts, and the rows cut at the switch before it (`carried`,
  waiting to continue) and their tokens."""
  return {"version": version, "texts": list(texts),
          "prompt_ids": [list(p) for p in prompt_ids],
          "answers": list(answers),
          "key_data": async_rollouts.array_text(key_data),
          "data_after": data_after,
          "carried": [len(carried),
                      sum(len(r.prompt) + len(r.ids) for r in carried)]}


class PartialThreaded(async_rollouts.Threaded):
  """The sampler thread on a stream of rows (module docstring)."""

  def __init__(self, source: async_rollouts.Source, sample: PartialSampling,
               sync, store, start: int, key_data, restored: dict | None):
    self._partial, self._resume = sample, restored
    self._snapshots: list = []       # (version or None at the end, dict)
    self._data_before: dict = {}     # step -> data position before it
    super().__init__(source, None, sync, store, start, key_data)

  # -- the sampler thread --------------------------------------------------

  def _run(self, first: int, key_data) -> None:
    stream, info = self._partial.stream(), {}
    if self._resume is not None:
      stream.restore(self._resume["stream"])
      info = {int(u): d for u, d in self._resume["steps"].items()}
      first = int(self._resume["step"])
    since = (self._resume or {}).get("since", (0, 0))
    u, self._mark = first, (time.perf_counter(), (-since[0], -since[1]))
    try:
      for u, step_key in async_rollouts.step_keys(key_data, self._start,
                                                  self.steps):
        if u < first:
          continue
        want = self.version(u)
        if want != stream.version:
          self._drain(stream, info, want)
          self._snapshot(stream, info, u, want)
          if not self._switch(stream, want):
            return
        with self._cond:
          self._data_before[u] = self.data.state_dict()
        self._add(stream, info, u, step_key)
        while not (stream.admitted_all(u) and stream.slot_free):
          stream.admit(u)
          stream.decode()
          self._finish(stream, info)
      self._drain(stream, info, self.steps)
      self._snapshot(stream, info, self.steps, None)
    except BaseException as e:  # pylint: disable=broad-except
      with self._cond:
        self._error = (u, e)
        self._cond.notify_all()

  def _drain(self, stream: partial.Stream, info: dict, below: int) -> None:
    """DRAIN: decode without admitting until no row of a step < below is
    in flight."""
    while stream.in_flight(below) and not self._stop:
      stream.decode()
      self._finish(stream, info)

  def _switch(self, stream: partial.Stream, version: int) -> bool:
    """SWITCH to `version` once published (False: the run is stopping)."""
    with self._cond:
      self._waiting_since = time.perf_counter()
    params = self._store.get(version)
    with self._cond:
      self._idle_s += time.perf_counter() - self._waiting_since
      self._waiting_since = None
    if params is None or self._stop:
      return False
    self._store.drop_below(version)
    stream.switch(self._sync.policy(params), version)
    return True

  def _add(self, stream: partial.Stream, info: dict, u: int, step_key):
    s = self._partial
    examples = next(self.data)
    texts = templates.render_prompts(
        s.tokenizer, s.groups.template, [e.question for e in examples],
        s.groups.system_prompt)
    prompt_ids = s.tokenizer.encode_batch(texts)
    info[u] = _step_info(stream.version, texts, prompt_ids, [e.answer for e in examples],
                         async_rollouts.key_value(step_key),
                         self.data.state_dict(),
                         [r for r in stream.queue if r.ids])
    stream.add(u, prompt_ids)

  def _finish(self, stream: partial.Stream, info: dict) -> None:
    """Scores each step whose rows have all ended and hands it over."""
    for u in sorted(s for s in stream.ended if stream.ready(s)):
      batch = self._score(stream, info.pop(u), u)
      with self._cond:
        self._finished[u] = batch
        self._cond.notify_all()

  def _score(self, stream: partial.Stream, d: dict, u: int
             ) -> async_rollouts.Batch:
    s, G = self._partial, self._partial.groups.num_generations
    t0, (prefilled0, steps0) = self._mark
    out, version_nt = stream.samples(u)
    t1 = time.perf_counter()
    groups, metrics = rollout.score_samples(
        s.groups.rewards, d["texts"], d["prompt_ids"], d["answers"], out,
        s.tokenizer, G)
    groups = groups._replace(version_bgt=version_nt.reshape(
        groups.tokens_bgt.shape))
    groups, metrics = rollout.collect(lambda i: (groups, metrics), len(
        d["prompt_ids"]))
    prefilled, steps = stream.counts()
    self._mark = (time.perf_counter(), (prefilled, steps))
    metrics.update({
        "time/sample": t1 - t0, "time/score": self._mark[0] - t1,
        "sample/tokens": int(out.length_n.sum()),
        "sample/decode_steps": steps - steps0,
        "partial/prefilled": prefilled - prefilled0,
        "partial/rows_carried": d["carried"][0],
        "partial/carried_tokens": d["carried"][1]})
    return async_rollouts.Batch(
        u, d["version"], groups, metrics, d["data_after"],
        async_rollouts.text_array(d["key_data"]))

  def _snapshot(self, stream: partial.Stream, info: dict, u: int,
                version: int | None) -> None:
    """The stream at a switch (or the run's end: version None), with the
    finished batches the trainer has not taken, for checkpoints."""
    stream.switch(stream.params, stream.version)   # every row off the engine
    counts = stream.counts()
    snap = {"step": u, "version": version, "stream": stream.state(),
            "steps": {str(k): d for k, d in info.items()},
            "data": self.data.state_dict(),
            "since": [counts[0] - self._mark[1][0],
                      counts[1] - self._mark[1][1]]}
    with self._cond:
      snap["batches"] = list(self._finished.values())
      self._snapshots.append((version, snap))
      self._cond.notify_all()

  # -- the trainer's side ----------------------------------------------------

  def _snapshot_for(self, version: int):
    return next((snap for v, snap in self._snapshots
                 if v is None or v >= version), None)

  def host_state(self, version: int, wait: bool = True) -> dict:
    """What a checkpoint of `version` needs: the stream at the switch into
    it (or the run's end) and the finished batches from step `version` on.
    wait=False (after a failure) without that switch: the data position
    before step `version`, so a resume samples it afresh."""
    with self._cond:
      if wait:
        self._wait(lambda: self._snapshot_for(version) is not None,
                   f"the checkpoint of step {version}")
      snap = self._snapshot_for(version)
      self._snapshots = [(v, s) for v, s in self._snapshots
                         if v is None or v >= version]
      if snap is None:
        return {"data": self._data_before.get(version,
                                              self.data.state_dict())}
    kept = sorted((b for b in snap["batches"] if b.step >= version),
                  key=lambda b: b.step)
    return {"data": snap["data"],
            "rollouts": [async_rollouts.encode(b) for b in kept],
            "partial": {k: snap[k] for k in ("step", "version", "stream",
                                             "steps", "since")}}
