"""What the two slot samplers share: the prefill, and rows and slots split
over the row shards.

`continuous.sample_slots` (dense slots) and `paged_slots.sample_pages`
(slots over a page pool) run the same loop around different caches: every
prompt once through the model, every row's first token from its logits
(`start`); idle slots take their shard's next rows in prompt-major order
(`assign`); each step a slot reads its row's previous token and writes
the next (`read`, `write`); the loop checks whether anything is left every
k steps (`every`).

Sharding (R row shards): slots, rows and prompts are split in R
contiguous parts along the `batch` rule, and shard r's slots take only
shard r's rows, so per-shard code is vmapped over a leading R axis
(`per_shard`) and no read or write crosses row shards. Per-shard arrays
carry no shape suffix.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from grpo_jax import sharding
from grpo_jax.generate import decoding
from grpo_jax.models import moe, transformer

Layout = Optional[sharding.Layout]


def pin(layout: Layout, x: jax.Array, axes=(sharding.BATCH,)) -> jax.Array:
  """Inside jit: x split as `axes` say (default: rows along axis 0)."""
  return x if layout is None else layout.constrain(x, axes)


def per_shard(R: int, x: jax.Array) -> jax.Array:
  """(R * X, ...) -> (R, X, ...): shard r's part on axis 0 (a local
  reshape: the first axis is split in R contiguous parts)."""
  return x.reshape(R, x.shape[0] // R, *x.shape[1:])


class Start(NamedTuple):
  """A slot sampler's call after its prefill: what its loop reads."""
  pp: decoding.PromptPass
  prompt_len_b: jax.Array   # int32, split along rows
  first_n: jax.Array        # int32: each row's first token
  tokens_nt: jax.Array      # the first tokens in column 0, pad elsewhere
  logp_nt: jax.Array        # float32: their log-probs in column 0
  first_row: jax.Array      # int32 (R,): each shard's first (global) row
  row_limit: jax.Array      # int32 (R,): one past each shard's last real row


def start(call: decoding.CallSpec, params: transformer.Params,
          prompt_bp: jax.Array, prompt_len_b: jax.Array, key: jax.Array,
          real_prompts: jax.Array) -> Start:
  """PREFILL: each left-padded prompt (B, P) once through the model
  (`decoding.prompt_pass`); every row's first token chosen from its
  prompt's last logits with the noise of (key, row, 0). Only the first
  real_prompts (int32, traced) prompts' rows are to be decoded
  (`row_limit`); B must be a multiple of the row shards."""
  B = prompt_bp.shape[0]
  G, T = call.num_generations, call.sampling.max_new_tokens
  N, R = B * G, call.shards
  prompt_bp, prompt_len_b = (pin(call.layout, x)
                             for x in (prompt_bp, prompt_len_b))
  pp = decoding.prompt_pass(call.model_config, params, prompt_bp,
                            prompt_len_b, call.sampling.record_routes)
  row_n = jnp.arange(N, dtype=jnp.int32)
  first_n, logp_n = decoding.choose_tokens(
      pin(call.layout, jnp.repeat(pp.logits_bv, G, axis=0)), key,
      call.sampling, row_n, 0)
  tokens_nt = jnp.full((N, T), call.sampling.pad_id,
                       jnp.int32).at[:, 0].set(first_n)
  logp_nt = jnp.zeros((N, T), jnp.float32).at[:, 0].set(logp_n)
  N_local = N // R
  first_row = jnp.arange(R, dtype=jnp.int32) * N_local
  row_limit = first_row + jnp.clip(real_prompts * G - first_row, 0, N_local)
  return Start(pp, prompt_len_b, first_n, tokens_nt, logp_nt, first_row,
               row_limit)


def check_shards(call: decoding.CallSpec, prompts: int) -> None:
  """Raises unless the prompts and the slots split evenly over the row
  shards."""
  R = call.shards
  if prompts % R or call.slots % R:
    raise ValueError(f"{prompts} prompts and {call.slots} slots must be "
                     f"multiples of the {R} row shards")


def assign(live_m: jax.Array, next_row: jax.Array, row_limit: jax.Array):
  """Idle slots take the next rows of their shard, in order. Returns which
  slots took a row (M,), the row each took (M,; meaningless where not
  taken) and the shards' next rows."""
  R = next_row.shape[0]
  idle = ~per_shard(R, live_m)                      # (R, M/R)
  row = next_row[:, None] + jnp.cumsum(idle, axis=1) - 1
  take = idle & (row < row_limit[:, None])
  return take.reshape(-1), row.reshape(-1), next_row + take.sum(1)


def _local_rows(row_m: jax.Array, N: int, R: int) -> jax.Array:
  """(R, M/R): each slot's row as an index into its shard's N/R rows."""
  return per_shard(R, row_m) - jnp.arange(R)[:, None] * (N // R)


def shard_take(x: jax.Array, index_m: jax.Array, R: int) -> jax.Array:
  """x[index_m] for a per-prompt or per-row array x (split in R contiguous
  parts over the row shards), each shard reading its own part: a slot of
  shard r holds only shard r's rows, so no read crosses row shards. Indexed
  globally, XLA gathered every shard's part onto every chip at each decode
  step: for the paged sampler's prompt tails of the paper config on
  v5p:8x8x4 (512 prompts), 537 MB per chip per step over ICI
  (docs/paged.md). Slots that never took a row read a clipped index
  (unused)."""
  take = lambda part, i: jnp.take(part, i, axis=0, mode="clip")
  return jax.vmap(take)(per_shard(R, x),
                        _local_rows(index_m, x.shape[0], R)).reshape(
                            index_m.shape + x.shape[1:])


def read(x_nt: jax.Array, row_m: jax.Array, t_m: jax.Array, R: int
         ) -> jax.Array:
  """x_nt[row_m, t_m], each shard reading its own rows."""
  one = lambda x, r, t: x[r, t]
  return jax.vmap(one)(per_shard(R, x_nt), _local_rows(row_m, x_nt.shape[0], R),
                       per_shard(R, t_m)).reshape(row_m.shape)


def write(x_nt: jax.Array, row_m: jax.Array, t_m: jax.Array,
          value_m: jax.Array, live_m: jax.Array, R: int) -> jax.Array:
  """x_nt[row_m, t_m] = value_m for live slots, each shard writing its own
  rows (vmapped over shards; dead slots write nowhere)."""
  local = jnp.where(per_shard(R, live_m),
                    _local_rows(row_m, x_nt.shape[0], R),
                    x_nt.shape[0] // R)                       # out of range

  def one(x, r, t, val):
    return x.at[r, t].set(val, mode="drop")
  return jax.vmap(one)(per_shard(R, x_nt), local, per_shard(R, t_m),
                       per_shard(R, value_m)).reshape(x_nt.shape)


def every(step, k: int):
  """A while loop's body of `k` steps: the loop checks its condition (an
  all-reduce of the slots' live flags when they are sharded) once per k
  steps. A step must be a no-op once nothing is left to decode (slots
  that finished stay masked), so any k gives the same samples; k = 1 is
  the step itself."""
  if k == 1:
    return step
  return lambda c: jax.lax.fori_loop(0, k, lambda _, c: step(c), c)


def new_routes(call: decoding.CallSpec, N: int) -> Optional[jax.Array]:
  """record_routes: the completions' routes to fill, zeros (N, T,
  L_sparse, C) in `moe.routes_dtype`; else None."""
  if not call.sampling.record_routes:
    return None
  c = call.model_config
  return jnp.zeros((N, call.sampling.max_new_tokens, len(c.sparse_layers()),
                    c.moe.experts_per_token),
                   moe.routes_dtype(c.moe.num_experts))


def finish(call: decoding.CallSpec, tokens_nt: jax.Array, logp_nt: jax.Array,
           steps: jax.Array, pp: Optional[decoding.PromptPass] = None,
           routes_ntlc: Optional[jax.Array] = None) -> decoding.Samples:
  """`decoding.finish`, the per-row outputs split along rows; recorded
  routes as the lockstep sampler's (N, P + T, L_sparse, C): each row's
  prompt's (`pp.routes_lbpc`) then its completion's."""
  routes = None
  if routes_ntlc is not None:
    G = tokens_nt.shape[0] // pp.routes_lbpc.shape[1]
    prompt = jnp.repeat(jnp.moveaxis(pp.routes_lbpc, 0, 2), G, axis=0)
    routes = jnp.concatenate([prompt.astype(routes_ntlc.dtype), routes_ntlc],
                             axis=1)
  out = decoding.finish(tokens_nt, logp_nt, steps, call.sampling, routes)
  return decoding.map_rows(lambda x: pin(call.layout, x), out)
