"""MLA's latent cache in the continuous samplers (docs/models.md, "Latent
attention (MLA)"): the dense slots' cache and the page pool hold one array
per layer (the latent and the rope key), no values; greedy and sampled
rows from each equal an uncached forward in float32; a pool's bytes per
token are the latent's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.generate import page_pool, sampling
from grpo_jax.models import decode, forward, get_preset, init_params

# Latent attention (R 16 + rope 8: one KV head of 24), DeepSeek's routing.
CONFIG = get_preset("tiny-deepseek")
PROMPTS = [[5, 9, 13, 2, 7], [11, 3], [4, 4, 8, 1]]
G, T = 2, 6
# 2 slots for 6 rows; stop ids these rows sample (sampled rows end early).
SAMPLERS = {"slots": dict(continuous_batching=True, slots=2),
            "paged": dict(continuous_batching=True, slots=2,
                          kv_cache="paged", page_size=4)}
_forward = jax.jit(forward, static_argnums=0)


@pytest.fixture(scope="module")
def params():
  return init_params(CONFIG, jax.random.key(5))


def _forward_logprobs(params, prompt, completion):
  """log softmax of an uncached forward over [prompt | completion], at the
  columns that predict the completion: (len(completion), V)."""
  seq = list(prompt) + list(completion)
  tokens = jnp.zeros((1, 16), jnp.int32).at[0, :len(seq)].set(
      jnp.asarray(seq, jnp.int32))
  logp = jax.nn.log_softmax(_forward(CONFIG, params, tokens)[0])
  return np.asarray(logp[len(prompt) - 1:len(seq) - 1])


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_rows_equal_an_uncached_forward(params, sampler, greedy):
  cfg = sampling.SamplingConfig(max_new_tokens=T, greedy=greedy,
                                stop_ids=(17, 57), **SAMPLERS[sampler])
  out = jax.device_get(sampling.sample(CONFIG, params, PROMPTS,
                                       jax.random.key(0), cfg, G))
  if not greedy:
    assert 0 < out.truncated_n.sum() < G * len(PROMPTS)   # rows end early
  for i, n in enumerate(out.length_n):
    comp = out.tokens_nt[i, :n]
    ref = _forward_logprobs(params, PROMPTS[i // G], comp)
    np.testing.assert_allclose(out.logp_nt[i, :n], ref[np.arange(n), comp],
                               atol=2e-6)
    if greedy:
      np.testing.assert_array_equal(comp, ref.argmax(-1))


def test_the_caches_hold_the_latent_once():
  """No value arrays in the dense slots' cache or the page pool; the pool's
  bytes per token are the latent's, L * (R + rope) * itemsize, where the
  same model with per-head keys and values has two arrays of K heads."""
  cache = decode.init_cache(CONFIG, 2, 8)
  assert cache.v == () and cache.k[0].shape == (2, 1, 8, 24)
  W, Z = 10, 4

  def pool_bytes_per_token(model_config):
    call = sampling.CallSpec(model_config, sampling.SamplingConfig(
        continuous_batching=True, kv_cache="paged", page_size=Z), G, slots=2,
        pool_pages=W)
    pool = page_pool.new_pool(call, jnp.bfloat16)
    return sum(x.nbytes for x in pool.k + pool.v) / (W * Z), pool

  per_token, pool = pool_bytes_per_token(CONFIG)
  assert pool.v == ()
  assert per_token == page_pool.token_bytes(CONFIG, 2) == 3 * 24 * 2
  gqa = get_preset("tiny-moe")                  # K = 2 heads of 16
  per_token, pool = pool_bytes_per_token(gqa)
  assert len(pool.v) == 3
  assert per_token == page_pool.token_bytes(gqa, 2) == 2 * 3 * 2 * 16 * 2
  # DeepSeek-V3, bf16: 61 layers x (512 + 64), docs/models.md's table.
  assert page_pool.token_bytes(get_preset("deepseek-v3"), 2) == 70_272
