"""Token log-probs and entropies without materialising [N, S, V] logits.

The LM head is applied to `chunk_size` positions at a time inside `lax.map`,
and each chunk is wrapped in `jax.checkpoint`, so the backward pass
recomputes a chunk's logits instead of storing them. Temporary memory of
forward + backward (float32, XLA's compiled memory analysis on CPU):

  naive:    ~4 · N · S · V · 4 bytes   (logits, probabilities, cotangents)
  chunked:  ~k · N · c · V · 4 + D · V · 4 bytes,  k ≈ 2-3

with c = chunk_size. The D · V term is one copy of the head weight that XLA
makes because the forward and the backward loop both carry it; it is
independent of S and the size of a parameter, not of an activation.
With Qwen's V = 151,936, D = 896, S = 4,096, N = 1: naive 9.3 GiB,
chunked (c = 256) 0.8 GiB (benchmarks/logprob_memory.py). The chunking is
over the sequence, so the row axis (sharded over data) stays whole; pick c
so that N_per_device · c · V · 4 bytes fits. (Letters as in `grpo_jax`: N
rows of S columns, T of them completion tokens.)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from grpo_jax.models.config import ModelConfig
from grpo_jax.models.transformer import (
  Constrain,
  ForwardSettings,
  Params,
  Rows,
  default_positions_and_valid,
  hidden_states_routed,
  hidden_states_shared_prompt,
)

DEFAULT_CHUNK_SIZE = 256


def _head_params(model_config: ModelConfig, params: Params) -> Params:
  """Only the weight the LM head reads, so the scan closes over nothing else."""
  key = "embed" if model_config.tie_embeddings else "lm_head"
  return {key: params[key]}


def _head_logits(head: Params, h_nsd: jax.Array) -> jax.Array:
  """float32 logits (N, S, V), as `transformer.unembed`, but contracting the
  tied (V, D) embedding in place: `embed.T` would be materialised as a
  (D, V) copy next to the loops."""
  if "embed" in head:
    return jnp.einsum("nsd,vd->nsv", h_nsd, head["embed"],
                      preferred_element_type=jnp.float32)
  return jnp.einsum("nsd,dv->nsv", h_nsd, head["lm_head"],
                    preferred_element_type=jnp.float32)


def _logprobs_from_hidden(temperature: float, softcap: Optional[float],
                          head: Params, h_nsd: jax.Array,
                          targets_ns: jax.Array):
  """log p(target) and entropy per position, from the full logits of h_nsd
  (soft-capped first where the model's are: Gemma 2)."""
  logits_nsv = _head_logits(head, h_nsd)  # (N, S, V) float32
  if softcap is not None:
    logits_nsv = softcap * jnp.tanh(logits_nsv / softcap)
  if temperature != 1.0:
    logits_nsv = logits_nsv / temperature
  logz_ns = jax.nn.logsumexp(logits_nsv, axis=-1)
  target_ns = jnp.take_along_axis(logits_nsv, targets_ns[..., None],
                                  axis=-1)[..., 0]
  probs_nsv = jnp.exp(logits_nsv - logz_ns[..., None])
  # H = -Σ p log p = logZ - Σ p·z
  entropy_ns = logz_ns - jnp.sum(probs_nsv * logits_nsv, axis=-1)
  return target_ns - logz_ns, entropy_ns


def token_logprobs_naive(model_config: ModelConfig, params: Params,
                         h_nsd: jax.Array, targets_ns: jax.Array, *,
                         temperature: float = 1.0):
  """Reference path that materialises the (N, S, V) logits; tests and
  benchmarks compare the chunked path against it."""
  return _logprobs_from_hidden(temperature, model_config.final_softcap,
                               _head_params(model_config, params),
                               h_nsd, targets_ns)


def _to_chunks(x_ns: jax.Array, chunk: int) -> jax.Array:
  """(N, S, ...) -> (C, N, chunk, ...), zero-padding S up to C·chunk."""
  N, S = x_ns.shape[:2]
  C = -(-S // chunk)
  pad = [(0, 0), (0, C * chunk - S)] + [(0, 0)] * (x_ns.ndim - 2)
  x = jnp.pad(x_ns, pad).reshape(N, C, chunk, *x_ns.shape[2:])
  return jnp.swapaxes(x, 0, 1)


def _from_chunks(chunks: jax.Array, length: int) -> jax.Array:
  """(C, N, chunk) -> (N, length)."""
  C, N, chunk = chunks.shape
  return jnp.swapaxes(chunks, 0, 1).reshape(N, C * chunk)[:, :length]


def token_logprobs(model_config: ModelConfig, params: Params, h_nsd: jax.Array,
                   targets_ns: jax.Array, *,
                   chunk_size: int = DEFAULT_CHUNK_SIZE,
                   temperature: float = 1.0):
  """Log-prob of targets_ns[i, j] under the head applied to h_nsd[i, j], and
  the entropy of that distribution, both float32 (N, S).

  h_nsd: final-normed hidden states (N, S, D), as `hidden_states` returns,
    already aligned so that column j predicts targets_ns[:, j].
  temperature: the sampler's temperature (a Python float), so that
    log-probs match π_old.
  Temporary memory of forward and backward ~ k · N · chunk_size · V floats
  (k ≈ 2-3) plus one copy of the head weight; never (N, S, V).
  """
  N, S, _ = h_nsd.shape
  chunk = max(1, min(chunk_size, S))

  fn = jax.checkpoint(
      functools.partial(_logprobs_from_hidden, temperature,
                        model_config.final_softcap),
      prevent_cse=False)
  head = _head_params(model_config, params)
  logp_chunks, entropy_chunks = jax.lax.map(
      lambda xs: fn(head, *xs),
      (_to_chunks(h_nsd, chunk), _to_chunks(targets_ns, chunk)))
  return _from_chunks(logp_chunks, S), _from_chunks(entropy_chunks, S)


@dataclasses.dataclass(frozen=True)
class Forward:
  """How the decoder and the chunked head run over rows (static, hashable).

  chunk_size: positions per chunk of the head; temperature: the sampler's
  (a Python float), so log-probs match π_old; remat and attention: the
  decoder's (`attention.ATTENTION`); constrain: pins the activations'
  shardings (`transformer.hidden_states`; `sharding.Layout.constrain`);
  group_size G > 1: rows come in groups of G consecutive rows whose prompt
  columns are identical, each group's prompt then runs once
  (`sequence_logprobs`); dispatch: an MoE layer's token dispatch
  (`transformer.ForwardSettings`)."""
  chunk_size: int = DEFAULT_CHUNK_SIZE
  temperature: float = 1.0
  remat: str = "none"
  attention: str = "auto"
  constrain: Optional[Constrain] = None
  group_size: int = 1
  dispatch: Optional[Callable] = None

  @property
  def settings(self) -> ForwardSettings:
    """The decoder's part (`transformer.ForwardSettings`)."""
    return ForwardSettings(self.remat, self.attention, self.constrain,
                           self.dispatch)


def sequence_logprobs(model_config: ModelConfig, params: Params,
                      tokens_ns: jax.Array,
                      positions_ns: Optional[jax.Array] = None,
                      valid_ns: Optional[jax.Array] = None, *,
                      completion_len: Optional[int] = None,
                      forward: Forward = Forward()):
  """Runs the decoder, then the chunked head: log-probs and entropies of the
  last T = completion_len tokens of tokens_ns (default T = S - 1, every token
  but the first), float32 (N, T). Entry j is log p(tokens[:, S-T+j] | the
  tokens before it), so with [prompt | completion] rows and T the completion
  length it lines up with the sampler's completion log-probs and mask.

  forward.group_size G > 1 declares that rows come in groups of G
  consecutive rows whose first P = S - T columns (the prompt, padding
  included) are identical: each group's prompt then runs through the
  decoder once (`hidden_states_shared_prompt`), with the same result.
  """
  return sequence_logprobs_routed(
      model_config, params, tokens_ns, positions_ns, valid_ns,
      completion_len=completion_len, forward=forward)[:2]


def sequence_logprobs_routed(model_config: ModelConfig, params: Params,
                             tokens_ns: jax.Array,
                             positions_ns: Optional[jax.Array] = None,
                             valid_ns: Optional[jax.Array] = None, *,
                             completion_len: Optional[int] = None,
                             forward: Forward = Forward(),
                             routes_nslc: Optional[jax.Array] = None):
  """`sequence_logprobs` and the MoE `transformer.Routed` of the pass
  (None for a dense model); routes_nslc (N, S, L_sparse, C): the experts
  to replay at every column (routing replay), or None."""
  S = tokens_ns.shape[1]
  T = S - 1 if completion_len is None else completion_len
  if not 0 < T < S:
    raise ValueError(f"completion_len={completion_len}; need 0 < T < S={S}")

  group_size, constrain = forward.group_size, forward.constrain
  settings = forward.settings
  routes_lnsc = (None if routes_nslc is None
                 else jnp.moveaxis(routes_nslc, 2, 0))
  if group_size > 1:
    positions_ns, valid_ns = default_positions_and_valid(
        tokens_ns, positions_ns, valid_ns)
    P, first = S - T, slice(None, None, group_size)   # one row per group
    h_last_bd, h_ntd, routed = hidden_states_shared_prompt(
        model_config, params,
        Rows(tokens_ns[first, :P], positions_ns[first, :P],
             valid_ns[first, :P]),
        Rows(tokens_ns[:, P:], positions_ns[:, P:], valid_ns[:, P:]),
        settings, None if routes_lnsc is None else (
            routes_lnsc[:, first, :P], routes_lnsc[:, :, P:]))
    h_last_nd = jnp.repeat(h_last_bd, group_size, axis=0)
    # Column j predicts completion token j: the prompt's last, then T - 1.
    h_ntd = jnp.concatenate([h_last_nd[:, None], h_ntd[:, :T - 1]], axis=1)
  else:
    h_nsd, routed = hidden_states_routed(
        model_config, params, tokens_ns, positions_ns, valid_ns,
        settings=settings, routes_lnsc=routes_lnsc)
    h_ntd = h_nsd[:, S - 1 - T:S - 1]
  if constrain is not None:     # the head reads whole rows' columns
    h_ntd = constrain(h_ntd, ("batch", None, None))
  logp_nt, entropy_nt = token_logprobs(
      model_config, params, h_ntd, tokens_ns[:, S - T:],
      chunk_size=forward.chunk_size, temperature=forward.temperature)
  return logp_nt, entropy_nt, routed
