"""Chunked token log-probs: equal to the full-logits path (values and
gradients) on the tiny model, and bounded in memory."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algorithms import logprobs
from grpo_jax.models import config as config_lib
from grpo_jax.models import transformer

CONFIG = config_lib.get_preset("tiny")
B, T = 2, 13  # 13 is prime: no chunk size below divides it


@functools.lru_cache(maxsize=None)
def _setup():
  """Params, tokens, loss weights, final hidden states, and the reference."""
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  tokens_ns = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0,
                                 CONFIG.vocab_size)
  weights_ns = jax.random.normal(jax.random.PRNGKey(2), (B, T - 1))
  h_nsd = jax.jit(functools.partial(transformer.hidden_states, CONFIG))(
      params, tokens_ns)[:, :-1]
  return params, tokens_ns, weights_ns, h_nsd


@functools.partial(jax.jit, static_argnames="temperature")
def _full_logits_reference(params, tokens_ns, temperature=1.0):
  """log_softmax of the forward pass, gathered at the next token."""
  logits_nsv = transformer.forward(CONFIG, params, tokens_ns)[:, :-1]
  logq_nsv = jax.nn.log_softmax(logits_nsv / temperature, axis=-1)
  logp_ns = jnp.take_along_axis(logq_nsv, tokens_ns[:, 1:, None], -1)[..., 0]
  entropy_ns = -jnp.sum(jnp.exp(logq_nsv) * logq_nsv, axis=-1)
  return logp_ns, entropy_ns


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 64])
def test_chunked_values_equal_full_logits(chunk_size):
  params, tokens_ns, _, h_nsd = _setup()
  logp, entropy = jax.jit(functools.partial(
      logprobs.token_logprobs, CONFIG, chunk_size=chunk_size))(
          params, h_nsd, tokens_ns[:, 1:])
  ref_logp, ref_entropy = _full_logits_reference(params, tokens_ns)
  assert logp.shape == entropy.shape == (B, T - 1)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(entropy, ref_entropy, atol=1e-5, rtol=1e-5)


def test_chunked_gradients_equal_full_logits():
  params, tokens_ns, w_ns, _ = _setup()

  def objective(params, fn):
    logp, entropy = fn(params, tokens_ns)
    return jnp.sum(w_ns * logp) + 0.1 * jnp.sum(w_ns * entropy)

  chunked = functools.partial(logprobs.sequence_logprobs, CONFIG,
                              forward=logprobs.Forward(chunk_size=5))
  grad = jax.jit(jax.grad(lambda p: objective(p, chunked)))(params)
  ref = jax.jit(jax.grad(lambda p: objective(p, _full_logits_reference)))(
      params)
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grad),
                          jax.tree_util.tree_leaves(ref)):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  assert float(jnp.abs(grad["embed"]).sum()) > 1e-3


def test_token_logprobs_gradient_wrt_hidden_states_and_temperature():
  params, tokens_ns, w_ns, h_nsd = _setup()
  targets_ns = tokens_ns[:, 1:]

  def objective(h, fn):
    logp, entropy = fn(CONFIG, params, h, targets_ns, temperature=0.7)
    return jnp.sum(w_ns * logp) - jnp.sum(entropy)

  chunked = functools.partial(logprobs.token_logprobs, chunk_size=3)
  value_and_grad = jax.jit(jax.value_and_grad(objective), static_argnums=1)
  value, grad = value_and_grad(h_nsd, chunked)
  ref_value, ref_grad = value_and_grad(h_nsd, logprobs.token_logprobs_naive)
  assert float(value) == pytest.approx(float(ref_value), rel=1e-5)
  np.testing.assert_allclose(grad, ref_grad, atol=1e-5, rtol=1e-5)
  # the temperature is applied: it matches log_softmax(logits / 0.7)
  ref_logp, _ = _full_logits_reference(params, tokens_ns, temperature=0.7)
  logp, _ = jax.jit(chunked, static_argnums=0, static_argnames="temperature")(
      CONFIG, params, h_nsd, targets_ns, temperature=0.7)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)


def test_completion_len_selects_the_last_tokens():
  params, tokens_ns, _, _ = _setup()
  logp, _ = jax.jit(functools.partial(
      logprobs.sequence_logprobs, CONFIG, completion_len=4,
      forward=logprobs.Forward(chunk_size=3)))(
          params, tokens_ns)
  ref_logp, _ = _full_logits_reference(params, tokens_ns)
  np.testing.assert_allclose(logp, ref_logp[:, -4:], atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="completion_len"):
    logprobs.sequence_logprobs(CONFIG, params, tokens_ns, completion_len=T)


def test_chunked_backward_never_holds_full_logits():
  # Compile only (nothing is allocated): forward + grad w.r.t. hidden states
  # and the head for T = 2048, V = 32768. The full logits alone are 256 MiB.
  cfg = CONFIG.replace(vocab_size=32768, dim=16)
  n, c, d, v = 2048, 64, cfg.dim, cfg.vocab_size
  h = jax.ShapeDtypeStruct((1, n, d), jnp.float32)
  tgt = jax.ShapeDtypeStruct((1, n), jnp.int32)
  head = {"embed": jax.ShapeDtypeStruct((v, d), jnp.float32)}

  def temp_bytes(fn):
    loss = lambda p, h, t: fn(cfg, p, h, t)[0].sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        head, h, tgt).compile()
    stats = compiled.memory_analysis()
    if stats is None:
      pytest.skip("this backend reports no memory analysis")
    return stats.temp_size_in_bytes

  naive = temp_bytes(logprobs.token_logprobs_naive)
  chunked = temp_bytes(functools.partial(logprobs.token_logprobs,
                                         chunk_size=c))
  assert naive >= n * v * 4  # the naive path does hold (T, V) logits
  # the bound of logprobs.py: a few (c, V) buffers + one (D, V) head copy
  assert chunked <= 4 * c * v * 4 + 2 * d * v * 4 + 4 * n * d * 4
  assert chunked * 8 < naive
