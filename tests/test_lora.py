"""LoRA (models/lora.py): adapters on a frozen base, exact where they must be.

The 8-device check (sharded base + adapters give one device's loss and
gradient) runs in tests/sharding_checks.py (test_sharding.py's subprocess).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from update_batches import random_update_batch

from configs import tiny
from grpo_jax import errors, validation
from grpo_jax.models import decode, get_preset, init_params, lora, transformer
from grpo_jax.rl import update

MODEL = get_preset("tiny")
SPEC = lora.LoraSpec(rank=4, alpha=8.0)
SETTINGS = update.LossSettings(chunk=4, lora_scale=SPEC.scale)


def _base():
  return init_params(MODEL, jax.random.key(0))


def _trained_adapters(seed=1):
  """Adapters as after some training: B != 0."""
  adapters = lora.init_adapters(MODEL, SPEC, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 100))
  return jax.tree_util.tree_map_with_path(
      lambda p, x: (0.05 * jax.random.normal(next(keys), x.shape)
                    if p[-1].key == "b" else x), adapters)


TOKENS = jax.random.randint(jax.random.key(9), (3, 11), 0, 256)
# jitted: eager op-by-op dispatch of the layer scan costs seconds per call
_forward = jax.jit(transformer.forward, static_argnums=0)
_grads = jax.jit(update.accumulate_gradients, static_argnums=3)
_loss = jax.jit(update.loss_fn, static_argnums=4)
PROGRAM = update.UpdateProgram(MODEL, SETTINGS)


def test_adapter_shapes_init_and_targets():
  adapters = lora.init_adapters(MODEL, SPEC, jax.random.key(1))
  ab = adapters["layers"]["lora"]
  assert sorted(ab) == sorted(lora.PROJECTIONS)
  L, D, H, K, E, F = 2, 64, 4, 2, 16, 128
  assert ab["wq"]["a"].shape == (L, D, 4) and ab["wq"]["b"].shape == (L, 4, H, E)
  assert ab["wk"]["b"].shape == (L, 4, K, E)
  assert ab["wo"]["a"].shape == (L, H, E, 4) and ab["wo"]["b"].shape == (L, 4, D)
  assert ab["w_down"]["a"].shape == (L, F, 4)
  assert all(not np.any(x["b"]) for x in ab.values())
  # PEFT's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
  bound = 1 / np.sqrt(H * E)
  assert 0.9 * bound < float(jnp.abs(ab["wo"]["a"]).max()) <= bound
  assert lora.target_names(("wq", "wv")) == ("wq", "wv")
  assert lora.target_names(("layers/w_*",)) == ("w_gate", "w_up", "w_down")
  with pytest.raises(ValueError, match="matches no projection"):
    lora.target_names(("embed",))
  axes = transformer.tree_axes(adapters)["layers"]["lora"]
  assert axes["wo"] == {"a": ("layers", "q_heads", "head_dim", "lora_rank"),
                        "b": ("layers", "lora_rank", "embed")}


def test_zero_b_equals_base_exactly():
  """B = 0 at init: the adapted model IS the base, bit for bit (also the
  decode step the sampler runs)."""
  base = _base()
  attached = lora.attach(base, lora.init_adapters(MODEL, SPEC,
                                                  jax.random.key(1)),
                         SPEC.scale)
  np.testing.assert_array_equal(_forward(MODEL, attached, TOKENS),
                                _forward(MODEL, base, TOKENS))
  cache = decode.init_cache(MODEL, 3, 4)
  args = (cache, TOKENS[:, 0], jnp.zeros(3, jnp.int32), 0)
  step = jax.jit(decode.decode_step, static_argnums=0)
  np.testing.assert_array_equal(step(MODEL, attached, *args)[0],
                                step(MODEL, base, *args)[0])


@pytest.mark.parametrize("dtype", [
    "float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_adapted_forward_equals_merged_forward(dtype):
  base, adapters = transformer.cast(_base(), dtype), _trained_adapters()
  adapted = _forward(
      MODEL, transformer.cast(lora.attach(base, adapters, SPEC.scale), dtype),
      TOKENS)
  merged = _forward(MODEL, lora.merge(base, adapters, SPEC.scale),
                               TOKENS)
  plain = _forward(MODEL, base, TOKENS)
  tol = 1e-5 if dtype == "float32" else 5e-2
  np.testing.assert_allclose(adapted, merged, atol=tol, rtol=tol)
  assert float(jnp.abs(adapted - plain).max()) > 10 * tol   # B != 0 matters
  # the sampler's two ways agree too (merged: one jitted merge per update)
  for sampler in lora.SAMPLERS:
    spec = dataclasses.replace(SPEC, sampler=sampler)
    got = _forward(
        MODEL, lora.policy_params(base, adapters, spec, dtype), TOKENS)
    np.testing.assert_allclose(got, merged, atol=tol, rtol=tol)


def test_gradients_reach_only_the_adapters():
  """The gradient is a tree of the adapters only; with B = 0 only B moves
  (dL/dA = x^T (dL/dy) B^T = 0), and update_step leaves the base as it was
  (not donated, not updated)."""
  base, batch = _base(), random_update_batch()
  adapters = lora.init_adapters(MODEL, SPEC, jax.random.key(1))
  grads, loss, _ = _grads(update.Policy(adapters, base), batch, 0.0, PROGRAM)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)
  for ab in grads["layers"]["lora"].values():
    assert not np.any(ab["a"]) and np.any(ab["b"])
  full_loss = _grads(update.Policy(base), batch, 0.0, PROGRAM)[1]
  np.testing.assert_allclose(loss, full_loss, rtol=1e-6)
  optim = tiny.get_config().optim
  from grpo_jax.rl.optimizer import OptimizerSpec  # pylint: disable=import-outside-toplevel
  optimizer = OptimizerSpec.from_config(optim, 10)
  before = jax.device_get(base)
  state = update.init_state(adapters, optimizer, 0)
  state, _ = update.update_step(
      state, batch, update.UpdateProgram(MODEL, SETTINGS, optimizer, 2), base)
  assert jax.tree.structure(state.params) == jax.tree.structure(adapters)
  assert jax.tree.structure(state.opt_state[1][0].mu) == jax.tree.structure(
      adapters)
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(base)):
    np.testing.assert_array_equal(x, y)
  assert np.any(state.params["layers"]["lora"]["wq"]["b"])


@pytest.mark.parametrize("agg", ["seq-mean-token-mean"])
def test_loss_and_gradient_do_not_depend_on_micro_batching(agg):
  base, adapters, batch = _base(), _trained_adapters(), random_update_batch()
  s = dataclasses.replace(SETTINGS, loss=dataclasses.replace(
      SETTINGS.loss, agg=agg))
  results = [_grads(update.Policy(adapters, base), batch, 0.0,
                    update.UpdateProgram(MODEL, s, num_micro=k))
             for k in (1, 4)]
  for grads, loss, _ in results[1:]:
    np.testing.assert_allclose(loss, results[0][1], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(results[0][0])):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_kl_to_the_base_with_adapters_off_is_zero():
  """The reference is the base itself (adapters off): at B = 0 the policy
  equals it, so the KL term is exactly 0; trained adapters make it > 0."""
  base, batch = _base(), random_update_batch()
  s = dataclasses.replace(SETTINGS, kl_beta=0.1)
  rows = update.UpdateBatch(batch.tokens_ns, batch.positions_ns,
                            batch.valid_ns)
  program = update.UpdateProgram(MODEL, s, logp_shape=batch.mask_nt.shape)
  ref = update.score_logprobs(update.Policy(base), rows, program)
  batch = batch._replace(ref_logp_nt=ref)
  fresh = lora.init_adapters(MODEL, SPEC, jax.random.key(1))
  np.testing.assert_array_equal(
      update.score_logprobs(update.Policy(fresh, base), rows, program), ref)
  norm = update.global_normalisers(batch.mask_nt, s)
  _, m = _loss(update.Policy(fresh, base), batch, norm, 0.1, program)
  assert float(m["kl"]) == 0.0
  _, m = _loss(update.Policy(_trained_adapters(), base), batch, norm, 0.1,
               program)
  assert float(m["kl"]) > 1e-4


def test_lora_config_is_validated():
  config = tiny.get_config()
  config.model.lora.rank = 8
  validation.validate(config)
  for field, value, match in (("rank", -1, "rank"),
                              ("alpha", 0.0, "alpha"),
                              ("targets", ("wq", "embed"), "matches no"),
                              ("dropout", 0.1, "only 0"),
                              ("sampler", "fused", "allowed")):
    bad = tiny.get_config()
    bad.model.lora.rank = 8
    bad.model.lora[field] = value
    with pytest.raises(errors.ConfigError, match=match):
      validation.validate(bad)


# ----------------------------------------------------------------------------
# PEFT interchange: our adapters on transformers' model, through peft.
# ----------------------------------------------------------------------------

_HF_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5)
_HF = {"llama": ("LlamaConfig", dict(rope_theta=10_000.0)),
       "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True))}


@pytest.mark.parametrize("arch", sorted(_HF))
def test_peft_adapter_loads_onto_transformers_with_our_logits(arch, tmp_path):
  """A tiny random Llama / Qwen2 written by transformers, our adapters
  (B != 0, every projection) trained beside it, saved as a PEFT directory:
  peft's logits on transformers equal grpo_jax's adapted logits, and the
  merged export (save_pretrained of lora.merge) gives them too."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  from grpo_jax.models import load_pretrained, save_pretrained  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  config_cls, extra = _HF[arch]
  hf_model = transformers.AutoModelForCausalLM.from_config(
      getattr(transformers, config_cls)(**_HF_COMMON, **extra))
  with torch.no_grad():
    for p in hf_model.parameters():
      p.copy_(torch.randn(p.shape) * 0.1)
  hf_model.save_pretrained(tmp_path / "base")
  model_config, base = load_pretrained(tmp_path / "base")
  spec = lora.LoraSpec(rank=4, alpha=8.0)
  adapters = lora.init_adapters(model_config, spec, jax.random.key(1))
  keys = iter(jax.random.split(jax.random.key(2), 100))
  adapters = jax.tree_util.tree_map_with_path(
      lambda p, x: (0.5 * jax.random.normal(next(keys), x.shape)
                    if p[-1].key == "b" else x), adapters)
  tokens = np.random.RandomState(0).randint(0, 300, (2, 24))
  ours = np.asarray(_forward(
      model_config, lora.attach(base, adapters, spec.scale),
      jnp.asarray(tokens, jnp.int32)))
  lora.save_peft_adapter(adapters, spec, tmp_path / "adapter",
                         str(tmp_path / "base"))
  peft_model = peft.PeftModel.from_pretrained(
      transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
      tmp_path / "adapter").eval()
  with torch.no_grad():
    theirs = peft_model(torch.tensor(tokens)).logits.numpy()
    plain = hf_model.eval()(torch.tensor(tokens)).logits.numpy()
  err = float(np.abs(ours - theirs).max())
  print(f"PEFT parity {arch}: max |d logit| = {err:.2e} "
        f"(the adapters move logits by {np.abs(ours - plain).max():.2f})")
  assert err < 1e-4, err
  assert np.abs(ours - plain).max() > 1e3 * err   # the adapters matter
  save_pretrained(model_config, lora.merge(base, adapters, spec.scale),
                  tmp_path / "merged")
  merged = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "merged").eval()
  with torch.no_grad():
    err = np.abs(merged(torch.tensor(tokens)).logits.numpy() - theirs).max()
  assert err < 1e-4, err


# ----------------------------------------------------------------------------
# The trainer: exact resume from adapters-only checkpoints, and export.
# ----------------------------------------------------------------------------

def _tiny_lora(steps):
  config = tiny.get_config()
  config.model.lora.rank, config.model.lora.alpha = 4, 8.0
  config.rl.kl_beta = 0.05                  # the base is the reference
  config.rl.packing = "off"                 # one update program to compile
  config.train.steps, config.train.checkpoint_every = steps, 1
  config.train.eval_at_start = config.train.eval_at_end = False
  return config


@pytest.mark.slow
def test_resume_is_exact_and_checkpoints_hold_adapters_only(tmp_path):
  from grpo_jax import checkpoint  # pylint: disable=import-outside-toplevel
  from grpo_jax.harness import experiment, lora_export  # pylint: disable=import-outside-toplevel
  from grpo_jax.rl import train  # pylint: disable=import-outside-toplevel
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  summary = train.run(_tiny_lora(2), straight)
  train.run(_tiny_lora(1), resumed)
  train.run(_tiny_lora(2), resumed)          # resumes at step 1
  a, b = checkpoint.load_params(straight), checkpoint.load_params(resumed)
  assert list(a) == ["layers"] and list(a["layers"]) == ["lora"]
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)      # bitwise on CPU
  assert np.any(a["layers"]["lora"]["wq"]["b"])
  host = checkpoint.load_host_state(straight)
  assert host["lora_base"] == experiment.base_identity(
      _tiny_lora(2), summary["base"])
  # Merged export = the policy the run trained (base + adapters).
  lora_export.export(straight, None, tmp_path / "merged", "hf")
  from grpo_jax.models import load_pretrained  # pylint: disable=import-outside-toplevel
  model_config, merged = load_pretrained(tmp_path / "merged")
  want = _forward(model_config, lora.attach(
      summary["base"], a, 2.0), TOKENS)
  np.testing.assert_allclose(_forward(model_config, merged, TOKENS),
                             want, atol=1e-5)
  lora_export.export(straight, None, tmp_path / "peft", "peft")
  assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == [
      "adapter_config.json", "adapter_model.safetensors"]
  # Another base: neither a resume nor an export goes ahead.
  other = _tiny_lora(2)
  other.seed = 1          # the tiny base is random from the seed
  with pytest.raises(errors.CheckpointError, match="trained on"):
    experiment.load_lora_base(other, straight, 2)


def test_star_finetune_trains_fresh_adapters_on_the_frozen_original():
  """STaR with LoRA: M_n = the original with adapters trained from B = 0,
  merged; the original is left as it was."""
  from configs import star_tiny  # pylint: disable=import-outside-toplevel
  from grpo_jax.star import loop, sft  # pylint: disable=import-outside-toplevel
  config = star_tiny.get_config()
  config.model.lora.rank, config.model.lora.targets = 4, ("wq", "wv")
  original = _base()
  before = jax.device_get(original)
  examples = [sft.SFTExample(tuple(range(5, 15)), tuple(range(20, 28)))] * 4
  params, m = loop.finetune(config, MODEL, original, examples, 3, 0, 0)
  assert m["sft/loss_last"] < m["sft/loss_first"]
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(original)):
    np.testing.assert_array_equal(x, y)
  changed = {k for k in params["layers"]
             if not np.array_equal(params["layers"][k], before["layers"][k])}
  assert changed == {"wq", "wv"}


@pytest.mark.slow   # 2 training steps: ~35 s of CPU
def test_adapters_alone_train_on_multi_turn_episodes(tmp_path, monkeypatch):
  """LoRA with an env (issue 42 item 5): 2 steps of the tiny config on the
  scripted env's episodes change the adapters and nothing else (the base the
  run returns is the seed's init, bit for bit), and every update batch holds
  observation tokens, attended to (valid) and out of the loss."""
  from grpo_jax.rl import batch as batch_lib  # pylint: disable=import-outside-toplevel
  from grpo_jax.rl import train  # pylint: disable=import-outside-toplevel
  seen = []

  def to_rows(groups, *args):
    out = batch_lib.to_rows(groups, *args)
    seen.append((groups.observation_bgt, out))
    return out

  monkeypatch.setattr(train, "to_rows", to_rows)
  config = _tiny_lora(2)
  config.train.checkpoint_every = 0
  config.rl.kl_beta = 0.0
  # A tool call earns 1 (the scripted env's per-turn term): the groups'
  # rewards differ, so the adapters get a gradient.
  config.env.update(name="scripted", max_turns=2, max_observation_tokens=32,
                    kwargs=dict(turn_reward=1.0))
  config.sampling.max_new_tokens = 24
  summary = train.run(config, str(tmp_path))
  assert len(seen) == 2
  for obs_bgt, batch in seen:
    obs_nt = obs_bgt.reshape(batch.mask_nt.shape)
    assert obs_nt.any()              # the episodes reached the tool
    T = obs_nt.shape[1]
    assert not batch.mask_nt[obs_nt].any()
    assert batch.valid_ns[:, -T:][obs_nt].all()
  init = lora.init_adapters(MODEL, SPEC, jax.random.key(0))
  adapters = summary["state"].params
  assert jax.tree.structure(adapters) == jax.tree.structure(init)
  assert any(np.any(np.asarray(b)) for b in jax.tree.leaves(
      {k: v["b"] for k, v in adapters["layers"]["lora"].items()}))
  for x, y in zip(jax.tree.leaves(summary["base"]),
                  jax.tree.leaves(_base()), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
