"""Continuous batching on 8 fake CPU devices (a script; tests/test_continuous.py
runs it in a subprocess, as tests/test_sharding.py runs sharding_checks.py).

For each mesh (data, fsdp, tensor) on the command line, with the tiny model
and the default rules: `sampling.sample` with continuous batching, sharded
params and the layout, at temperature 1 with stop ids (ragged rows, slots
refilled mid-call) gives the tokens of one device's static sampler and its
log-probs; every output's rows are split data x fsdp ways; and the compiled
program's slot cache is a per-device slice (slots over data x fsdp, KV heads
over tensor), never whole on one device. Prints one JSON line per mesh: {"mesh": [...], "ok": bool,
"error": str}.
"""
import os

if __name__ == "__main__":  # before JAX starts a backend
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from sharding_checks import parse_meshes, run_meshes

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.generate import continuous, sampling
from grpo_jax.models import get_preset, init_params, ragged

MODEL = get_preset("tiny")   # H=4, K=2, E=16, L=2
STATIC = sampling.SamplingConfig(max_new_tokens=10, temperature=1.0,
                                 stop_ids=(3, 50, 77, 120, 200, 250))
SLOTS = 8
PROMPTS = [[5, 9, 17, 3], [40, 2], [7, 7, 100, 31, 64, 8], [1, 250, 99],
           [12, 13], [8, 6, 4, 2, 1], [33], [90, 91, 92]]
G = 3


def row_shards(x: jax.Array) -> set:
  rows = range(x.shape[0])
  return {(rows[s.index[0]].start, rows[s.index[0]].stop)
          for s in x.addressable_shards}


def check_mesh(shape, params, ref) -> None:
  config = config_lib.base_config()
  config.mesh.shape = shape
  layout = sharding.Layout.from_config(config)
  sharded = layout.shard_params(MODEL, params)
  cfg = dataclasses.replace(STATIC, continuous_batching=True, slots=SLOTS)
  out = sampling.Sampler(MODEL, cfg, layout).sample(
      sharded, PROMPTS, jax.random.key(3), G)
  host = jax.device_get(out)
  np.testing.assert_array_equal(host.tokens_nt, ref.tokens_nt)
  np.testing.assert_array_equal(host.length_n, ref.length_n)
  np.testing.assert_allclose(host.logp_nt, ref.logp_nt, rtol=1e-5, atol=1e-5)
  data, fsdp, tensor = shape
  for name in ("tokens_nt", "logp_nt", "mask_nt", "length_n"):
    ranges = row_shards(getattr(out, name))
    assert len(ranges) == data * fsdp, f"{name}: row shards {sorted(ranges)}"
  # The compiled program: slot cache (M, K, S, E) sliced per device.
  R = layout.batch_shards
  P = sampling.bucket(max(map(len, PROMPTS)))
  prompt_bp, len_b = sampling.left_pad(PROMPTS, P, len(PROMPTS), 0)
  call = sampling.CallSpec(MODEL, dataclasses.replace(cfg, slots=0), G,
                           layout, SLOTS)
  hlo = continuous.sample_slots.lower(
      call, sharded, layout.rows(prompt_bp), layout.rows(len_b),
      jax.random.key(3), jnp.int32(len(PROMPTS))).compile().as_text()
  S = -(-(P + STATIC.max_new_tokens) // ragged.BLOCK_S) * ragged.BLOCK_S
  K, E = MODEL.num_kv_heads, MODEL.head_dim
  heads = K // tensor if K % tensor == 0 else K
  assert f"f32[{SLOTS // R},{heads},{S},{E}]" in hlo, (
      f"no per-device slot cache f32[{SLOTS // R},{heads},{S},{E}]")
  assert f"f32[{SLOTS},{K},{S},{E}]" not in hlo, "a whole slot cache"


def main(argv) -> int:
  assert jax.device_count() == 8, jax.devices()
  params = init_params(MODEL, jax.random.key(0))
  ref = jax.device_get(sampling.sample(MODEL, params, PROMPTS,
                                       jax.random.key(3), STATIC, G))
  assert len(set(np.asarray(ref.length_n))) > 2, ref.length_n   # ragged
  return run_meshes(parse_meshes(argv),
                    lambda shape: check_mesh(shape, params, ref))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
