"""Packed update and scoring on 8 fake CPU devices (a script; tests/test_packing.py
runs it in a subprocess, as tests/test_sharding.py runs sharding_checks.py:
the device count is fixed before JAX starts).

For each mesh (data, fsdp, tensor) on the command line, with the tiny model
and the default rules (`mesh.sequence_parallel` on the meshes in
sharding_checks.SEQUENCE_PARALLEL), on ragged completions in groups of G
sharing a prompt, packed (`packing.pack_rows`, rows a multiple of the batch
shards):

  - one packed `update_step` with SGD at lr 1 (the parameter change is the
    gradient) on the placed state and row-sharded packed batch, with the
    layout, gives one device's loss, metrics and gradient, and keeps every
    leaf's sharding;
  - packed `score_logprobs` with the layout gives one device's log-probs, its rows
    split as the padded rows are;
  - the compiled update holds the packed residual stream per device (its
    rows over the batch shards, its length over tensor with sequence
    parallelism, as the padded path pins them); without the layout's
    constraints the compiler keeps no such buffer on (1, 8, 1) or (1, 2, 4).

It prints one JSON line per mesh: {"mesh": [...], "ok": bool, "error": str}.
"""
import os

if __name__ == "__main__":  # before JAX starts a backend; importers keep theirs
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sharding_checks import check_close, parse_meshes, run_meshes

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.algorithms import losses
from grpo_jax.models import get_preset, init_params
from grpo_jax.rl import packing, update

MODEL = get_preset("tiny")   # D = 64
SETTINGS = update.LossSettings(
    chunk=4, loss=losses.PolicyLossSpec(agg="seq-mean-token-mean"),
    kl_beta=0.05)
SGD = optax.sgd(1.0)
N, P, T, G = 32, 8, 12, 4
ROWS_PER_MICRO = 8
SEQUENCE_PARALLEL = {(1, 2, 4)}


def grouped_batch() -> update.UpdateBatch:
  """N rows in groups of G sharing a left-padded prompt, ragged completions
  (EOS inside the row or truncated at T), one row fully masked."""
  rng = np.random.default_rng(0)
  prompt_len = np.repeat(rng.integers(2, P + 1, N // G), G)
  comp_len = rng.integers(1, T + 1, N)
  comp_len[3] = T
  prompts = np.repeat(rng.integers(1, MODEL.vocab_size, (N // G, P)), G, 0)
  tokens = np.concatenate(
      [prompts, rng.integers(1, MODEL.vocab_size, (N, T))], 1)
  col = np.arange(P + T)[None]
  pad = (P - prompt_len)[:, None]
  valid = (col >= pad) & (col < P + comp_len[:, None])
  tokens = np.where(valid, tokens, 0).astype(np.int32)
  positions = np.maximum(col - pad, 0).astype(np.int32)
  mask = (np.arange(T)[None] < comp_len[:, None]).astype(np.float32)
  mask[6] = 0.0
  old = (-3.0 + 0.3 * rng.standard_normal((N, T))).astype(np.float32) * mask
  ref = (old + 0.1 * rng.standard_normal((N, T))).astype(np.float32) * mask
  adv = rng.standard_normal(N).astype(np.float32)
  return update.UpdateBatch(tokens, positions, valid, mask, old, ref, adv)


def packed(batch, shards):
  rows, num_micro = packing.pack_rows(batch.tokens_ns, batch.valid_ns,
                                      batch.mask_nt, G, ROWS_PER_MICRO, shards)
  return update.pack_update_batch(batch, rows), num_micro


def run(params, batch, layout=None):
  """(new params, metrics, scored log-probs, placed shardings, new state,
  the packed batch) of one packed update and one packed scoring."""
  shards = 1 if layout is None else layout.batch_shards
  pb, num_micro = packed(batch, 8)      # the same rows for every mesh
  assert shards <= 8 and 8 % shards == 0
  state = update.init_state(jax.tree.map(jnp.copy, params), SGD, 0)
  if layout is not None:
    state = layout.place_state(MODEL, SGD, state)
    pb = jax.tree.map(layout.rows, pb)
  placed = jax.tree.map(lambda x: x.sharding, state)
  scored = update.score_logprobs(
      update.Policy(state.params), update.UpdateBatch(rows=pb.rows),
      update.UpdateProgram(MODEL, SETTINGS, num_micro=num_micro,
                           layout=layout, logp_shape=(N, T)))
  new_state, metrics = update.update_step(
      state, pb, update.UpdateProgram(MODEL, SETTINGS, SGD, num_micro,
                                      layout=layout))
  return dict(params=jax.device_get(new_state.params),
              metrics=jax.device_get(metrics), scored=scored,
              placed=placed, new_state=new_state, num_micro=num_micro,
              batch=pb)


def check_mesh(shape, params, batch, ref) -> None:
  config = config_lib.base_config()
  config.mesh.shape = shape
  config.mesh.sequence_parallel = shape in SEQUENCE_PARALLEL
  layout = sharding.Layout.from_config(config)
  out = run(layout.shard_params(MODEL, params), batch, layout)
  check_close("metrics", out["metrics"], ref["metrics"], rtol=1e-5,
              atol=1e-7)
  # SGD at lr 1: new - old params is minus the gradient.
  grad = lambda p: jax.tree.map(np.subtract, jax.device_get(params), p)
  check_close("grad", grad(out["params"]), grad(ref["params"]), atol=2e-7)
  check_close("scored", jax.device_get(out["scored"]),
              jax.device_get(ref["scored"]))
  spec = out["scored"].sharding.spec
  want = sharding.batch_sharding(layout.mesh, layout.rules, (N, T)).spec
  assert spec == want, f"scored rows {spec}, expected {want}"
  kept = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim),
                      out["new_state"], out["placed"])
  assert all(jax.tree.leaves(kept)), f"update changed shardings: {kept}"
  # The residual stream [R, S, D] of one micro-batch, per device.
  pb = out["batch"]
  R, S, D = pb.rows.tokens_rs.shape[0] // out["num_micro"], P + T, MODEL.dim
  state = layout.place_state(MODEL, SGD, update.init_state(
      layout.shard_params(MODEL, params), SGD, 0))
  hlo = update.update_step.lower(
      state, pb, update.UpdateProgram(MODEL, SETTINGS, SGD, out["num_micro"],
                                      layout=layout)).compile().as_text()
  rows = R // layout.batch_shards
  seq = 4 if shape in SEQUENCE_PARALLEL else 1   # length over tensor
  assert f"f32[{rows},{S // seq},{D}]" in hlo, (
      f"no per-device residual f32[{rows},{S // seq},{D}]")


def main(argv) -> int:
  shapes = parse_meshes(argv)
  assert jax.device_count() == 8, jax.devices()
  params = init_params(MODEL, jax.random.key(0))
  batch = grouped_batch()
  ref = run(params, batch)
  assert ref["num_micro"] > 1, ref["num_micro"]   # micro-batches exercised
  return run_meshes(shapes,
                    lambda shape: check_mesh(shape, params, batch, ref))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
