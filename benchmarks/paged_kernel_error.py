"""The TPU paged-attention kernel against the plain-JAX reference, on CPU.

    python benchmarks/paged_kernel_error.py [--seeds 3]

Runs `paged.kernel_attention` (JAX's Pallas `paged_attention`; on int8
pages `int8_kernel`) in TPU interpret mode and
`paged.paged_attention_reference` on the same decode queries and page
pools: ragged lengths (1 to 5 pages and a partial last page), pages in
random order, two rows sharing their first pages (a prompt's), GQA
(H = 4K), head width 128 (the kernels' lane width); pools in float32 and
bfloat16, and int8 pages (pages first, quantised from the float32 draw)
under float32 and bfloat16 queries, against the reference over the same
int8 pages in float32. Prints the largest absolute difference of the
attention outputs and the largest relative one (over |reference| > 0.1)
per kind, over --seeds draws. tests/test_paged.py and
tests/test_int8_kernel.py assert the same agreement; this prints how
close it is.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # libtpu is installed: no TPU probe
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from jax.experimental.pallas import tpu as pltpu  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo_jax.models import page_layout, paged  # pylint: disable=wrong-import-position
from grpo_jax.models.int8_pages import Int8Pages, quantize_columns  # pylint: disable=wrong-import-position

M, K, H, E, Z, J = 4, 2, 8, 128, 16, 3     # rows, KV heads, heads, width, page, pages per row


def draw(seed: int, dtype):
  """(q_mhe, k_kwze, v_kwze, length_m, table_mj) in the kernel's layout."""
  rng = np.random.RandomState(seed)
  length_m = rng.randint(1, J * Z + 1, M)
  length_m[1] = max(length_m[1], 2 * Z + 1)     # row 1 shares row 0's first 2 pages
  length_m[0] = max(length_m[0], 2 * Z)
  W = M * J
  order, used = rng.permutation(W), 0
  table_mj = np.full((M, J), 0)
  for m in range(M):
    for j in range(-(-int(length_m[m]) // Z)):
      if m == 1 and j < 2:
        table_mj[m, j] = table_mj[0, j]
      else:
        table_mj[m, j], used = order[used], used + 1
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (M, H, E)).astype(dtype)
  k = jax.random.normal(ks[1], (K, W, Z, E)).astype(dtype)
  v = jax.random.normal(ks[2], (K, W, Z, E)).astype(dtype)
  return q, k, v, jnp.asarray(length_m, jnp.int32), jnp.asarray(table_mj, jnp.int32)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seeds", type=int, default=3)
  args = p.parse_args(argv)
  int8 = lambda x: Int8Pages(*quantize_columns(jnp.swapaxes(x, 0, 1)))
  for name, dtype, pages in (("float32", jnp.float32, None),
                             ("bfloat16", jnp.bfloat16, None),
                             ("int8, float32 q", jnp.float32, int8),
                             ("int8, bf16 q", jnp.bfloat16, int8)):
    worst_abs = worst_rel = 0.0
    for seed in range(args.seeds):
      q, k, v, length_m, table_mj = draw(seed, dtype if pages is None
                                         else jnp.float32)
      if pages is None:
        pools, layout = (k, v), page_layout.KERNEL_LAYOUT
        ref_pools = (k.astype(jnp.float32), v.astype(jnp.float32))
      else:
        pools = ref_pools = (pages(k), pages(v))
        layout = page_layout.REFERENCE_LAYOUT
      want = paged.paged_attention_reference(
          q.astype(jnp.float32), *ref_pools, length_m, table_mj, None, layout)
      with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        got = paged.kernel_attention(q.astype(dtype), *pools, length_m, table_mj)
      got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
      diff = np.abs(got - want)
      big = np.abs(want) > 0.1
      worst_abs = max(worst_abs, float(diff.max()))
      worst_rel = max(worst_rel, float((diff[big] / np.abs(want[big])).max()))
    print(f"{name:15s} pools: kernel vs float32 reference, "
          f"{args.seeds} draws of {M} rows: max |diff| {worst_abs:.2e}, "
          f"max relative {worst_rel:.2e}")


if __name__ == "__main__":
  main()
