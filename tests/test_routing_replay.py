"""MoE routing replay through the loop (docs/models.md): the lockstep,
dense-slot and paged samplers record every token's experts per sparse
layer (the slots: 2 slots for 6 rows, so rows end and slots refill; the
pages: a pool so small that rows wait and one is preempted); they travel
with the rollout (Groups, rows, packed rows, the async host state) and the
trainer's passes replay them (gates recomputed from its router)."""
import functools
import json
import os
import subprocess
import sys

import async_checks
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import validation
from grpo_jax.errors import ConfigError
from grpo_jax.generate import parked, rollout, sampling
from grpo_jax.harness import experiment, preflight
from grpo_jax.models import cast, get_preset, init_params, routing, transformer
from grpo_jax.rl import async_rollouts, batch, step, update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = get_preset("tiny-moe")
PROMPTS = [[5, 9, 13, 2, 7], [11, 3], [4, 4, 8, 1]]
G, T = 2, 6


# The samplers that record: lockstep, dense slots (2 for 6 rows; stop ids
# these rows sample: a row ends at its 3rd token, one at its first) and
# pages (6 slots over the smallest pool the host allows: 5 prompt pages and
# one row's 11 of 2 columns; rows wait and one is preempted).
SAMPLERS = {"lockstep": dict(stop_ids=(3,)),
            "slots": dict(continuous_batching=True, slots=2,
                          stop_ids=(17, 57)),
            "paged": dict(continuous_batching=True, kv_cache="paged",
                          slots=6, page_size=2, pages=16, stop_ids=(17, 57))}


def _sample(params, record=True, sampler="lockstep", pools=None):
  """pools: the paged sampler's (kept: one compiled program for the tests;
  its `stats` say how the pool went)."""
  settings = sampling.SamplingConfig(max_new_tokens=T, record_routes=record,
                                     **SAMPLERS[sampler])
  pools = sampling.PagePools() if pools is None else pools
  return jax.device_get(sampling.Sampler(CONFIG, settings, pools=pools).sample(
      params, PROMPTS, jax.random.key(0), G))


def _groups(out) -> rollout.Groups:
  B = len(PROMPTS)
  return rollout.shape_groups(
      out, PROMPTS, np.arange(B * G, dtype=np.float32) % 2,
      np.zeros(B * G, bool), G)


@pytest.fixture(scope="module")
def params():
  return init_params(CONFIG, jax.random.key(1))


def _scored(params, rows, group_size=1, dtype="float32", routes=True):
  """The trainer's log-probs and metrics on the rows (one micro-batch)."""
  program = update.UpdateProgram(
      CONFIG, update.LossSettings(chunk=8, compute_dtype=dtype),
      group_size=group_size)
  b = update.UpdateBatch(
      jnp.asarray(rows.tokens_ns), jnp.asarray(rows.positions_ns),
      jnp.asarray(rows.valid_ns), jnp.asarray(rows.mask_nt),
      jnp.asarray(rows.old_logp_nt), jnp.zeros_like(rows.old_logp_nt),
      jnp.ones(len(rows.mask_nt)),
      routes_nslc=jnp.asarray(rows.routes_nslc) if routes else None)
  norm = update.global_normalisers(b.mask_nt, program.loss)
  logp, _, _ = update.batch_logprobs(
      update.cast(params, dtype), b, rows.mask_nt.shape[1], program)
  _, metrics = update.loss_fn(update.Policy(params), b, norm, 0.0, program)
  return np.asarray(logp), metrics


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_recorded_routes_are_the_full_forwards(params, sampler):
  """Every column's recorded experts (prompt and completion, the last
  sampled token included) are the ones a full-sequence pass chooses."""
  pools = sampling.PagePools()
  out = _sample(params, sampler=sampler, pools=pools)
  if sampler != "lockstep":  # rows end at other steps, one at its 1st token
    assert 1 in out.length_n and 0 < out.truncated_n.sum() < 5
  if sampler == "paged":
    stats = jax.device_get(pools.stats)
    assert stats.preempted >= 1 and stats.waited > 0
    assert stats.in_use_end == 0
  _assert_full_forwards_routes(params, batch.to_rows(_groups(out), 0, False))


# The full passes the checks compare with, jitted: a compile a shape, where
# op-by-op dispatch compiles every op.
_hidden_states_and_routes = jax.jit(functools.partial(
    transformer.hidden_states_and_kv, return_routes=True), static_argnums=0)
_forward_routed = jax.jit(routing.forward_routed, static_argnums=0)


def _assert_full_forwards_routes(params, rows):
  """The rows' recorded routes are a full-sequence pass's at every valid
  column."""
  assert rows.routes_nslc.dtype == np.uint8
  assert rows.routes_nslc.shape == rows.tokens_ns.shape + (2, 2)
  *_, taken_lnsc = _hidden_states_and_routes(
      CONFIG, params, jnp.asarray(rows.tokens_ns),
      jnp.asarray(rows.positions_ns), jnp.asarray(rows.valid_ns))
  taken_nslc = np.moveaxis(np.asarray(taken_lnsc), 0, 2)
  valid = rows.valid_ns
  np.testing.assert_array_equal(np.sort(rows.routes_nslc[valid], -1),
                                np.sort(taken_nslc[valid], -1))


# Shared prompts by default through packed rows (test_packed_rows_...);
# the padded shared-prompt pass is slow (CI budget).
@pytest.mark.parametrize("group_size,sampler", [
    (1, "lockstep"), (1, "slots"), (1, "paged"),
    pytest.param(G, "lockstep", marks=pytest.mark.slow)])
def test_replay_gives_the_samplers_logprobs_in_float32(params, group_size,
                                                       sampler):
  """At the sampler's parameters, the trainer's log-probs with replay are
  the sampler's (float32) and no route differs."""
  out = _sample(params, sampler=sampler)
  rows = batch.to_rows(_groups(out), 0, False)
  logp, metrics = _scored(params, rows, group_size)
  mask = rows.mask_nt > 0
  np.testing.assert_allclose(logp[mask], rows.old_logp_nt[mask], atol=2e-6)
  assert float(metrics["moe/routes_differ"]) == 0.0
  assert float(metrics["moe/aux_loss"]) > 0


@pytest.mark.slow
def test_replay_in_bfloat16_within_its_rounding(params):
  """bf16 sampler and trainer, replayed: the log-probs agree within bf16's
  rounding of the logits (measured: docs/models.md)."""
  half = cast(params, "bfloat16")
  out = _sample(half)
  rows = batch.to_rows(_groups(out), 0, False)
  logp, _ = _scored(half, rows, dtype="bfloat16")
  mask = rows.mask_nt > 0
  np.testing.assert_allclose(logp[mask], rows.old_logp_nt[mask], atol=0.02)


def test_routes_differ_when_the_samplers_router_did(params):
  """A sampler whose router moved routes some tokens elsewhere: the metric
  counts them (> 0); the trainer still replays the sampler's experts."""
  moved = dict(params, layers=dict(params["layers"]))
  router = params["layers"]["router"]
  moved["layers"]["router"] = router + 0.2 * jnp.std(router) * \
      jax.random.normal(jax.random.key(3), router.shape)
  rows = batch.to_rows(_groups(_sample(moved)), 0, False)
  _, metrics = _scored(params, rows)
  assert 0 < float(metrics["moe/routes_differ"]) < 0.5


def test_packed_rows_carry_the_routes(params):
  """Packed rows (a group's prompt once) replay the same experts: their
  log-probs are the padded rows'."""
  rows = batch.to_rows(_groups(_sample(params)), 0, False)
  plan = step.UpdatePlan.of(step.UpdateSpec(packing="on", num_generations=G),
                            rows)
  cols = update.UpdateBatch(jnp.asarray(rows.tokens_ns),
                            jnp.asarray(rows.positions_ns),
                            jnp.asarray(rows.valid_ns),
                            routes_nslc=jnp.asarray(rows.routes_nslc))
  packed, num_micro, used = step.for_program(
      plan, cols, (rows.tokens_ns, rows.valid_ns, rows.mask_nt,
                   rows.routes_nslc), G, jnp.asarray)
  assert used["pack/used"] == 1.0 and packed.rows.routes_rslc is not None
  program = update.UpdateProgram(CONFIG, update.LossSettings(chunk=8),
                                 num_micro=num_micro,
                                 logp_shape=rows.mask_nt.shape)
  logp = update.score_logprobs(update.Policy(params), packed, program)
  mask = rows.mask_nt > 0
  np.testing.assert_allclose(np.asarray(logp)[mask], rows.old_logp_nt[mask],
                             atol=2e-6)


def test_routes_survive_dynamic_sampling_and_the_host_state(params):
  """Groups' routes are selected and concatenated with their groups, and an
  async batch's host state (JSON) gives them back bit for bit."""
  groups = _groups(_sample(params))
  from grpo_jax.algorithms import dynamic_sampling
  picked = dynamic_sampling.select_groups(groups, np.array([2, 0]))
  assert picked.prompt_routes_b[0].shape == (len(PROMPTS[2]), 2, 2)
  np.testing.assert_array_equal(picked.routes_bgtlc[1], groups.routes_bgtlc[0])
  b = async_rollouts.Batch(1, 0, groups, {}, {}, np.zeros(2, np.uint32))
  back = async_rollouts.decode(async_rollouts.encode(b)).groups
  for p, q in zip(back.prompt_routes_b, groups.prompt_routes_b):
    np.testing.assert_array_equal(p, q)
  np.testing.assert_array_equal(back.routes_bgtlc, groups.routes_bgtlc)
  assert back.routes_bgtlc.dtype == np.uint8


# Each record_routes episode path; the parked engine's over 2 slots and a
# pool of one row's context (20 pages of 4 columns): rows wait for slots,
# parked rows are released for room and recomputed, prompts are shared.
EPISODES = {
    "turns": {}, "parked": dict(engine="parked", slots=2, pages=20,
                                page_size=4)}


@pytest.mark.slow      # the sampler's or engine's compiles, a forward, a loss
@pytest.mark.parametrize("engine", EPISODES)
def test_env_episodes_record_the_routes_the_trainer_replays(params, engine):
  """Turn by turn (env.engine = 'turns'), a row's last sampler call gives
  its whole history's experts; on the parked engine each column's are
  recorded when it is fed (the last token by one more admission). Either
  way the rows' routes (observations included) are a full-sequence pass's
  at every valid column, and the trainer's log-probs with replay are the
  sampler's."""
  from grpo_jax.data.example import Example
  from grpo_jax.envs import base
  from grpo_jax.models.byte_tokenizer import byte_tokenizer
  kw = dict(EPISODES[engine])
  spec = base.EnvSpec("scripted", kwargs=(("observations", ("12", "x")),),
                      max_turns=2, max_observation_tokens=24,
                      tool_timeout_s=5.0, engine=kw.pop("engine", "turns"))
  settings = rollout.GroupSettings(
      G, rollout.RewardSpec((("last_number", 1.0, {}),), "last_number"),
      "last_number", env=spec)
  sampler = sampling.Sampler(CONFIG, sampling.SamplingConfig(
      max_new_tokens=T, stop_ids=tuple(range(0, 256, 3)), pad_id=1,
      record_routes=True, **kw))
  groups, metrics = rollout.generate_groups(
      sampler, params, byte_tokenizer(),
      [Example("2+3?", "5"), Example("what is 7*8", "56")],
      jax.random.key(5), settings)
  assert metrics["env/turns_mean"] > 1 and groups.routes_bgtlc is not None
  if engine == "parked":
    assert metrics["env/engine_released"] > 0
    assert metrics["env/engine_free_pages"] == metrics["env/engine_pages"]
  rows = batch.to_rows(groups, 1, False)
  assert groups.observation_bgt.any()
  _assert_full_forwards_routes(params, rows)
  logp, metrics = _scored(params, rows)
  mask = rows.mask_nt > 0
  np.testing.assert_allclose(logp[mask], rows.old_logp_nt[mask], atol=2e-6)
  assert float(metrics["moe/routes_differ"]) == 0.0


def _recording_engine(params) -> parked.Engine:
  """2 slots, 32 pages of 2 columns, a 24-column context."""
  cfg = sampling.SamplingConfig(max_new_tokens=T, stop_ids=(), pad_id=1,
                                record_routes=True, page_size=2)
  return parked.Engine(parked.EngineSpec(CONFIG, cfg, 2, 32, 24), params,
                       jax.random.key(0))


def _full_routes(params, tokens) -> np.ndarray:
  """A full-sequence pass's experts (S, L_sparse, C), sorted per token."""
  _, taken_lnsc = _forward_routed(CONFIG, params, jnp.asarray([tokens]))
  return np.sort(np.moveaxis(np.asarray(taken_lnsc)[:, 0], 0, 1), -1)


def _run_turns(engine, rows, turns=None) -> dict:
  """Admit each (row, max_new); step until `turns` (default: one a row)
  have ended: row -> Turn."""
  for noise, (row, max_new) in enumerate(rows):
    assert engine.admit(row, noise, max_new)
  ended = {}
  while len(ended) < (turns or len(rows)):
    ended.update((t.row, t) for t in engine.step())
  return ended


def test_parked_engine_records_each_column_when_fed(params):
  """The parked engine records every column's experts when it is fed: a
  shared prompt's (the sharer's pages), prefills after a park (an
  observation appended) and after a release (recomputed from the first
  token), decode steps', the last token's by a one-token admission: each
  row's routes are a full-sequence pass's."""
  engine = _recording_engine(params)
  prompt = (5, 9, 13, 2, 7)
  first = engine.admit(parked.Parked(0, prompt), 0, T)
  shared = parked.Parked(1, prompt, 4, engine.share(first, 2))   # 4 columns
  ended = _run_turns(engine, [(shared, T)], 2)    # and row 0's turn
  ended = _run_turns(engine, [
      (engine.release(ended[0].parked), 2),     # row 1 holds the shared
      (ended[1].parked._replace(tokens=ended[1].parked.tokens + (11, 3)), 3)])
  ended = _run_turns(engine, [(t.parked, 1) for t in ended.values()])
  for turn in ended.values():
    row = turn.parked
    assert row.cached == len(row.tokens) - 1 and len(turn.ids) == 1
    np.testing.assert_array_equal(np.sort(engine.routes(row), -1),
                                  _full_routes(params, row.tokens[:-1]))
    engine.release(row)
  assert engine.free_pages == 32


def test_a_recomputed_row_keeps_its_routes_as_first_fed(params):
  """A row released (a weight switch) and recomputed under other weights
  keeps its columns' routes as first fed (the old weights' full pass), the
  columns fed after as the new weights' full pass gives them."""
  engine = _recording_engine(params)
  before = _run_turns(engine, [(parked.Parked(0, (5, 9, 13, 2, 7)), T)])[0]
  k = before.parked.cached
  released = engine.release(before.parked)
  engine.params = moved = jax.tree.map(lambda x: 3.0 * x, params)
  after = _run_turns(engine, [(released, 3)])[0]
  row = _run_turns(engine, [(after.parked, 1)])[0].parked
  routes = np.sort(engine.routes(row), -1)
  old, new = (_full_routes(p, row.tokens[:-1]) for p in (params, moved))
  assert (old[:k] != new[:k]).any(), "the new weights route otherwise"
  np.testing.assert_array_equal(routes[:k], old[:k])
  np.testing.assert_array_equal(routes[k:], new[k:])


def test_partial_rollouts_stream_records_each_column_as_first_fed(params):
  """Partial rollouts' stream over 2 slots, a weight switch while rows are
  in flight: a row that ended before it fed its last token under the old
  weights, a cut row keeps its fed columns' routes (the old weights' full
  pass) and those fed after are the new weights', rows admitted after it
  are the new weights' throughout; the routes travel into Groups, and the
  stream's state at the switch (a checkpoint of rows in flight) keeps them
  bit for bit."""
  from grpo_jax.generate import partial
  cfg = sampling.SamplingConfig(
      max_new_tokens=T, stop_ids=(17,), pad_id=1, record_routes=True,
      continuous_batching=True, kv_cache="paged", slots=2, page_size=2)
  stream = partial.Stream(sampling.Sampler(CONFIG, cfg), len(PROMPTS) * G,
                          jax.random.key(0))
  stream.switch(params, 0)
  stream.add(0, PROMPTS)
  stream.admit(0)
  stream.decode()      # row 0 ends at its 3rd token, row 1 is in flight
  moved = jax.tree.map(lambda x: 3.0 * x, params)
  stream.switch(moved, 1)
  held = json.loads(json.dumps(stream.state()))
  copy = partial.Stream(stream.sampler, stream.n, stream.key)
  copy.restore(held)
  for r, c in zip([*stream.queue, stream.ended[0][0][0]],
                  [*copy.queue, copy.ended[0][0][0]]):
    assert (r.routes is None) == (c.routes is None)
    if r.routes is not None:
      np.testing.assert_array_equal(c.routes, r.routes)
      assert c.routes.dtype == r.routes.dtype
  while not stream.ready(0):
    stream.admit(0)
    stream.decode()
  out, version_nt = stream.samples(0)
  P = max(map(len, PROMPTS))
  spans = []
  for i in range(len(PROMPTS) * G):
    prompt, n = PROMPTS[i // G], int(out.length_n[i])
    tokens = tuple(prompt) + tuple(out.tokens_nt[i, :n])
    old = int((version_nt[i, :n] == 0).sum())
    # columns fed under the old weights: all (ended before the switch),
    # the prompt and all but the last old token (cut), none (admitted after)
    k = len(tokens) if old == n else old and len(prompt) + old - 1
    spans.append((old, n - old))
    routes = np.sort(out.routes_nslc[i, P - len(prompt):P + n], -1)
    padded = tokens + (1,) * (P + T - len(tokens))    # one shape: causal
    want = [_full_routes(p, padded)[:len(tokens)] for p in (params, moved)]
    np.testing.assert_array_equal(routes[:k], want[0][:k])
    np.testing.assert_array_equal(routes[k:], want[1][k:])
  assert spans[0] == (3, 0) and spans[1][0] == 3 and spans[1][1] > 0
  assert all(old == 0 for old, _ in spans[2:])
  groups = _groups(out)
  np.testing.assert_array_equal(groups.routes_bgtlc.reshape(
      out.routes_nslc[:, P:].shape), out.routes_nslc[:, P:])
  for b, p in enumerate(PROMPTS):
    np.testing.assert_array_equal(groups.prompt_routes_b[b],
                                  out.routes_nslc[b * G, P - len(p):P])


def test_replay_is_refused_where_routes_are_not_recorded():
  """Every sampler records routes: dense slots, pages, partial rollouts,
  env episodes (turn by turn, parked) validate; an unknown mode and a
  dense model are refused, naming the field."""
  config = async_checks.config(**{"model.source": "tiny-moe",
                                  "model.moe.routing_replay": "rollout"})
  validation.validate(config)
  config.sampling.continuous_batching = True
  validation.validate(config)
  config.sampling.kv_cache = "paged"
  validation.validate(config)
  partial = async_checks.stale(config.copy_and_resolve_references())
  partial.rollout.partial = True
  validation.validate(partial)
  config.sampling.continuous_batching = False
  config.sampling.kv_cache = "dense"
  config.env.name = "calculator"
  validation.validate(config)
  config.sampling.continuous_batching = True
  config.sampling.kv_cache = "paged"
  config.env.engine = "parked"
  validation.validate(config)
  config.model.moe.routing_replay = "always"
  with pytest.raises(ConfigError, match="allowed: \\('off', 'rollout'\\)"):
    validation.validate(config)
  dense = async_checks.config(**{"model.moe.routing_replay": "rollout"})
  with pytest.raises(ConfigError, match="has no experts"):
    preflight.check_model(dense, get_preset("tiny"),
                          experiment.load_tokenizer(dense))


def _train_rows(tmp_path, name, *fields, model="tiny-moe"):
  """The training rows (metrics.jsonl, timings dropped) of a `model` run
  with replay on 8 fake devices (tests/async_checks.py)."""
  out = tmp_path / f"{name}.npz"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", "async_checks.py"), "8",
       str(tmp_path / name), str(out), f"model.source={model}",
       "model.moe.routing_replay=rollout", "rl.packing=on", *fields],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-4000:]
  saved = np.load(out)
  assert int(saved["devices"]) == 8
  return [r for r in json.loads(str(saved["metrics"])) if "loss" in r]


@pytest.mark.slow
def test_tiny_moe_trains_with_replay_on_8_devices_with_an_expert_axis(
    tmp_path):
  """tiny-moe, experts split 4 ways over `tensor` (mesh (2, 1, 4)), packed
  rows, replay: in float32 the trainer routes as the sampler did and
  scores its log-probs (the first update's mismatch at rounding). Then
  the asynchronous split (4 + 4 devices, rows one version stale): the
  routes travel through the sampler thread; a stale router differs."""
  rows = _train_rows(tmp_path, "mesh", "mesh.shape=[2,1,4]")
  assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
  assert all(r["moe/routes_differ"] == 0 for r in rows)
  assert all(r["rollout_logp_diff/max"] < 1e-5 for r in rows)
  assert rows[0]["moe/aux_loss"] > 0 and rows[0]["pack/used"] == 1
  stale = _train_rows(tmp_path, "split", "mesh.shape=[1,1,4]",
                      "rollout.sampler_devices=4", "stale=1")
  assert [r["staleness/max"] for r in stale] == [0, 1, 1]
  assert all(np.isfinite(r["loss"]) for r in stale)
  assert stale[0]["moe/routes_differ"] == 0 < stale[1]["moe/routes_differ"]


@pytest.mark.slow
def test_tiny_deepseek_trains_with_replay_on_the_paged_sampler(tmp_path):
  """DeepSeek-V3's architecture (MLA's latent pages, grouped sigmoid
  routing with a bias, a shared expert) sampled by the paged sampler,
  experts split 4 ways over `tensor` (mesh (2, 1, 4), 8 fake devices),
  packed rows, replay, 2 steps: in float32 the trainer routes as the
  sampler did and scores its log-probs."""
  rows = _train_rows(tmp_path, "deepseek", "mesh.shape=[2,1,4]",
                     "train.steps=2", "sampling.continuous_batching=true",
                     "sampling.kv_cache=paged", model="tiny-deepseek")
  assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
  assert all(r["moe/routes_differ"] == 0 for r in rows)
  assert all(r["rollout_logp_diff/max"] < 1e-5 for r in rows)
  assert rows[0]["pack/used"] == 1
