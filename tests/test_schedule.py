"""The slot-schedule simulator (grpo_jax/aot/schedule.py) on cases traced by
hand: which rows decode at each step and how many KV columns each step
reads, dense slots against pages; and its length distributions."""
import json

import numpy as np
import pytest

from grpo_jax.aot import sampler as pod_sampler
from grpo_jax.aot import schedule

# One byte per column read, nothing else: bytes_k counts columns.
COLUMNS = dict(column_bytes=1.0, weight_bytes=0.0, slot_flops=0.0,
               column_flops=0.0, bandwidth=1.0, peak_flops=1.0)


def _cost(prompt_len=0, block=1, **kw):
  return schedule.Cost(prompt_len=prompt_len, block=block, **{**COLUMNS, **kw})


def test_dense_rows_take_the_slot_that_frees_first():
  """Lengths 3, 2, 5, 1 hold a slot 2, 1, 4, 1 steps: row 2 takes slot 1
  (free at step 1), row 3 slot 0 (free at step 2)."""
  got = schedule.dense_starts(np.array([3, 2, 5, 1]), 2)
  assert got.tolist() == [0, 0, 1, 2]


def test_dense_every_slot_reads_up_to_the_longest_live_row():
  """Rows of 3 and 2 tokens in 2 slots: step 0 both live at t = 1, step 1
  only the first, at t = 2; both slots read P + t_max, in whole blocks."""
  s = schedule.dense(np.array([[3, 2]]), 2, _cost())
  assert s.bytes_k.tolist() == [2, 4]
  assert s.live_k.tolist() == [2, 1]
  s = schedule.dense(np.array([[3, 2]]), 2, _cost(prompt_len=4, block=4))
  assert s.bytes_k.tolist() == [16, 16]        # ceil(5/4)*4, ceil(6/4)*4
  # shards in lockstep: the longest live row is the whole call's
  s = schedule.dense(np.array([[3, 2], [2, 2]]), 2, _cost())
  assert s.bytes_k.tolist() == [2, 4]


def test_paged_rows_read_their_own_columns_and_wait_for_pages():
  """Two rows of 5 tokens, pages of 2 columns, a pool of 3 pages (one row
  needs 2): both start; at column 2 one page is left, the older row takes
  it and the younger waits a step, then takes the older's pages."""
  s = schedule.paged(np.array([[5, 5]]), 2, 3, 2, 1, _cost())
  assert s.bytes_k.tolist() == [2, 4, 6, 7, 3, 4]
  assert s.live_k.tolist() == [2, 2, 1, 1, 1, 1]
  assert s.preempted == 0


def test_paged_page_writes_move_every_slots_page_and_each_live_rows():
  """`aot.sampler.page_write_bytes`, the whole-page writes the roofline
  leaves out: each step reads the 2 slots' pages (2 columns each) and
  writes back the live rows' (2, 2, 1, 1, 1, 1 of them above)."""
  s = schedule.paged(np.array([[5, 5]]), 2, 3, 2, 1, _cost())
  got = pod_sampler.page_write_bytes(s, 2)
  assert got.tolist() == [8, 8, 6, 6, 6, 6]


def test_paged_preempts_the_youngest_when_the_oldest_waits():
  """Rows of 7 tokens need 3 pages each, the pool holds 4: at column 4
  neither gets a page, the younger is preempted (its 2 pages back, restart
  from its first token), the older finishes, then the younger runs."""
  s = schedule.paged(np.array([[7, 7]]), 2, 4, 2, 1, _cost())
  assert s.bytes_k.tolist() == [2, 4, 6, 8, 6, 6, 7, 1, 2, 3, 4, 5, 6]
  assert s.preempted == 1
  assert (s.busy, s.tail) == (8, 5)    # last step with a row waiting: 7


def test_paged_prompt_pages_are_shared_and_freed_with_the_group():
  """One prompt of one full page, G = 2 rows of 2 tokens, a pool of 2
  pages: the prompt's page and one row's own; the second row starts when
  the first ends. Both read their prompt's column."""
  s = schedule.paged(np.array([[2, 2]]), 2, 2, 2, 2, _cost(prompt_len=2))
  assert s.bytes_k.tolist() == [6, 3]
  with pytest.raises(ValueError, match="cannot hold"):
    schedule.paged(np.array([[2, 2]]), 2, 1, 2, 2, _cost(prompt_len=2))


def test_paged_with_room_equals_the_rows_own_reads():
  """A pool for every row: no wait, and the columns read over the call are
  each row's prompt + 1 .. prompt + L - 1, whatever the slots (one shard:
  bytes_k is the slowest shard's)."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 40, (1, 8))
  P = 4
  want = sum(sum(range(P + 1, P + L)) for L in lengths.ravel() if L > 1)
  for slots in (2, 8):
    s = schedule.paged(lengths, slots, 1000, 4, 2, _cost(prompt_len=P))
    assert s.preempted == 0 and s.bytes_k.sum() == want


def test_roofline_time_is_bytes_or_flops_whichever_is_slower():
  cost = schedule.Cost(0, 1.0, 10.0, 5.0, 0.0, bandwidth=2.0, peak_flops=1.0,
                       block=1)
  s = schedule.dense(np.array([[2, 2]]), 2, cost)     # one step, 2 columns
  assert s.bytes_k.tolist() == [12.0] and s.flops_k.tolist() == [10.0]
  assert s.seconds == pytest.approx(10.0)              # 10 FLOPs / 1 > 12 / 2
  assert s.memory_bound == 0.0


def test_lognormal_lengths_have_the_asked_mean():
  x = schedule.lognormal_lengths(200_000, 20480, 0.3)
  assert x.min() >= 1 and x.max() == 20480
  assert x.mean() / 20480 == pytest.approx(0.3, abs=0.005)


def test_fit_lognormal_recovers_mean_and_truncation():
  mu, sigma = np.log(0.2), 1.3
  fraction = schedule.clipped_mean(mu, sigma, 1.0)
  rate = schedule.truncation(mu, sigma, 1.0)
  got = schedule.fit_lognormal(fraction, rate)
  assert got == pytest.approx((mu, sigma), abs=1e-3)


def test_lengths_from_a_runs_metrics(tmp_path):
  """The run's mean length and truncation rate (training steps only), as
  fractions of its cap (config.yaml), drawn at another cap."""
  (tmp_path / "config.yaml").write_text("sampling: {max_new_tokens: 32}\n")
  lines = [{"step": 0, "eval/response_length": 3.0},
           {"step": 1, "response_length/mean": 14.0, "truncation_rate": 0.1},
           {"step": 2, "response_length/mean": 18.0, "truncation_rate": 0.3}]
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  assert schedule.run_length_stats(str(path)) == pytest.approx((0.5, 0.2))
  x, what = schedule.lengths_from_flag(str(path), 100_000, 1000)
  assert x.mean() / 1000 == pytest.approx(0.5, abs=0.01)
  assert (x == 1000).mean() == pytest.approx(0.2, abs=0.01)
  assert "fitted" in what
  x, _ = schedule.lengths_from_flag("cap", 5, 7)
  assert x.tolist() == [7] * 5
