"""The parked engine on 8 fake CPU devices (a script; tests/test_parked.py
runs it in a subprocess, as test_paged.py runs paged_sharding_checks.py).

For each mesh (data, fsdp, tensor) on the command line, with the tiny model,
the scripted env and greedy turns: `agent_parked.run_episodes` with the
sharded weights and the sampler's layout (rows over data x fsdp row shards,
an engine per shard: its own pool and slots on the shard's devices) gives
one device's episodes token for token, each shard's pool on its own
devices, and every page back at the end.
Prints one JSON line per mesh: {"mesh": [...], "ok": bool, "error": str}.
"""
import os

if __name__ == "__main__":  # before JAX starts a backend
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

import jax
import numpy as np
from sharding_checks import parse_meshes, row_shard_layout, run_meshes

from grpo_jax.data.example import Example
from grpo_jax.envs import base
from grpo_jax.generate import agent_parked, sampling
from grpo_jax.models import get_preset, init_params
from grpo_jax.models.byte_tokenizer import byte_tokenizer

MODEL = get_preset("tiny")
STOPS = tuple(range(0, 256, 3))      # a random tiny model stops in ~3 tokens
PAGED = sampling.SamplingConfig(max_new_tokens=6, greedy=True, stop_ids=STOPS,
                                pad_id=1, continuous_batching=True,
                                kv_cache="paged", page_size=4)
SPEC = base.EnvSpec("scripted", max_turns=4, max_observation_tokens=24,
                    kwargs=(("observations", ("12", "a longer output", "x")),),
                    engine="parked")
EXAMPLES = [Example(q, "5") for q in ("2+3?", "what is 7*8", "9-4", "1+1+1")]
G = 2
FIELDS = ("tokens_nt", "action_nt", "observation_nt", "length_n",
          "truncated_n", "turns_n", "tool_calls_n")


def episodes(params, layout):
  stats = {}
  ep = agent_parked.run_episodes(
      sampling.Sampler(MODEL, PAGED, layout), params, byte_tokenizer(),
      EXAMPLES, jax.random.key(3), G, SPEC, stats=stats)
  return ep, stats


def check_mesh(shape, params, ref) -> None:
  layout, devices = row_shard_layout(shape)
  shards = layout.batch_shards
  sharded = layout.shard_params(MODEL, params)
  ep, stats = episodes(sharded, layout)
  for name in FIELDS:
    np.testing.assert_array_equal(getattr(ep, name), getattr(ref, name), name)
  np.testing.assert_allclose(ep.logp_nt, ref.logp_nt, atol=1e-4)
  assert stats["free_pages"] == stats["pages"], "every page back at the end"
  sampler = sampling.Sampler(MODEL, PAGED, layout)
  one = agent_parked.engine_spec(sampler, len(EXAMPLES) * G // shards,
                                 max(map(len, ep.prompt_ids)), SPEC)
  assert stats["pages"] == shards * one.pages, (stats, one.pages)
  engines = agent_parked.engines(sampler, sharded, jax.random.key(3), one)
  for r, engine in enumerate(engines):     # each pool on its shard's devices
    assert engine.pool.k[0].sharding.device_set == devices[r]
    assert jax.tree.leaves(engine.params)[0].sharding.device_set == devices[r]


def main(argv) -> int:
  assert jax.device_count() == 8, jax.devices()
  params = jax.tree.map(lambda x: 4.0 * x, init_params(MODEL, jax.random.key(0)))
  ref, _ = episodes(params, None)
  assert ref.turns_n.max() >= 3, "the check must cover several turns"
  return run_meshes(parse_meshes(argv),
                    lambda shape: check_mesh(shape, params, ref))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
