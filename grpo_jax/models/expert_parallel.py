"""Expert-parallel dispatch: each chip computes only its own experts, the
tokens travel to them and back by all-to-all (`jax.shard_map`).

The other dispatch, `moe.experts`, is one grouped matmul over the layer's
sorted (token, expert) pairs, left to the compiler's partitioner; this one
says where every byte goes. With the X experts split P ways over the
expert mesh axes (`experts` in `mesh.rules`, `tensor` by default), each
chip holds X / P experts, and the tokens are split over every mesh axis
(a slice of rows the chip already has: no communication). Per chip:

1. SEND: its tokens' N_loc*C pairs sorted by expert, hence by the chip
   holding the expert; each destination gets a buffer of `capacity` rows
   (hidden state and local expert id) and the all-to-all delivers them.
2. EXPERTS: the P*capacity received rows sorted by local expert, the
   SwiGLU as grouped matmuls (`jax.lax.ragged_dot`, only its own experts'
   weights; on TPU XLA lowers it to a grouped matmul kernel).
3. RETURN: the inverse all-to-all sends each row's output back to the slot
   it left from; the pairs are unsorted and summed with their gates.

Capacity, per (source chip, destination chip) buffer: a chip's N_loc
tokens send at most N_loc * min(C, X / P) pairs to one destination (C
distinct experts per token, X / P of them there), so that bound drops
nothing whatever the routing: the default (`capacity_factor=0`), as RL
needs (a dropped pair changes the policy's distribution). A
`capacity_factor` f > 0 gives ceil(f * N_loc * C / P) rows instead (f = 1:
each expert's share of a perfectly balanced load, N_loc * C / X rows per
expert per source), smaller buffers and all-to-alls, and pairs past a
buffer's end are dropped (their output 0) and counted. The count comes
back beside the output: nonzero only with f > 0.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo_jax.models import moe

Params = dict[str, Any]
WEIGHTS = ("expert_gate", "expert_up", "expert_down")


def buffer_rows(tokens: int, chosen: int, local_experts: int, chips: int,
                capacity_factor: float) -> int:
  """Rows of one (source, destination) buffer for a chip's `tokens` tokens
  (module docstring): the no-drop bound, or ceil(f * tokens * C / P) at
  most that."""
  bound = tokens * min(chosen, local_experts)
  if capacity_factor <= 0:
    return bound
  return max(1, min(bound, math.ceil(capacity_factor * tokens * chosen
                                     / chips)))


def _send_slots(experts_nc, valid_n, local_experts: int, chips: int,
                capacity: int):
  """Where each (token, choice) pair goes: the pairs' order sorted by
  expert, each sorted pair's slot in the flat (P * capacity) send buffer
  (P * capacity: not sent), and the count of valid pairs past capacity."""
  n, c = experts_nc.shape
  flat = experts_nc.reshape(-1)
  valid = jnp.repeat(valid_n, c)
  order = jnp.argsort(jnp.where(valid, flat, local_experts * chips),
                      stable=True)
  dest = jnp.where(valid[order], flat[order] // local_experts, chips)
  counts_p = jnp.bincount(dest, length=chips)
  pos = jnp.arange(n * c) - (jnp.cumsum(counts_p) - counts_p).at[dest].get(
      mode="fill", fill_value=0)
  keep = (dest < chips) & (pos < capacity)
  slot = jnp.where(keep, dest * capacity + pos, chips * capacity)
  dropped = ((dest < chips) & (pos >= capacity)).sum()
  return order, slot, dropped


def _local_dispatch(h_nd, experts_nc, gates_nc, valid_n, w_gate, w_up,
                    w_down, *, axes, chips: int, capacity_factor: float):
  """One chip's part (module docstring): its tokens' output (N_loc, D) and
  how many of their pairs were dropped."""
  n, c = experts_nc.shape
  local = w_gate.shape[0]
  capacity = buffer_rows(n, c, local, chips, capacity_factor)
  # SEND
  order, slot, dropped = _send_slots(experts_nc, valid_n, local, chips,
                                     capacity)
  rows = chips * capacity
  send_x = jnp.zeros((rows, h_nd.shape[1]), h_nd.dtype).at[slot].set(
      h_nd[order // c], mode="drop")
  send_e = jnp.full((rows,), local, jnp.int32).at[slot].set(
      experts_nc.reshape(-1)[order] % local, mode="drop")
  to_experts = (functools.partial(jax.lax.all_to_all, axis_name=axes,
                                  split_axis=0, concat_axis=0, tiled=True)
                if chips > 1 else lambda x: x)
  # EXPERTS
  # the received rows at their local experts (X_loc, an empty row: 0)
  y_rd = moe.grouped_swiglu(to_experts(send_x), jnp.arange(rows),
                            to_experts(send_e), w_gate, w_up, w_down)
  # RETURN: the inverse all-to-all is the same exchange
  back_rd = to_experts(y_rd)
  y_sorted = back_rd.at[slot].get(mode="fill", fill_value=0)
  y_ncd = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, c, -1)
  out_nd = jnp.einsum("ncd,nc->nd", y_ncd, gates_nc.astype(h_nd.dtype))
  return out_nd, dropped


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """The all-to-all dispatch on `mesh`: experts split over `expert_axes`,
  tokens over `token_axes` (which include the expert axes);
  `capacity_factor` as the module docstring (0: no drops)."""
  mesh: Any                      # jax.sharding.Mesh or AbstractMesh
  expert_axes: tuple
  token_axes: tuple
  capacity_factor: float = 0.0

  def __post_init__(self):
    if not set(self.expert_axes) <= set(self.token_axes):
      raise ValueError(f"ExpertParallel: expert_axes {self.expert_axes} must "
                       f"be among token_axes {self.token_axes}")
    if self.capacity_factor < 0:
      raise ValueError(f"ExpertParallel.capacity_factor="
                       f"{self.capacity_factor} must be >= 0")

  @property
  def chips(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.expert_axes)

  def __call__(self, lp: Params, h_nd: jax.Array, routing: moe.Routing
               ) -> tuple:
    """(sum over each token's C experts of gate * SwiGLU_expert(h) (N, D),
    the pairs dropped (int32, 0 at the default capacity))."""
    n, c = routing.experts_nc.shape
    experts = lp["expert_gate"].shape[0]
    if experts % self.chips:
      raise ValueError(f"model.moe.dispatch='all_to_all': {experts} experts "
                       f"do not split over the {self.chips} chips of mesh "
                       f"axes {self.expert_axes} (the `experts` rule)")
    shards = math.prod(self.mesh.shape[a] for a in self.token_axes)
    pad = (-n) % shards
    padded = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    tokens = PartitionSpec(self.token_axes)
    experts = PartitionSpec(self.expert_axes)
    body = functools.partial(
        _local_dispatch, axes=self.expert_axes, chips=self.chips,
        capacity_factor=self.capacity_factor)
    body = functools.partial(_summed_over, body, self.token_axes)
    f = jax.shard_map(body, mesh=self.mesh,
                      in_specs=(tokens,) * 4 + (experts,) * 3,
                      out_specs=(tokens, PartitionSpec()), check_vma=False)
    weights = [lp[name].astype(h_nd.dtype) for name in WEIGHTS]
    out, dropped = f(padded(h_nd), padded(routing.experts_nc),
                     padded(routing.gates_nc),
                     padded(jnp.ones((n,), bool)), *weights)
    return out[:n], dropped


def _summed_over(body, token_axes, *args):
  """`body` with its drop count summed over every token shard."""
  out, dropped = body(*args)
  return out, jax.lax.psum(dropped, tuple(token_axes))
