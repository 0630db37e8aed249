"""Tiny Gemma models where the model runs: the samplers (static, dense
slots, paged) with per-layer windows shorter than the rows and Gemma 2's
soft-caps, and a training run (LoRA, packing, paged continuous batching,
export) on the tiny-gemma preset."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from configs import tiny
from grpo_jax.generate import sampling
from grpo_jax.harness import lora_export
from grpo_jax.models import forward, get_preset, init_params
from grpo_jax.rl import train

GEMMA3 = get_preset("tiny-gemma")       # window 4; sliding, full, sliding
GEMMA2 = get_preset("tiny-gemma2")      # the same layers, soft-caps


def _prompts(vocab, lengths=(5, 11, 8), seed=0):
  rng = np.random.RandomState(seed)
  return [list(rng.randint(1, vocab, n)) for n in lengths]


@pytest.mark.parametrize("model_config", [
    pytest.param(GEMMA3, id="gemma3"),
    pytest.param(GEMMA2, id="gemma2", marks=pytest.mark.slow)])
def test_samplers_agree_with_the_uncached_forward(model_config):
  """Greedy: static, dense-slot and paged samplers give the tokens of the
  uncached forward's argmax, rows past every sliding layer's window."""
  params = jax.tree.map(lambda w: w * 3.0 if w.ndim > 1 else w,
                        init_params(model_config, jax.random.key(0)))
  prompts = _prompts(model_config.vocab_size)
  base = sampling.SamplingConfig(max_new_tokens=8, greedy=True)
  variants = {
      "static": base,
      "dense": dataclasses.replace(base, continuous_batching=True, slots=2),
      "paged": dataclasses.replace(base, continuous_batching=True, slots=2,
                                   kv_cache="paged", page_size=4)}
  outs = {name: sampling.sample(model_config, params, prompts,
                                jax.random.key(1), cfg, 1)
          for name, cfg in variants.items()}
  fwd = jax.jit(forward, static_argnums=0)
  width = 32     # one compile: right padding leaves earlier columns alone
  for b, prompt in enumerate(prompts):
    seq = list(prompt)
    for _ in range(8):
      row = jnp.zeros((1, width), jnp.int32).at[0, :len(seq)].set(
          jnp.asarray(seq))
      seq.append(int(jnp.argmax(fwd(model_config, params, row)[0,
                                                              len(seq) - 1])))
    for name, out in outs.items():
      np.testing.assert_array_equal(out.tokens_nt[b], seq[len(prompt):],
                                    err_msg=name)
  for name in ("dense", "paged"):
    np.testing.assert_allclose(outs[name].logp_nt, outs["static"].logp_nt,
                               atol=2e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-gemma", "tiny-gemma2"])
def test_sharded_tiny_gemma_equals_one_device(run_sharding_checks,
                                             monkeypatch, preset):
  """tests/sharding_checks.py on tiny-gemma (Gemma 3) and tiny-gemma2, 8
  fake devices as (data, fsdp, tensor) = (2, 2, 2): greedy samples, loss
  and gradient, an update step and LoRA match one device."""
  monkeypatch.setenv("SHARDING_CHECKS_MODEL", preset)
  run_sharding_checks("sharding_checks.py", ["2,2,2"])


@pytest.mark.slow
def test_a_tiny_gemma_run_with_lora_packing_paged_and_export(tmp_path):
  """Two steps of the tiny config on tiny-gemma (window 4 < the rows'
  prompt + 8 tokens): LoRA adapters, packed update rows, paged continuous
  sampling; the merged model exported loads in transformers as
  Gemma3ForCausalLM."""
  c = tiny.get_config()
  c.model.source = "tiny-gemma"
  c.model.lora.rank = 4
  c.rl.packing = "on"
  c.sampling.update(continuous_batching=True, kv_cache="paged", slots=4,
                    page_size=4)
  c.train.update(steps=2, eval_at_start=False, eval_at_end=False)
  summary = train.run(c, str(tmp_path / "run"))
  rows = [json.loads(line) for line in open(tmp_path / "run/metrics.jsonl")]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2 and np.all(np.isfinite(losses))
  assert set(summary["state"].params["layers"]) == {"lora"}
  lora_export.export(str(tmp_path / "run"), None, str(tmp_path / "hf"))
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
  assert type(model).__name__ == "Gemma3ForCausalLM"
  assert model.config.sliding_window == GEMMA3.sliding_window


@pytest.mark.slow
def test_a_stale_tiny_gemma_run_resumes(tmp_path):
  """The asynchronous loop (a sampler thread, rows one version stale) on
  tiny-gemma; stopped after step 2, the same command with 3 steps resumes
  from the checkpoint and runs step 3 only."""
  import async_checks
  c = async_checks.stale(async_checks.config(steps=2))
  c.model.source = "tiny-gemma"
  c.train.checkpoint_every = 1
  train.run(c, str(tmp_path))
  c.train.steps = 3
  summary = train.run(c, str(tmp_path))
  rows = async_checks.run_metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert [r["staleness/max"] for r in rows][:2] == [0, 1]
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert int(summary["state"].step) == 3 * 2   # two mini-batches a step
