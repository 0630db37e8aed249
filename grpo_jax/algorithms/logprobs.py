"""Token log-probs and entropies without materialising [B, T, V] logits.

The LM head is applied to `chunk_size` positions at a time inside `lax.map`,
and each chunk is wrapped in `jax.checkpoint`, so the backward pass
recomputes a chunk's logits instead of storing them. Temporary memory of
forward + backward (float32, XLA's compiled memory analysis on CPU):

  naive:    ~4 · B · T · V · 4 bytes   (logits, probabilities, cotangents)
  chunked:  ~k · B · c · V · 4 + D · V · 4 bytes,  k ≈ 2-3

with c = chunk_size. The D · V term is one copy of the head weight that XLA
makes because the forward and the backward loop both carry it; it is
independent of T and the size of a parameter, not of an activation.
With Qwen's V = 151,936, D = 896, T = 4,096, B = 1: naive 9.3 GiB,
chunked (c = 256) 0.8 GiB (benchmarks/logprob_memory.py). The chunking is
over the sequence, so the batch axis (sharded over data) stays whole; pick c
so that B_per_device · c · V · 4 bytes fits.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from grpo_jax.models.config import ModelConfig
from grpo_jax.models.transformer import (RESIDUAL_AXES, Constrain, Params,
                                         default_positions_and_valid,
                                         hidden_states,
                                         hidden_states_shared_prompt)

DEFAULT_CHUNK_SIZE = 256


def _head_params(config: ModelConfig, params: Params) -> Params:
  """Only the weight the LM head reads, so the scan closes over nothing else."""
  key = "embed" if config.tie_embeddings else "lm_head"
  return {key: params[key]}


def _head_logits(head: Params, h_btd: jax.Array) -> jax.Array:
  """float32 logits (B, t, V), as `transformer.unembed`, but contracting the
  tied (V, D) embedding in place: `embed.T` would be materialised as a
  (D, V) copy next to the loops."""
  if "embed" in head:
    return jnp.einsum("btd,vd->btv", h_btd, head["embed"],
                      preferred_element_type=jnp.float32)
  return jnp.einsum("btd,dv->btv", h_btd, head["lm_head"],
                    preferred_element_type=jnp.float32)


def _logprobs_from_hidden(temperature: float, head: Params, h_btd: jax.Array,
                          targets_bt: jax.Array):
  """log p(target) and entropy per position, from the full logits of h_btd."""
  logits_btv = _head_logits(head, h_btd)  # (B, t, V) float32
  if temperature != 1.0:
    logits_btv = logits_btv / temperature
  logz_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  target_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None],
                                  axis=-1)[..., 0]
  probs_btv = jnp.exp(logits_btv - logz_bt[..., None])
  # H = -Σ p log p = logZ - Σ p·z
  entropy_bt = logz_bt - jnp.sum(probs_btv * logits_btv, axis=-1)
  return target_bt - logz_bt, entropy_bt


def token_logprobs_naive(config: ModelConfig, params: Params,
                         h_btd: jax.Array, targets_bt: jax.Array, *,
                         temperature: float = 1.0):
  """Reference path that materialises the (B, T, V) logits; tests and
  benchmarks compare the chunked path against it."""
  return _logprobs_from_hidden(temperature, _head_params(config, params),
                               h_btd, targets_bt)


def _to_chunks(x_bt: jax.Array, chunk: int) -> jax.Array:
  """(B, T, ...) -> (n, B, chunk, ...), zero-padding T up to n·chunk."""
  B, T = x_bt.shape[:2]
  n = -(-T // chunk)
  pad = [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (x_bt.ndim - 2)
  x = jnp.pad(x_bt, pad).reshape(B, n, chunk, *x_bt.shape[2:])
  return jnp.swapaxes(x, 0, 1)


def _from_chunks(x_nbc: jax.Array, length: int) -> jax.Array:
  """(n, B, chunk) -> (B, length)."""
  n, B, chunk = x_nbc.shape
  return jnp.swapaxes(x_nbc, 0, 1).reshape(B, n * chunk)[:, :length]


def token_logprobs(config: ModelConfig, params: Params, h_btd: jax.Array,
                   targets_bt: jax.Array, *,
                   chunk_size: int = DEFAULT_CHUNK_SIZE,
                   temperature: float = 1.0):
  """Log-prob of targets_bt[b, t] under the head applied to h_btd[b, t], and
  the entropy of that distribution, both float32 (B, T).

  h_btd: final-normed hidden states (B, T, D), as `hidden_states` returns,
    already aligned so that position t predicts targets_bt[:, t].
  temperature: the sampler's temperature (a Python float), so that
    log-probs match π_old.
  Temporary memory of forward and backward ~ k · B · chunk_size · V floats
  (k ≈ 2-3) plus one copy of the head weight; never (B, T, V).
  """
  B, T, _ = h_btd.shape
  chunk = max(1, min(chunk_size, T))
  fn = jax.checkpoint(
      functools.partial(_logprobs_from_hidden, temperature),
      prevent_cse=False)
  head = _head_params(config, params)
  logp_nbc, entropy_nbc = jax.lax.map(
      lambda xs: fn(head, *xs),
      (_to_chunks(h_btd, chunk), _to_chunks(targets_bt, chunk)))
  return _from_chunks(logp_nbc, T), _from_chunks(entropy_nbc, T)


def sequence_logprobs(config: ModelConfig, params: Params,
                      tokens_bt: jax.Array,
                      positions_bt: Optional[jax.Array] = None,
                      valid_bt: Optional[jax.Array] = None, *,
                      completion_len: Optional[int] = None,
                      chunk_size: int = DEFAULT_CHUNK_SIZE,
                      temperature: float = 1.0, remat: str = "none",
                      group_size: int = 1, attention: str = "auto",
                      constrain: Optional[Constrain] = None):
  """Runs the decoder, then the chunked head: log-probs and entropies of the
  last K = completion_len tokens of tokens_bt (default K = T - 1, every token
  but the first), float32 (B, K). Entry k is log p(tokens[:, T-K+k] | the
  tokens before it), so with [prompt | completion] rows and K the completion
  length it lines up with the sampler's completion log-probs and mask.

  group_size G > 1 declares that rows come in groups of G consecutive rows
  whose first T - K columns (the prompt, padding included) are identical: each
  group's prompt then runs through the decoder once
  (`hidden_states_shared_prompt`), with the same result.
  attention: the decoder's attention (`transformer.ATTENTION`).
  constrain: pins the activations' shardings (`transformer.hidden_states`).
  """
  T = tokens_bt.shape[1]
  K = T - 1 if completion_len is None else completion_len
  if not 0 < K < T:
    raise ValueError(f"completion_len={completion_len}; need 0 < K < T={T}")
  if group_size > 1:
    positions_bt, valid_bt = default_positions_and_valid(
        tokens_bt, positions_bt, valid_bt)
    P, first = T - K, slice(None, None, group_size)   # one row per group
    h_last_bd, h_nkd = hidden_states_shared_prompt(
        config, params, tokens_bt[first, :P], positions_bt[first, :P],
        valid_bt[first, :P], tokens_bt[:, P:], positions_bt[:, P:],
        valid_bt[:, P:], remat=remat, attention_impl=attention,
        constrain=constrain)
    h_last_nd = jnp.repeat(h_last_bd, group_size, axis=0)
    h_btd = jnp.concatenate([h_last_nd[:, None], h_nkd[:, :K - 1]], axis=1)
  else:
    h_btd = hidden_states(config, params, tokens_bt, positions_bt, valid_bt,
                          remat=remat, attention_impl=attention,
                          constrain=constrain)[:, T - 1 - K:T - 1]
  if constrain is not None:
    h_btd = constrain(h_btd, RESIDUAL_AXES)
  return token_logprobs(config, params, h_btd, tokens_bt[:, T - K:],
                        chunk_size=chunk_size, temperature=temperature)
