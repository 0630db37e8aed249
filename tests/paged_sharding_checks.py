"""The paged continuous sampler on 8 fake CPU devices (a script;
tests/test_paged.py runs it in a subprocess, as test_continuous.py runs
continuous_sharding_checks.py).

For each mesh (data, fsdp, tensor) on the command line, with the tiny model
and the default rules: `sampling.sample` with kv_cache "paged", sharded
params and the layout, at temperature 1 with stop ids (ragged rows, slots
refilled mid-call) gives one device's static samples; the outputs' rows are
split data x fsdp ways; the compiled program's page pool is a per-device
slice (one row shard's pool, KV heads over tensor), never whole on one
device; every page returns to its shard's pool; the decode loop gathers
no per-prompt or per-row array (tails, page tables) across row shards,
and with an fsdp axis no weight (`page_pool.decode_constrain`);
with a tensor axis, the TPU kernel (sampling.paged_kernel = "pallas",
inside jax.shard_map, in TPU interpret mode) gives the same samples, and
on int8 pages (`int8_kernel`) the int8 reference's.
Prints one JSON line per mesh: {"mesh": [...], "ok": bool, "error": str}.
"""
import os
import re

if __name__ == "__main__":  # before JAX starts a backend
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from continuous_sharding_checks import PROMPTS, SLOTS, STATIC, G, row_shards
from jax.experimental.pallas import tpu as pltpu
from sharding_checks import parse_meshes, run_meshes

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.generate import paged_slots, sampling
from grpo_jax.models import get_preset, init_params, page_layout

MODEL = get_preset("tiny")   # H=4, K=2, E=16, L=2
PAGED = dataclasses.replace(STATIC, continuous_batching=True, slots=SLOTS,
                            kv_cache="paged", page_size=4)


def check_mesh(shape, params, ref) -> None:
  config = config_lib.base_config()
  config.mesh.shape = shape
  layout = sharding.Layout.from_config(config)
  sharded = layout.shard_params(MODEL, params)
  out = sampling.Sampler(MODEL, PAGED, layout).sample(
      sharded, PROMPTS, jax.random.key(3), G)
  host = jax.device_get(out)
  np.testing.assert_array_equal(host.tokens_nt, ref.tokens_nt)
  np.testing.assert_array_equal(host.length_n, ref.length_n)
  np.testing.assert_allclose(host.logp_nt, ref.logp_nt, rtol=1e-5, atol=1e-5)
  data, fsdp, tensor = shape
  for name in ("tokens_nt", "logp_nt", "mask_nt", "length_n"):
    ranges = row_shards(getattr(out, name))
    assert len(ranges) == data * fsdp, f"{name}: row shards {sorted(ranges)}"
  R = layout.batch_shards
  P = sampling.bucket(max(map(len, PROMPTS)))
  prompt_bp, len_b = sampling.left_pad(PROMPTS, P, len(PROMPTS), 0)
  W = sampling.pool_pages(PAGED, len_b, len(PROMPTS), SLOTS, R, P)
  call = sampling.CallSpec(MODEL, dataclasses.replace(PAGED, slots=0), G,
                           layout, SLOTS, W)
  args = (sharded, layout.rows(prompt_bp), layout.rows(len_b),
          jax.random.key(3), jnp.int32(len(PROMPTS)))
  _, stats = paged_slots.sample_pages(
      dataclasses.replace(call, check_pages=True), *args)
  assert int(stats.in_use_end) == 0 and int(stats.conflicts) == 0, stats
  hlo = paged_slots.sample_pages.lower(call, *args).compile().as_text()
  K, E, Z = MODEL.num_kv_heads, MODEL.head_dim, PAGED.page_size
  heads = K // tensor if K % tensor == 0 else K
  shape = lambda k: ",".join(map(str, page_layout.REFERENCE_LAYOUT.shape(k, W, Z, E)))
  assert f"f32[1,{shape(heads)}]" in hlo, (
      f"no per-device pool f32[1,{shape(heads)}]")
  assert f"f32[{R},{shape(K)}]" not in hlo, "a whole pool on a device"
  B = len(prompt_bp)           # no per-prompt or per-row array (the tails,
  gathered = [                 # the page tables) gathered across row shards
      m.group(1) for m in re.finditer(   # at each decode step
          r"= \w+\[(\d+)[,\]][^\n]* all-gather\([^\n]*while/body", hlo)]
  assert not {int(n) for n in gathered} & {B, B * G}, gathered
  if fsdp > 1:   # fewer rows per fsdp group than the width D: activations
    many = 16 * R  # cross ICI, never weights (XLA gathered w_gate here)
    W = sampling.pool_pages(PAGED, len_b, len(PROMPTS), many, R, P)
    hlo = paged_slots.sample_pages.lower(
        dataclasses.replace(call, slots=many, pool_pages=W),
        *args).compile().as_text()
    assert 16 * fsdp < MODEL.dim and not re.search(
        rf"= \w+\[{MODEL.dim},[^\n]* all-gather\([^\n]*decode/while/body",
        hlo), "a weight gathered in the decode loop"
  if tensor > 1:   # the TPU kernel inside shard_map, interpreted on CPU
    kernel_cfg = dataclasses.replace(PAGED, paged_kernel="pallas")
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      kernel = jax.device_get(sampling.Sampler(     # 4 prompts: interpreting
          MODEL, kernel_cfg, layout).sample(        # is slow
              sharded, PROMPTS[:4], jax.random.key(3), G))
    rows = 4 * G          # the noise is (key, row, t): the same rows' samples
    np.testing.assert_array_equal(kernel.tokens_nt, ref.tokens_nt[:rows])
    np.testing.assert_allclose(kernel.logp_nt, ref.logp_nt[:rows], atol=2e-2)
    int8 = dataclasses.replace(PAGED, kv_dtype="int8")   # int8 pages: the
    int8_ref = jax.device_get(sampling.Sampler(           # int8 kernel's
        MODEL, int8, layout).sample(sharded, PROMPTS[:4], jax.random.key(3), G))
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      int8_kernel = jax.device_get(sampling.Sampler(
          MODEL, dataclasses.replace(int8, paged_kernel="pallas"),
          layout).sample(sharded, PROMPTS[:4], jax.random.key(3), G))
    np.testing.assert_array_equal(int8_kernel.tokens_nt, int8_ref.tokens_nt)
    np.testing.assert_allclose(int8_kernel.logp_nt, int8_ref.logp_nt, atol=1e-4)


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
