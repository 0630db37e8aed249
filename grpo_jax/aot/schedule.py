"""A simulation of the continuous-batching sampler's slot schedule, dense
slots against a paged KV cache, on the same rows.

`check.step_roofline` bounds the sampler's time by what each decode step
reads from HBM. That depends on which rows are in flight at each step,
which depends on the completion lengths and on how slots are refilled, so
it is simulated here, step by step, on a row shard's rows as the compiled
programs schedule them (pure numpy; no model is run):

  dense   (`continuous.sample_slots`) `slots` slots per row shard; an idle
          slot takes the shard's next row (prompt-major) at the end of a
          step. Every step every slot reads its cache up to the longest
          live row of the whole call (`filled`, an all-reduce), rounded up
          to blocks of `block` columns (the `lax.switch` buckets of
          `ragged.filled_attention`).
  paged   (`paged_slots.sample_pages`) `slots` slots and a pool of `pages`
          pages of `page_size` columns per row shard, holding every
          prompt's full pages from the prefill on (shared by its G rows,
          freed when the group's last row ends) and each row's own pages
          (one to start, one more per page_size columns). The grant rules
          are the sampler's: waiting rows start when a page is free beyond
          one per live row; pages go oldest row first; when the oldest live
          row waits the youngest live row is preempted (its own pages freed,
          restarted from its first token). Every slot holding a row (live
          or waiting) reads its own columns, prompt included, rounded up to
          the kernel's compute blocks of `block` columns; slots holding no
          row read nothing (the kernel skips length 0).

tests/test_schedule_device.py holds the simulation to the samplers: on
the device's own rows both give the same decode steps, and for pages the
same preemptions, waits and peak pages.

A row of L completion tokens (its first from the prefill) is live for
L - 1 decode steps; a row with L = 1 holds its slot for one step. Shards
run in lockstep (one SPMD program): a step ends when the slowest shard's
chips are done, and the call when every shard is.

A step's time on a chip is the roofline `max(bytes / bandwidth, FLOPs /
peak)`: bytes = the chip's weight slice (every step) + the KV columns its
slots read; FLOPs = every slot's matmuls (the program computes idle slots
too) + attention over the columns read. It is a simulation of a
memory-bound lower bound, not a measurement: no collective (weight
all-gathers, the `filled` all-reduce), no prefill, no host time.

Shapes: R row shards, N rows per shard, M slots per shard, B prompts per
shard; per-step arrays are indexed by the step.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np


class Cost(NamedTuple):
  """Per-chip costs of one decode step, from the model and the layout."""
  prompt_len: int         # P: prompt columns of every row (the bucket)
  column_bytes: float     # one row's keys + values at one column, all layers
  weight_bytes: float     # the weights the chip reads every step
  slot_flops: float       # matmul FLOPs of one slot (one token)
  column_flops: float     # attention FLOPs of one slot over one column
  bandwidth: float        # HBM bytes/s
  peak_flops: float       # FLOP/s
  block: int = 128        # columns read in whole blocks of this many


class Schedule(NamedTuple):
  """One simulated call. Per step: the slowest shard's chip."""
  kind: str               # "dense" or "paged"
  slots: int              # per shard
  pages: int              # per shard (paged), else 0
  bytes_k: np.ndarray     # HBM bytes read per chip (max over shards)
  flops_k: np.ndarray     # FLOPs per chip (max over shards)
  live_k: np.ndarray      # rows decoding, mean over shards
  queued_k: np.ndarray    # bool: some shard has rows not started (or
                          # waiting to restart)
  preempted: int          # rows preempted (paged), summed over shards
  cost: Cost
  waited: int = 0         # slot-steps a live row waited for a page (paged)
  peak_pages: int = 0     # most pages counted at once, summed over shards
                          # (paged); these two and `preempted` are the
                          # device's `paged_slots.PageStats`

  @property
  def steps(self) -> int:
    return len(self.bytes_k)

  @property
  def seconds_k(self) -> np.ndarray:
    return np.maximum(self.bytes_k / self.cost.bandwidth,
                      self.flops_k / self.cost.peak_flops)

  @property
  def seconds(self) -> float:
    return float(self.seconds_k.sum())

  @property
  def busy(self) -> int:
    """Steps up to the last one with a row not started (or waiting to
    restart): the slots are full, or waiting for pages."""
    queued = np.nonzero(self.queued_k)[0]
    return int(queued[-1]) + 1 if len(queued) else 0

  @property
  def tail(self) -> int:
    """Steps after `busy`: the drain, as rows end and none replaces them."""
    return self.steps - self.busy

  @property
  def tail_seconds(self) -> float:
    return float(self.seconds_k[self.busy:].sum())

  @property
  def in_flight(self) -> float:
    """Rows decoding per shard, mean over the call's decode steps."""
    return float(self.live_k.mean())

  @property
  def memory_bound(self) -> float:
    """Share of the time in steps whose bytes bound them."""
    s = self.seconds_k
    mem = self.bytes_k / self.cost.bandwidth >= self.flops_k / self.cost.peak_flops
    return float(s[mem].sum() / max(s.sum(), 1e-30))


def read_columns(lengths: np.ndarray, block: int) -> np.ndarray:
  """Columns read for rows of `lengths` columns: whole blocks (0: none)."""
  return -(-lengths // block) * block


def _step_cost(cost: Cost, slots: int, columns_r: np.ndarray) -> tuple:
  """(bytes, FLOPs) per chip of the slowest shard, given its columns read."""
  bytes_r = cost.weight_bytes + columns_r * cost.column_bytes
  flops_r = slots * cost.slot_flops + columns_r * cost.column_flops
  return float(bytes_r.max()), float(flops_r.max())


# ----------------------------------------------------------------------------
# Dense slots: the schedule does not depend on memory, so it is computed
# from each row's start step (list scheduling), then costed per step.
# ----------------------------------------------------------------------------

def dense_starts(lengths_n: np.ndarray, slots: int) -> np.ndarray:
  """The decode step at which each row of one shard starts: rows in order
  take the slot that frees first (lowest slot on ties), as `_refill`
  fills idle slots in slot order at the end of a step."""
  free = [(0, m) for m in range(slots)]
  start_n = np.zeros(len(lengths_n), np.int64)
  for i, length in enumerate(lengths_n):
    step, m = heapq.heappop(free)
    start_n[i] = step
    heapq.heappush(free, (step + max(int(length) - 1, 1), m))
  return start_n


def dense(lengths_rn: np.ndarray, slots: int, cost: Cost) -> Schedule:
  """The dense-slot sampler on R shards of rows (module docstring)."""
  R, N = lengths_rn.shape
  start_rn = np.stack([dense_starts(x, slots) for x in lengths_rn])
  end_rn = start_rn + np.maximum(lengths_rn - 1, 1)
  steps = int(end_rn.max())
  # Longest live row at step k: k + 1 - the earliest start among live rows.
  big = np.iinfo(np.int64).max
  first_k = np.full(steps, big)
  live_k = np.zeros(steps + 1)
  for s, e, length in zip(start_rn.ravel(), end_rn.ravel(), lengths_rn.ravel()):
    if length > 1:
      first_k[s:e] = np.minimum(first_k[s:e], s)
      live_k[s] += 1
      live_k[e] -= 1
  t_max_k = np.where(first_k < big, np.arange(steps) + 1 - first_k, 0)
  columns_k = slots * read_columns(cost.prompt_len + t_max_k, cost.block)
  bytes_k = cost.weight_bytes + columns_k * cost.column_bytes
  flops_k = slots * cost.slot_flops + columns_k * cost.column_flops
  queued_k = np.arange(steps) < start_rn[:, -1].max()
  return Schedule("dense", slots, 0, bytes_k, flops_k,
                  np.cumsum(live_k)[:steps] / R, queued_k, 0, cost)


# ----------------------------------------------------------------------------
# Paged: admission by free pages, simulated step by step (all shards at once).
# ----------------------------------------------------------------------------

class _Pool(NamedTuple):
  """Per shard (R, ...) state of a paged call; mutable numpy arrays."""
  row_m: np.ndarray       # the row a slot holds (-1: none yet)
  t_m: np.ndarray         # tokens chosen so far
  live_m: np.ndarray
  wait_m: np.ndarray
  own_m: np.ndarray       # the row's own pages
  length_m: np.ndarray    # the row's completion length
  left_b: np.ndarray      # rows of each prompt not ended
  used: np.ndarray        # (R,) pages counted
  next_row: np.ndarray    # (R,)


def _grant(p: _Pool, cost_P: int, page_size: int, pages: int, N: int):
  """PAGES: grants in order, starts, preemption (the paged sampler's
  `paged_slots._pages_step`). Returns the slots that decode this step, the
  rows preempted and the live rows that wait for a page."""
  full = cost_P // page_size
  column_m = cost_P + p.t_m - 1
  grow_m = p.live_m & (p.own_m < column_m // page_size - full + 1)
  want_m = grow_m | p.wait_m
  order_m = np.where(p.live_m, p.row_m, p.row_m + N)
  n_live = p.live_m.sum(1, keepdims=True)
  keep_m = np.where(p.wait_m, n_live, 0)
  key_m = np.where(want_m, order_m, np.iinfo(np.int64).max)
  rank_m = np.argsort(np.argsort(key_m, 1, kind="stable"), 1, kind="stable")
  got_m = want_m & (rank_m < (pages - p.used)[:, None] - keep_m)
  start_m = p.wait_m & got_m
  p.own_m[got_m] += 1
  p.used[:] += got_m.sum(1)
  waiting_m = grow_m & ~got_m
  if not waiting_m.any():
    p.live_m[:] |= start_m
    p.wait_m[:] &= ~start_m
    return p.live_m.copy(), 0, 0
  rows = np.arange(p.live_m.shape[0])
  oldest = np.argmin(np.where(p.live_m, p.row_m, np.iinfo(np.int64).max), 1)
  youngest = np.argmax(np.where(p.live_m, p.row_m, -1), 1)
  hit = p.live_m.any(1) & waiting_m[rows, oldest] & (youngest != oldest)
  victim_m = np.zeros_like(p.live_m)
  victim_m[rows[hit], youngest[hit]] = True
  p.used[:] -= np.where(victim_m, p.own_m, 0).sum(1)
  p.own_m[victim_m] = 0
  p.t_m[victim_m] = 1
  p.live_m[:] = (p.live_m | start_m) & ~victim_m
  p.wait_m[:] = (p.wait_m & ~start_m) | victim_m
  return p.live_m & ~waiting_m, int(victim_m.sum()), int(waiting_m.sum())


def _decode(p: _Pool, active_m, lengths_rn, G: int, full: int) -> None:
  """DECODE: active slots choose a token; rows that end free their pages."""
  ended_m = active_m & (p.t_m + 1 >= p.length_m)
  p.t_m[active_m] += 1
  _end(p, ended_m, G, full)
  p.live_m[ended_m] = False


def _end(p: _Pool, ended_m, G: int, full: int) -> None:
  """Rows ended: their own pages back, their prompt's count down (its pages
  back when its last row ends)."""
  if not ended_m.any():
    return
  p.used[:] -= np.where(ended_m, p.own_m, 0).sum(1)
  p.own_m[ended_m] = 0
  r, m = np.nonzero(ended_m)
  np.subtract.at(p.left_b, (r, p.row_m[r, m] // G), 1)
  gone = np.zeros_like(p.left_b)
  np.add.at(gone, (r, p.row_m[r, m] // G), 1)
  p.used[:] -= ((p.left_b == 0) & (gone > 0)).sum(1) * full


def _take(p: _Pool, lengths_rn, G: int, full: int) -> None:
  """REFILL: idle slots take the shard's next rows (slot order) and wait;
  a row of one token ends at once."""
  N = lengths_rn.shape[1]
  idle_m = ~(p.live_m | p.wait_m)
  row_m = p.next_row[:, None] + np.cumsum(idle_m, 1) - 1
  take_m = idle_m & (row_m < N)
  if not take_m.any():
    return
  p.row_m[take_m] = row_m[take_m]
  p.t_m[take_m] = 1
  p.next_row[:] += take_m.sum(1)
  p.length_m[:] = np.take_along_axis(lengths_rn, np.maximum(p.row_m, 0), 1)
  done_m = take_m & (p.length_m <= 1)
  _end(p, done_m, G, full)
  p.wait_m[:] = p.wait_m | (take_m & ~done_m)


def paged(lengths_rn: np.ndarray, slots: int, pages: int, page_size: int,
          G: int, cost: Cost, max_steps: int = 10_000_000) -> Schedule:
  """The paged sampler on R shards of rows (module docstring). `pages`
  must hold a shard's prompt pages plus one whole row (as the host
  checks), so some row always finishes."""
  R, N = lengths_rn.shape
  P, full = cost.prompt_len, cost.prompt_len // page_size
  B = N // G
  row_pages = -(-(P + int(lengths_rn.max())) // page_size)
  if pages < B * full + row_pages - full:
    raise ValueError(f"{pages} pages cannot hold {B} prompts of {full} pages "
                     f"and one row of {row_pages} pages")
  zeros = lambda dtype: np.zeros((R, slots), dtype)
  p = _Pool(np.full((R, slots), -1), np.ones((R, slots), np.int64),
            zeros(bool), zeros(bool), zeros(np.int64), zeros(np.int64),
            np.full((R, B), G), np.full(R, B * full), np.zeros(R, np.int64))
  _take(p, lengths_rn, G, full)
  out_bytes, out_flops, out_live, queued = [], [], [], []
  preempted = waited = peak = 0
  while (p.live_m | p.wait_m).any() or (p.next_row < N).any():
    if len(out_bytes) >= max_steps:
      raise RuntimeError(f"paged schedule did not finish in {max_steps} steps")
    queued.append(bool((p.next_row < N).any() or p.wait_m.any()))
    active_m, victims, waits = _grant(p, P, page_size, pages, N)
    preempted, waited = preempted + victims, waited + waits
    peak = max(peak, int(p.used.sum()))
    holds_m = p.live_m | p.wait_m
    columns_r = np.where(holds_m, read_columns(P + p.t_m, cost.block),
                         0).sum(1)
    b, f = _step_cost(cost, slots, columns_r)
    out_bytes.append(b)
    out_flops.append(f)
    out_live.append(active_m.sum() / R)
    _decode(p, active_m, lengths_rn, G, full)
    _take(p, lengths_rn, G, full)
  if p.used.any():
    raise RuntimeError(f"pages still counted at the end: {p.used}")
  return Schedule("paged", slots, pages, np.asarray(out_bytes),
                  np.asarray(out_flops), np.asarray(out_live),
                  np.asarray(queued, bool), preempted, cost, waited, peak)


# ----------------------------------------------------------------------------
# Length distributions.
# ----------------------------------------------------------------------------

SIGMA = 1.0     # benchmarks/ragged.py's lognormal (impose_lengths)


def clipped_mean(mu: float, sigma: float, cap: float, n: int = 4001) -> float:
  """E[min(X, cap)] / cap for X lognormal(mu, sigma), by quadrature."""
  z = np.linspace(-8, 8, n)
  x = np.minimum(np.exp(mu + sigma * z), cap)
  pdf = np.exp(-z * z / 2) / np.sqrt(2 * np.pi)
  return float(np.trapezoid(x * pdf, z) / cap)


def lognormal_mu(mean_fraction: float, sigma: float, cap: float) -> float:
  """The mu whose lognormal, clipped at the cap, has this mean fraction."""
  if not 0 < mean_fraction < 1:
    raise ValueError(f"mean fraction {mean_fraction} must be in (0, 1)")
  lo, hi = np.log(cap) - 20, np.log(cap) + 20
  for _ in range(100):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if clipped_mean(mid, sigma, cap) < mean_fraction else (lo, mid)
  return (lo + hi) / 2


def lognormal_lengths(rows: int, cap: int, mean_fraction: float,
                      sigma: float = SIGMA, seed: int = 0) -> np.ndarray:
  """Completion lengths in [1, cap]: a lognormal of the given sigma whose
  clipped mean is `mean_fraction` of the cap."""
  mu = lognormal_mu(mean_fraction, sigma, cap)
  x = np.random.default_rng(seed).lognormal(mu, sigma, rows)
  return np.clip(np.ceil(x), 1, cap).astype(np.int64)


def truncation(mu: float, sigma: float, cap: float) -> float:
  """P(X >= cap) for X lognormal(mu, sigma)."""
  from math import erf  # pylint: disable=import-outside-toplevel
  return 0.5 * (1 - erf((np.log(cap) - mu) / (sigma * np.sqrt(2))))


def fit_lognormal(mean_fraction: float, truncation_rate: float,
                  cap: float = 1.0) -> tuple[float, float]:
  """(mu, sigma) of the lognormal whose clip at the cap has this mean
  fraction and this share of rows at the cap (a run's metrics)."""
  if not 0 < truncation_rate < 1:
    raise ValueError(f"truncation rate {truncation_rate} must be in (0, 1) "
                     "to fit a lognormal")
  lo, hi = 0.01, 10.0
  for _ in range(100):
    sigma = (lo + hi) / 2
    mu = lognormal_mu(mean_fraction, sigma, cap)
    # at a fixed clipped mean, a wider lognormal puts more rows at the cap
    lo, hi = (sigma, hi) if truncation(mu, sigma, cap) < truncation_rate else (lo, sigma)
  sigma = (lo + hi) / 2
  return lognormal_mu(mean_fraction, sigma, cap), sigma


def run_length_stats(metrics_path: str) -> tuple[float, float]:
  """(mean completion length / cap, truncation rate) over the training
  steps of a run's metrics.jsonl, the cap read from the config.yaml the run
  wrote beside it (sampling.max_new_tokens)."""
  import json  # pylint: disable=import-outside-toplevel,multiple-imports
  import os

  import yaml  # pylint: disable=import-outside-toplevel
  config_path = os.path.join(os.path.dirname(metrics_path), "config.yaml")
  if not os.path.exists(config_path):
    raise ValueError(f"{config_path} not found: the run's cap "
                     "(sampling.max_new_tokens) is read from it")
  with open(config_path) as f:
    cap = yaml.safe_load(f)["sampling"]["max_new_tokens"]
  means, truncated = [], []
  with open(metrics_path) as f:
    for line in f:
      record = json.loads(line)
      if "response_length/mean" in record and "truncation_rate" in record:
        means.append(record["response_length/mean"])
        truncated.append(record["truncation_rate"])
  if not means:
    raise ValueError(f"{metrics_path}: no step with response_length/mean "
                     "and truncation_rate")
  return float(np.mean(means)) / cap, float(np.mean(truncated))


def lengths_from_flag(flag: str, rows: int, cap: int, seed: int = 0
                      ) -> tuple[np.ndarray, str]:
  """Completion lengths of `rows` rows at `cap` from aot.py's --lengths:
  "cap" (every row at the cap), "lognormal:F" (sigma SIGMA, clipped mean
  F of the cap), or a run's metrics.jsonl (a lognormal fitted to its mean
  length and truncation rate, as fractions of its cap). Returns the
  lengths and a description."""
  if flag == "cap":
    return np.full(rows, cap, np.int64), "every row at the cap"
  if flag.startswith("lognormal:"):
    fraction = float(flag.split(":", 1)[1])
    return (lognormal_lengths(rows, cap, fraction, SIGMA, seed),
            f"lognormal, sigma {SIGMA}, clipped mean {fraction} of the cap")
  fraction, rate = run_length_stats(flag)
  mu, sigma = fit_lognormal(fraction, rate)
  x = np.random.default_rng(seed).lognormal(mu, sigma, rows) * cap
  return (np.clip(np.ceil(x), 1, cap).astype(np.int64),
          f"lognormal fitted to {flag}: mean {fraction:.3f} of its cap, "
          f"{rate:.3f} truncated -> sigma {sigma:.2f}")
