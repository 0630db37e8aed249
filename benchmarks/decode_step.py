"""Where a continuous-batching decode step's time goes: dense slots vs pages.

    python benchmarks/decode_step.py [--slots 16] [--columns 128,256,384]
        [--page-size 16] [--dtype float32] [--repeats 20] [--quick]

SmolLM2-135M-Instruct (random weights of its shapes: timing only), M slots
each holding a row of `columns` filled columns (the longest live row), per
decode step of the two continuous-batching samplers:

  step      the whole step: `ragged.decode_step` (dense slots, a cache of
            S columns per slot) and `paged.decode_step` (a pool of pages,
            each slot's pages in random order through its table), both
            reading up to `columns` (bucketed the same way)
  weights   the same step with attention replaced by its query (the
            projections, MLP and head: one read of the weights)
  attention one layer's decode attention alone (`ragged.filled_attention`
            vs `paged.bucketed_attention` over the same rows) x layers
  gather    paged only: one layer's page gather (`PoolLayout.gather` of
            the pages the bucket reads, as (M, K, S, E)) x layers, the copy
            the reference makes before its dots

--layout kernel times the reference over the TPU kernel's heads-first
pools instead of its own pages-first ones (`page_layout.PoolLayout`).

Each runs --repeats times in one jitted loop, its caches donated and
updated in place as in the samplers' loops; the first call compiles, the
second is timed. The ratio column is paged / dense (< 1: pages faster).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models import blockwise, decode, page_layout, paged, ragged, transformer
from grpo_jax.models import config as model_config_lib

# pylint: enable=g-import-not-at-top,wrong-import-position

MODEL = "smollm2-135m-instruct"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--slots", type=int, default=16, help="M slots")
  p.add_argument("--columns", default="128,256,384",
                 help="comma-separated filled columns of the longest row")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--dtype", default="float32",
                 help="weights and KV dtype (float32 | bfloat16)")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--layout", choices=("reference", "kernel"),
                 default="reference",
                 help="the pools' layout (page_layout.REFERENCE_LAYOUT: pages "
                      "first, what the reference uses; kernel: heads first)")
  p.add_argument("--quick", action="store_true",
                 help="smoke check: 4 slots, 128 columns, 3 repeats")
  args = p.parse_args(argv)
  if args.quick:
    args.slots, args.columns, args.repeats = 4, "128", 3
  args.column_list = [int(x) for x in args.columns.split(",") if x]
  return args


def seconds_per_step(body, weights, state, repeats: int) -> float:
  """`body` ((weights, state) -> state) run `repeats` times in one jitted
  fori_loop, the weights an argument (not constants to fold) and the state
  donated (as in the samplers' while loops, the caches are updated in
  place, never copied): seconds per step of the second call (the first
  compiles)."""
  run = jax.jit(lambda w, s: jax.lax.fori_loop(
      0, repeats, lambda _, x: body(w, x), s), donate_argnums=1)
  state = jax.block_until_ready(run(weights, state))
  t0 = time.perf_counter()
  jax.block_until_ready(run(weights, state))
  return (time.perf_counter() - t0) / repeats


def dense_state(c, M: int, S: int, filled: int, dtype, key):
  """A dense cache of S columns per slot, the first `filled` valid."""
  cache = decode.init_cache(c, M, S, dtype)
  k = jax.random.normal(key, cache.k[0].shape, dtype)
  valid = jnp.broadcast_to(jnp.arange(S) < filled, (M, S))
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (M, S))
  layers = lambda: tuple(jnp.copy(k) for _ in range(c.num_layers))
  return decode.KVCache(layers(), layers(), valid, pos)


def paged_state(c, M: int, J: int, Z: int, dtype, key, layout):
  """A pool of M * J pages (one shard), slot m's table a random
  permutation slice: every slot J pages of its own."""
  W = M * J
  pool = jax.random.normal(
      key, (1,) + layout.shape(c.num_kv_heads, W, Z, c.head_dim), dtype)
  table = np.random.default_rng(0).permutation(W).reshape(M, J)
  return (tuple(jnp.copy(pool) for _ in range(c.num_layers)),
          jnp.asarray(table, jnp.int32))


def timings(c, params, M: int, filled: int, Z: int, dtype, repeats: int,
            layout):
  """Seconds per step of each part (module docstring), dense and paged.
  Each step's input is the previous step's output (the next tokens, or the
  attention output as the next query), so no part is loop-invariant."""
  L, T = c.num_layers, 256
  S = -(-(filled + T) // ragged.BLOCK_S) * ragged.BLOCK_S
  J = S // Z
  key = jax.random.key(1)
  column = jnp.full((M,), filled - 1, jnp.int32)
  n = jnp.int32(filled)
  pages = jnp.int32(-(-filled // Z))
  cut = -(-filled // ragged.BLOCK_S) * ragged.BLOCK_S // Z
  tokens = lambda: jnp.ones((M,), jnp.int32)
  query = lambda: jax.random.normal(key, (M, c.num_heads, c.head_dim), dtype)
  # Sliced once, as the samplers do before their loops.
  weights = decode.weights(c, params)
  next_tokens = lambda logits: jnp.argmax(logits, -1).astype(jnp.int32)

  def dense_step(w, s):
    tok, cache = s
    logits, cache = ragged.decode_step(c, w, cache, tok, column, column, n)
    return next_tokens(logits), cache

  def paged_step(w, s, skip=False):
    tok, k, v, table = s
    page = jnp.take_along_axis(table, (column // Z)[:, None], 1)[:, 0]
    attend = (lambda q, *a: q) if skip else paged.reference_fn(c, pages, layout)
    logits, pool = paged.decode_step(
        c, w, paged.PagePool(k, v), tok, paged.RowPages(column, page, table),
        paged.DecodeSettings(attend, 1, layout))
    return next_tokens(logits), pool.k, pool.v, table

  def dense_attention(w, s):
    q, cache = s
    keys = blockwise.MaskInfo(column[:, None], cache.pos_ns, cache.valid_ns)
    out = ragged.filled_attention(q[:, None], cache.k[0], cache.v[0], keys, n)
    return out[:, 0], cache

  def paged_attention(w, s):
    q, k, v, table = s
    out = paged.bucketed_attention(q, k[0][0], v[0][0], column + 1, table,
                                   pages, paged.Buckets(layout=layout))
    return out, k, v, table

  def gather(w, s):
    q, k, v, table = s
    cols = layout.gather(k[0][0], table[:, :cut])     # (M, K, S, E)
    return q + cols.sum().astype(q.dtype), k, v, table

  def dense(x):
    return x, dense_state(c, M, S, filled, dtype, key)

  def paged_pools(x):
    pools, table = paged_state(c, M, J, Z, dtype, key, layout)
    return x, pools, paged_state(c, M, J, Z, dtype, key, layout)[0], table

  t = lambda body, state: seconds_per_step(body, weights, state, repeats)
  return {
      "step": (t(dense_step, dense(tokens())),
               t(paged_step, paged_pools(tokens()))),
      "weights": (None, t(functools.partial(paged_step, skip=True),
                          paged_pools(tokens()))),
      "attention": (L * t(dense_attention, dense(query())),
                    L * t(paged_attention, paged_pools(query()))),
      "gather": (None, L * t(gather, paged_pools(query()))),
  }


def main(argv=None) -> int:
  args = parse_args(argv)
  c = model_config_lib.get_preset(MODEL)
  dtype = jnp.dtype(args.dtype)
  params = transformer.cast(transformer.init_params(c, jax.random.key(0)),
                            args.dtype)
  print(f"# decode step: dense slots vs pages, {MODEL} shapes ({args.dtype}), "
        f"{args.slots} slots, page size {args.page_size}, {args.layout} "
        f"pool layout, jax "
        f"{jax.__version__} on {jax.default_backend()}, {args.repeats} steps "
        "per timed loop")
  print("| columns | part | dense ms | paged ms | paged / dense |")
  print("| ---: | --- | ---: | ---: | ---: |")
  for filled in args.column_list:
    layout = (page_layout.REFERENCE_LAYOUT if args.layout == "reference"
              else page_layout.KERNEL_LAYOUT)
    for part, (d, p) in timings(c, params, args.slots, filled,
                                args.page_size, dtype, args.repeats,
                                layout).items():
      ms = lambda x: "-" if x is None else f"{x * 1e3:.1f}"
      ratio = "-" if d is None else f"{p / d:.2f}"
      print(f"| {filled} | {part} | {ms(d)} | {ms(p)} | {ratio} |")
    sys.stdout.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
