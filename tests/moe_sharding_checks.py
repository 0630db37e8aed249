"""The all-to-all expert dispatch on 8 fake CPU devices (a script;
tests/test_expert_parallel.py runs it in a subprocess, as
tests/test_sharding.py runs sharding_checks.py: the device count is fixed
before JAX starts).

For each mesh (data, fsdp, tensor) on the command line, with `tiny-moe`
(8 experts, 2 chosen) and the default rules (experts split over tensor):

  - one sparse layer: `Layout.expert_dispatch("all_to_all")` gives
    `moe.experts`' output and gradients (w.r.t. the expert weights, the
    router and the input) on 37 tokens (padded to the token shards), and
    drops nothing at its default capacity; at capacity factor 0.5 it drops
    the pairs `kept_pairs` says (counted) and equals `moe.experts` with
    their gates zeroed;
  - the model: the trainer's log-probs and their gradient through
    `logprobs.Forward(dispatch=...)` on the placed parameters equal one
    device's without it (the grouped matmul), and the program holds an
    all-to-all where tensor > 1; so do the log-probs of groups of 2 rows
    sharing a prompt pass, with the Forward that `update.LossSettings(
    moe_dispatch="all_to_all")` builds from the layout.

It prints one JSON line per mesh: {"mesh": [...], "ok": bool, "error": str}.
"""
import os

if __name__ == "__main__":  # before JAX starts a backend; importers keep theirs
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from sharding_checks import check_close, parse_meshes, run_meshes

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.algorithms import logprobs
from grpo_jax.models import expert_parallel, get_preset, init_params, moe
from grpo_jax.rl import update

MODEL = get_preset("tiny-moe")
SPARSE = ("router", "expert_gate", "expert_up", "expert_down")


def kept_pairs(experts_nc, shards: int, chips: int, local: int,
               capacity: int) -> np.ndarray:
  """Which (token, choice) pairs a dispatch with buffers of `capacity`
  rows keeps, by its rule in plain numpy: each of `shards` contiguous
  token slices sends, per destination chip (expert // local), its pairs in
  (expert, token, choice) order, the first `capacity` of them."""
  experts_nc = np.asarray(experts_nc)
  keep = np.zeros(experts_nc.shape, bool)
  per = len(experts_nc) // shards
  for s in range(shards):
    rows = range(s * per, (s + 1) * per)
    for d in range(chips):
      pairs = sorted((experts_nc[n, c], n, c) for n in rows
                     for c in range(experts_nc.shape[1])
                     if experts_nc[n, c] // local == d)
      for _, n, c in pairs[:capacity]:
        keep[n, c] = True
  return keep


def check_drops(dispatch, lp, h_nd, factor: float) -> None:
  """At `factor`, the output is `moe.experts`' with the dropped pairs'
  gates zeroed, and the count is theirs."""
  dispatch = expert_parallel.ExpertParallel(
      dispatch.mesh, dispatch.expert_axes, dispatch.token_axes, factor)
  routing = moe.route(MODEL.moe, lp, h_nd)
  n, c = routing.experts_nc.shape
  shards = math.prod(dispatch.mesh.shape[a] for a in dispatch.token_axes)
  local = MODEL.moe.num_experts // dispatch.chips
  capacity = expert_parallel.buffer_rows(n // shards, c, local,
                                         dispatch.chips, factor)
  keep = kept_pairs(routing.experts_nc, shards, dispatch.chips, local,
                    capacity)
  assert 0 < keep.sum() < keep.size, keep.sum()
  out, dropped = jax.jit(dispatch)(lp, h_nd, routing)
  assert int(dropped) == keep.size - keep.sum(), (dropped, keep.sum())
  want = moe.experts(lp, h_nd, routing._replace(
      gates_nc=routing.gates_nc * keep))
  check_close(f"output at capacity factor {factor}", out, want, rtol=1e-5,
              atol=1e-6)


def layer_loss(dispatch, lp, h_nd):
  """A scalar of one sparse layer's output (every output counts)."""
  routing = moe.route(MODEL.moe, lp, h_nd)
  out_nd = (moe.experts(lp, h_nd, routing) if dispatch is None
            else dispatch(lp, h_nd, routing)[0])
  return jnp.sum(out_nd * jnp.cos(out_nd)), out_nd


def model_logprobs(forward, params, tokens_ns, completion_len=None):
  logp_nt, _ = logprobs.sequence_logprobs(MODEL, params, tokens_ns,
                                          completion_len=completion_len,
                                          forward=forward)
  return logp_nt.sum(), logp_nt


def check_mesh(shape) -> None:
  config = config_lib.base_config()
  config.mesh.shape = shape
  layout = sharding.Layout.from_config(config)
  dispatch = layout.expert_dispatch("all_to_all")
  assert dispatch.expert_axes == (("tensor",) if shape[2] > 1 else ())
  params = init_params(MODEL, jax.random.key(0))
  lp = {k: params["layers"][k][0] for k in SPARSE}
  h_nd = jax.random.normal(jax.random.key(1), (37, MODEL.dim))
  grad = lambda d: jax.jit(jax.value_and_grad(
      lambda lp, h: layer_loss(d, lp, h), (0, 1), has_aux=True))
  (_, want), want_g = grad(None)(lp, h_nd)
  placed = layout.shard_params(MODEL, {"layers": params["layers"]})
  placed = {k: placed["layers"][k][0] for k in SPARSE}
  (_, got), got_g = grad(dispatch)(placed, h_nd)
  check_close("layer output", got, want, rtol=1e-5, atol=1e-6)
  check_close("layer gradient", got_g, want_g, rtol=1e-4, atol=1e-6)
  _, dropped = jax.jit(lambda lp, h: dispatch(
      lp, h, moe.route(MODEL.moe, lp, h)))(placed, h_nd)
  assert int(dropped) == 0, dropped
  check_drops(dispatch, lp, h_nd[:32], 0.5)

  tokens_ns = jax.random.randint(jax.random.key(2), (8, 10), 0,
                                 MODEL.vocab_size)
  run = lambda forward: jax.jit(jax.value_and_grad(
      lambda p, t: model_logprobs(forward, p, t), has_aux=True))
  (_, want), want_g = run(logprobs.Forward(chunk_size=4))(params, tokens_ns)
  sharded = layout.shard_params(MODEL, params)
  forward = logprobs.Forward(chunk_size=4, constrain=layout.constrain,
                             dispatch=dispatch)
  (_, got), got_g = run(forward)(sharded, layout.rows(tokens_ns))
  lowered = run(forward).lower(sharded, layout.rows(tokens_ns)).as_text()
  assert ("all_to_all" in lowered) == (shape[2] > 1)

  grouped_ns = tokens_ns.at[1::2, :4].set(tokens_ns[::2, :4])  # pairs share
  settings = update.LossSettings(chunk=4, moe_dispatch="all_to_all")
  forward = settings.forward(layout, group_size=2)
  assert forward.dispatch == dispatch
  logp = lambda f, p, t: jax.jit(lambda p, t: model_logprobs(
      f, p, t, completion_len=6)[1])(p, t)
  check_close("shared-prompt log-probs",
              logp(forward, sharded, layout.rows(grouped_ns)),
              logp(logprobs.Forward(chunk_size=4), params, grouped_ns),
              rtol=1e-5, atol=2e-6)
  check_close("log-probs", got, want, rtol=1e-5, atol=2e-6)
  check_close("log-prob gradient", got_g, want_g, rtol=1e-4, atol=2e-6)


if __name__ == "__main__":
  assert len(jax.devices()) == 8, jax.devices()
  np.set_printoptions(precision=4)
  sys.exit(run_meshes(parse_meshes(sys.argv), check_mesh))
