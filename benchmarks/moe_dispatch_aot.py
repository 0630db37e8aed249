"""The two MoE dispatches on a TPU pod slice, compiled from this CPU.

One sparse layer of a preset (router + experts, bf16 compute, float32
router), forward and backward (gradients of the expert weights, the router
and the input) on one update micro-batch's tokens, compiled ahead of time
for a TPU topology (libtpu, no TPU) with the default mesh rules, once per
`model.moe.dispatch`:

    python benchmarks/moe_dispatch_aot.py --model=qwen3-30b-a3b \\
        --topology=v5p:2x4x4 --mesh=1,8,4 --tokens=167936

(167,936 tokens: 8 rows of 512 + 20,480, the DAPO recipe's micro-batch on
that slice.) Columns: per-chip temporaries and the bytes of each
collective kind in the compiled layer (the result arrays, each op once),
and the all-to-all dispatch's against the ragged one's as a ratio.
"""
from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.aot import programs
from grpo_jax.models import get_preset, moe, transformer

SPARSE = ("router", "expert_gate", "expert_up", "expert_down")
def collective_bytes(hlo: str) -> dict:
  """Bytes per collective kind: each op's (last) result array."""
  return dict(programs.hlo_collectives(hlo))


def layer_grad(model_config, dispatch):
  """Gradients of a scalar of one sparse layer's output."""
  def loss(lp, h_nd):
    routing = moe.route(model_config.moe, lp, h_nd)
    out = (moe.experts(lp, h_nd, routing) if dispatch is None
           else dispatch(lp, h_nd, routing)[0])
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return jax.grad(loss, (0, 1))


def compile_layer(model_config, layout, tokens: int, dispatch_name: str):
  specs = sharding.param_specs(layout.mesh, layout.rules, model_config)
  shapes = transformer.param_shapes(model_config)
  lp = {k: jax.ShapeDtypeStruct(
      shapes["layers"][k][1:], jnp.bfloat16,
      sharding=NamedSharding(layout.mesh, P(*tuple(specs["layers"][k])[1:])))
        for k in SPARSE}
  h = jax.ShapeDtypeStruct((tokens, model_config.dim), jnp.bfloat16,
                           sharding=sharding.batch_sharding(
                               layout.mesh, layout.rules, (tokens,)))
  fn = layer_grad(model_config, layout.expert_dispatch(dispatch_name))
  compiled = jax.jit(fn).lower(lp, h).compile()
  return (compiled.memory_analysis().temp_size_in_bytes,
          collective_bytes(compiled.as_text()))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", default="qwen3-30b-a3b")
  parser.add_argument("--topology", default="v5p:2x4x4")
  parser.add_argument("--mesh", default="1,8,4")
  parser.add_argument("--tokens", type=int, default=167936)
  args = parser.parse_args()
  config = config_lib.base_config()
  config.mesh.shape = tuple(int(x) for x in args.mesh.split(","))
  devices = programs.topology_devices(args.topology)
  layout = sharding.Layout.from_config(config, devices)
  model_config = get_preset(args.model)
  print(f"{args.model}, one sparse layer fwd+bwd, {args.tokens} tokens, "
        f"{args.topology} mesh {dict(layout.mesh.shape)}; GB per chip")
  kinds = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
           "collective-permute")
  print(f"{'dispatch':<11} {'temp':>7} " + " ".join(f"{k:>18}" for k in kinds))
  rows = {}
  for name in ("ragged", "all_to_all"):
    temp, coll = compile_layer(model_config, layout, args.tokens, name)
    rows[name] = (temp, sum(coll.values()))
    print(f"{name:<11} {temp / 1e9:7.2f} " + " ".join(
        f"{coll.get(k, 0) / 1e9:18.3f}" for k in kinds), flush=True)
  (t_r, c_r), (t_a, c_a) = rows["ragged"], rows["all_to_all"]
  print(f"all_to_all / ragged: temporaries {t_a / max(t_r, 1):.2f}x, "
        f"collective bytes {c_a / max(c_r, 1):.2f}x")


if __name__ == "__main__":
  main()
