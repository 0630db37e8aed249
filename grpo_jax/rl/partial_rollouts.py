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
      a generation batch whose rows have all ended is scored; with
        dynamic sampling a step short of kept groups draws a refill (its
        rows queued ahead of later steps'), else it is handed over

Generation batch j of step u is the stream's batch u * max_batches + j
(rl.max_gen_batches with rl.dynamic_sampling, else 1 batch a step): its
rows' noise numbers never collide, and a refill's rows go ahead of later
steps' in the queue. A refill's prompts are drawn from the data when the
batch before it is scored, a point fixed by the stream's own progress, so
which prompts it reads is a function of the config (not of timing) and a
checkpoint's data position resumes it exactly; the step's groups and its
dynamic/* metrics are `rollout.collect`'s over its scored batches, as in
the non-partial path.

A row's first token comes from w(u) (its step's version) and later tokens
from newer ones, so its age is within the bound k by construction: a row
is never dropped or restarted for staleness, it finishes (the DRAIN), since
dropping the rows that run longest would bias each batch toward short
answers. Everything is a function of the config and the stream's state at
a switch, never of timing, so checkpoints are exact: checkpoint s holds the
stream at the switch into version s (carried rows' tokens, log-probs,
versions and, with routing replay, fed columns' routes; the rows of
unfinished steps that ended) and the batches finished
before it that the trainer has not taken; resume switches into s with the
same rows, as the uninterrupted run did.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

from grpo_jax import checkpoint
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
  dynamic: rollout.DynamicSampling = rollout.DynamicSampling()

  def stream(self) -> partial.Stream:
    """A new stream (an engine per row shard, on one host:
    preflight.check_engine)."""
    return partial.Stream(self.sampler,
                          self.prompts * self.groups.num_generations, self.key)

  def batch(self, u: int, j: int) -> int:
    """The stream's number of step u's generation batch j (module
    docstring)."""
    return u * self.dynamic.batches + j


def _step_info(version: int, key_data, carried: list) -> dict:
  """What handing a step over needs (JSON data): the version its rows
  start with, its key, the rows cut at the switch before it (`carried`,
  waiting to continue) and their tokens; `prompts` (texts, ids, answers)
  of its generation batch in flight and `scored`, those scored so far
  (`async_rollouts.encode`d)."""
  return {"version": version,
          "key_data": checkpoint.array_text(key_data),
          "carried": [len(carried),
                      sum(len(r.prompt) + len(r.ids) for r in carried)],
          "prompts": None, "scored": []}


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
        info[u] = _step_info(stream.version,
                             async_rollouts.key_value(step_key),
                             [r for r in stream.queue if r.ids])
        self._add(stream, info[u], u, 0)
        last = self._partial.batch(u + 1, 0) - 1
        while not (stream.admitted_all(last) and stream.slot_free):
          stream.admit(last)
          stream.decode()
          self._finish(stream, info)
      self._drain(stream, info, self.steps)
      self._snapshot(stream, info, self.steps, None)
    except BaseException as e:  # pylint: disable=broad-except
      with self._cond:
        self._error = (u, e)
        self._cond.notify_all()

  def _drain(self, stream: partial.Stream, info: dict, below: int) -> None:
    """DRAIN: decode, admitting only refills of steps < below, until every
    step < below is handed over."""
    first = self._partial.batch(below, 0)
    while stream.in_flight(first) and not self._stop:
      stream.admit(first - 1)
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

  def _add(self, stream: partial.Stream, d: dict, u: int, j: int) -> None:
    """Step u's generation batch j: the next prompts from the data, their
    rows into the stream."""
    s = self._partial
    examples = next(self.data)
    texts = templates.render_prompts(
        s.tokenizer, s.groups.template, [e.question for e in examples],
        s.groups.system_prompt)
    prompt_ids = s.tokenizer.encode_batch(texts)
    d["prompts"] = {"texts": list(texts),
                    "ids": [list(p) for p in prompt_ids],
                    "answers": [e.answer for e in examples]}
    d["data_after"] = self.data.state_dict()
    stream.add(s.batch(u, j), prompt_ids)

  def _finish(self, stream: partial.Stream, info: dict) -> None:
    """Scores each generation batch whose rows have all ended; its step
    draws a refill (`rollout.DynamicSampling.wants_more`) or is handed
    over."""
    s = self._partial
    for c in sorted(c for c in stream.ended if stream.ready(c)):
      u, j = divmod(c, s.dynamic.batches)
      d = info[u]
      d["scored"].append(self._score(stream, d, u, c))
      seen = [async_rollouts.decode(x).groups for x in d["scored"]]
      if s.dynamic.wants_more(seen, s.prompts):
        self._add(stream, d, u, j + 1)
        continue
      batch = self._hand_over(stream, info.pop(u), u)
      with self._cond:
        self._finished[u] = batch
        self._cond.notify_all()

  def _score(self, stream: partial.Stream, d: dict, u: int, c: int) -> dict:
    """SCORE generation batch c (of step u) as a Batch (encoded)."""
    s, p = self._partial, d["prompts"]
    out, version_nt = stream.samples(c)
    t0 = time.perf_counter()
    groups, metrics = rollout.score_samples(
        s.groups.rewards, p["texts"], p["ids"], p["answers"], out,
        s.tokenizer, s.groups.num_generations)
    groups = groups._replace(version_bgt=version_nt.reshape(
        groups.tokens_bgt.shape))
    metrics.update({"time/score": time.perf_counter() - t0,
                    "sample/tokens": int(out.length_n.sum())})
    return async_rollouts.encode(async_rollouts.Batch(
        u, d["version"], groups, metrics, d["data_after"],
        checkpoint.text_array(d["key_data"])))

  def _hand_over(self, stream: partial.Stream, d: dict, u: int
                 ) -> async_rollouts.Batch:
    """Step u's batch from its scored generation batches: the kept groups
    and metrics of `rollout.collect` (dynamic sampling as without partial
    rollouts), and the stream's counts since the last step handed over."""
    s = self._partial
    t0, (prefilled0, steps0) = self._mark
    seen = [async_rollouts.decode(x) for x in d["scored"]]
    groups, metrics = rollout.collect(
        lambda i: (seen[i].groups, seen[i].metrics), s.prompts, s.dynamic)
    prefilled, steps = stream.counts()
    self._mark = (time.perf_counter(), (prefilled, steps))
    metrics.update({
        "time/sample": self._mark[0] - t0 - metrics["time/score"],
        "sample/decode_steps": steps - steps0,
        "partial/prefilled": prefilled - prefilled0,
        "partial/rows_carried": d["carried"][0],
        "partial/carried_tokens": d["carried"][1]})
    return async_rollouts.Batch(
        u, d["version"], groups, metrics, d["data_after"],
        checkpoint.text_array(d["key_data"]))

  def _snapshot(self, stream: partial.Stream, info: dict, u: int,
                version: int | None) -> None:
    """The stream at a switch (or the run's end: version None), with the
    finished batches the trainer has not taken, for checkpoints."""
    stream.switch(stream.params, stream.version)   # every row off the engine
    self._finish(stream, info)      # a batch its last turns ended
    counts = stream.counts()
    snap = {"step": u, "version": version, "stream": stream.state(),
            "steps": {str(k): copy.deepcopy(d) for k, d in info.items()},
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
