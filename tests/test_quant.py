"""Int8 rollout weights (grpo_jax/models/quant.py) and int8 KV pages
(models/paged.py, `sampling.kv_dtype`): quantise / dequantise against
float, the int8 model against the float one, the samplers on int8 weights
and pages against the model's own uncached forward, and off = today."""
import async_checks
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algorithms import rollout_correction
from grpo_jax.config import base_config
from grpo_jax.errors import ConfigError
from grpo_jax.generate import sampling
from grpo_jax.models import attention, forward, get_preset, init_params, int8_pages, quant, transformer
from grpo_jax.models.page_layout import KERNEL_LAYOUT, REFERENCE_LAYOUT
from grpo_jax.rl import train
from grpo_jax.validation import fields

CONFIG = get_preset("tiny")
INPUTS = transformer.PROJECTION_INPUTS


@pytest.fixture(scope="module")
def params():
  return init_params(CONFIG, jax.random.key(0))


def _int8(params):
  return quant.sampler_weights(params, "int8", INPUTS)


def test_each_weight_is_within_half_a_step_of_its_channel(params):
  """W ≈ q·s with |W - q·s| <= s/2 per output channel (layers and outputs
  have their own scales; inputs share them); half the bytes of bf16."""
  q = _int8(params)
  for name, w in params["layers"].items():
    qw = q["layers"][name]
    if name not in INPUTS:
      assert qw is w                              # norms stay as they are
      continue
    assert qw.qvalue.dtype == jnp.int8 and qw.qvalue.shape == w.shape
    num_in = INPUTS[name]
    assert qw.scale.shape == (w.shape[0],) + (1,) * num_in + w.shape[1 + num_in:]
    back = qw.qvalue.astype(jnp.float32) * qw.scale
    assert float(jnp.max(jnp.abs(back - w) - qw.scale / 2)) <= 1e-7, name
    # the largest |W| of each channel maps to ±127 or ±128 (absmax / 127.5)
    assert int(jnp.max(jnp.abs(qw.qvalue.astype(jnp.int32)))) >= 127
  assert q["embed"].scale.shape == (CONFIG.vocab_size, 1)
  bf16 = transformer.cast(params, "bfloat16")
  assert quant.nbytes(_int8(bf16)) < 0.55 * quant.nbytes(bf16)


def test_off_is_the_params_themselves(params):
  assert quant.sampler_weights(params, "", INPUTS) is params
  with pytest.raises(ValueError, match="sampling.weights_dtype='int4'"):
    quant.sampler_weights(params, "int4", INPUTS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_log_probs_are_close_to_the_float_models(params, dtype):
  """Ragged rows, tied and untied heads: per-token log-probs of the int8
  model within 0.05 nats of the float model's (W8A8 projections, a
  weight-only head), and not equal (the int8 path ran)."""
  tokens = jax.random.randint(jax.random.key(1), (3, 17), 0, CONFIG.vocab_size)
  for config in (CONFIG, CONFIG.replace(tie_embeddings=False)):
    p = transformer.cast(init_params(config, jax.random.key(2)), dtype)
    want = jax.nn.log_softmax(forward(config, p, tokens))
    got = jax.nn.log_softmax(forward(config, _int8(p), tokens))
    diff = float(jnp.max(jnp.abs(got - want)))
    assert 0 < diff < 0.05, (dtype, config.tie_embeddings, diff)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_int8_sampler_equals_its_own_uncached_forward(params, kv_cache):
  """Continuous batching on int8 weights, ragged rows with stop ids on:
  the sampler runs the int8 model. Its log-probs are the int8 model's full
  forward over the row so far within 0.02 nats (each token's activations
  are quantised alike, but the cached and uncached float sums differ in
  order and a value on a rounding edge moves by one int8 step: about 0.01
  nats here), and each greedy token is that forward's argmax wherever the
  top two are further apart than that (most tokens; near-ties may differ)."""
  loud = jax.tree.map(lambda w: w * 3.0 if w.ndim > 1 else w, params)
  q = _int8(loud)
  rng = np.random.RandomState(0)
  prompts = [list(rng.randint(1, CONFIG.vocab_size, n)) for n in (5, 12, 9)]
  cfg = sampling.SamplingConfig(
      continuous_batching=True, slots=2, max_new_tokens=10, greedy=True,
      kv_cache=kv_cache, page_size=4, stop_ids=(33, 121, 1, 197))
  out = sampling.sample(CONFIG, q, prompts, jax.random.key(1), cfg, 1)
  fwd = jax.jit(forward, static_argnums=0)
  checked = total = 0
  for b, prompt in enumerate(prompts):
    n, P = int(out.length_n[b]), len(prompt)
    seq = list(prompt) + [int(t) for t in out.tokens_nt[b, :n]]
    padded = jnp.zeros((1, 32), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
    logp = np.asarray(jax.nn.log_softmax(fwd(CONFIG, q, padded)[0]))
    steps = logp[P - 1:P - 1 + n]
    np.testing.assert_allclose(out.logp_nt[b, :n],
                               steps[np.arange(n), seq[P:]], atol=2e-2)
    top2 = np.sort(steps, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05
    np.testing.assert_array_equal(np.argmax(steps, -1)[clear],
                                  np.asarray(seq[P:])[clear])
    checked, total = checked + clear.sum(), total + n
  assert checked >= 0.7 * total, (checked, total)


def test_each_kv_column_is_within_half_a_step_of_its_scale():
  """Per (row, head, column) absmax / 127: |x - q·s| <= s/2, an all-zero
  column kept exact; pages and scales written and read back through both
  pool layouts."""
  x = jax.random.normal(jax.random.key(2), (3, 2, 5, 8)) * jnp.arange(1, 6)[:, None]
  x = x.at[0, 0, 0].set(0.0)
  q, s = int8_pages.quantize_columns(x)
  assert q.dtype == jnp.int8 and s.shape == (3, 2, 5)
  back = int8_pages.dequantize_columns(q, s, jnp.float32)
  assert float(jnp.max(jnp.abs(back - x) - s[..., None] / 2)) <= 1e-6
  assert float(jnp.abs(back[0, 0, 0]).max()) == 0.0
  assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127
  for layout in (KERNEL_LAYOUT, REFERENCE_LAYOUT):
    K, W, Z, E = 2, 4, 5, 8
    pool = int8_pages.Int8Pages(jnp.zeros(layout.shape(K, W, Z, E), jnp.int8),
                           jnp.ones(layout.shape(K, W, Z, E)[:-1]))
    pool = layout.put(pool, jnp.moveaxis(x[:2], 1, 1), jnp.array([3, 1]))
    got = layout.gather(pool, jnp.array([[3], [1]]), jnp.float32)
    np.testing.assert_allclose(got, back[:2], atol=1e-6)
    # a decode step's write of one column per row
    new = jax.random.normal(jax.random.key(3), (2, K, E))
    pool = layout.write(pool, new, jnp.array([3, 1]), jnp.array([4, 0]))
    got = layout.gather(pool, jnp.array([[3], [1]]), jnp.float32)
    np.testing.assert_allclose(got[0, :, 4], new[0], atol=float(jnp.abs(new).max()) / 127)
    np.testing.assert_allclose(got[1, :, 0], new[1], atol=float(jnp.abs(new).max()) / 127)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_int8_attention_is_attention_over_the_dequantised_columns(softcap):
  """The decode reads int8 pages without dequantising them (scales folded
  into the scores and the probabilities): equal to attention over the
  dequantised columns (float32), masked columns and a soft-cap included."""
  keys = jax.random.split(jax.random.key(4), 3)
  M, H, K, S, E = 3, 4, 2, 7, 8
  q = jax.random.normal(keys[0], (M, H, E))
  k = int8_pages.Int8Pages(*int8_pages.quantize_columns(jax.random.normal(keys[1], (M, K, S, E)) * 3))
  v = int8_pages.Int8Pages(*int8_pages.quantize_columns(jax.random.normal(keys[2], (M, K, S, E))))
  mask = jnp.arange(S)[None] < jnp.array([[7], [3], [1]])
  want = attention.attention(q[:, None], int8_pages.dequantize_columns(*k, jnp.float32),
                             int8_pages.dequantize_columns(*v, jnp.float32), mask[:, None],
                             softcap)[:, 0]
  got = int8_pages.int8_attention(q, k, v, mask, softcap)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_pages_sample_what_the_uncached_forward_gives(params, dtype):
  """The paged sampler on int8 pages, ragged rows with stop ids, slots
  fewer than rows (pages reused): its log-probs are the float model's full
  forward over the row so far within 0.05 nats, and the pool it keeps is
  int8 (automatic pages: as many as the dense slots' bytes hold)."""
  p = transformer.cast(jax.tree.map(lambda w: w * 3.0 if w.ndim > 1 else w, params), dtype)
  rng = np.random.RandomState(0)
  prompts = [list(rng.randint(1, CONFIG.vocab_size, n)) for n in (5, 12, 9)]
  cfg = sampling.SamplingConfig(
      continuous_batching=True, slots=2, max_new_tokens=10, greedy=True,
      kv_cache="paged", page_size=4, stop_ids=(33, 121, 1, 197), kv_dtype="int8")
  sampler = sampling.Sampler(CONFIG, cfg, pools=sampling.PagePools())
  out = sampler.sample(p, prompts, jax.random.key(1), 1)
  assert sampler.pools.pool.k[0].values.dtype == jnp.int8
  fwd = jax.jit(forward, static_argnums=0)
  worst = 0.0
  for b, prompt in enumerate(prompts):
    n, P = int(out.length_n[b]), len(prompt)
    seq = list(prompt) + [int(t) for t in out.tokens_nt[b, :n]]
    padded = jnp.zeros((1, 32), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
    logp = np.asarray(jax.nn.log_softmax(fwd(CONFIG, p, padded)[0].astype(jnp.float32)))
    got = np.asarray(out.logp_nt[b, :n])
    worst = max(worst, float(np.abs(got - logp[np.arange(P - 1, P - 1 + n), seq[P:]]).max()))
  assert 0 < worst < 0.05, worst   # close, and not the float pool's (the int8 path ran)
  itemsize = jnp.dtype(dtype).itemsize
  ratio = sampling.kv_ratio(CONFIG, itemsize, "int8")
  assert ratio == pytest.approx(itemsize * CONFIG.head_dim / (CONFIG.head_dim + 4))
  assert sampling.pool_pages(cfg, np.array([5, 12]), 2, 2, 1, 16, ratio) > \
      sampling.pool_pages(cfg, np.array([5, 12]), 2, 2, 1, 16)


def test_int8_pages_are_the_paged_pools_of_either_attention():
  config = base_config()
  config.sampling.kv_dtype = "int8"
  with pytest.raises(ConfigError, match="'sampling.kv_dtype' = 'int8' is the paged"):
    fields.validate(config, data_files=False)
  config.sampling.update(kv_cache="paged", continuous_batching=True, paged_kernel="pallas")
  fields.validate(config, data_files=False)       # int8_kernel reads them


def test_the_mismatch_metrics_count_ratios_outside_the_band():
  """χ² = E[(ρ - 1)²] and the fraction of valid tokens with ρ outside
  [0.9, 1.1], by hand on four tokens (one padding)."""
  old = jnp.log(jnp.array([[1.0, 1.2, 0.5, 7.0]]))
  roll = jnp.zeros((1, 4))
  mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
  _, _, m = rollout_correction.correct(old, roll, mask,
                                       rollout_correction.CorrectionSettings())
  rho = np.array([1.0, 1.2, 0.5])
  assert float(m["rollout_chi2"]) == pytest.approx(np.mean((rho - 1) ** 2))
  assert float(m["rollout_is/outside_0.9_1.1_frac"]) == pytest.approx(2 / 3)


@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_a_run_samples_on_int8_and_trains_in_full_precision(tmp_path, k):
  """The inline sampler (k = 0) and the sampler thread behind a weight sync
  (k = 1): the rows come from int8 weights and int8 KV pages (the mismatch
  metrics see it)
  and the trainer's parameters stay float32."""
  c = async_checks.stale(async_checks.config(
      steps=2, **{"sampling.weights_dtype": "int8", "sampling.kv_dtype": "int8",
                  "sampling.continuous_batching": True, "sampling.kv_cache": "paged"}), k)
  c.rollout.max_staleness = k
  summary = train.run(c, str(tmp_path))
  rows = [r for r in async_checks.run_metrics(str(tmp_path)) if "loss" in r]
  assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
  assert all(r["rollout_chi2"] > 0 and r["rollout_kl/k3"] > 0 for r in rows)
  leaves = jax.tree.leaves(summary["state"].params)
  assert all(x.dtype == jnp.float32 for x in leaves)
