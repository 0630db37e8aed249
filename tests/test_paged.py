"""The paged KV cache (grpo_jax/models/paged.py, grpo_jax/generate/pages.py,
grpo_jax/generate/paged_slots.py): decode attention over pages equals dense
attention; the paged continuous sampler gives the dense one's samples, also
when its pool runs out mid-row; the pool's accounting holds."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from grpo_jax import config as config_lib
from grpo_jax import errors, validation
from grpo_jax.generate import continuous, decoding, page_pool, paged_slots, pages, sampling
from grpo_jax.models import attention, get_preset, init_params, page_layout, paged, ragged, transformer

CONFIG = get_preset("tiny")
STOPS = (7, 11, 200, 3, 50)
LENGTHS = [5, 12, 9, 16, 3]      # page size 4: 12 and 16 fill whole pages


@pytest.fixture(scope="module")
def params():
  return jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))


def _prompts(lengths=LENGTHS, seed=0):
  rng = np.random.RandomState(seed)
  return [list(rng.randint(1, CONFIG.vocab_size, n)) for n in lengths]


def _cfg(**kwargs):
  kwargs = {"stop_ids": STOPS, "max_new_tokens": 20, **kwargs}
  return sampling.SamplingConfig(continuous_batching=True,
                                 slots=4, **kwargs)


def _paged(params, prompts, cfg, G, key=5):
  """paged_slots.sample_pages as `sampling.sample` calls it, with its
  PageStats."""
  P = sampling.bucket(max(map(len, prompts)))
  prompt_bp, len_b = sampling.left_pad(prompts, P, len(prompts), 0)
  pool = sampling.pool_pages(cfg, len_b, len(prompts), cfg.slots, 1, P)
  call = sampling.CallSpec(CONFIG, dataclasses.replace(cfg, slots=0, pages=0),
                           G, None, cfg.slots, pool, check_pages=True)
  return paged_slots.sample_pages(
      call, params, jnp.asarray(prompt_bp), jnp.asarray(len_b),
      jax.random.key(key), jnp.int32(len(prompts)))


def _assert_same(a, b, atol=1e-5):
  for name in ("tokens_nt", "mask_nt", "length_n", "truncated_n"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
  np.testing.assert_allclose(a.logp_nt, b.logp_nt, rtol=0, atol=atol)


def _assert_accounting(stats):
  assert int(stats.in_use_end) == 0, "pages not returned to the pool"
  assert int(stats.conflicts) == 0, "a page writable by two slots"


@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_equals_dense(window):
  """Ragged lengths, GQA (H = 3K), pages in random order, two rows sharing
  their first pages (a prompt's), unused table entries past the pool:
  the reference (and its bucketed form) equals attention.attention over
  each row's dense columns."""
  M, K, H, E, Z, J, W = 4, 2, 6, 8, 4, 5, 24
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (M, H, E))
  k_mkse = jax.random.normal(ks[1], (M, K, J * Z, E))
  v_mkse = jax.random.normal(ks[2], (M, K, J * Z, E))
  k_mkse = k_mkse.at[1, :, :2 * Z].set(k_mkse[0, :, :2 * Z])   # shared pages
  v_mkse = v_mkse.at[1, :, :2 * Z].set(v_mkse[0, :, :2 * Z])
  length_m = jnp.array([9, 17, 1, 12])
  order = np.random.RandomState(1).permutation(W)
  table_mj = np.full((M, J), W)
  used = 0
  for m in range(M):
    for j in range(-(-int(length_m[m]) // Z)):
      if m == 1 and j < 2:
        table_mj[m, j] = table_mj[0, j]
      else:
        table_mj[m, j], used = order[used], used + 1
  pools = []      # the kernel's layout (K, W, Z, E)
  for dense in (np.asarray(k_mkse), np.asarray(v_mkse)):
    pool = np.zeros((K, W, Z, E), np.float32)
    for m, j in zip(*np.nonzero(table_mj < W)):
      pool[:, table_mj[m, j]] = dense[m, :, j * Z:(j + 1) * Z]
    pools.append(jnp.asarray(pool))
  col = jnp.arange(J * Z)
  mask = col[None] < length_m[:, None]
  if window is not None:
    mask &= col[None] > length_m[:, None] - 1 - window
  want = attention.attention(q[:, None], k_mkse, v_mkse, mask[:, None])[:, 0]
  table_mj = jnp.asarray(table_mj)
  for layout, layout_pools in [
      (page_layout.KERNEL_LAYOUT, pools),
      (page_layout.REFERENCE_LAYOUT, [jnp.swapaxes(p, 0, 1) for p in pools])]:
    got = paged.paged_attention_reference(q, *layout_pools, length_m,
                                          table_mj, window, layout)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for block in (4, 8, 12, 32):    # cuts of 1, 2, 3 pages; one of all 5
      cut = paged.bucketed_attention(q, *layout_pools, length_m, table_mj,
                                     jnp.int32(5),
                                     paged.Buckets(window, block, layout))
      np.testing.assert_allclose(cut, want, atol=1e-5)
  if window is None:      # the TPU kernel, interpreted on this CPU
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      kernel = paged.kernel_attention(q, *pools, length_m, table_mj)
      # a page table too big for one call's SMEM: 64 bytes hold 3 slots'
      # tables of 5 pages, so the 4 slots go through 2 calls of 2
      assert paged.kernel_slots(5, 64) == 3
      calls = paged.kernel_attention(q, *pools, length_m, table_mj, 64)
    np.testing.assert_allclose(kernel, want, atol=2e-2)
    assert np.abs(np.asarray(kernel) - np.asarray(want)).max() > 0  # ran
    np.testing.assert_array_equal(calls, kernel)


def test_window_reads_only_its_pages():
  """A sliding layer's bucketed attention (window 6, pages of 4) reads only
  the pages holding each row's window: pages wholly behind it hold NaN and
  the output is still the reference's over clean pools, where the
  reference, which reads every page, gives NaN."""
  M, K, H, E, Z, W, window = 2, 2, 4, 8, 4, 16, 6
  ks = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(ks[0], (M, H, E))
  k_pool, v_pool = (jax.random.normal(key, (W, K, Z, E)) for key in ks[1:])
  length_m = jnp.array([27, 13])
  table_mj = jnp.array([list(range(8)), [8, 9, 10, 11] + [W] * 4])
  behind = [0, 1, 2, 3, 4, 8]         # row 0: columns < 21; row 1: < 7
  poison = lambda pool: pool.at[jnp.array(behind)].set(jnp.nan)
  layout = page_layout.REFERENCE_LAYOUT
  want = paged.paged_attention_reference(q, k_pool, v_pool, length_m,
                                         table_mj, window, layout)
  assert paged.window_pages(window, Z) == 3
  for block in (4, 32):       # a branch per page, or one of all 8 pages
    got = paged.bucketed_attention(q, poison(k_pool), poison(v_pool),
                                   length_m, table_mj, jnp.int32(8),
                                   paged.Buckets(window, block, layout))
    np.testing.assert_allclose(got, want, atol=1e-6)
  read_all = paged.paged_attention_reference(
      q, poison(k_pool), poison(v_pool), length_m, table_mj, window, layout)
  assert np.isnan(np.asarray(read_all)).all()


def test_greedy_equals_the_dense_sampler(params):
  """Greedy, float32, ragged rows (stop ids on; weights x3 so that greedy
  does not repeat one token), prompts with and without a partly-filled last
  page, the loop checking for live rows every 4 steps: the dense continuous
  sampler's tokens and log-probs (checking every step) and steps; every
  page back in the pool."""
  prompts = _prompts()
  loud = jax.tree.map(lambda w: w * 3.0 if w.ndim > 1 else w, params)
  cfg = _cfg(greedy=True, stop_ids=(33, 121, 1, 197))
  dense = sampling.sample(CONFIG, loud, prompts, jax.random.key(0), cfg, 2)
  out, stats = _paged(loud, prompts, dataclasses.replace(
      cfg, kv_cache="paged", page_size=4, stop_check_every=4), 2)
  assert len(set(np.asarray(dense.length_n))) > 3, dense.length_n
  _assert_same(out, dense, atol=1e-6)
  assert int(out.steps) == int(dense.steps)
  assert int(stats.preempted) == 0 and int(stats.waited) == 0
  _assert_accounting(stats)


@pytest.fixture(scope="module")
def dense_samples(params):
  return sampling.sample(CONFIG, params, _prompts(), jax.random.key(5),
                         _cfg(top_p=0.9), 3)


def test_a_small_pool_waits_and_preempts_with_the_same_samples(
    params, dense_samples):
  """A pool of 20 pages of 4 columns (the prompts take 8; a whole row is
  9): rows wait for pages and the youngest is preempted, restarting from
  its first token; the samples are still the dense sampler's for the same
  key, nothing deadlocks, and no page is shared but prompt pages."""
  cfg = _cfg(top_p=0.9, kv_cache="paged", page_size=4, pages=20)
  out, stats = _paged(params, _prompts(), cfg, 3)
  _assert_same(out, dense_samples)
  assert int(stats.preempted) > 0 and int(stats.waited) > 0
  assert int(stats.peak_pages) == 20
  _assert_accounting(stats)
  with pytest.raises(ValueError, match="sampling.pages' = 12"):
    _paged(params, _prompts(), dataclasses.replace(cfg, pages=12), 3)


def test_a_kept_pool_gives_fresh_pools_samples_and_is_reused(params):
  """sampling.PagePools across two calls with other weights between them
  (a weight update): each call's samples equal a fresh pool's, its pages
  all come back, the previous call's pool buffers were donated (deleted)
  to the next, and the pool was allocated once."""
  cfg = _cfg(top_p=0.9, kv_cache="paged", page_size=4)
  updated = jax.tree.map(lambda w: w * 1.5 if w.ndim > 1 else w, params)
  pools = sampling.PagePools()
  tokens = []
  for weights in (params, updated):
    before = pools.pool
    kept = sampling.Sampler(CONFIG, cfg, pools=pools).sample(
        weights, _prompts(), jax.random.key(5), 3)
    fresh = sampling.sample(CONFIG, weights, _prompts(), jax.random.key(5),
                            cfg, 3)
    _assert_same(kept, fresh, atol=0)
    assert int(pools.stats.in_use_end) == 0, "pages not returned to the pool"
    if before is not None:
      assert all(x.is_deleted() for x in before.k + before.v)
    tokens.append(np.asarray(kept.tokens_nt))
  assert not np.array_equal(*tokens)       # the update changed the samples
  assert pools.allocations == 1
  assert not any(x.is_deleted() for x in pools.pool.k + pools.pool.v)


def test_the_decode_loop_writes_the_pools_in_place(params):
  """The compiled sampler's decode loop neither copies a pool nor writes
  one out of place: every pool-shaped `copy` is in the entry computation
  (the zero pools, once per call), none in a loop body, and each layer's
  write is a scatter into the loop-carried pool (XLA gives a scatter its
  operand's buffer, or inserts such a copy)."""
  cfg = _cfg(kv_cache="paged", page_size=4)
  P = sampling.bucket(max(LENGTHS))
  prompt_bp, len_b = sampling.left_pad(_prompts(), P, len(LENGTHS), 0)
  pool = sampling.pool_pages(cfg, len_b, len(LENGTHS), cfg.slots, 1, P)
  call = sampling.CallSpec(CONFIG, dataclasses.replace(cfg, slots=0, pages=0),
                           2, None, cfg.slots, pool)
  hlo = paged_slots.sample_pages.lower(
      call, params, jnp.asarray(prompt_bp), jnp.asarray(len_b),
      jax.random.key(5), jnp.int32(len(LENGTHS))).compile().as_text()
  shape = "f32[%s]" % ",".join(map(str, (1,) + page_layout.REFERENCE_LAYOUT.shape(
      CONFIG.num_kv_heads, pool, 4, CONFIG.head_dim)))
  where, copies, scatters = None, [], 0
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):
      where = line.split()[0]
    elif line.startswith("  ") and f"= {shape}" in line:
      copies += [where] if " copy(" in line else []
      scatters += " scatter(" in line and "while/body" in line
  assert copies and all(w == "ENTRY" for w in copies), copies
  assert scatters >= 2 * CONFIG.num_layers


@pytest.mark.parametrize("kv_cache", ["paged", "dense"])
def test_a_bf16_cache_is_written_as_bits(params, kv_cache):
  """With bf16 weights (so a bf16 KV cache), every write into the cache
  scatters its bits (u16, `decode.set_in_bits`), never floats: XLA:CPU
  has no bf16 scatter, and scattering bf16 made it convert every layer's
  whole cache to float32 and back at every decode step (docs/paged.md)."""
  bf16 = transformer.cast(params, "bfloat16")
  cfg = dataclasses.replace(_cfg(kv_cache=kv_cache, page_size=4), slots=0)
  P = sampling.bucket(max(LENGTHS))
  prompt_bp, len_b = sampling.left_pad(_prompts(), P, len(LENGTHS), 0)
  args = (bf16, jnp.asarray(prompt_bp), jnp.asarray(len_b), jax.random.key(5),
          jnp.int32(len(LENGTHS)))
  K, E = CONFIG.num_kv_heads, CONFIG.head_dim
  if kv_cache == "paged":
    pool = sampling.pool_pages(_cfg(page_size=4), len_b, len(LENGTHS), 4, 1,
                               P)
    program = paged_slots.sample_pages.lower(
        sampling.CallSpec(CONFIG, cfg, 2, None, 4, pool), *args)
    dims = (1,) + page_layout.REFERENCE_LAYOUT.shape(K, pool, 4, E)
  else:
    program = continuous.sample_slots.lower(
        sampling.CallSpec(CONFIG, cfg, 2, None, 4), *args)
    S = -(-(P + cfg.max_new_tokens) // ragged.BLOCK_S) * ragged.BLOCK_S
    dims = (4, K, S, E)
  shape = "[%s]" % ",".join(map(str, dims))
  scatters = [line.split("=")[1].split()[0].split("{")[0]
              for line in program.compile().as_text().splitlines()
              if " scatter(" in line and "while/body" in line]
  written = [t for t in scatters if t.endswith(shape)]
  assert len(written) >= 2 * CONFIG.num_layers, scatters
  assert set(written) == {"u16" + shape}, written


@pytest.mark.slow
def test_stop_check_every_k_steps_gives_the_same_samples(
    params, dense_samples):
  """The dense continuous loop checking for live rows every 4 steps: the
  same samples and step count (steps after the last row ends are not
  counted). (The paged loop, in the default suite:
  test_greedy_equals_the_dense_sampler.)"""
  every = sampling.sample(CONFIG, params, _prompts(), jax.random.key(5),
                          _cfg(top_p=0.9, stop_check_every=4), 3)
  _assert_same(every, dense_samples, atol=0)
  assert int(every.steps) == int(dense_samples.steps)


def test_grant_is_oldest_first_and_leaves_pages():
  ref_w = jnp.array([1, 0, 0, 2, 0, 0])          # pages 1, 2, 4, 5 free
  want_m = jnp.array([True, True, False, True])
  order_m = jnp.array([7, 3, 0, 5])
  keep_m = jnp.array([0, 0, 0, 3])                # slot 3 must leave 3 free
  ref, page_m, got_m = pages.grant(ref_w, want_m, order_m, keep_m)
  np.testing.assert_array_equal(got_m, [True, True, False, False])
  np.testing.assert_array_equal(page_m, [4, 1, 6, 6])   # order 3 first
  np.testing.assert_array_equal(ref, [1, 1, 0, 2, 1, 0])


def test_release_and_conflicts():
  W = 6
  table_mj = jnp.array([[0, 1, 2], [0, 3, W], [4, W, W]])
  ref_w = jnp.array([2, 1, 1, 1, 1, 0])           # page 0: a shared prompt page
  full_m = jnp.array([1, 1, 0])
  holds_m = jnp.array([True, True, True])
  assert int(pages.conflicts(ref_w, table_mj, holds_m, full_m)) == 0
  # Slot 2 taking slot 0's own page 2, or a page freed while in use: caught.
  bad = table_mj.at[2, 1].set(2)
  assert int(pages.conflicts(ref_w, bad, holds_m, full_m)) == 1
  assert int(pages.conflicts(ref_w.at[3].set(0), table_mj, holds_m,
                             full_m)) == 1
  # Slot 0 preempted (own pages only), slot 1 ends (all its references).
  ref = pages.release(ref_w, table_mj, jnp.array([True, False, False]), full_m)
  np.testing.assert_array_equal(ref, [2, 0, 0, 1, 1, 0])
  ref = pages.release(ref, table_mj, jnp.array([False, True, False]),
                      jnp.zeros(3, jnp.int32))
  np.testing.assert_array_equal(ref, [1, 0, 0, 0, 1, 0])
  np.testing.assert_array_equal(
      pages.prompt_tables(jnp.array([2, 0, 1]), 3, W),
      [[0, 1, W], [W, W, W], [2, W, W]])


@pytest.mark.slow
def test_the_kernel_in_the_sampler_equals_the_reference(params):
  """sampling.paged_kernel = 'pallas' (the TPU kernel, interpreted on this
  CPU) in the whole paged sampler: the reference path's greedy tokens, its
  log-probs to the kernel's precision (~5e-3 here: over 12 tokens these
  chaotic weights flip a near-tie at token 10, so 8 tokens)."""
  prompts = _prompts([5, 12, 3])
  loud = jax.tree.map(lambda w: w * 3.0 if w.ndim > 1 else w, params)
  cfg = _cfg(greedy=True, stop_ids=(33, 121, 1, 197), kv_cache="paged",
             page_size=4, max_new_tokens=8)
  ref, _ = _paged(loud, prompts,
                  dataclasses.replace(cfg, paged_kernel="reference"), 2)
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    out, stats = _paged(loud, prompts, dataclasses.replace(
        cfg, paged_kernel="pallas"), 2)
  np.testing.assert_array_equal(out.tokens_nt, ref.tokens_nt)
  np.testing.assert_allclose(out.logp_nt, ref.logp_nt, atol=2e-2)
  _assert_accounting(stats)


@pytest.mark.parametrize("layout", [page_layout.KERNEL_LAYOUT,
                                    page_layout.REFERENCE_LAYOUT])
def test_pool_layout_writes_and_gathers(layout):
  """put (whole pages), write (one column each; write_step, a decode
  step's, the same pool) then gather: each row's columns in table order;
  writes to page W go nowhere."""
  K, W, Z, E = 2, 5, 3, 4
  pool = jnp.zeros(layout.shape(K, W, Z, E))
  assert layout.pages(pool) == W
  page_kze = jnp.arange(K * Z * E, dtype=jnp.float32).reshape(K, Z, E) + 1
  pool = layout.put(pool, jnp.stack([page_kze, -page_kze]), jnp.array([3, W]))
  new_mke = jnp.full((2, K, E), 7.0)
  stepped = layout.write_step(pool, new_mke, jnp.array([1, W]),
                              jnp.array([2, 0]))            # whole pages
  pool = layout.write(pool, new_mke, jnp.array([1, W]), jnp.array([2, 0]))
  np.testing.assert_array_equal(stepped, pool)
  got = layout.gather(pool, jnp.array([[3, 1], [1, 3]]))     # (M, K, 2Z, E)
  np.testing.assert_array_equal(got[0, :, :Z], page_kze)
  np.testing.assert_array_equal(got[0, :, Z + 2], new_mke[0])
  np.testing.assert_array_equal(got[1, :, Z:], page_kze)
  assert float(jnp.abs(got[:, :, :, :]).sum()) == float(
      2 * page_kze.sum() + 2 * new_mke[0].sum())       # nothing else written
  assert page_layout.pool_layout("pallas") is page_layout.KERNEL_LAYOUT
  assert page_layout.pool_layout("reference") is page_layout.REFERENCE_LAYOUT


def test_attention_choice():
  assert paged.resolve("auto", CONFIG) == "reference"     # a CPU
  windowed = dataclasses.replace(CONFIG, sliding_window=8)
  assert paged.resolve("auto", windowed) == "reference"
  with pytest.raises(ValueError, match="sliding window"):
    paged.resolve("pallas", windowed)
  # on a TPU: the kernel where it can take the model (head_dim 128), the
  # reference where Pallas would refuse it (the tiny model's 16, SmolLM2's 64)
  wide = dataclasses.replace(CONFIG, head_dim=128)
  assert paged.resolve("auto", wide, backend="tpu") == "pallas"
  assert paged.resolve("auto", CONFIG, backend="tpu") == "reference"
  with pytest.raises(ValueError, match="head_dim a multiple of 128"):
    paged.resolve("pallas", CONFIG, backend="tpu")
  assert paged.resolve("pallas", CONFIG) == "pallas"   # interpreted on a CPU


def test_config_fields_are_validated():
  for field, value, match in [("kv_cache", "paged_v2", "sampling.kv_cache"),
                              ("page_size", 0, "sampling.page_size"),
                              ("pages", -1, "sampling.pages"),
                              ("stop_check_every", 0,
                               "sampling.stop_check_every"),
                              ("paged_kernel", "splash",
                               "sampling.paged_kernel")]:
    c = config_lib.base_config()
    c.sampling.continuous_batching = True
    c.sampling[field] = value
    with pytest.raises(errors.ConfigError, match=match):
      validation.validate(c)
  c = config_lib.base_config()
  c.sampling.kv_cache = "paged"
  with pytest.raises(errors.ConfigError, match="continuous_batching"):
    validation.validate(c)
  assert validation.fields._CHOICES["sampling.kv_cache"] == decoding.KV_CACHES
  with pytest.raises(ValueError, match="kv_cache"):
    sampling.SamplingConfig(kv_cache="paged")
  with pytest.raises(ValueError, match="stop_check_every"):
    sampling.SamplingConfig(stop_check_every=0)


@pytest.mark.slow
def test_sharded_rows_on_eight_fake_devices(run_sharding_checks):
  """tests/paged_sharding_checks.py in a subprocess: the paged sampler with
  rows over 8 (then 4 x tensor 2) row shards gives one device's static
  samples, one page pool per row shard, every page returned."""
  run_sharding_checks("paged_sharding_checks.py", ["8,1,1", "2,2,2"])


@pytest.mark.slow
def test_a_paged_training_run_keeps_one_pool_and_equals_the_dense_run(
    tmp_path, monkeypatch):
  """The RL loop with the paged sampler: one pool for the whole run (made
  at the first step, reused by the next), and the same rows as the dense
  continuous sampler, so the same metrics."""
  from configs import tiny  # pylint: disable=import-outside-toplevel
  from grpo_jax.rl import train  # pylint: disable=import-outside-toplevel
  made = []
  real = sampling.PagePools.take

  def take(self, signature, make):
    made.append(self.pool is None or signature != self._signature)
    return real(self, signature, make)

  monkeypatch.setattr(sampling.PagePools, "take", take)
  rows = {}
  for cache in ("dense", "paged"):
    config = tiny.get_config()
    config.train.steps = 2
    config.train.eval_at_start = config.train.eval_at_end = False
    config.sampling.continuous_batching = True
    config.sampling.kv_cache = cache
    train.run(config, str(tmp_path / cache))
    rows[cache] = [json.loads(l) for l in open(tmp_path / cache / "metrics.jsonl")]
  assert made == [True, False]   # the paged run: made once, then reused
  for dense_row, paged_row in zip(rows["dense"], rows["paged"]):
    for k in ("reward/mean", "accuracy", "sample/tokens", "loss"):
      assert paged_row[k] == pytest.approx(dense_row[k], rel=1e-5, abs=1e-6), k


def test_bucket_block_bounds_a_layers_branches():
  """The reference's buckets: BLOCK_S columns, or coarser so a layer has
  at most MAX_BUCKETS branches (the paper config's 20,992 columns on pages
  of 16: 1,312 pages, 82 a bucket, 16 buckets), never under a page."""
  assert page_pool.bucket_block(8, 16) == paged.BLOCK_S
  block = page_pool.bucket_block(1312, 16)
  assert block == 82 * 16 and -(-1312 // (block // 16)) == page_pool.MAX_BUCKETS
  assert page_pool.bucket_block(3, 64) == 64
  assert page_pool.bucket_block(100, 4, max_buckets=10) == 40
