"""What the plain-JAX paged reference costs MLA above a dense cache, by
XLA's cost analysis (no timing).

    python benchmarks/mla_page_bytes.py [--rows 8] [--columns 512]

DeepSeek-V3's decode attention over its latent (128 query heads, one
latent head of 576 = 512 + 64, bf16): `paged.paged_attention_reference`
over latent pages (the values are the keys: one pool, gathered once)
against `attention.attention` over the same columns in a dense cache.
Prints the bytes each compiled program accesses (`cost_analysis()`, this
backend's compile) and what the page gather adds, as a multiple of the
pages' own bytes. TPU has no kernel for these pages (docs/models.md,
"Latent attention (MLA)"), so the reference is what serves them there.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # libtpu is installed: no TPU probe
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo_jax.models import attention, page_layout, paged  # pylint: disable=wrong-import-position

H, E, Z = 128, 576, 16        # query heads, latent width, page columns


def accessed(f, *shapes) -> float:
  cost = jax.jit(f).lower(*shapes).compile().cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--columns", type=int, default=512)
  args = parser.parse_args()
  M, J = args.rows, args.columns // Z
  S, bf16 = J * Z, jnp.bfloat16
  spec = jax.ShapeDtypeStruct
  q = spec((M, H, E), bf16)
  reference = accessed(
      lambda q, pool, n, t: paged.paged_attention_reference(
          q, pool, pool, n, t, layout=page_layout.REFERENCE_LAYOUT),
      q, spec((M * J, 1, Z, E), bf16), spec((M,), jnp.int32),
      spec((M, J), jnp.int32))
  dense = accessed(lambda q, k, m: attention.attention(q[:, None], k, k, m),
                   q, spec((M, 1, S, E), bf16), spec((M, 1, S), bool))
  pages = M * S * E * 2
  print(f"{M} rows x {S} columns, {H} heads over one latent head of {E}, "
        f"bf16 ({jax.default_backend()} compile): pages {pages / 1e6:.1f} MB; "
        f"reference accesses {reference / 1e6:.1f} MB, dense attention "
        f"{dense / 1e6:.1f} MB ({reference / dense:.2f}x); the gather adds "
        f"{(reference - dense) / pages:.1f}x the pages' bytes")


if __name__ == "__main__":
  main()
