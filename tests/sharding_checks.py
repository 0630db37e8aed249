"""Sharded vs single-device numerics on 8 fake CPU devices (a script).

tests/test_sharding.py runs this in a subprocess, because the device count
must be fixed before JAX starts and the rest of the suite runs on one device.
For each mesh (data, fsdp, tensor) given on the command line it checks, with
the tiny model and the default `config.mesh.rules`:

  - every parameter's `.sharding.spec` and shard shape are what the rules say,
  - greedy sampling (`sampling.sample` with sharded params and the layout)
    gives the same tokens and log-probs as one device, its rows are split
    over data x fsdp, and no device holds more than its slice of the KV
    cache (rows over data x fsdp, KV heads over tensor where they divide);
    with a prompt count that needs padding too,
  - the loss and the gradient (micro-batched, KL on) match one device,
  - one `update_step` (donated, sharded state) gives the same params and keeps
    every leaf's sharding; on the meshes in SEQUENCE_PARALLEL with
    `mesh.sequence_parallel` (the residual stream split over tensor too),
  - LoRA (models/lora.py): the adapters are split like their base weights'
    input/output axes (rank replicated), and the loss and the adapters'
    gradient on a sharded frozen base match one device.

It prints one JSON line per mesh: {"mesh": [...], "ok": bool, "error": str}.
"""
import os

if __name__ == "__main__":  # before JAX starts a backend; importers keep theirs
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.generate import padded, sampling
from grpo_jax.models import get_preset, init_params, lora, transformer
from grpo_jax.rl import optimizer as optimizer_lib
from grpo_jax.rl import update

# H=4, K=2, hd=16, D=64, F=128, V=256, L=2; env SHARDING_CHECKS_MODEL names
# another preset of these widths (tests/test_gemma_runs.py: tiny-gemma).
MODEL = get_preset(os.environ.get("SHARDING_CHECKS_MODEL", "tiny"))
SETTINGS = update.LossSettings(chunk=4, kl_beta=0.05)
NUM_MICRO = 2
GREEDY = sampling.SamplingConfig(max_new_tokens=6, greedy=True)
# A step large enough to see (lr 1e-2), and eps large enough that Adam's
# first step is ~ linear in small gradients instead of ~ their sign, which
# float32 rounding noise could flip.
OPTIM = config_lib.base_config().optim
OPTIM.update(learning_rate=1e-2, eps=1e-3)
PROMPTS = [[5, 9, 17, 3], [40, 2], [7, 7, 100, 31, 64, 8], [1, 250, 99]]
SEQUENCE_PARALLEL = {(1, 2, 4)}

# Expected specs, written out by hand from the default rules (not computed
# by the code under test). Size-1 mesh axes never appear in a spec.
# The norms: tiny's three, and tiny-gemma's q/k-norm and norms after
# attention and MLP where the model has them.
_SHAPES = transformer.param_shapes(MODEL)
_REPLICATED = {name: P() for name in (
    "final_norm", "attn_norm", "mlp_norm", "q_norm", "k_norm",
    "post_attn_norm", "post_mlp_norm") if name in _SHAPES or name in _SHAPES["layers"]}


def _specs(embed, wq, wkv, wo, w_in, w_down):
  return {**_REPLICATED, "embed": embed, "wq": wq, "wk": wkv, "wv": wkv,
          "wo": wo, "w_gate": w_in, "w_up": w_in, "w_down": w_down}


EXPECTED = {
    (8, 1, 1): _specs(P(), P(), P(), P(), P(), P()),
    (1, 8, 1): _specs(P(None, "fsdp"), P(None, "fsdp"), P(None, "fsdp"),
                      P(None, None, None, "fsdp"), P(None, "fsdp"),
                      P(None, None, "fsdp")),
    (2, 2, 2): _specs(P("tensor", "fsdp"), P(None, "fsdp", "tensor"),
                      P(None, "fsdp", "tensor"),
                      P(None, "tensor", None, "fsdp"),
                      P(None, "fsdp", "tensor"), P(None, "tensor", "fsdp")),
    # kv_heads = 2 does not divide by tensor = 4: wk, wv fall back to
    # replication on that axis while wq's 4 heads are split.
    (1, 2, 4): _specs(P("tensor", "fsdp"), P(None, "fsdp", "tensor"),
                      P(None, "fsdp"), P(None, "tensor", None, "fsdp"),
                      P(None, "fsdp", "tensor"), P(None, "tensor", "fsdp")),
}
EXPECTED_ROWS = {(8, 1, 1): P("data"), (1, 8, 1): P("fsdp"),
                 (2, 2, 2): P(("data", "fsdp")), (1, 2, 4): P("fsdp")}
# The sampler's KV cache per device, by hand: (rows, KV heads) of the
# B*G = 8 rows and K = 2 heads (tensor = 4 does not divide K: replicated).
EXPECTED_CACHE_SHARD = {(8, 1, 1): (1, 2), (1, 8, 1): (1, 2),
                        (2, 2, 2): (2, 1), (1, 2, 4): (4, 2)}
# Shard shapes of two leaves, by hand: wq (L, D, H, hd), embed (V, D).
L = MODEL.num_layers
EXPECTED_SHARD = {
    (8, 1, 1): {"wq": (L, 64, 4, 16), "embed": (256, 64)},
    (1, 8, 1): {"wq": (L, 8, 4, 16), "embed": (256, 8)},
    (2, 2, 2): {"wq": (L, 32, 2, 16), "embed": (128, 32)},
    (1, 2, 4): {"wq": (L, 32, 1, 16), "wk": (L, 32, 2, 16),
                "embed": (64, 32)},
}


def make_batch(n: int = 16, p: int = 8, t: int = 8) -> update.UpdateBatch:
  """A fixed update batch: left-padded prompts, ragged completions."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, MODEL.vocab_size, (n, p + t)).astype(np.int32)
  prompt_len = rng.integers(2, p + 1, n)
  comp_len = rng.integers(1, t + 1, n)
  col = np.arange(p + t)[None]
  pad = (p - prompt_len)[:, None]
  valid = (col >= pad) & (col < p + comp_len[:, None])
  positions = np.maximum(col - pad, 0).astype(np.int32)
  mask = (np.arange(t)[None] < comp_len[:, None]).astype(np.float32)
  old = (-3.0 + 0.3 * rng.standard_normal((n, t))).astype(np.float32)
  ref = (old + 0.1 * rng.standard_normal((n, t))).astype(np.float32)
  adv = rng.standard_normal(n).astype(np.float32)
  return update.UpdateBatch(tokens, positions, valid, mask, old * mask,
                            ref * mask, adv)


@jax.jit
def loss_and_grad(params, batch):
  """The whole batch's loss and gradient (no micro-batches: update_step
  covers those) - one compile, not two."""
  norm = update.global_normalisers(batch.mask_nt, SETTINGS)
  (loss, _), grads = jax.value_and_grad(update.loss_fn, has_aux=True)(
      update.Policy(params), batch, norm, SETTINGS.kl_beta,
      update.UpdateProgram(MODEL, SETTINGS))
  return loss, grads.params


LORA = lora.LoraSpec(rank=4, alpha=8.0)
LORA_SETTINGS = dataclasses.replace(SETTINGS, lora_scale=LORA.scale)


def make_adapters():
  """Adapters with B != 0, so that the gradient reaches A as well."""
  adapters = lora.init_adapters(MODEL, LORA, jax.random.key(5))
  return jax.tree_util.tree_map_with_path(
      lambda p, x: (0.05 * jax.random.normal(jax.random.key(6), x.shape)
                    if p[-1].key == "b" else x), adapters)


@jax.jit
def lora_loss_and_grad(adapters, base, batch):
  norm = update.global_normalisers(batch.mask_nt, LORA_SETTINGS)
  (loss, _), grads = jax.value_and_grad(
      lambda p: update.loss_fn(update.Policy(p, base), batch, norm,
                               LORA_SETTINGS.kl_beta,
                               update.UpdateProgram(MODEL, LORA_SETTINGS)),
      has_aux=True)(adapters)
  return loss, grads


def check_lora(layout, sharded_base, placed_batch, ref) -> None:
  """Adapters split like their weights; loss and gradient as one device."""
  adapters = layout.shard_params(MODEL, make_adapters())
  for name, ab in adapters["layers"]["lora"].items():
    w = tuple(sharded_base["layers"][name].sharding.spec)
    w += (None,) * (sharded_base["layers"][name].ndim - len(w))
    k = 1 + transformer.PROJECTION_INPUTS[name]
    pad = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))
    assert pad(ab["a"].sharding.spec, ab["a"].ndim) == w[:k] + (None,), (
        name, ab["a"].sharding.spec, w)
    assert pad(ab["b"].sharding.spec, ab["b"].ndim) == (
        w[:1] + (None,) + w[k:]), (name, ab["b"].sharding.spec, w)
  loss, grads = lora_loss_and_grad(adapters, sharded_base, placed_batch)
  np.testing.assert_allclose(float(loss), ref["lora_loss"], rtol=1e-5,
                             atol=1e-7)
  check_close("lora grad", jax.device_get(grads), ref["lora_grads"],
              atol=2e-7)


def run_all(params, batch, optimizer, layout=None):
  """Greedy samples, (grads, loss) and the state after one update."""
  samples = sampling.Sampler(MODEL, GREEDY, layout).sample(
      params, PROMPTS, jax.random.key(3), num_generations=2)
  loss, grads = loss_and_grad(params, batch)
  # A copy: the update donates its state, and `params` is used again.
  state = update.init_state(jax.tree.map(jnp.copy, params), optimizer, seed=0)
  if layout is not None:
    state = layout.place_state(MODEL, optimizer, state)
  placed = jax.tree.map(lambda x: x.sharding, state)
  new_state, metrics = update.update_step(
      state, batch, update.UpdateProgram(MODEL, SETTINGS, optimizer,
                                         NUM_MICRO, layout=layout))
  return dict(samples=jax.device_get(samples), sharded_samples=samples,
              grads=jax.device_get(grads),
              loss=float(loss), new_params=jax.device_get(new_state.params),
              metrics_loss=float(metrics["loss"]), placed=placed,
              new_state=new_state)


def check_specs(shape, params) -> None:
  expected = EXPECTED[shape]
  flat = {**{k: v for k, v in params.items() if k != "layers"},
          **params["layers"]}
  for name, x in flat.items():
    assert x.sharding.spec == expected[name], (
        f"{name}: spec {x.sharding.spec}, expected {expected[name]}")
  for name, shard in EXPECTED_SHARD[shape].items():
    got = flat[name].addressable_shards[0].data.shape
    assert got == shard, f"{name}: shard shape {got}, expected {shard}"


def row_shards(x: jax.Array) -> set[tuple[int, int]]:
  """The distinct (start, stop) row ranges of an array's shards."""
  rows = range(x.shape[0])
  return {(rows[s.index[0]].start, rows[s.index[0]].stop)
          for s in x.addressable_shards}


def check_sampler_sharding(shape, layout, params, samples, ref) -> None:
  """Rows of every output split data*fsdp ways; the compiled sampler holds
  only a slice of the KV cache per device; padded prompt counts work."""
  data, fsdp, _ = shape
  for name in ("tokens_nt", "logp_nt", "mask_nt", "length_n"):
    x = getattr(samples, name)
    ranges = row_shards(x)
    assert len(ranges) == data * fsdp, f"{name}: row shards {sorted(ranges)}"
    assert {b - a for a, b in ranges} == {x.shape[0] // (data * fsdp)}, (
        name, sorted(ranges))
  # The per-device shapes of the partitioned program: the cache buffer of
  # one layer is (rows, K, S, hd) sliced, and never whole on one device,
  # even from replicated prompts (the layout, not the inputs, splits it).
  P_ = sampling.bucket(max(len(p) for p in PROMPTS))
  S, hd, K = P_ + GREEDY.max_new_tokens, MODEL.head_dim, MODEL.num_kv_heads
  prompt_bp, len_b = sampling.left_pad(PROMPTS, P_, len(PROMPTS), 0)
  hlo = padded.sample_padded.lower(
      sampling.CallSpec(MODEL, GREEDY, 2, layout), params,
      jnp.asarray(prompt_bp), jnp.asarray(len_b),
      jax.random.key(3)).compile().as_text()
  rows, heads = EXPECTED_CACHE_SHARD[shape]
  assert f"f32[{rows},{heads},{S},{hd}]" in hlo, (
      f"no per-device cache buffer f32[{rows},{heads},{S},{hd}]")
  assert f"f32[{2 * len(PROMPTS)},{K},{S},{hd}]" not in hlo, (
      "a whole KV cache on one device")
  # 3 prompts x G=2: padded to a prompt count whose rows divide evenly.
  three = sampling.Sampler(MODEL, GREEDY, layout).sample(
      params, PROMPTS[:3], jax.random.key(3), num_generations=2)
  np.testing.assert_array_equal(jax.device_get(three.tokens_nt),
                                ref["samples"].tokens_nt[:6])


def check_close(name, got, want, rtol=2e-5, atol=2e-6) -> None:
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree.leaves(want)):
    np.testing.assert_allclose(
        g, w, rtol=rtol, atol=atol,
        err_msg=f"{name} {jax.tree_util.keystr(path)}")


def check_mesh(shape, params, batch, optimizer, ref) -> None:
  config = config_lib.base_config()
  config.mesh.shape = shape
  config.mesh.sequence_parallel = shape in SEQUENCE_PARALLEL
  layout = sharding.Layout.from_config(config)
  assert (("length", ("tensor",)) in layout.rules) == (
      shape in SEQUENCE_PARALLEL), layout.rules
  sharded = layout.shard_params(MODEL, params)
  check_specs(shape, sharded)
  placed_batch = jax.tree.map(layout.rows, batch)
  assert placed_batch.tokens_ns.sharding.spec == EXPECTED_ROWS[shape], (
      placed_batch.tokens_ns.sharding.spec)
  out = run_all(sharded, placed_batch, optimizer, layout)
  np.testing.assert_array_equal(out["samples"].tokens_nt,
                                ref["samples"].tokens_nt)
  check_close("sample logp", out["samples"].logp_nt, ref["samples"].logp_nt)
  check_sampler_sharding(shape, layout, sharded, out["sharded_samples"], ref)
  np.testing.assert_allclose(out["loss"], ref["loss"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(out["metrics_loss"], ref["metrics_loss"],
                             rtol=1e-5, atol=1e-7)
  check_close("grad", out["grads"], ref["grads"], atol=2e-7)
  check_close("updated params", out["new_params"], ref["new_params"],
              atol=1e-6)
  kept = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim),
                      out["new_state"], out["placed"])
  assert all(jax.tree.leaves(kept)), f"update changed shardings: {kept}"
  check_lora(layout, sharded, placed_batch, ref)


def main(argv) -> int:
  shapes = parse_meshes(argv)
  assert jax.device_count() == 8, jax.devices()
  params = init_params(MODEL, jax.random.key(0))
  batch = make_batch()
  optimizer = optimizer_lib.make_optimizer(OPTIM, 10)
  t0 = time.perf_counter()
  ref = run_all(params, jax.tree.map(jnp.asarray, batch), optimizer)
  lora_loss, lora_grads = lora_loss_and_grad(
      make_adapters(), params, jax.tree.map(jnp.asarray, batch))
  ref.update(lora_loss=float(lora_loss), lora_grads=jax.device_get(lora_grads))
  print(f"# reference {time.perf_counter() - t0:.1f}s", file=sys.stderr)
  return run_meshes(
      shapes, lambda shape: check_mesh(shape, params, batch, optimizer, ref))


def run_meshes(shapes, check) -> int:
  """The checking scripts' loop: check(shape) for each mesh shape, one JSON
  line {"mesh": [...], "ok": bool, "error": str} each (the traceback of a
  failure), the seconds on stderr. Returns the exit status (1: a failure).
  """
  failed = False
  for shape in shapes:
    t0 = time.perf_counter()
    try:
      check(shape)
      result = {"mesh": shape, "ok": True, "error": ""}
    except Exception:  # pylint: disable=broad-except
      result = {"mesh": shape, "ok": False, "error": traceback.format_exc()}
      failed = True
    print(json.dumps(result), flush=True)
    print(f"# {shape} {time.perf_counter() - t0:.1f}s", file=sys.stderr)
  return int(failed)


def row_shard_layout(shape) -> tuple[sharding.Layout, list[set]]:
  """The sampler's layout on mesh `shape` (data, fsdp, tensor) and each row
  shard's devices, checked to hold the 8 devices once between them."""
  config = config_lib.base_config()
  config.mesh.shape = shape
  layout = sharding.Layout.from_config(config)
  devices = [set(layout.row_shard(r).mesh.devices.flat)
             for r in range(layout.batch_shards)]
  assert len(set.union(*devices)) == 8 and sum(map(len, devices)) == 8
  return layout, devices


def parse_meshes(argv) -> list[tuple[int, ...]]:
  """The command line's "data,fsdp,tensor" mesh shapes."""
  return [tuple(int(v) for v in a.split(",")) for a in argv[1:]]

if __name__ == "__main__":
  sys.exit(main(sys.argv))
