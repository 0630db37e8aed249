"""Partial rollouts' stream on 8 fake CPU devices (a script; tests/
test_partial.py runs it in a subprocess, as test_parked.py runs
parked_sharding_checks.py).

For each mesh (data, fsdp, tensor) on the command line, with the tiny model
and greedy rows: `partial.Stream` with the sharded weights and the sampler's
layout (rows over data x fsdp row shards, an engine per shard: its own pool
and slots on the shard's devices), two generation batches whose rows are
cut by a weight switch part-way and continued, gives one device's rows
token for token, and every page back at the end.
With env PARTIAL_CHECKS_ROUTES=1: `tiny-moe` (experts split over tensor by the
default rules) with `sampling.record_routes` (routing replay): the rows'
recorded experts per column (`Samples.routes_nslc`, cut rows' carried
columns and those fed after the switch) equal one device's too.
Prints one JSON line per mesh: {"mesh": [...], "ok": bool, "error": str}.
"""
import os

if __name__ == "__main__":  # before JAX starts a backend
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import sys

import jax
import numpy as np
from sharding_checks import parse_meshes, row_shard_layout, run_meshes

from grpo_jax.generate import partial, sampling
from grpo_jax.models import get_preset, init_params

DENSE = get_preset("tiny")
STOPS = tuple(range(0, 256, 23))     # rows of a few to 24 tokens
PAGED = sampling.SamplingConfig(max_new_tokens=24, greedy=True,
                                stop_ids=STOPS, pad_id=1,
                                continuous_batching=True, kv_cache="paged",
                                page_size=4, slots=8)
N = 16                               # 4 prompts x G = 4 a batch
PROMPTS = [[tuple(range(40 + b, 45 + b + 2 * i)) for i in range(4)]
           for b in (0, 7)]
SWITCH_AFTER = 1                     # decode calls before the switch


def variant() -> tuple:
  """The model and sampling config: PARTIAL_CHECKS_ROUTES=1, tiny-moe
  recording routes; else the dense tiny model."""
  if os.environ.get("PARTIAL_CHECKS_ROUTES") == "1":
    return get_preset("tiny-moe"), dataclasses.replace(PAGED,
                                                      record_routes=True)
  return DENSE, PAGED


def rows(model, cfg, params, layout):
  """Batches 0 and 1 through the stream, every row off the engines after
  SWITCH_AFTER calls (the same weights as version 1); their samples, the
  rows the switch cut, and whether every page came back."""
  stream = partial.Stream(sampling.Sampler(model, cfg, layout), N,
                          jax.random.key(3))
  stream.switch(params, 0)
  for b, prompts in enumerate(PROMPTS):
    stream.add(b, prompts)
  calls = 0
  while not (stream.ready(0) and stream.ready(1)):
    stream.admit(1)
    stream.decode()
    calls += 1
    if calls == SWITCH_AFTER:
      stream.switch(params, 1)
  cut = sum(len(set(r.versions)) > 1 for rows in stream.ended.values()
            for r, _ in rows.values())
  pages_back = all(e.free_pages == e.spec.pages for e in stream.engines)
  return [stream.samples(b) for b in (0, 1)], cut, pages_back


def check_mesh(shape, model, cfg, params, ref) -> None:
  layout, _ = row_shard_layout(shape)
  got, cut, pages_back = rows(model, cfg, layout.shard_params(model, params),
                              layout)
  assert cut > 0, "the switch must cut rows in flight"
  assert pages_back, "every page back at the end"
  for (out, version_nt), (want, want_version) in zip(got, ref):
    for name in ("tokens_nt", "mask_nt", "length_n", "truncated_n"):
      np.testing.assert_array_equal(getattr(out, name), getattr(want, name),
                                    name)
    np.testing.assert_allclose(out.logp_nt, want.logp_nt, atol=1e-4)
    assert (out.routes_nslc is None) == (not cfg.record_routes)
    if cfg.record_routes:   # the experts as chosen: their order kept
      np.testing.assert_array_equal(out.routes_nslc, want.routes_nslc,
                                    "routes_nslc")
    assert ((version_nt == 0) | (version_nt == 1)).all()
    del want_version       # cut elsewhere: the shards' slots differ


def main(argv) -> int:
  assert jax.device_count() == 8, jax.devices()
  model, cfg = variant()
  params = jax.tree.map(lambda x: 4.0 * x, init_params(model, jax.random.key(0)))
  ref, cut, _ = rows(model, cfg, params, None)
  assert cut > 0, "the check must cut rows on one device too"
  lengths = np.concatenate([out.length_n for out, _ in ref])
  assert lengths.min() < lengths.max(), "rows of several lengths"
  if cfg.record_routes:   # a zero means a column never recorded too
    assert all(out.routes_nslc.any() for out, _ in ref), "routes recorded"
  return run_meshes(parse_meshes(argv),
                    lambda shape: check_mesh(shape, model, cfg, params, ref))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
