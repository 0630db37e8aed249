"""The trainer end to end on the tiny config, and its invariants."""
import dataclasses
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from update_batches import random_update_batch

from configs import tiny
from grpo_jax import config as config_lib
from grpo_jax import errors, validation
from grpo_jax.algorithms import losses
from grpo_jax.generate import rollout
from grpo_jax.models import get_preset, init_params
from grpo_jax.rl import step, train, update


def test_three_step_run_of_tiny_config(tmp_path):
  """Three steps, the rate warming up; each step's one update is on the
  sampler's policy, so with the sampler's log-probs its ratio is 1 (at
  step 1 before any update, at steps 2 and 3 after one)."""
  config = tiny.get_config()
  config.optim.warmup_steps = 2
  summary = train.run(config, str(tmp_path))
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  steps = [r for r in rows if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3]
  for key in ("reward/mean", "reward/std", "accuracy", "response_length/mean",
              "response_length/max", "truncation_rate", "entropy",
              "clip/low_frac", "clip/high_frac", "grad_norm", "learning_rate",
              "time/sample", "time/score", "time/reference", "time/update",
              "tokens_per_second"):
    assert key in steps[0], key
  assert all(np.isfinite(r["loss"]) for r in steps)
  assert config.rl.num_updates == 1 and config.rl.mini_batch_size == 0
  for r in steps:
    assert abs(r["ratio/max"] - 1) < 1e-4 and abs(r["ratio/min"] - 1) < 1e-4
    assert r["clip/low_frac"] == 0 and r["clip/high_frac"] == 0
  # the rate each step's update used: warm-up from 0 over 2 updates
  lr = config.optim.learning_rate
  np.testing.assert_allclose([r["learning_rate"] for r in steps],
                             [0.0, lr / 2, lr], rtol=1e-6)
  assert "eval_before" in summary and "eval_after" in summary
  assert int(summary["state"].step) == 3
  assert os.path.isdir(tmp_path / "tensorboard")


# seq-mean-token-mean: the same at the loss level (test_losses.py), and
# through LoRA (test_lora.py); here slow.
@pytest.mark.parametrize("agg", [
    "token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow)])
def test_loss_and_gradient_do_not_depend_on_micro_batching(agg):
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0))
  batch = random_update_batch()
  s = update.LossSettings(loss=losses.PolicyLossSpec(agg=agg), chunk=4)
  # 2 micro-batches too: test_shared_prompt_pass_equals_full_rows (1, 2, 4).
  results = [jax.jit(update.accumulate_gradients, static_argnums=3)(
      update.Policy(params), batch, 0.0,
      update.UpdateProgram(cfg, s, num_micro=k)) for k in (1, 4)]
  for grads, loss, _ in results[1:]:
    np.testing.assert_allclose(loss, results[0][1], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(results[0][0])):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def _grouped_batch(prompt_lens=(3, 6), G=4, P=6, comp=5, seed=1):
  """B = len(prompt_lens) left-padded prompts, each with G completions: the
  packed layout train.py feeds the update (rows b*G .. b*G+G-1 share b)."""
  rng = np.random.RandomState(seed)
  rows = []
  for n in prompt_lens:
    prompt = rng.randint(1, 256, n)
    for _ in range(G):
      rows.append(np.concatenate([np.zeros(P - n, int), prompt,
                                  rng.randint(1, 256, comp)]))
  tokens = np.array(rows, np.int32)
  pad = np.repeat([P - n for n in prompt_lens], G)[:, None]
  col = np.arange(P + comp)[None]
  N = len(rows)
  lengths = rng.randint(1, comp + 1, N)
  mask = (np.arange(comp)[None] < lengths[:, None]).astype(np.float32)
  valid = (col >= pad) & ((col < P) | (col - P < lengths[:, None]))
  return update.UpdateBatch(
      jnp.asarray(tokens), jnp.asarray(np.maximum(col - pad, 0), jnp.int32),
      jnp.asarray(valid), jnp.asarray(mask),
      jnp.asarray(rng.randn(N, comp).astype(np.float32) * 0.1 - 2.0),
      jnp.zeros((N, comp)), jnp.asarray(rng.randn(N).astype(np.float32)))


@pytest.mark.parametrize("variant,remat", [
    ("tiny", "none"), pytest.param("tiny", "dots", marks=pytest.mark.slow),
    pytest.param("window+bias+qk_norm", "none", marks=pytest.mark.slow)])
def test_shared_prompt_pass_equals_full_rows(variant, remat):
  """Running each group's prompt once gives the loss, gradient and log-probs
  of running every row whole, for any micro-batching."""
  cfg = get_preset("tiny")
  if variant != "tiny":   # Mistral's sliding window, Qwen's bias and q/k norm
    cfg = dataclasses.replace(cfg, sliding_window=4, qkv_bias=True,
                              qk_norm=True)
  params = init_params(cfg, jax.random.key(0))
  batch = _grouped_batch()
  s = update.LossSettings(chunk=4, remat=remat)
  step = jax.jit(update.accumulate_gradients, static_argnums=3)
  program = lambda num_micro, group_size: update.UpdateProgram(
      cfg, s, num_micro=num_micro, group_size=group_size,
      logp_shape=batch.mask_nt.shape)
  want_grads, want_loss, _ = step(update.Policy(params), batch, 0.0,
                                  program(1, 1))
  for num_micro in (1, 2, 4):
    grads, loss, _ = step(update.Policy(params), batch, 0.0,
                          program(num_micro, 4))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  rows = update.UpdateBatch(batch.tokens_ns, batch.positions_ns,
                            batch.valid_ns)
  np.testing.assert_allclose(
      update.score_logprobs(update.Policy(params), rows, program(1, 4)),
      update.score_logprobs(update.Policy(params), rows, program(1, 1)),
      rtol=1e-5, atol=1e-5)


def test_micro_group_size_and_group_minibatches():
  assert [update.micro_group_size(8, m) for m in (1, 2, 4, 8, 16)] == [
      8, 4, 2, 1, 1]
  assert update.micro_group_size(6, 4) == 1 and update.micro_group_size(1, 1) == 1
  # With a layout, the prompts (rows / group size) must split over its
  # batch shards: 512 rows in groups of 16 are 32 prompts, which 64 batch
  # shards cannot split (every chip would run all 32), 32 shards can.
  shards = lambda n: types.SimpleNamespace(batch_shards=n)
  assert update.micro_group_size(16, 8, 512, shards(64)) == 1
  assert update.micro_group_size(16, 8, 512, shards(32)) == 2
  config = config_lib.base_config()
  config.rl.num_generations = 4
  spec = step.UpdateSpec.from_config(config)
  assert spec.group_size(8) == 4
  assert spec.group_size(6) == 1     # mini-batch splits a group
  config.rl.shared_prompt = False
  assert step.UpdateSpec.from_config(config).group_size(8) == 1
  batches = step._minibatches(12, 8 // 2, np.random.default_rng(0), 4)
  for idx in batches:                           # whole groups, in order
    assert len(idx) == 4 and idx[0] % 4 == 0
    assert list(idx) == list(range(idx[0], idx[0] + 4))
  assert sorted(np.concatenate(batches)) == list(range(12))


def test_dynamic_sampling_returns_exactly_b_groups_with_signal():
  rng = np.random.RandomState(0)
  B, G, T = 4, 3, 2

  def generate(i):
    correct = rng.rand(B, G) < 0.5
    correct[0] = True              # one group without signal per batch
    prompts_b = np.empty(B, object)
    prompts_b[:] = [(1, 2)] * B
    batch = rollout.Groups(
        prompts_b, np.zeros((B, G, T), np.int32), np.zeros((B, G, T), np.float32),
        np.ones((B, G, T), bool), np.full((B, G), T), np.zeros((B, G), bool),
        correct.astype(np.float32), correct)
    return batch, {"time/sample": 1.0, "sample/tokens": B * G * T}

  batch, metrics = rollout.collect(generate, B, rollout.DynamicSampling(True, 10, "raise"))
  assert isinstance(batch, rollout.Groups) and batch.reward_bg.shape == (B, G)
  assert np.all(batch.reward_bg.max(1) > batch.reward_bg.min(1))
  assert batch.prompt_ids_b.shape == (B,) and batch.tokens_bgt.shape == (B, G, T)
  assert 0 < metrics["dynamic/kept_fraction"] < 1


def test_config_errors_name_the_field():
  config = tiny.get_config()
  config.rl.eps_hihg = 0.3
  with pytest.raises(errors.ConfigError, match="rl.eps_hihg"):
    validation.validate(config)
  config = tiny.get_config()
  config.rl.loss_agg = "token-sum"
  with pytest.raises(errors.ConfigError, match="token-mean"):
    validation.validate(config)
  config = tiny.get_config()
  config.rewards = {"lastnumber": 1.0}
  with pytest.raises(errors.ConfigError, match="last_number"):
    validation.validate(config)
  config = tiny.get_config()
  config.rl.micro_batch_size = 3
  with pytest.raises(errors.ConfigError, match="micro_batch_size"):
    validation.validate(config)


def test_configs_that_cannot_run_fail_validation_with_the_reason():
  config = tiny.get_config()
  config.rl.advantage = "grpo_process"      # needs per-step rewards
  with pytest.raises(errors.ConfigError,
                     match=r"per-step rewards.*'grpo', 'rloo'|'grpo'.*'rloo'"):
    validation.validate(config)
  config.rl.process_reward = "equations"    # a process reward: it runs
  config.rl.loss_agg = "seq-mean-token-mean"
  validation.validate(config)
  config = tiny.get_config()
  config.rl.eps_low = 1.5                   # the loss's own clip check
  with pytest.raises(errors.ConfigError, match="rl.eps_low.*eps_low < 1"):
    validation.validate(config)
  config = tiny.get_config()
  config.rl.dual_clip = 0.5
  with pytest.raises(errors.ConfigError, match="dual_clip.*> 1"):
    validation.validate(config)
  config = tiny.get_config()
  config.rewards = {"countdown": 1.0}       # no final_answer to evaluate with
  config.accuracy_reward = "countdown"
  with pytest.raises(errors.ConfigError, match="final_answer.*last_number"):
    validation.validate(config)
  config.train.eval_at_start = config.train.eval_at_end = False
  validation.validate(config)               # a run that never evaluates
  config = tiny.get_config()
  config.data.source = "jsonl"
  config.data.kwargs = {"path": "/data/x.jsonl", "layout": "cqa"}
  config.data.eval_kwargs = {"path": "/data/x.jsonl"}
  with pytest.raises(errors.ConfigError,
                     match=r"data.kwargs.layout.*'commonsenseqa'"):
    validation.validate(config)
  config = tiny.get_config()
  config.rl.on_cap = "drop"
  with pytest.raises(errors.ConfigError, match="'fill', 'fewer', 'raise'"):
    validation.validate(config)
