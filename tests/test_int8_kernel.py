"""The int8 paged kernel (`models/int8_kernel.py`), interpreted on this CPU
(TPU interpret mode), against the plain-JAX reference over the same int8
pages (`paged.paged_attention_reference`, `int8_attention`); its TPU
compile is in test_aot.py."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from grpo_jax.models import get_preset, page_layout, paged
from grpo_jax.models.int8_kernel import int8_kernel_attention
from grpo_jax.models.int8_pages import Int8Pages, quantize_columns

K, G, E, Z, W, J = 2, 3, 128, 16, 40, 7
# a row of one column, one of a page and one more, one ending on a block's
# edge (4 pages: 2 blocks of 2), the longest (7 pages), an empty slot
LENGTH_M = np.array([1, Z + 1, 4 * Z, 7 * Z - 3, 0])


def _case(seed: int, dtype=jnp.float32):
  """Random int8 pools (pages first), a query per row, page tables of
  distinct pages in shuffled order (no page: W), and the pages no row's
  length reaches."""
  rng = np.random.default_rng(seed)
  pool = lambda: Int8Pages(*quantize_columns(
      jnp.asarray(rng.normal(size=(W, K, Z, E)) * 3)))
  M = len(LENGTH_M)
  table_mj = np.full((M, J), W, np.int32)
  order, used = rng.permutation(W), 0
  for m, length in enumerate(LENGTH_M):
    n = -(-int(length) // Z)
    table_mj[m, :n], used = order[used:used + n], used + n
  q_mhe = jnp.asarray(rng.normal(size=(M, K * G, E)), dtype)
  return q_mhe, pool(), pool(), jnp.asarray(LENGTH_M), jnp.asarray(table_mj), order[used:]


def _reference(q_mhe, k, v, length_m, table_mj):
  return paged.paged_attention_reference(q_mhe, k, v, length_m, table_mj,
                                         layout=page_layout.REFERENCE_LAYOUT)


@pytest.mark.parametrize("pages_per_block", [1, 2, 8])
def test_the_int8_kernel_equals_the_reference(pages_per_block):
  """Float32 queries: the reference's output to float32 rounding, for
  blocks of 1, 2 and more pages than a row has; the empty slot's is 0."""
  q, k, v, length_m, table_mj, _ = _case(0)
  want = _reference(q, k, v, length_m, table_mj)
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    got = int8_kernel_attention(q, k, v, length_m,
                                jnp.minimum(table_mj, W - 1),
                                pages_per_block=pages_per_block)
  live = LENGTH_M > 0
  np.testing.assert_allclose(got[live], want[live], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[~live], 0)


def test_the_int8_kernel_reads_no_page_past_a_rows_length():
  """Pages no row's length reaches, their scales NaN (page W - 1, where
  the no-page entries point, among them): the output is unchanged, so
  the kernel copied none of them (a NaN scale read would reach the
  output). bf16 queries, through `paged.kernel_attention` in calls of
  two slots' tables (64 bytes): the reference's output to bf16's
  precision."""
  q, k, v, length_m, table_mj, unread = _case(1, jnp.bfloat16)
  assert W - 1 in unread or not (np.asarray(table_mj) == W - 1).any()
  poison = lambda p: p._replace(scales=p.scales.at[unread].set(jnp.nan))
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    clean = paged.kernel_attention(q, k, v, length_m, table_mj)
    got = paged.kernel_attention(q, poison(k), poison(v), length_m, table_mj,
                                 table_bytes=2 * 4 * J)
  np.testing.assert_array_equal(got, clean)
  want = _reference(q, k, v, length_m, table_mj)
  live = LENGTH_M > 0
  np.testing.assert_allclose(np.asarray(got[live], np.float32),
                             np.asarray(want[live], np.float32),
                             rtol=1e-2, atol=1e-2)     # a bf16 ulp
  read = int(table_mj[3, 5])           # a page row 3 reads: its NaN shows
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    seen = paged.kernel_attention(
        q, k, v._replace(scales=v.scales.at[read].set(jnp.nan)), length_m,
        table_mj)
  assert np.isnan(np.asarray(seen[3], np.float32)).all()
  assert not np.isnan(np.asarray(seen[:3], np.float32)).any()


def test_int8_pages_go_to_the_kernel_on_a_tpu():
  """`resolve` gives the kernel for int8 pages where it gives it for
  bf16 (a TPU, head_dim 128), and their pools are pages first for
  either implementation."""
  wide = dataclasses.replace(get_preset("tiny"), head_dim=128)
  assert paged.resolve("auto", wide, backend="tpu") == "pallas"
  assert page_layout.pool_layout("pallas", "int8") is page_layout.REFERENCE_LAYOUT
  assert page_layout.pool_layout("reference", "int8") is page_layout.REFERENCE_LAYOUT
  assert page_layout.pool_layout("pallas") is page_layout.KERNEL_LAYOUT
