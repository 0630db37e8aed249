"""Partial rollouts: per-token policy versions (algorithms/staleness.py),
through the batch, packing, the staleness metrics and checkpoints
(docs/async.md, "Partial rollouts")."""
import types

import async_checks
import numpy as np
import pytest

from grpo_jax import checkpoint, validation
from grpo_jax.algorithms import dynamic_sampling, staleness
from grpo_jax.errors import ConfigError
from grpo_jax.generate import agent_parked, partial, rollout
from grpo_jax.harness import interrupts, preflight
from grpo_jax.rl import async_rollouts, packing, partial_rollouts, train
from grpo_jax.rl.batch import to_rows

# 2 groups of 2 rows, 4 completion tokens; the update makes version 4 + 1.
VERSION_NT = np.array([[3, 3, 4, 4],     # cut once: versions 3 then 4
                       [2, 2, 2, 0],     # first token 2 versions old
                       [1, 3, 4, 0],     # first token 3 old: past k = 2
                       [4, 0, 0, 0]], np.int32)
VALID_NT = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0],
                     [1, 0, 0, 0]], bool)


def test_rows_past_the_bound_leave_the_loss_and_are_counted():
  mask = VALID_NT.astype(np.float32)
  first, last = staleness.row_versions(VERSION_NT, VALID_NT)
  assert first.tolist() == [3, 2, 1, 4] and last.tolist() == [4, 2, 4, 4]
  got, m = staleness.bound_rows(VERSION_NT, VALID_NT, mask, 4, 2)
  assert got.dtype == np.float32
  assert got.sum(axis=1).tolist() == [4, 3, 0, 1]     # row 2 dropped
  ages = [1, 1, 0, 0, 2, 2, 2, 3, 1, 0, 0]             # 4 - each version
  assert m["staleness/token_mean"] == np.mean(ages)
  assert m["staleness/token_max"] == 3
  assert m["partial/version_span"] == (1 + 0 + 3 + 0) / 4
  assert m["partial/version_span_max"] == 3
  assert m["partial/stale_dropped"] == 1
  _, m = staleness.bound_rows(VERSION_NT, VALID_NT, mask, 4, 3)
  assert m["partial/stale_dropped"] == 0


def _groups(version_bgt=None) -> rollout.Groups:
  rng = np.random.default_rng(0)
  prompts = np.empty((2,), object)
  prompts[:] = [(5, 6, 7), (8,)]
  mask = VALID_NT.reshape(2, 2, 4)
  return rollout.Groups(
      prompts, rng.integers(1, 256, (2, 2, 4)).astype(np.int32),
      (rng.standard_normal((2, 2, 4)) * mask).astype(np.float32), mask,
      mask.sum(axis=2).astype(np.int32), np.zeros((2, 2), bool),
      np.array([[1, 0], [0, 1]], np.float32), np.array([[1, 0], [0, 1]], bool),
      version_bgt=version_bgt)


def test_versions_follow_their_tokens_through_the_rows_and_packing():
  batch = to_rows(_groups(VERSION_NT.reshape(2, 2, 4)), 0, False)
  np.testing.assert_array_equal(batch.version_nt, VERSION_NT)
  assert to_rows(_groups(), 0, False).version_nt is None
  mask, _ = staleness.bound_rows(batch.version_nt, VALID_NT, batch.mask_nt,
                                 4, 2)
  for group_size, rows_per_micro in ((2, 1), (1, 4)):
    rows, _ = packing.pack_rows(batch.tokens_ns, batch.valid_ns, mask,
                                group_size, rows_per_micro)
    version = np.asarray(packing.gather_slots(batch.version_nt, rows.row_n))
    logp = np.asarray(packing.gather_slots(batch.old_logp_nt, rows.row_n))
    slot_mask = np.asarray(packing.gather_slots(mask, rows.row_n))
    assert sorted(r for r in rows.row_n.tolist() if r < 4) == [0, 1, 3]
    for i, r in enumerate(rows.row_n.tolist()):
      if r == 4:       # an empty slot: nothing, and no loss
        assert not slot_mask[i].any()
        continue
      np.testing.assert_array_equal(version[i], VERSION_NT[r])
      np.testing.assert_array_equal(logp[i], batch.old_logp_nt[r])
      np.testing.assert_array_equal(slot_mask[i], mask[r])


def test_row_ages_come_from_each_rows_first_token():
  groups = _groups(VERSION_NT.reshape(2, 2, 4))
  batch = async_rollouts.Batch(4, 3, groups, {}, {}, np.zeros(2, np.uint32))
  m = async_rollouts.staleness_metrics(batch, 3)
  assert m["staleness/max"] == 3 and m["staleness/mean"] == (1 + 2 + 3) / 4
  assert [m[f"staleness/rows_{j}"] for j in range(4)] == [1, 1, 1, 1]
  same = async_rollouts.staleness_metrics(batch._replace(
      groups=groups._replace(version_bgt=None)), 3)
  assert same["staleness/rows_1"] == 4 and same["staleness/mean"] == 1


def test_versions_survive_a_checkpoint_bit_for_bit():
  groups = _groups(VERSION_NT.reshape(2, 2, 4))
  batch = async_rollouts.Batch(4, 3, groups, {}, {}, np.zeros(2, np.uint32))
  back = async_rollouts.decode(checkpoint.integrity.to_json(
      async_rollouts.encode(batch), "host_state"))
  assert back.groups.version_bgt.dtype == np.int32
  np.testing.assert_array_equal(back.groups.version_bgt, groups.version_bgt)


# ----------------------------------------------------------------------------
# The loop: rows carried across a weight switch (rl/partial_rollouts.py).
# ----------------------------------------------------------------------------

def _config(steps: int = 4):
  """The tiny config at k = 1 on the decoupled objective, the paged
  continuous sampler with 4 slots for a step's 8 rows of up to 16 tokens,
  partial rollouts on."""
  c = async_checks.stale(async_checks.config(steps=steps))
  c.rl.dynamic_sampling = False
  c.sampling.update(continuous_batching=True, kv_cache="paged", slots=4,
                    max_new_tokens=16)
  c.rollout.partial = True
  return c


@pytest.mark.parametrize("fields, why", [
    ({"rollout.max_staleness": 0}, "max_staleness >= 1"),
    ({"rollout.max_staleness": 2, "rollout.sync_every": 2}, "sync_every = 1"),
    ({"sampling.continuous_batching": False, "sampling.kv_cache": "dense"},
     "not the lockstep sampler"),
    ({"env.name": "scripted"}, "single-turn")])
def test_partial_rollouts_refuse_what_the_stream_does_not_carry(fields, why):
  validation.validate(_config())
  c = _config()
  c.update_from_flattened_dict(fields)
  with pytest.raises(ConfigError, match=rf"'rollout.partial' = True .*{why}"):
    validation.validate(c)


def test_partial_rollouts_run_on_one_host(monkeypatch):
  preflight.check_engine(_config())       # any row shards: an engine each
  monkeypatch.setattr(agent_parked.jax, "process_count", lambda: 2)
  with pytest.raises(ConfigError, match=r"'rollout.partial' = True runs on "
                     "one host; this run has 2 processes"):
    preflight.check_engine(_config())


@pytest.mark.slow
def test_the_stream_over_row_shards_on_eight_fake_devices(
    run_sharding_checks):
  """tests/partial_sharding_checks.py in a subprocess: the stream's rows
  over 8 (then 4 x tensor 2, fsdp 2) row shards, an engine per shard, cut
  by a switch and continued, give one device's greedy rows token for
  token, every page back."""
  run_sharding_checks("partial_sharding_checks.py", ["8,1,1", "2,2,2"])


@pytest.mark.slow
def test_the_streams_routes_over_row_shards_on_eight_fake_devices(
    run_sharding_checks, monkeypatch):
  """The same on tiny-moe with `sampling.record_routes` (experts split over
  tensor on 2,2,2): every column's recorded experts, cut rows' carried
  ones included, are one device's too."""
  monkeypatch.setenv("PARTIAL_CHECKS_ROUTES", "1")
  run_sharding_checks("partial_sharding_checks.py", ["8,1,1", "2,2,2"])


def _record(monkeypatch) -> tuple[list, list]:
  """The generation batches the stream scores, (step, Groups) in order,
  and the steps' batches the trainer learns on, (Groups, metrics)."""
  scored, learned = [], []
  score, learn = partial_rollouts.PartialThreaded._score, train.learn

  def recorded_score(self, stream, d, u, c):
    out = score(self, stream, d, u, c)
    scored.append((u, async_rollouts.decode(out).groups))
    return out

  def recorded_learn(r, state, groups, metrics, step):
    learned.append((groups, metrics))
    return learn(r, state, groups, metrics, step)

  monkeypatch.setattr(partial_rollouts.PartialThreaded, "_score",
                      recorded_score)
  monkeypatch.setattr(train, "learn", recorded_learn)
  return scored, learned


def _dynamic_config():
  """_config with dynamic sampling's refills for 6 steps: at seed 0 steps
  0, 2 and 4 draw a refill, step 3 hits the cap (2 fillers), and rows are
  carried into steps 4 and 5."""
  c = _config(steps=6)
  c.rl.update(dynamic_sampling=True, max_gen_batches=3, on_cap="fill")
  return c


@pytest.mark.slow
def test_dynamic_sampling_refills_in_the_stream_and_resume_with_them(
    tmp_path, monkeypatch):
  """Each step trains on the first b groups with signal of its generation
  batches, drawn until b are kept or max_gen_batches are drawn (filler
  groups, on_cap = fill, masked out), its dynamic/* metrics count them as
  the non-partial path defines them; stopped after step 4 (checkpoint 4
  holds carried rows) and resumed, the run equals the uninterrupted one."""
  with monkeypatch.context() as m:
    scored, learned = _record(m)
    straight = train.run(_dynamic_config(), str(tmp_path / "straight"))
  c = _dynamic_config()
  b, cap = c.rl.prompts_per_step, c.rl.max_gen_batches
  assert len(learned) == c.train.steps
  for u, (groups, metrics) in enumerate(learned):
    seen = [g for s, g in scored if s == u]
    signal = [dynamic_sampling.group_has_signal(g.reward_bg) for g in seen]
    kept = np.cumsum([k.sum() for k in signal])
    # drawn until b are kept or the cap: none after the one reaching b
    assert (kept[:-1] < b).all() and (kept[-1] >= b or len(seen) == cap)
    assert metrics["dynamic/num_gen_batches"] == len(seen)
    assert metrics["dynamic/kept_fraction"] == kept[-1] / (b * len(seen))
    real = min(b, int(kept[-1]))
    assert metrics["dynamic/num_filler"] == b - real
    assert metrics["dynamic/cap_hit"] == int(kept[-1] < b)
    # the first `real` groups with signal, whole and in order
    want = np.concatenate([g.tokens_bgt[k] for g, k in zip(seen, signal)])
    np.testing.assert_array_equal(groups.tokens_bgt[:real], want[:real])
    assert dynamic_sampling.group_has_signal(groups.reward_bg[:real]).all()
    assert not groups.mask_bgt[real:].any()      # fillers: no gradient
    rewards = np.concatenate([g.reward_bg.ravel() for g in seen])
    assert metrics["reward/mean"] == pytest.approx(float(rewards.mean()))
  assert any(m["dynamic/num_gen_batches"] > 1 for _, m in learned)
  assert any(m["dynamic/cap_hit"] for _, m in learned)
  rows = async_checks.run_metrics(tmp_path / "straight")
  assert all(r["partial/stale_dropped"] == 0 for r in rows)
  assert max(r["staleness/token_max"] for r in rows) <= 1
  _stopped_and_resumed(monkeypatch, _dynamic_config, tmp_path, 4, straight)


def test_a_refill_joins_the_queue_ahead_of_later_steps_rows():
  """The stream keeps its queue in (batch, index) order: step 0's refill
  (batch 1 at 3 batches a step) added after step 1's batch 3 goes ahead of
  it; a batch counts as in flight until its samples are taken."""
  cfg = types.SimpleNamespace(max_new_tokens=4)
  stream = partial.Stream(types.SimpleNamespace(sampling=cfg, shards=1), 4,
                          None)
  stream.add(0, [(1,), (2,)])
  stream.add(3, [(3,), (4,)])
  for _ in range(4):     # batch 0 admitted, as the engine would
    row = stream.queue.popleft()
    stream.live[row.batch, row.index] = row
  stream.add(1, [(5,), (6,)])
  assert [(r.batch, r.prompt) for r in stream.queue] == (
      [(1, (5,))] * 2 + [(1, (6,))] * 2 + [(3, (3,))] * 2 + [(3, (4,))] * 2)
  assert stream.in_flight(1) and not stream.admitted_all(1)
  assert stream.admitted_all(0) and not stream.in_flight(0)


def test_a_step_draws_refills_by_the_rule_of_the_non_partial_path():
  """wants_more: without dynamic sampling one batch a step; with it,
  batches until b = 2 groups with signal are kept, at most 3."""
  mixed = _groups()                                     # 2 groups, both kept
  flat = mixed._replace(reward_bg=np.ones((2, 2), np.float32))   # none
  half = mixed._replace(reward_bg=np.array([[1, 1], [0, 1]], np.float32))
  off = rollout.DynamicSampling()
  assert off.wants_more([], 2) and not off.wants_more([flat], 2)
  on = rollout.DynamicSampling(True, 3, "fill")
  assert on.batches == 3 and off.batches == 1
  assert on.wants_more([], 2) and on.wants_more([flat], 2)
  assert on.wants_more([flat, half], 2)
  assert not on.wants_more([half, half], 2)
  assert not on.wants_more([mixed], 2)
  assert not on.wants_more([flat, flat, half], 2)        # the cap


def _stop_after(monkeypatch, step: int):
  """A stop request at the end of step `step` (as SIGTERM's), once."""
  calls = []

  def stop_requested():
    calls.append(1)
    return len(calls) == step

  monkeypatch.setattr(train.interrupts, "stop_requested", stop_requested)


def _stopped_and_resumed(monkeypatch, config, tmp_path, step: int,
                         straight: dict) -> dict:
  """config() stopped after `step` in tmp_path/stopped (its checkpoint holds
  the stream with rows queued), then the same command again: metrics and
  parameters equal the uninterrupted run `straight` (in tmp_path/straight).
  Returns the stopped checkpoint's partial-rollouts host state."""
  with monkeypatch.context() as m:
    _stop_after(m, step)
    with pytest.raises(interrupts.Preempted):
      train.run(config(), str(tmp_path / "stopped"))
  held = checkpoint.load_host_state(str(tmp_path / "stopped"), step)["partial"]
  assert held["version"] == step and held["stream"]["queue"]
  resumed = train.run(config(), str(tmp_path / "stopped"))
  assert (async_checks.run_metrics(tmp_path / "stopped") ==
          async_checks.run_metrics(tmp_path / "straight"))
  want = async_checks.leaves(straight["state"].params)
  got = async_checks.leaves(resumed["state"].params)
  for name, x in want.items():
    np.testing.assert_array_equal(got[name], x, err_msg=name)
  return held


# tiny, and tiny-moe with routing replay (the rows' routes through the
# stream, its checkpoint and the trainer's replay; its rows run to 16
# tokens at once, so at 32 some are in flight at a switch)
REPLAY = {"tiny": {}, "replay": {"model.source": "tiny-moe",
                                 "model.moe.routing_replay": "rollout",
                                 "sampling.max_new_tokens": 32}}


@pytest.mark.slow
@pytest.mark.parametrize("model", REPLAY)
def test_rows_carried_across_switches_and_resume_with_them_is_exact(
    tmp_path, monkeypatch, model):
  def config():
    c = _config()
    c.update_from_flattened_dict(REPLAY[model])
    return c

  straight = train.run(config(), str(tmp_path / "straight"))
  rows = async_checks.run_metrics(tmp_path / "straight")
  assert [r["rollout/version"] for r in rows] == [0, 0, 1, 2]
  assert [r["staleness/max"] for r in rows] == [0, 1, 1, 1]
  assert sum(r["partial/rows_carried"] for r in rows) > 0
  assert max(r["partial/version_span_max"] for r in rows) == 1
  assert max(r["staleness/token_max"] for r in rows) <= 1
  assert all(r["partial/stale_dropped"] == 0 for r in rows)
  if model == "replay":     # step 0: version 0's rows scored by version 0
    assert rows[0]["moe/routes_differ"] == 0
    assert rows[0]["rollout_logp_diff/max"] < 1e-5
  # stopped after step 2: checkpoint 2 holds the rows cut at the switch
  # into version 2, and the same command resumes from it
  held = _stopped_and_resumed(monkeypatch, config, tmp_path, 2, straight)
  if model == "replay":     # the cut rows' fed columns' routes
    assert all(len(d) == 7 for d in held["stream"]["queue"] if d[3])


def test_a_switch_prefills_the_rows_in_flight_at_their_mean_length_so_far():
  """Rows of lengths 1 and 3: one in flight at a random moment has sampled
  E[L^2] / 2E[L] = 10 / 8 tokens; 4 such rows of a 6-token prompt on 2
  chips at 1e12 FLOP/s."""
  from grpo_jax.aot import flops, split  # pylint: disable=import-outside-toplevel
  from grpo_jax.models import get_preset  # pylint: disable=import-outside-toplevel
  c = get_preset("tiny")
  plan = types.SimpleNamespace(model_config=c, prompt_len=6)
  chips = types.SimpleNamespace(count=2, spec={"flops": 1e12})
  tokens = 6 + 10 / 8
  want = flops.forward_flops(c, 4 * tokens, 4, 4 * flops.causal_pairs(
      tokens, 0)) / 2e12
  assert split.switch_prefill(plan, chips, 4, np.array([1, 3])) == want
