"""Sampler and trainer apart: rollouts up to k policy versions stale.

config.rollout (docs/async.md):

  sampler_devices  the last sampler_devices / P devices of each of the P
                   hosts sample, the rest train (0: the sampler shares the
                   trainer's devices and layout)
  sampler_mesh     the sampler's grid over its devices (its own Layout;
                   (): the trainer's mesh.shape)
  max_staleness    k: rows may come from a policy up to k versions old
  sync_every       n: weights reach the sampler after every n-th step
  timeout_s        how long the trainer waits for a batch before it calls
                   the sampler hung

The schedule is fixed, not raced, so a run is a function of its config and
resume is exact: step u's rows are sampled with policy version

    w(u) = n * floor(max(0, u - (k - n + 1)) / n)       (version v: after v
                                                         update steps)

so u - w(u) is in [k - n + 1, k]; at k = 0 every step's rows come from the
policy that the step updates, as in the synchronous loop. A sampler thread
samples and scores step u + 1 .. u + k while the trainer updates on step u
(admission control: it starts step u only once version w(u) is published,
and never drops a finished batch). It owns the data iterator (dynamic
sampling's refills read from it) and derives every step's key from the
chain of `state.key` splits, which no update changes.

    trainer: take(u) -> UPDATE -> publish(u + 1) -> checkpoint
    sampler: wait for w(u) -> SAMPLE + SCORE (rollout.collect) -> finished

Weight sync (weight_sync.py): the parameters cast to the sampler's dtype
on the trainer's devices, copied onto the sampler's shardings (with
LoRA the adapters only, merged into or attached to the sampler's own copy of
the frozen base), waited for, and only then entered in the `WeightStore`
under their version: the sampler never reads a half-copied tree. The
sampler thread alone runs programs on the sampler's devices (with LoRA it
merges the adapters there itself), so on several hosts each device set
sees its programs in one order.

Checkpoints hold the finished batches that the saved version cannot
regenerate (those with w(u) below it: their policy is gone) and the data
position after them; every later batch is regenerated exactly from the
saved parameters. `Inline` is the synchronous colocated loop (k = 0, no
thread, no copy) behind the same three calls.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from grpo_jax.algorithms import staleness
from grpo_jax.checkpoint import array_text, text_array
from grpo_jax.errors import UserError
from grpo_jax.generate import rollout
from grpo_jax.rl.weight_sync import WeightStore, WeightSync

Params = Any


class SamplerError(RuntimeError):
  """The sampler raised, hung, or its weights could not be synced: the run
  stops (after saving what the last completed update gives)."""


class SamplerStopped(SamplerError, UserError):
  """A SamplerError that is one line, no traceback: the sampler hung, or
  raised a user error (a ConfigError such as too few sampling.pages)."""


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """config.rollout, checked (validation.groups.check_rollout)."""
  sampler_devices: int = 0
  sampler_mesh: tuple = (-1, 1, 1)
  max_staleness: int = 0
  sync_every: int = 1
  timeout_s: float = 3600.0
  partial: bool = False

  @classmethod
  def from_config(cls, config) -> "RolloutSettings":
    r = config.rollout
    return cls(int(r.sampler_devices),
               tuple(r.sampler_mesh) or tuple(config.mesh.shape),
               int(r.max_staleness), int(r.sync_every), float(r.timeout_s),
               bool(r.partial))

  @property
  def asynchronous(self) -> bool:
    """A sampler thread (and its own copy of the weights) is needed."""
    return self.sampler_devices > 0 or self.max_staleness > 0

  def version(self, u: int) -> int:
    """w(u): the policy version step u's rows are sampled with."""
    n = self.sync_every
    return n * (max(0, u - (self.max_staleness - n + 1)) // n)

  def last_below(self, version: int, steps: int) -> int:
    """The last step whose rows come from a version below `version`
    (`version - 1` when none after it does)."""
    u = version - 1
    while u + 1 < steps and self.version(u + 1) < version:
      u += 1
    return u


def use_thread(settings: RolloutSettings) -> bool:
  """Whether the run samples in a thread from published weights (else
  inline, the synchronous loop); tests force it on at k = 0, colocated."""
  return settings.asynchronous


# ----------------------------------------------------------------------------
# Batches: what the sampler hands over, and how a checkpoint keeps them.
# ----------------------------------------------------------------------------

class Batch(NamedTuple):
  """One step's rows: sampled at policy `version` with `key_data` (the
  step key), SAMPLE + SCORE metrics, the data position after them."""
  step: int
  version: int
  groups: rollout.Groups
  metrics: dict
  data_after: dict
  key_data: np.ndarray


def encode(batch: Batch) -> dict:
  """A Batch as JSON data (the host state), bit-exact arrays."""
  g = batch.groups._asdict()
  prompts = [list(map(int, p)) for p in g.pop("prompt_ids_b")]
  prompt_routes = g.pop("prompt_routes_b")   # routing replay: [p, l, c] each
  return {"step": batch.step, "version": batch.version,
          "metrics": batch.metrics, "data_after": batch.data_after,
          "key_data": array_text(batch.key_data), "prompt_ids": prompts,
          "arrays": {k: array_text(v) for k, v in g.items()
                     if v is not None},
          **({} if prompt_routes is None else {"prompt_routes": [
              array_text(r) for r in prompt_routes]})}


def decode(d: dict) -> Batch:
  prompts_b = np.empty((len(d["prompt_ids"]),), object)
  prompts_b[:] = [tuple(p) for p in d["prompt_ids"]]
  arrays = {k: text_array(v) for k, v in d["arrays"].items()}
  if "prompt_routes" in d:
    routes_b = arrays["prompt_routes_b"] = np.empty((len(prompts_b),),
                                                   object)
    for b, text in enumerate(d["prompt_routes"]):
      routes_b[b] = text_array(text)
  return Batch(int(d["step"]), int(d["version"]),
               rollout.Groups(prompt_ids_b=prompts_b, **arrays),
               dict(d["metrics"]), dict(d["data_after"]),
               text_array(d["key_data"]))


def staleness_metrics(batch: Batch, max_staleness: int) -> dict[str, float]:
  """The staleness of the step's rows: mean, max, and a histogram of row
  counts at 0..k versions behind. A row's version is the batch's, or with
  partial rollouts its first token's (algorithms/staleness.py)."""
  g = batch.groups
  B, G, T = g.tokens_bgt.shape
  if g.version_bgt is None:
    age_n = np.full(B * G, batch.step - batch.version)
  else:
    first_n, _ = staleness.row_versions(g.version_bgt.reshape(B * G, T),
                                        g.mask_bgt.reshape(B * G, T))
    age_n = batch.step - first_n
  out = {"staleness/mean": float(age_n.mean()),
         "staleness/max": float(age_n.max()),
         "rollout/version": float(batch.version)}
  out.update({f"staleness/rows_{j}": float((age_n == j).sum())
              for j in range(max_staleness + 1)})
  return out


def key_value(key) -> np.ndarray:
  """A (replicated) key's data as numpy on this host, without a collective:
  on several processes the key is a global array, whose local copy is the
  whole value."""
  data = (jax.random.key_data(key)
          if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key)
  if isinstance(data, jax.Array) and not data.is_fully_addressable:
    data = data.addressable_data(0)
  return np.asarray(data)


def step_keys(key_data, start: int, stop: int):
  """(u, step key) for u in [start, stop): the chain train.run splits off
  state.key (key_data: the chain's key at `start`)."""
  key = jax.random.wrap_key_data(key_data)
  for u in range(start, stop):
    key, step_key = jax.random.split(key)
    yield u, step_key


# ----------------------------------------------------------------------------
# The two ways to get a step's rows.
# ----------------------------------------------------------------------------

SampleFn = Callable[[Params, Any, Any], tuple[rollout.Groups, dict]]


class Source(NamedTuple):
  """Where a run's batches come from: the rollout settings, the prompt
  iterator, the run's steps and the batches a checkpoint kept (`decode`)."""
  settings: RolloutSettings
  data: Any
  steps: int
  restored: list


class _Rollouts:
  """What `Inline` and `Threaded` share: the batches a checkpoint restored
  (consumed first) and the data position of the last batch taken."""

  def __init__(self, source: Source):
    settings, data, steps, restored = source
    self.settings, self.data, self.steps = settings, data, steps
    self._restored = {b.step: b for b in restored}
    self._data_taken = (restored[-1].data_after if restored
                        else data.state_dict())

  def _from_restore(self, u: int) -> Batch | None:
    return self._restored.pop(u, None)


class Inline(_Rollouts):
  """The synchronous colocated loop: step u's rows are sampled when the
  trainer asks, with its current parameters (no copy, no thread)."""

  def __init__(self, source: Source, sample: SampleFn,
               policy: Callable[[Params], Params]):
    super().__init__(source)
    self._sample, self._policy, self._params = sample, policy, None

  def publish(self, version: int, params: Params) -> dict:
    del version
    self._params = params
    return {}

  def take(self, u: int, step_key) -> tuple[Batch, float]:
    batch = self._from_restore(u)
    if batch is None:
      compute = self._policy(self._params)
      groups, metrics = self._sample(compute, self.data, step_key)
      del compute   # the compute-dtype copy is not kept through the update
      batch = Batch(u, u, groups, metrics, self.data.state_dict(),
                    key_value(step_key))
    self._data_taken = batch.data_after
    return batch, 0.0

  def host_state(self, version: int, wait: bool = True) -> dict:
    del version, wait
    return {"data": self._data_taken}

  def close(self) -> None:
    pass


class Threaded(_Rollouts):
  """A sampler thread k steps ahead (module docstring)."""

  def __init__(self, source: Source, sample: SampleFn, sync: WeightSync,
               store: WeightStore, start: int, key_data):
    super().__init__(source)
    self._sample, self._sync, self._store = sample, sync, store
    self._start = start    # the version the run (re)started from
    self._cond = threading.Condition()
    self._finished: dict[int, Batch] = dict(self._restored)
    self._restored.clear()
    self._error: tuple[int, BaseException] | None = None
    self._stop = False
    self._idle_s = 0.0      # the sampler's finished waits for weights
    self._waiting_since: float | None = None   # the wait under way
    self._idle_mark = (0.0, time.perf_counter())
    first = max([start - 1] + list(self._finished)) + 1
    self._thread = threading.Thread(
        target=self._run, args=(first, key_data), name="sampler", daemon=True)
    self._thread.start()

  def version(self, u: int) -> int:
    """w(u), or the restart version for a batch the checkpoint lacks (only
    after a failure: its rows are then fresher than the schedule)."""
    return max(self.settings.version(u), self._start)

  # -- the sampler thread ----------------------------------------------------

  def _run(self, first: int, key_data) -> None:
    u, policy, policy_version = first, None, None
    try:
      keys = step_keys(key_data, self._start, self.steps)
      for u, step_key in keys:
        if u < first:
          continue
        with self._cond:
          self._waiting_since = time.perf_counter()
        params = self._store.get(self.version(u))
        with self._cond:
          self._idle_s += time.perf_counter() - self._waiting_since
          self._waiting_since = None
        if params is None or self._stop:
          return
        self._store.drop_below(self.version(u))
        if policy_version != self.version(u):   # LoRA: merged once a version
          policy, policy_version = self._sync.policy(params), self.version(u)
        del params
        groups, metrics = self._sample(policy, self.data, step_key)
        batch = Batch(u, self.version(u), groups, metrics,
                      self.data.state_dict(),
                      key_value(step_key))
        with self._cond:
          self._finished[u] = batch
          self._cond.notify_all()
    except BaseException as e:  # pylint: disable=broad-except
      with self._cond:
        self._error = (u, e)
        self._cond.notify_all()

  # -- the trainer's side ----------------------------------------------------

  def publish(self, version: int, params: Params) -> dict:
    """Syncs `version` if some step's rows need it."""
    if version != self._start and not (
        version % self.settings.sync_every == 0
        and version <= self.settings.version(self.steps - 1)):
      return {}
    try:
      return self._sync.publish(version, params)
    except Exception as e:
      raise SamplerError(
          f"weight sync of policy version {version} to the sampler failed "
          f"({type(e).__name__}: {e}); the sampler kept version(s) "
          f"{self._store.versions()}") from e

  def _wait(self, ready: Callable[[], bool], what: str) -> None:
    """Waits under the lock until ready(), the sampler fails, or
    rollout.timeout_s passes (SamplerError naming the step)."""
    deadline = time.monotonic() + self.settings.timeout_s
    while not ready():
      if self._error is not None:
        u, e = self._error
        kind = SamplerStopped if isinstance(e, UserError) else SamplerError
        raise kind(f"the sampler failed on step {u + 1} "
                   f"({type(e).__name__}: {e})") from e
      left = deadline - time.monotonic()
      if left <= 0:
        raise SamplerStopped(
            f"the sampler is hung: no rows for {what} within "
            f"rollout.timeout_s = {self.settings.timeout_s:g} s")
      self._cond.wait(left)

  def take(self, u: int, step_key) -> tuple[Batch, float]:
    """Step u's batch (waiting for it), and the seconds waited."""
    t0 = time.perf_counter()
    with self._cond:
      self._wait(lambda: u in self._finished, f"step {u + 1}")
      batch = self._finished.pop(u)
    if not np.array_equal(batch.key_data, key_value(step_key)):
      raise SamplerError(f"the sampler's key for step {u + 1} is not the "
                         "trainer's: the schedule is broken")
    self._data_taken = batch.data_after
    return batch, time.perf_counter() - t0

  def sampler_idle_fraction(self) -> float:
    """The share of the time since the last call the sampler spent waiting
    for weights (admission control); a wait under way counts up to now, so
    a wait across calls is split between them (the share stays <= 1)."""
    with self._cond:
      now = time.perf_counter()
      idle = self._idle_s + (0.0 if self._waiting_since is None
                             else now - self._waiting_since)
    (idle0, t0), self._idle_mark = self._idle_mark, (idle, now)
    return (idle - idle0) / max(now - t0, 1e-9)

  def host_state(self, version: int, wait: bool = True) -> dict:
    """What a checkpoint of `version` needs: the finished batches it cannot
    regenerate (their version is older) and the data position after them.
    wait=False (after a failure): those finished so far."""
    last = self.settings.last_below(version, self.steps)
    with self._cond:
      if wait:
        self._wait(lambda: all(u in self._finished
                               for u in range(version, last + 1)),
                   f"the checkpoint of step {version}")
      kept = [self._finished[u] for u in range(version, last + 1)
              if u in self._finished]
      kept = kept[:next((i for i, b in enumerate(kept)
                         if b.step != version + i), len(kept))]
    data = kept[-1].data_after if kept else self._data_taken
    return {"data": data, "rollouts": [encode(b) for b in kept]}

  def close(self) -> None:
    """Stops the sampler: after its current batch at the latest (a batch in
    flight is not waited for beyond a few seconds: the thread is a daemon)."""
    with self._cond:
      self._stop = True
    self._store.close()
    self._thread.join(timeout=5.0)
    if self._thread.is_alive():
      logging.warning("the sampler thread is still busy; not waiting for it")
