"""Multi-turn episodes with tools (envs/, generate/agent.py): token-in,
token-out, the masks in every aggregation, the built-in envs, tool errors
and time-outs as observations, the config."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax import errors, validation
from grpo_jax.algorithms import losses, rollout_correction
from grpo_jax.data.example import Example
from grpo_jax.envs import base, calculator
from grpo_jax.generate import agent, rollout, sampling
from grpo_jax.models import forward, get_preset, init_params
from grpo_jax.models.byte_tokenizer import byte_tokenizer
from grpo_jax.rl import async_rollouts, update
from grpo_jax.rl import batch as batch_lib
from grpo_jax.star import sft_run

CONFIG = get_preset("tiny")
STOPS = tuple(range(0, 256, 3))      # a random tiny model stops in ~3 tokens
OBS = ("12", "error-free output that is long enough to be cut", "x")


@pytest.fixture(scope="module")
def params():
  # Scaled up: a random tiny model's greedy turns then vary (at init scale
  # it repeats one token).
  return jax.tree.map(lambda x: 4.0 * x, init_params(CONFIG, jax.random.key(0)))


def _spec(observations=OBS, **kwargs):
  fields = dict(max_turns=4, max_observation_tokens=24, tool_timeout_s=5.0)
  fields.update(kwargs)
  return base.EnvSpec("scripted", kwargs=(("observations", observations),),
                      **fields)


def _sampler(**kwargs):
  cfg = dict(max_new_tokens=6, greedy=True, stop_ids=STOPS, pad_id=1)
  cfg.update(kwargs)
  return sampling.Sampler(CONFIG, sampling.SamplingConfig(**cfg))


EXAMPLES = [Example("2+3?", "5"), Example("what is 7*8", "56")]
_forward = jax.jit(forward, static_argnums=0)


def _next_greedy(params, seq):
  padded = jnp.zeros((1, 256), jnp.int32).at[0, :len(seq)].set(
      jnp.asarray(seq, jnp.int32))
  return int(jnp.argmax(_forward(CONFIG, params, padded)[0, len(seq) - 1]))


def _reference(params, tokenizer, prompt, spec, max_new):
  """Greedy turn by turn with a full forward per token (no cache), the
  scripted observations appended as ids: (trajectory, action mask)."""
  turns = agent.ToolTurns.of(tokenizer, STOPS)
  seq, traj, act = list(prompt), [], []
  for k in range(spec.max_turns):
    for _ in range(max_new):
      tok = _next_greedy(params, seq)
      seq.append(tok)
      traj.append(tok)
      act.append(True)
      if tok in STOPS:
        break
    else:
      break                                  # no stop: the episode ends
    if k + 1 == spec.max_turns or k >= len(OBS):
      break
    obs = turns.wrap(tokenizer, OBS[k], spec.max_observation_tokens)
    seq += obs
    traj += obs
    act += [False] * len(obs)
  return traj, act


@pytest.mark.parametrize("continuous", [
    False, pytest.param(True, marks=pytest.mark.slow)])
def test_greedy_episodes_equal_an_uncached_turn_by_turn_reference(
    params, continuous):
  tok, spec = byte_tokenizer(), _spec()
  kw = dict(continuous_batching=True, slots=2) if continuous else {}
  ep = agent.run_episodes(_sampler(**kw), params, tok, EXAMPLES,
                          jax.random.key(3), 2, spec)
  assert ep.turns_n.max() >= 3, "the test must cover several turns"
  for i in range(4):
    want, act = _reference(params, tok, ep.prompt_ids[i // 2], spec, 6)
    k = len(want)
    assert int(ep.length_n[i]) == k
    np.testing.assert_array_equal(ep.tokens_nt[i, :k], want)
    np.testing.assert_array_equal(ep.action_nt[i, :k], act)
    np.testing.assert_array_equal(ep.observation_nt[i, :k], ~np.array(act))
    assert not ep.action_nt[i, k:].any() and not ep.observation_nt[i, k:].any()


def test_update_trains_on_exactly_the_sampled_and_observation_tokens(params):
  """The env saw each turn's ids as sampled; the update's rows are the
  prompt + those ids + the observation ids, and scoring them with the
  sampler's weights gives the sampler's log-probs on the model's tokens."""
  tok, spec = byte_tokenizer(), _spec()
  settings = rollout.GroupSettings(
      2, rollout.RewardSpec((("last_number", 1.0, {}),), "last_number"),
      "last_number", env=spec)
  seen = []
  real_make = base.EnvSpec.make
  def recording_make(self):
    env = real_make(self)
    seen.append(env)
    return env
  base.EnvSpec.make = recording_make
  try:
    groups, metrics = rollout.generate_groups(
        _sampler(greedy=False, temperature=1.0), params, tok, EXAMPLES,
        jax.random.key(5), settings)
  finally:
    base.EnvSpec.make = real_make
  assert metrics["env/turns_mean"] > 1
  rows = batch_lib.to_rows(groups, 1, False)
  T = rows.mask_nt.shape[1]
  turns = agent.ToolTurns.of(tok, STOPS)
  for i, env in enumerate(seen):
    want, act = [], []
    for k, (_, ids) in enumerate(env.turns):
      want += ids
      act += [True] * len(ids)
      if k < len(env.turns) - 1:
        obs = turns.wrap(tok, OBS[k], spec.max_observation_tokens)
        want += obs
        act += [False] * len(obs)
    traj = rows.tokens_ns[i, -T:]
    k = int(groups.length_bg.reshape(-1)[i])
    np.testing.assert_array_equal(traj[:len(want)], want)
    np.testing.assert_array_equal(rows.mask_nt[i, :len(want)] > 0, act)
    assert rows.valid_ns[i, -T:][:k].all() and not rows.valid_ns[i, -T:][k:].any()
  program = update.UpdateProgram(CONFIG, update.LossSettings(), None)
  cols = update.UpdateBatch(jnp.asarray(rows.tokens_ns),
                            jnp.asarray(rows.positions_ns),
                            jnp.asarray(rows.valid_ns))
  logp = update.score_logprobs(update.Policy(params), cols, dataclasses.replace(
      program, num_micro=1, group_size=1, logp_shape=rows.mask_nt.shape))
  m = rows.mask_nt > 0
  np.testing.assert_allclose(np.asarray(logp)[m], rows.old_logp_nt[m],
                             atol=2e-5)
  assert (rows.old_logp_nt[~m] == 0).all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean",
                                 "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm"])
def test_observation_tokens_are_out_of_every_aggregation(agg):
  """Values at observation positions (mask 0 inside a row) change nothing:
  the loss, KL, entropy, ratio and rollout-correction metrics, the token
  counts; and the loss equals the same rows with the observations cut out
  (token-mean, seq-mean-token-mean, seq-mean-token-sum)."""
  mask = np.array([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 0, 0]], np.float32)
  r = np.random.default_rng(1)   # logp, old, ref, entropy, rollout logp
  a = [r.normal(-1.0, 0.3, mask.shape).astype(np.float32) for _ in range(5)]
  b = [np.where(mask > 0, v, np.random.default_rng(9).normal(0, 3, mask.shape)
                ).astype(np.float32) for v in a]
  adv = jnp.asarray([0.7, -0.4])
  spec = losses.PolicyLossSpec(agg=agg)
  corr = rollout_correction.CorrectionSettings(is_level="token")
  def run(v, m):
    weight, _, cm = rollout_correction.correct(jnp.asarray(v[1]),
                                               jnp.asarray(v[4]), m, corr)
    loss, metrics = losses.policy_loss(
        jnp.asarray(v[0]), jnp.asarray(v[1]), adv, m, jnp.asarray(v[2]),
        spec=spec, kl_beta=0.1, entropy_nt=jnp.asarray(v[3]),
        is_weight_nt=weight)
    return float(loss), {**{k: float(x) for k, x in metrics.items()},
                         **{k: float(x) for k, x in cm.items()}}
  la, ma = run(a, jnp.asarray(mask))
  lb, mb = run(b, jnp.asarray(mask))
  assert la == pytest.approx(lb, abs=1e-6)
  for k in ma:
    assert ma[k] == pytest.approx(mb[k], abs=1e-5), k
  if agg != "seq-mean-token-sum-norm":    # its constant is T, not the length
    keep = mask > 0
    cut = [np.zeros_like(v) for v in a]
    cut_mask = np.zeros_like(mask)
    for i in range(2):
      n = int(keep[i].sum())
      cut_mask[i, :n] = 1
      for c, v in zip(cut, a):
        c[i, :n] = v[i][keep[i]]
    lc, mc = run(cut, jnp.asarray(cut_mask))
    assert la == pytest.approx(lc, abs=1e-6)
    assert ma["kl"] == pytest.approx(mc["kl"], abs=1e-6)
    assert ma["entropy"] == pytest.approx(mc["entropy"], abs=1e-6)


@pytest.mark.slow   # 20 s; the padded invariant is test_train.py's
def test_token_mean_is_exact_under_micro_batching_with_observations():
  """The update's loss and gradient with observation tokens inside rows do
  not depend on the micro-batch split (the token-mean invariant)."""
  params = init_params(CONFIG, jax.random.key(0))
  rng = np.random.default_rng(2)
  n, P, T = 4, 4, 10
  tokens = rng.integers(2, 256, (n, P + T)).astype(np.int32)
  obs = np.zeros((n, T), bool)
  obs[:, 3:6] = True
  mask = np.ones((n, T), bool) & ~obs
  mask[1, 8:] = False
  valid = np.concatenate([np.ones((n, P), bool), mask | obs], axis=1)
  positions = np.broadcast_to(np.arange(P + T), (n, P + T)).astype(np.int32)
  old = rng.normal(-2, 0.2, (n, T)).astype(np.float32) * mask
  b = update.UpdateBatch(jnp.asarray(tokens), jnp.asarray(positions),
                         jnp.asarray(valid), jnp.asarray(mask, jnp.float32),
                         jnp.asarray(old), jnp.zeros((n, T)),
                         jnp.asarray([1.0, -1.0, 0.5, -0.5]))
  def grads(micro):
    program = update.UpdateProgram(CONFIG, update.LossSettings(chunk=4),
                                   num_micro=micro)
    g, loss, _ = jax.jit(update.accumulate_gradients, static_argnums=3)(
        update.Policy(params), b, 0.0, program)
    return loss, g
  (l1, g1), (l4, g4) = grads(1), grads(4)
  assert float(l1) == pytest.approx(float(l4), rel=1e-5, abs=1e-6)
  for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7)


def test_tool_errors_and_time_outs_are_observations():
  spec = _spec(observations=("raise",), tool_timeout_s=0.05)
  slow = base.EnvSpec("scripted", 2, 24, 0.05,
                      (("delay_s", 1.5), ("observations", ("late",))))
  crash, late = spec.make(), slow.make()
  out = agent.run_tools([(crash, "t", [5]), (late, "t", [5])], 0.05)
  assert out[0] == base.Observation("error: RuntimeError", error=True)
  assert out[1].error and "timed out" in out[1].text


def test_calculator_evaluates_arithmetic_and_nothing_else():
  assert calculator.evaluate("12*(3+4) - 2**10") == 12 * 7 - 1024
  assert calculator.evaluate("7/2") == 3.5
  for bad in ("__import__('os')", "x + 1", "9**9**9", "(1).real", "[1]",
              "open('f')", "1 +"):
    with pytest.raises(ValueError):
      calculator.evaluate(bad)
  env = calculator.Calculator()
  assert env.step("so <calc>123*456</calc>", [1]) == base.Observation("56088")
  assert env.step("<calc>1/0</calc>", [1]).error
  assert env.step("the answer is 5", [1]) == base.Done()


def test_calculator_calls_are_tool_transcripts_for_an_sft_warm_up():
  """Data source calculator_calls (configs/tool_use.py :warm): a problem's
  call turn after the episode's own first prompt, and its answer turn after
  the call and the tool's value, rendered from the chat in its meta."""
  call, answer = calculator.calculator_calls(1, levels=5)
  assert call.rationale == f"<calc>{call.meta['expression']}</calc>"
  assert answer.rationale == f"The answer is {call.answer}."
  c, tok = config_lib.base_config(), byte_tokenizer()
  c.data.template = "calculator"
  first, second = sft_run.sft_examples(c, tok, [call, answer])
  _, _, prompt_ids = agent.start_rows(tok, [call], 1, base.EnvSpec(
      "calculator"), "")
  assert first.prompt_ids == prompt_ids[0]
  turn = tok.decode(second.prompt_ids)[len(tok.decode(first.prompt_ids)):]
  assert turn.startswith(call.rationale) and call.answer in turn
  assert calculator.Calculator().step(call.rationale, []) == base.Observation(
      call.answer)                    # the value the env gives that call


def test_an_env_run_is_rl_or_an_sft_warm_up():
  c = config_lib.base_config()
  c.env.name = "calculator"
  for method in ("rl", "sft"):
    c.method = method
    validation.validate(c)
  c.method = "star"
  with pytest.raises(errors.ConfigError, match="not 'star'"):
    validation.validate(c)


def test_python_env_runs_the_block_in_the_sandbox():
  from grpo_jax.rewards import sandbox
  if sandbox.unavailable_reason() is not None:
    pytest.skip(f"no sandbox here: {sandbox.unavailable_reason()}")
  env = base.EnvSpec("python", tool_timeout_s=3.0).make()
  assert env.step("```python\nprint(123*456)\n```", [1]) == base.Observation(
      "56088\n")
  assert env.step("```python\nraise KeyError(1)\n```", [1]).error
  slow = base.EnvSpec("python", tool_timeout_s=0.5).make()
  out = slow.step("```python\nwhile True: pass\n```", [1])
  assert out.error and "timed out" in out.text
  assert env.step("no code, answer 5", [1]) == base.Done()


def test_groups_with_observations_survive_the_host_state():
  """Asynchronous rollouts keep batches in the checkpoint's host state:
  the observation mask comes back bit for bit (and None stays None)."""
  g = np.ones((1, 2, 3), bool)
  groups = rollout.Groups(np.array([(1, 2)], object), np.ones((1, 2, 3), np.int32),
                          np.zeros((1, 2, 3), np.float32), g, np.full((1, 2), 3),
                          np.zeros((1, 2), bool), np.zeros((1, 2), np.float32),
                          np.zeros((1, 2), bool), ~g)
  b = async_rollouts.Batch(0, 0, groups, {}, {}, np.zeros(2, np.uint32))
  back = async_rollouts.decode(async_rollouts.encode(b)).groups
  np.testing.assert_array_equal(back.observation_bgt, ~g)
  none = async_rollouts.decode(async_rollouts.encode(
      b._replace(groups=groups._replace(observation_bgt=None)))).groups
  assert none.observation_bgt is None


def test_env_config_is_validated():
  c = config_lib.base_config()
  assert c.env.name == ""
  validation.validate(c)
  for field, value, words in (("name", "nope", "env.name"),
                              ("max_turns", 0, "env.max_turns"),
                              ("tool_timeout_s", 0.0, "env.tool_timeout_s")):
    bad = config_lib.base_config()
    bad.env.name = "scripted"
    bad.env[field] = value
    with pytest.raises(errors.ConfigError, match=words):
      validation.validate(bad)


def test_observation_budget_is_checked_at_start():
  from grpo_jax.harness import preflight
  c = config_lib.base_config()
  c.env.update(name="scripted", max_observation_tokens=8)
  with pytest.raises(errors.ConfigError, match="env.max_observation_tokens"):
    preflight.check_env(c, byte_tokenizer())      # markers: 19 bytes
  c.env.max_observation_tokens = 20
  preflight.check_env(c, byte_tokenizer())


@pytest.mark.slow   # 23 s of compiles; the default tests keep under a minute
def test_evaluation_with_an_env_reports_tool_use(params):
  from grpo_jax import evaluation
  settings = evaluation.EvalSettings(
      _sampler().sampling, rollout.RewardSpec((("last_number", 1.0, {}),),
                                              "last_number"),
      "last_number", "last_number", "", "float32", 0, n=0, ks=(1,),
      temperature=1.0, top_p=1.0, batch_size=2, env=_spec())
  out = evaluation.evaluate_policy(settings, CONFIG, params, byte_tokenizer(),
                                   EXAMPLES)
  m = out.metrics
  assert m["eval/greedy_turns_mean"] >= 1 and "eval/greedy_tool_call_rate" in m
  # the answer read is each episode's last turn, after its last observation
  assert all("tool:" not in t for row in out.greedy.texts for t in row)


# A training step of the tiny config on the scripted env (a tool call earns
# 1, so the groups' rewards differ and the loss is not 0), in a process of
# its own with `devices` fake CPU devices and mesh `mesh`: its step metrics.
_ENV_STEP = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + sys.argv[1]
from configs import tiny
from grpo_jax.rl import train
c = tiny.get_config()
c.train.steps, c.train.eval_at_start, c.train.eval_at_end = 2, False, False
c.rl.packing = "off"
c.mesh.shape = tuple(int(x) for x in sys.argv[2].split(","))
c.env.update(name="scripted", max_turns=2, max_observation_tokens=32,
             kwargs=dict(turn_reward=1.0), engine=sys.argv[3])
c.sampling.max_new_tokens = 24
if sys.argv[3] == "parked":
  c.sampling.update(continuous_batching=True, kv_cache="paged")
train.run(c, sys.argv[4])
"""


def _env_step_metrics(tmp_path, devices: int, mesh: str, engine: str):
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  workdir = str(tmp_path / f"{engine}_{devices}")
  subprocess.run([sys.executable, "-c", _ENV_STEP, str(devices), mesh, engine,
                  workdir], check=True, timeout=900, cwd=root,
                 env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"},
                 stdout=subprocess.DEVNULL)
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return [r for r in rows if "loss" in r]


@pytest.mark.slow   # 4 training runs of 2 steps in subprocesses
@pytest.mark.parametrize("engine, mesh", [("turns", "2,2,2"),
                                          ("parked", "4,1,2")])
def test_env_training_steps_on_eight_fake_devices_equal_one_devices(
    tmp_path, engine, mesh):
  """The env path in training on 8 fake devices (rows over the row shards;
  the parked engine one per shard): the same episodes (turns, tool calls,
  rewards) and the same loss and gradient norm as on one device."""
  one = _env_step_metrics(tmp_path, 1, "1,1,1", engine)
  eight = _env_step_metrics(tmp_path, 8, mesh, engine)
  assert [r["step"] for r in eight] == [1, 2]
  assert any(r["advantage/std"] > 0 for r in one)    # something to learn
  for a, b in zip(one, eight, strict=True):
    for key in ("env/turns_mean", "env/tool_calls_mean", "reward/mean",
                "env/observation_tokens_mean", "sample/tokens"):
      assert a[key] == b[key], (key, a[key], b[key])
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6)
