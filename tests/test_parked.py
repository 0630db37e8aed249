"""Rows that wait on the paged engine (generate/parked.py, agent_parked.py):
a parked row keeps its pages, re-admission prefills only its new tokens,
episodes equal the per-turn path's and an uncached reference, no page leaks."""
import dataclasses

import jax
import numpy as np
import pytest
import test_agents as ta  # the tiny model, the scripted env, the reference

from grpo_jax import config as config_lib
from grpo_jax import errors, validation
from grpo_jax.generate import agent, agent_parked, parked, rollout
from grpo_jax.harness import preflight
from grpo_jax.models import init_params
from grpo_jax.models.byte_tokenizer import byte_tokenizer

Z = 4          # columns per page: small, so turns cross pages


@pytest.fixture(scope="module")
def params():
  return jax.tree.map(lambda x: 4.0 * x,
                      init_params(ta.CONFIG, jax.random.key(0)))


def _paged(**kwargs):
  return ta._sampler(continuous_batching=True, kv_cache="paged",
                     page_size=Z, **kwargs)


def _engine(params, pages=32, slots=2, max_new=6):
  spec = parked.EngineSpec(ta.CONFIG, _paged(max_new_tokens=max_new).sampling,
                           slots, pages, context=64)
  return parked.Engine(spec, params, jax.random.key(0))


def _greedy(params, seq, n):
  """n greedy ids after seq by a full forward per token (no cache)."""
  seq = list(seq)
  for _ in range(n):
    seq.append(ta._next_greedy(params, seq))
  return seq[-n:]


def _run(engine, row, max_new=6, first_t=0):
  assert engine.admit(row, noise=0, max_new=max_new, first_t=first_t)
  turns = []
  while not turns:
    turns = engine.step()
  return turns[0]


@pytest.mark.parametrize("slots,pages", [(2, 0), (3, 32)])
def test_greedy_episodes_equal_the_per_turn_path_and_an_uncached_reference(
    params, slots, pages):
  """slots < rows: rows queue for slots; pages 32 (one row's context):
  parked rows' pages are released for room and recomputed."""
  tok = byte_tokenizer()
  spec = dataclasses.replace(ta._spec(), engine="parked")
  stats = {}
  ep = agent_parked.run_episodes(_paged(slots=slots, pages=pages), params, tok,
                                 ta.EXAMPLES, jax.random.key(3), 2, spec,
                                 stats=stats)
  assert ep.turns_n.max() >= 3, "the test must cover several turns"
  if not pages:
    want = agent.run_episodes(ta._sampler(), params, tok, ta.EXAMPLES,
                              jax.random.key(3), 2, ta._spec())
    for name in ("tokens_nt", "action_nt", "observation_nt", "length_n",
                 "truncated_n", "turns_n", "tool_calls_n"):
      np.testing.assert_array_equal(getattr(ep, name), getattr(want, name),
                                    name)
    np.testing.assert_allclose(ep.logp_nt, want.logp_nt, atol=1e-4)
  for i in range(4):
    ref, _ = ta._reference(params, tok, ep.prompt_ids[i // 2], spec, 6)
    np.testing.assert_array_equal(ep.tokens_nt[i, :len(ref)], ref)
  assert stats["free_pages"] == stats["pages"], "every page back at the end"
  if pages:
    assert stats["released"] > 0, "the test must cover releasing for room"


def test_coarse_decode_buckets_give_the_uncached_reference(params):
  """EngineSpec.max_buckets bounds the decode attention's branches a layer
  (what keeps a 16K context compilable): 1, the whole table in one bucket,
  and 16 (two buckets of 8 pages here) give the reference's greedy turn."""
  prompt = tuple(byte_tokenizer().encode("what is 7*8 and then 9-4"))
  for max_buckets, block in ((1, 16 * Z), (16, 8 * Z)):
    spec = parked.EngineSpec(ta.CONFIG, _paged(max_new_tokens=30,
                                               stop_ids=(0,)).sampling,
                             1, 16, context=64, max_buckets=max_buckets)
    assert spec.block == block
    turn = _run(parked.Engine(spec, params, jax.random.key(0)),
                parked.Parked(0, prompt), max_new=30)
    assert len(prompt) + len(turn.ids) > 8 * Z, "reads past one bucket"
    assert turn.ids == _greedy(params, prompt, len(turn.ids))


def test_a_groups_rows_share_their_prompts_pages(params):
  """G = 4 rows a prompt: the first admitted prefills the prompt, the
  others take its full pages (`Engine.share`) and prefill their tails on
  their own pages: fewer pages and prefilled tokens, the same episodes."""
  tok = byte_tokenizer()
  spec = dataclasses.replace(ta._spec(), engine="parked")
  runs = {}
  for share in (True, False):
    stats = {}
    ep = agent_parked.run_episodes(_paged(), params, tok, ta.EXAMPLES,
                                   jax.random.key(3), 4, spec, stats=stats,
                                   share_prompts=share)
    assert stats["free_pages"] == stats["pages"], "every page back"
    runs[share] = ep, stats
  (shared, s), (own, o) = runs[True], runs[False]
  for name in ("tokens_nt", "action_nt", "observation_nt", "length_n"):
    np.testing.assert_array_equal(getattr(shared, name), getattr(own, name))
  np.testing.assert_allclose(shared.logp_nt, own.logp_nt, atol=1e-5)
  full = sum((len(p) - 1) // Z for p in shared.prompt_ids)
  assert full > 0, "the test must cover a prompt of full pages"
  assert s["peak_pages"] < o["peak_pages"]
  assert o["prefilled"] - s["prefilled"] == 3 * full * Z   # 3 of 4 rows


def test_a_shared_page_returns_when_its_last_holder_gives_it_back(params):
  engine = _engine(params, pages=32)
  prompt = tuple(range(40, 51))                       # 2 full pages + 3
  first = engine.admit(parked.Parked(0, prompt), 0, 6)
  pages = engine.share(first, 2)
  second = engine.admit(parked.Parked(1, prompt, 2 * Z, pages), 1, 6)
  assert second.pages[:2] == first.pages[:2]
  turns = []
  while len(turns) < 2:
    turns += engine.step()
  a, b = sorted(turns, key=lambda t: t.row)
  assert a.ids == b.ids == _greedy(params, prompt, len(a.ids))
  engine.release(a.parked)
  assert engine.free_pages == 32 - len(b.parked.pages)  # b holds the shared
  engine.release(b.parked)
  assert engine.free_pages == 32


def test_int8_pages_on_the_engine_score_what_the_uncached_forward_gives(
    params):
  """sampling.kv_dtype = int8: the engine's pool is int8 pages and its
  episodes' log-probs are the float model's full forward over each
  trajectory within 0.05 nats, and not exactly it (the int8 path ran):
  test_quant's tolerance, on weights x 3 as there (the module's x 4 sharpens the
  logits past it: 0.14 at worst there, the float engine's 4e-6)."""
  params = jax.tree.map(lambda x: 0.75 * x, params)
  tok = byte_tokenizer()
  spec = dataclasses.replace(ta._spec(), engine="parked")
  sampler = _paged(kv_dtype="int8")
  ep = agent_parked.run_episodes(sampler, params, tok, ta.EXAMPLES,
                                 jax.random.key(3), 2, spec)
  assert ep.turns_n.max() >= 3, "the test must cover several turns"
  engine = parked.Engine(parked.EngineSpec(ta.CONFIG, sampler.sampling, 2, 32,
                                           64), params, jax.random.key(3))
  assert engine.pool.k[0].values.dtype == np.int8
  worst = 0.0
  for i in range(len(ep.length_n)):
    prompt = list(ep.prompt_ids[i // 2])
    n, P = int(ep.length_n[i]), len(prompt)
    seq = prompt + ep.tokens_nt[i, :n].tolist()
    padded = np.zeros((1, 256), np.int32)
    padded[0, :len(seq)] = seq
    logp = np.asarray(jax.nn.log_softmax(ta._forward(ta.CONFIG, params,
                                                     padded)[0]))
    act = np.flatnonzero(ep.action_nt[i, :n])
    want = logp[P - 1 + act, np.asarray(seq)[P + act]]
    worst = max(worst, float(np.abs(ep.logp_nt[i, act] - want).max()))
  assert 0 < worst < 0.05, worst


def test_the_rollout_runs_the_engine_the_env_config_names(params):
  """generate_groups with env.engine 'parked': the per-turn path's groups
  (greedy), and the engine's metrics."""
  tok, rewards = byte_tokenizer(), rollout.RewardSpec(
      (("last_number", 1.0, {}),), "last_number")
  groups = {}
  for engine, sampler in (("turns", ta._sampler()),
                          ("parked", _paged(slots=2))):
    settings = rollout.GroupSettings(
        2, rewards, "last_number",
        env=dataclasses.replace(ta._spec(), engine=engine))
    groups[engine], metrics = rollout.generate_groups(
        sampler, params, tok, ta.EXAMPLES, jax.random.key(3), settings)
  for name in ("tokens_bgt", "mask_bgt", "observation_bgt", "length_bg",
               "reward_bg"):
    np.testing.assert_array_equal(getattr(groups["parked"], name),
                                  getattr(groups["turns"], name), name)
  assert metrics["env/engine_free_pages"] == metrics["env/engine_pages"]
  assert metrics["env/engine_prefilled"] > 0


@pytest.mark.parametrize("kwargs,error", [
    ((("delay_s", 3.0), ("observations", ("late",))), "timed out after 0.1 s"),
    ((("observations", ("raise",)),), "RuntimeError")])
def test_slow_and_failing_tools_are_error_observations_on_the_engine(
    params, kwargs, error):
  tok = byte_tokenizer()
  spec = dataclasses.replace(ta._spec(), engine="parked", max_turns=2,
                             max_observation_tokens=48, tool_timeout_s=0.1,
                             kwargs=kwargs)
  ep = agent_parked.run_episodes(_paged(), params, tok, ta.EXAMPLES[:1],
                                 jax.random.key(3), 2, spec)
  called = ep.tool_calls_n > 0
  assert called.any(), "the test must cover a tool call"
  np.testing.assert_array_equal(ep.tool_errors_n, called)
  i = int(np.argmax(called))
  text = tok.decode(ep.tokens_nt[i][ep.observation_nt[i]].tolist())
  assert f"error: {error}" in text


def test_a_parked_row_keeps_its_pages_and_only_new_tokens_are_prefilled(
    params):
  engine = _engine(params)
  prompt = tuple(range(40, 51))                              # 11 tokens
  turn = _run(engine, parked.Parked(0, prompt))
  assert engine.stats.prefilled == len(prompt)
  assert turn.ids == _greedy(params, prompt, len(turn.ids))
  row = turn.parked
  assert row.cached == len(prompt) + len(turn.ids) - 1
  assert len(row.pages) == -(-row.cached // Z)
  assert engine.free_pages == 32 - len(row.pages), "held while parked"
  observation = (7, 8, 9, 10, 11)
  again = _run(engine, row._replace(tokens=row.tokens + observation))
  # the turn's last id (its keys were never written) and the observation
  assert engine.stats.prefilled == len(prompt) + 1 + len(observation)
  history = row.tokens + observation
  assert again.ids == _greedy(params, history, len(again.ids))
  engine.release(again.parked)
  assert engine.free_pages == 32 and not engine.busy


def test_a_released_row_comes_back_with_cached_zero(params):
  """The partial-rollouts admission: pages released (a weight switch), the
  row recomputed from its first token."""
  engine = _engine(params)
  turn = _run(engine, parked.Parked(0, tuple(range(40, 51))))
  row = engine.release(turn.parked._replace(
      tokens=turn.parked.tokens + (7, 8, 9)))
  assert row.cached == 0 and row.pages == () and engine.free_pages == 32
  before = engine.stats.prefilled
  again = _run(engine, row)
  assert engine.stats.prefilled - before == len(row.tokens)
  assert again.ids == _greedy(params, row.tokens, len(again.ids))
  engine.release(again.parked)
  assert engine.free_pages == 32
  with pytest.raises(ValueError, match="free"):
    engine.release(again.parked)


def test_admission_waits_for_a_slot_and_for_pages(params):
  engine = _engine(params, pages=16, slots=1)
  row = parked.Parked(0, tuple(range(40, 51)))
  assert engine.admit(row, 0, 6)
  assert not engine.admit(row._replace(row=1), 1, 6), "no slot left"
  turns = []
  while not turns:
    turns = engine.step()
  held = 16 - engine.free_pages
  big = parked.Parked(1, tuple(range(30, 30 + 4 * (16 - held) + 1)))
  assert not engine.admit(big, 1, 6), "its pages are not free"
  engine.release(turns[0].parked)
  assert engine.admit(big, 1, 6)


def test_a_bad_admission_is_refused(params):
  engine = _engine(params)
  with pytest.raises(ValueError, match="cached"):
    engine.admit(parked.Parked(0, (1, 2, 3), cached=3), 0, 6)
  with pytest.raises(ValueError, match="context"):
    engine.admit(parked.Parked(0, tuple(range(70))), 0, 6)
  assert engine.admit(parked.Parked(0, (1, 2, 3)), 0, 6)
  with pytest.raises(ValueError, match="already holds a slot"):
    engine.admit(parked.Parked(0, (1, 2, 3)), 0, 6)


def test_the_engine_is_chosen_and_checked_in_the_config():
  c = config_lib.base_config()
  c.env.name, c.env.engine = "scripted", "nope"
  with pytest.raises(errors.ConfigError, match="env.engine"):
    validation.validate(c)
  c.env.engine = "parked"
  with pytest.raises(errors.ConfigError, match="kv_cache"):
    validation.validate(c)
  c.sampling.continuous_batching, c.sampling.kv_cache = True, "paged"
  validation.validate(c)
  assert ta.base.EnvSpec.from_config(c).engine == "parked"
  preflight.check_engine(c)      # any row shards: an engine per shard


@pytest.mark.parametrize("recompute", [False, True])
def test_a_turn_cut_at_a_step_boundary_continues_as_if_uncut(params,
                                                             recompute):
  """Partial rollouts' use: a live row leaves mid-turn (`park_all`) and is
  admitted again (with its pages, or released and recomputed); sampled at
  temperature 1, the continued turn is the uncut one."""
  cfg = _paged(max_new_tokens=12, greedy=False, temperature=1.0,
               stop_ids=()).sampling
  spec = parked.EngineSpec(ta.CONFIG, cfg, 2, 32, 64, steps_per_call=4)
  prompt = parked.Parked(0, tuple(range(40, 51)))
  whole = parked.Engine(spec, params, jax.random.key(7))
  want = _run(whole, prompt, max_new=12)
  engine = parked.Engine(spec, params, jax.random.key(7))
  assert engine.admit(prompt, 0, 12)
  assert engine.step() == []
  cut = engine.park_all()[0]
  assert cut.cut and 0 < len(cut.ids) < 12 and not engine.busy
  row = engine.release(cut.parked) if recompute else cut.parked
  rest = _run(engine, row, 12 - len(cut.ids), first_t=len(cut.ids))
  assert cut.ids + rest.ids == want.ids
  np.testing.assert_allclose(cut.logp + rest.logp, want.logp, atol=1e-5)
  engine.release(rest.parked)
  assert engine.free_pages == 32


@pytest.mark.slow
def test_rows_over_row_shards_on_eight_fake_devices(run_sharding_checks):
  """tests/parked_sharding_checks.py in a subprocess: rows over 8 (then 4 x
  tensor 2, fsdp 2) row shards, an engine per shard on its devices, give
  one device's greedy episodes token for token, every page back."""
  run_sharding_checks("parked_sharding_checks.py", ["8,1,1", "2,2,2"])
