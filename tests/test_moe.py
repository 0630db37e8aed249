"""Mixture-of-experts decoders: Qwen3-MoE parity with transformers on a tiny
random checkpoint written here (dense and sparse layers, float32 log-softmax
within 1e-4) and export back; DeepSeek-V3's router (sigmoid, correction
bias, grouped top-k, scaling) and shared experts against transformers'
`DeepseekV3MoE`; no token dropped (a token's output does not depend on the
batch's other tokens); the balancing loss against transformers'; the cached
decode step against the full forward."""
import json

import hf_reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from grpo_jax.models import (
  decode,
  forward,
  get_preset,
  hf,
  init_params,
  load_pretrained,
  moe,
  save_pretrained,
)
from grpo_jax.models.moe_config import MoeConfig

TOKENS = np.random.RandomState(0).randint(0, 300, (2, 12))


def _randomize(model, seed=0):
  return hf_reference.randomize(model, seed, norm_offset=1.0)


_logprobs = hf_reference.logprobs


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
  config = transformers.Qwen3MoeConfig(
      vocab_size=300, hidden_size=64, intermediate_size=96,
      moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, num_experts=8,
      num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
      max_position_embeddings=128)
  model = _randomize(transformers.Qwen3MoeForCausalLM(config))
  directory = tmp_path_factory.mktemp("qwen3_moe")
  model.save_pretrained(directory)
  return model, directory


def test_qwen3_moe_matches_transformers_and_exports(qwen3_moe, tmp_path):
  model, directory = qwen3_moe
  config, params = load_pretrained(directory)
  assert config.moe.dense_layers == (1,) and config.moe.num_experts == 8
  assert params["layers"]["expert_gate"].shape == (2, 8, 64, 32)
  ours = jax.nn.log_softmax(jax.jit(forward, static_argnums=0)(
      config, params, jnp.asarray(TOKENS)))
  np.testing.assert_allclose(ours, _logprobs(model, TOKENS), atol=1e-4)
  save_pretrained(config, params, tmp_path / "out")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
  np.testing.assert_allclose(_logprobs(back.eval(), TOKENS),
                             _logprobs(model, TOKENS), atol=1e-5)


def test_cached_decode_matches_the_forward():
  config = get_preset("tiny-moe")
  params = init_params(config, jax.random.key(0))
  tokens = jnp.asarray(TOKENS % config.vocab_size)
  full = jax.jit(forward, static_argnums=0)(config, params, tokens)
  cache = decode.init_cache(config, 2, tokens.shape[1])
  step = jax.jit(decode.decode_step, static_argnums=0)
  for t in range(6):
    logits, cache = step(config, params, cache, tokens[:, t],
                         jnp.full((2,), t), t)
    np.testing.assert_allclose(logits, full[:, t], atol=1e-5)


def test_a_tokens_output_does_not_depend_on_the_batch():
  """No capacity, nothing dropped: a row alone and among 7 others whose
  tokens crowd its experts gets the same logits."""
  config = get_preset("tiny-moe")
  params = init_params(config, jax.random.key(1))
  run = jax.jit(forward, static_argnums=0)
  row = jnp.asarray(TOKENS[:1] % config.vocab_size)
  crowd = jnp.concatenate([row, jnp.full((7, row.shape[1]), 5)])
  np.testing.assert_allclose(run(config, params, crowd)[:1],
                             run(config, params, row), atol=1e-6)


def _deepseek_moe():
  config = transformers.DeepseekV3Config(
      hidden_size=32, moe_intermediate_size=16, n_routed_experts=8,
      num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
      routed_scaling_factor=2.5, norm_topk_prob=True)
  block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(
      config)
  block = _randomize(block, seed=3)
  with torch.no_grad():   # a bias that changes the choice, not the gates
    block.gate.e_score_correction_bias.copy_(
        torch.linspace(-0.5, 0.5, 8))
  return config, block


def _deepseek_params(block):
  t = lambda p: jnp.asarray(p.detach().numpy())
  F = block.experts.intermediate_dim
  gate_up = t(block.experts.gate_up_proj)          # (X, 2F, D)
  return {
      "router": t(block.gate.weight).T,
      "router_bias": t(block.gate.e_score_correction_bias),
      "expert_gate": gate_up[:, :F].transpose(0, 2, 1),
      "expert_up": gate_up[:, F:].transpose(0, 2, 1),
      "expert_down": t(block.experts.down_proj).transpose(0, 2, 1),
      "shared_gate": t(block.shared_experts.gate_proj.weight).T,
      "shared_up": t(block.shared_experts.up_proj.weight).T,
      "shared_down": t(block.shared_experts.down_proj.weight).T,
  }


def test_deepseek_v3_router_and_shared_experts_match_transformers():
  config, block = _deepseek_moe()
  cfg = MoeConfig(num_experts=8, experts_per_token=3, expert_dim=16,
                  router="sigmoid", norm_topk_prob=True, num_groups=4,
                  topk_groups=2, routed_scaling=2.5, correction_bias=True,
                  shared_dim=32)
  h = np.random.RandomState(2).randn(2, 20, 32).astype(np.float32)
  with torch.no_grad():
    want = block(torch.tensor(h)).numpy()
    _, gates, experts = block.gate(torch.tensor(h))
  got, routing = moe.sparse_mlp(cfg, _deepseek_params(block), jnp.asarray(h))
  np.testing.assert_allclose(got, want, atol=1e-5)
  order = lambda e: np.sort(np.asarray(e), axis=-1)
  np.testing.assert_array_equal(order(routing.experts_nc),
                                order(experts.numpy()))
  np.testing.assert_allclose(np.sort(routing.gates_nc, -1),
                             np.sort(gates.numpy(), -1), atol=1e-6)


def test_grouped_choice_by_hand():
  """4 groups of 2; group scores (two best summed) 0.3, 1.1, 0.9, 1.7: the
  best 2 groups are 3 and 1, so expert 4 (0.8, group 2) is passed over for
  expert 3 (0.6) though it scores higher."""
  cfg = MoeConfig(num_experts=8, experts_per_token=3, expert_dim=4,
                  router="sigmoid", num_groups=4, topk_groups=2)
  scores = jnp.array([[0.1, 0.2, 0.5, 0.6, 0.8, 0.1, 0.9, 0.8]])
  chosen = moe._choose_grouped(cfg, scores)  # pylint: disable=protected-access
  assert sorted(np.asarray(chosen[0]).tolist()) == [3, 6, 7]


def test_balance_loss_matches_transformers():
  cfg = MoeConfig(num_experts=8, experts_per_token=2, expert_dim=4)
  rng = np.random.RandomState(4)
  logits = [rng.randn(10, 8).astype(np.float32) for _ in range(3)]
  want = transformers.models.qwen3_moe.modeling_qwen3_moe \
      .load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), 8, 2)
  sums = [0.0, 0.0, 0.0]
  for x in logits:
    probs = jax.nn.softmax(jnp.asarray(x))
    routing = moe.Routing(jax.lax.top_k(probs, 2)[1], None, probs)
    terms = moe.balance_terms(cfg, routing, jnp.ones(10, bool))
    sums = [a + b for a, b in zip(sums, terms)]
  np.testing.assert_allclose(moe.balance_loss(cfg, *sums), float(want),
                             rtol=1e-5)
  uniform = moe.Routing(jnp.array([[0, 1], [2, 3], [4, 5], [6, 7]]), None,
                        jnp.full((4, 8), 1 / 8))
  assert float(moe.balance_loss(cfg, *moe.balance_terms(
      cfg, uniform, jnp.ones(4, bool)))) == pytest.approx(2.0)


@pytest.fixture(scope="module",
                params=[24, pytest.param(None, marks=pytest.mark.slow)])
def deepseek_v3(request, tmp_path_factory):
  """A tiny DeepSeek-V3: latent attention (with and without the query's low
  rank), interleaved rope, a dense first layer, grouped sigmoid routing
  with a correction bias, a shared expert."""
  config = transformers.DeepseekV3Config(
      vocab_size=300, hidden_size=32, intermediate_size=48,
      moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
      n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=16,
      q_lora_rank=request.param, qk_nope_head_dim=8, qk_rope_head_dim=4,
      v_head_dim=8, n_shared_experts=1, max_position_embeddings=128)
  model = _randomize(transformers.DeepseekV3ForCausalLM(config), seed=5)
  with torch.no_grad():
    for layer in model.model.layers[1:]:
      layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-.3, .3, 8))
  directory = tmp_path_factory.mktemp("deepseek_v3")
  model.save_pretrained(directory)
  return model, directory


def test_deepseek_v3_matches_transformers_and_exports(deepseek_v3, tmp_path):
  model, directory = deepseek_v3
  config, params = load_pretrained(directory)
  assert (config.num_kv_heads, config.head_dim) == (1, 20)  # latent + rope
  assert config.moe.dense_layers == (0,)
  tokens = TOKENS % 300
  full = jax.jit(forward, static_argnums=0)(config, params, jnp.asarray(tokens))
  np.testing.assert_allclose(jax.nn.log_softmax(full),
                             _logprobs(model, tokens), atol=1e-4)
  save_pretrained(config, params, tmp_path / "out")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
  np.testing.assert_allclose(_logprobs(back.eval(), tokens),
                             _logprobs(model, tokens), atol=1e-5)
  # The cache holds the latent and the rope key: one head of 16 + 4.
  cache = decode.init_cache(config, 2, tokens.shape[1])
  assert cache.k[0].shape == (2, 1, tokens.shape[1], 20)
  step = jax.jit(decode.decode_step, static_argnums=0)
  for t in range(4):
    logits, cache = step(config, params, cache, jnp.asarray(tokens[:, t]),
                         jnp.full((2,), t), t)
    np.testing.assert_allclose(logits, full[:, t], atol=1e-4)


def test_default_rules_split_the_experts_over_tensor():
  """(data, fsdp, tensor) = (2, 2, 2) with the default rules: each chip
  holds X / 2 experts (and half of each one's input width, over fsdp)."""
  from jax.sharding import AbstractMesh
  from jax.sharding import PartitionSpec as P

  from grpo_jax import config as config_lib
  from grpo_jax import sharding
  mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
  rules = sharding.logical_rules(config_lib.base_config().mesh)
  specs = sharding.param_specs(mesh, rules, get_preset("tiny-moe"))["layers"]
  assert specs["expert_gate"] == P(None, "tensor", "fsdp")
  assert specs["expert_down"] == P(None, "tensor", None, "fsdp")
  assert specs["router"] == P(None, "fsdp")


def test_replayed_routes_reproduce_and_keep_the_router_learning():
  """forward_routed records the experts; replaying them at the same params
  gives the same logits; after a router change that reroutes some tokens,
  replay still uses the recorded experts, and the router has a gradient."""
  from grpo_jax.models import routing
  config = get_preset("tiny-moe")
  params = init_params(config, jax.random.key(2))
  tokens = jnp.asarray(TOKENS % config.vocab_size)
  # Jitted: a compile each way (free, replayed), where op-by-op dispatch
  # compiles every op.
  routed = jax.jit(routing.forward_routed, static_argnums=0)
  logits, routes = routed(config, params, tokens)
  assert routes.shape == (2, 2, 12, 2)          # 2 sparse layers, C = 2
  again, replayed = routed(config, params, tokens, routes)
  np.testing.assert_array_equal(again, logits)
  np.testing.assert_array_equal(replayed, routes)
  moved = dict(params, layers=dict(params["layers"]))
  moved["layers"]["router"] = params["layers"]["router"] + 0.05 * \
      jax.random.normal(jax.random.key(3), params["layers"]["router"].shape)
  _, free = routed(config, moved, tokens)
  assert 0 < float(routing.routes_differ(free, routes).mean()) < 1
  _, kept = routed(config, moved, tokens, routes)
  np.testing.assert_array_equal(kept, routes)
  grad = jax.jit(jax.grad(lambda p: routing.forward_routed(
      config, p, tokens, routes)[0].sum()))(moved)
  assert float(jnp.abs(grad["layers"]["router"]).sum()) > 0


def test_the_update_adds_the_balancing_loss_of_transformers(qwen3_moe):
  """The update's loss carries the MoE balancing loss over the batch's
  tokens and sparse layers, equal to transformers' `aux_loss` on the same
  rows, weighted by the checkpoint's router_aux_loss_coef by default or by
  model.moe.aux_loss_coef; logged unweighted as moe/aux_loss."""
  from grpo_jax.rl import update
  model, directory = qwen3_moe
  config, params = load_pretrained(directory)
  with torch.no_grad():
    want = float(model(torch.tensor(TOKENS), output_router_logits=True)
                 .aux_loss)
  N, T = len(TOKENS), 5
  batch = update.UpdateBatch(
      jnp.asarray(TOKENS), mask_nt=jnp.ones((N, T)),
      old_logp_nt=jnp.full((N, T), -3.0), ref_logp_nt=jnp.zeros((N, T)),
      adv_n=jnp.array([1.0, -1.0]))
  norm = update.global_normalisers(batch.mask_nt, update.LossSettings())

  def loss(coef):
    program = update.UpdateProgram(config, update.LossSettings(
        moe_aux_coef=coef))
    return update.loss_fn(update.Policy(params), batch, norm, 0.0, program)

  plain, metrics = loss(0.0)
  np.testing.assert_allclose(metrics["moe/aux_loss"], want, rtol=1e-5)
  assert float(metrics["moe/routes_differ"]) == 0.0      # nothing replayed
  assert config.moe.aux_loss_coef == model.config.router_aux_loss_coef > 0
  for coef, weight in ((-1.0, config.moe.aux_loss_coef), (0.5, 0.5)):
    np.testing.assert_allclose(loss(coef)[0] - plain, weight * want,
                               rtol=1e-4)


def test_the_lockstep_sampler_caches_the_latent_once():
  """MLA in the lockstep sampler: the cache holds the latent and rope key
  once (no value array; values are the keys), half the bytes of the k + v
  arrays; the sampler's log-probs are the trainer's (float32)."""
  from grpo_jax.generate import rollout, sampling
  from grpo_jax.models.moe_config import MlaConfig
  from grpo_jax.rl import batch, update
  config = get_preset("tiny-moe").replace(
      mla=MlaConfig(kv_lora_rank=16, nope_dim=8, rope_dim=8, v_head_dim=8),
      num_kv_heads=1, head_dim=24)
  params = init_params(config, jax.random.key(5))
  assert decode.cache_arrays(config) == 1
  assert sampling.kv_cache_bytes(config, 4, 32, 2, arrays=1) * 2 == \
      sampling.kv_cache_bytes(config, 4, 32, 2)
  prompts, G, T = [[5, 9, 13, 2], [7, 1]], 2, 5
  out = jax.device_get(sampling.sample(
      config, params, prompts, jax.random.key(0),
      sampling.SamplingConfig(max_new_tokens=T), G))
  prompts_b = np.empty((2,), object)
  prompts_b[:] = [tuple(p) for p in prompts]
  shape = lambda x: np.asarray(x).reshape(2, G, *np.shape(x)[1:])
  rows = batch.to_rows(rollout.Groups(
      prompts_b, shape(out.tokens_nt), shape(out.logp_nt), shape(out.mask_nt),
      shape(out.length_n), shape(out.truncated_n), np.zeros((2, G)),
      np.zeros((2, G), bool)), 0, False)
  program = update.UpdateProgram(config, update.LossSettings(chunk=8))
  logp, _, _ = update.batch_logprobs(params, update.UpdateBatch(
      *(jnp.asarray(x) for x in rows[:3])), T, program)
  mask = rows.mask_nt > 0
  np.testing.assert_allclose(np.asarray(logp)[mask], rows.old_logp_nt[mask],
                             atol=2e-6)


# Qwen/Qwen3-30B-A3B's config.json (the fields transformers 4.51 wrote):
# what experiments/aot.py reads for the pod row (docs/pod.md), no download.
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
    vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], router_aux_loss_coef=0.001, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
    tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
    sliding_window=None, use_sliding_window=False, torch_dtype="bfloat16")


def test_qwen3_30b_a3b_config_json_is_the_preset(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
  assert hf.read_config(tmp_path / "config.json") == get_preset(
      "qwen3-30b-a3b")
