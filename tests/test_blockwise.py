"""Blockwise attention (models/blockwise.py) equals the dense reference in
values and gradients: left padding, sliding window, GQA, packed segments,
the shared-prompt path, float32 and bfloat16."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algorithms import logprobs
from grpo_jax.models import attention, blockwise, get_preset, init_params

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _inputs(key, B=2, T=11, S=11, H=4, K=2, hd=8, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (B, T, H, hd), dtype)
  k = jax.random.normal(kk, (B, K, S, hd), dtype)
  v = jax.random.normal(kv, (B, K, S, hd), dtype)
  return q, k, v


# Jitted: one compile a shape, where op-by-op dispatch compiles every op.
_blockwise = jax.jit(blockwise.attention, static_argnames=("block_q",
                                                           "block_k"))


def _left_padded(B, S, pads):
  col = np.arange(S)[None, :]
  pad = np.asarray(pads)[:, None]
  return (jnp.asarray(np.maximum(col - pad, 0), jnp.int32),
          jnp.asarray(col >= pad))


@pytest.mark.parametrize("dtype,window,blocks", [
    (jnp.float32, None, (4, 4)), (jnp.float32, 3, (3, 5)),
    (jnp.bfloat16, None, (3, 5)), (jnp.bfloat16, 3, (16, 16))])
def test_values_and_gradients_match_dense(dtype, window, blocks):
  B, S = 3, 13
  q, k, v = _inputs(jax.random.key(0), B=B, T=S, S=S, H=6, K=2, dtype=dtype)
  pos, valid = _left_padded(B, S, [0, 4, 9])
  config = dataclasses.replace(get_preset("tiny"), sliding_window=window)
  mask = attention.attention_mask(config, pos, pos, valid)
  w = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
  rows = valid[:, :, None, None]       # padded query rows are never read

  def dense(q, k, v):
    return attention.attention(q, k, v, mask)

  def block(q, k, v):
    return blockwise.attention(q, k, v, blockwise.MaskInfo(pos, pos, valid),
                               sliding_window=window, block_q=blocks[0],
                               block_k=blocks[1])

  loss = lambda f: lambda q, k, v: jnp.sum(
      jnp.where(rows, f(q, k, v).astype(jnp.float32) * w, 0.0))
  tol = TOL[dtype]
  # Jitted: one compile each, where op-by-op dispatch compiles every op.
  np.testing.assert_allclose(
      np.where(rows, jax.jit(block)(q, k, v).astype(jnp.float32), 0),
      np.where(rows, jax.jit(dense)(q, k, v).astype(jnp.float32), 0),
      atol=tol, rtol=tol)
  grads = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v)
  g_dense, g_block = grads(dense), grads(block)
  for a, b in zip(g_block, g_dense):
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), atol=4 * tol,
                               rtol=4 * tol)


def test_skips_causally_masked_blocks():
  """With 4 query and 4 key blocks only the 10 on or below the diagonal are
  computed: a key block after the query block changes nothing, even NaN."""
  S = 16
  q, k, v = _inputs(jax.random.key(2), B=1, T=S, S=S)
  pos, valid = _left_padded(1, S, [0])
  v_nan = v.at[:, :, 12:].set(jnp.nan)
  out = _blockwise(q, k, v_nan, blockwise.MaskInfo(pos, pos, valid),
                   block_q=4, block_k=4)
  assert np.isfinite(np.asarray(out[:, :12])).all()
  ref = _blockwise(q, k, v, blockwise.MaskInfo(pos, pos, valid),
                   block_q=4, block_k=4)
  np.testing.assert_array_equal(np.asarray(out[:, :12]),
                                np.asarray(ref[:, :12]))


def test_segments_and_queries_after_a_prefix():
  """Packed segments; and queries that are the last T of S columns."""
  B, S = 2, 12
  q, k, v = _inputs(jax.random.key(3), B=B, T=S, S=S)
  seg = jnp.asarray([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4], jnp.int32)
  pos = jnp.asarray([list(range(5)) + list(range(7)),
                     list(range(8)) + list(range(4))], jnp.int32)
  valid = jnp.ones((B, S), bool)
  config = get_preset("tiny")
  mask = attention.attention_mask(config, pos, pos, valid, seg, seg)
  want = attention.attention(q, k, v, mask)
  got = _blockwise(q, k, v, blockwise.MaskInfo(pos, pos, valid, seg, seg),
                   block_q=5, block_k=3)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  T = 5                                  # queries: the last 5 columns
  mask = attention.attention_mask(config, pos[:, -T:], pos, valid)
  want = attention.attention(q[:, -T:], k, v, mask)
  got = _blockwise(q[:, -T:], k, v,
                   blockwise.MaskInfo(pos[:, -T:], pos, valid),
                   block_q=2, block_k=4)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("group_size,dtype", [
    pytest.param(1, jnp.float32, marks=pytest.mark.slow), (4, jnp.float32),
    pytest.param(4, jnp.bfloat16, marks=pytest.mark.slow)])
def test_sequence_logprobs_and_gradient_match(group_size, dtype, monkeypatch):
  """The model's log-probs and their parameter gradient are the same with
  blockwise attention, through hidden_states and the shared-prompt path."""
  monkeypatch.setattr(blockwise, "attention", _small_blocks(blockwise.attention))
  config = dataclasses.replace(get_preset("tiny"), num_kv_heads=2,
                               sliding_window=6)
  params = jax.tree.map(lambda x: x.astype(dtype),
                        init_params(config, jax.random.key(0)))
  B, G, P, T = 2, 4, 7, 9
  prompts = jax.random.randint(jax.random.key(1), (B, P), 1, 200)
  pos_bp, valid_bp = _left_padded(B, P, [0, 3])
  tokens = jnp.concatenate([jnp.repeat(prompts, G, 0), jax.random.randint(
      jax.random.key(2), (B * G, T), 1, 200)], axis=1)
  pos = jnp.concatenate([jnp.repeat(pos_bp, G, 0), jnp.repeat(
      pos_bp[:, -1:], G, 0) + 1 + jnp.arange(T)], axis=1)
  valid = jnp.concatenate([jnp.repeat(valid_bp, G, 0),
                           jnp.arange(T)[None] < 7 + jnp.arange(B * G)[:, None] % 3],
                          axis=1)

  # Jitted: one compile each, where op-by-op dispatch compiles every op.
  @functools.partial(jax.jit, static_argnums=1)
  def logp(params, impl):
    out, _ = logprobs.sequence_logprobs(
        config, params, tokens, pos, valid, completion_len=T,
        forward=logprobs.Forward(chunk_size=4, group_size=group_size,
                                 attention=impl))
    return out

  grad = lambda impl: jax.jit(jax.grad(
      lambda p: jnp.sum(logp(p, impl) * valid[:, P:])))
  tol = TOL[dtype]
  np.testing.assert_allclose(logp(params, "blockwise"), logp(params, "dense"),
                             atol=5 * tol, rtol=tol)
  g_b = grad("blockwise")(params)
  g_d = grad("dense")(params)
  for a, b in zip(jax.tree.leaves(g_b), jax.tree.leaves(g_d)):
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-6
    np.testing.assert_allclose(np.asarray(a, np.float32) / scale,
                               np.asarray(b, np.float32) / scale,
                               atol=10 * tol)


def _small_blocks(fn):
  """Blocks of 4 so that tiny sequences span several blocks."""
  return lambda *a, **kw: fn(*a, **{**kw, "block_q": 4, "block_k": 4})
