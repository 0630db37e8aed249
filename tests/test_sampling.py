"""The group sampler against the cache-free forward pass."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from grpo_jax.generate import padded, sampling
from grpo_jax.models import forward, get_preset, init_params

CONFIG = get_preset("tiny")


@pytest.fixture(scope="module")
def params():
  return init_params(CONFIG, jax.random.key(0))


def _prompts(lengths, seed=0):
  rng = np.random.RandomState(seed)
  return [list(rng.randint(1, CONFIG.vocab_size, n)) for n in lengths]


_WIDTH = 64  # right-padded: causal attention ignores the padding after a token
_forward = jax.jit(forward, static_argnums=0)


def _logits(params, seq):
  padded = jnp.zeros((1, _WIDTH), jnp.int32).at[0, :len(seq)].set(
      jnp.asarray(seq, jnp.int32))
  return _forward(CONFIG, params, padded)[0, :len(seq)]


def _greedy_reference(params, prompt, steps):
  """Token-by-token argmax of the full, cache-free forward pass."""
  seq = list(prompt)
  for _ in range(steps):
    seq.append(int(jnp.argmax(_logits(params, seq)[-1])))
  return seq[len(prompt):]


def _forward_logprobs(params, prompt, completion, temperature=1.0):
  logp = jax.nn.log_softmax(
      _logits(params, list(prompt) + list(completion)) / temperature, axis=-1)
  n = len(prompt)
  return np.array([logp[n - 1 + t, tok] for t, tok in enumerate(completion)])


def test_greedy_equals_uncached_argmax(params):
  prompts = _prompts([5, 12, 9])
  cfg = sampling.SamplingConfig(max_new_tokens=12, greedy=True)
  out = sampling.sample(CONFIG, params, prompts, jax.random.key(1), cfg,
                        num_generations=2)
  for b, prompt in enumerate(prompts):
    ref = _greedy_reference(params, prompt, 12)
    for g in range(2):
      np.testing.assert_array_equal(out.tokens_nt[2 * b + g], ref)
  assert bool(jnp.all(out.mask_nt)) and not bool(jnp.any(out.length_n != 12))
  assert bool(jnp.all(out.truncated_n))


def test_logprobs_equal_forward_log_softmax(params):
  prompts = _prompts([7, 3])
  cfg = sampling.SamplingConfig(max_new_tokens=10, temperature=1.0)
  out = sampling.sample(CONFIG, params, prompts, jax.random.key(3), cfg,
                        num_generations=3)
  for i in range(6):
    comp = np.asarray(out.tokens_nt[i])
    ref = _forward_logprobs(params, prompts[i // 3], comp)
    np.testing.assert_allclose(out.logp_nt[i], ref, atol=1e-4)


def test_logprobs_are_temperature_scaled(params):
  prompts = _prompts([6])
  cfg = sampling.SamplingConfig(max_new_tokens=4, temperature=0.7, top_k=20)
  out = sampling.sample(CONFIG, params, prompts, jax.random.key(4), cfg)
  ref = _forward_logprobs(params, prompts[0], out.tokens_nt[0], 0.7)
  np.testing.assert_allclose(out.logp_nt[0], ref, atol=1e-4)


@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prefill_equals_per_row_prefill(params, greedy):
  prompts = _prompts([4, 11])
  cfg = sampling.SamplingConfig(max_new_tokens=8, greedy=greedy)
  key = jax.random.key(5)
  shared = sampling.sample(CONFIG, params, prompts, key, cfg, num_generations=3)
  repeated = [p for p in prompts for _ in range(3)]
  per_row = sampling.sample(CONFIG, params, repeated, key, cfg,
                            num_generations=1)
  np.testing.assert_array_equal(shared.tokens_nt, per_row.tokens_nt)
  np.testing.assert_allclose(shared.logp_nt, per_row.logp_nt, atol=1e-5)


def test_mixed_lengths_equal_each_prompt_alone(params):
  prompts = _prompts([2, 15, 7, 30])
  cfg = sampling.SamplingConfig(max_new_tokens=10, greedy=True)
  batch = sampling.sample(CONFIG, params, prompts, jax.random.key(0), cfg)
  for b, prompt in enumerate(prompts):
    alone = sampling.sample(CONFIG, params, [prompt], jax.random.key(0), cfg)
    np.testing.assert_array_equal(batch.tokens_nt[b], alone.tokens_nt[0])


def test_top_k_one_is_greedy(params):
  prompts = _prompts([9, 4])
  greedy = sampling.sample(CONFIG, params, prompts, jax.random.key(0),
                           sampling.SamplingConfig(max_new_tokens=6,
                                                   greedy=True))
  top1 = sampling.sample(CONFIG, params, prompts, jax.random.key(7),
                         sampling.SamplingConfig(max_new_tokens=6, top_k=1,
                                                 temperature=1.3))
  np.testing.assert_array_equal(greedy.tokens_nt, top1.tokens_nt)


def test_same_key_same_output_other_key_differs(params):
  prompts = _prompts([5])
  cfg = sampling.SamplingConfig(max_new_tokens=16, temperature=1.0)
  a = sampling.sample(CONFIG, params, prompts, jax.random.key(11), cfg, 4)
  b = sampling.sample(CONFIG, params, prompts, jax.random.key(11), cfg, 4)
  c = sampling.sample(CONFIG, params, prompts, jax.random.key(12), cfg, 4)
  np.testing.assert_array_equal(a.tokens_nt, b.tokens_nt)
  assert not np.array_equal(a.tokens_nt, c.tokens_nt)


def test_token_frequencies_match_softmax(params):
  """Chi-square goodness of fit of first tokens at temperature 1."""
  prompt = _prompts([6], seed=3)[0]
  # A sharper distribution than the random init's near-uniform one.
  sharp = {**params, "embed": params["embed"] * 4.0}
  logits = forward(CONFIG, sharp, jnp.asarray([prompt], jnp.int32))[0, -1]
  probs = np.asarray(jax.nn.softmax(logits), np.float64)
  n = 8192
  cfg = sampling.SamplingConfig(max_new_tokens=1, temperature=1.0)
  out = sampling.sample(CONFIG, sharp, [prompt], jax.random.key(0), cfg,
                        num_generations=n)
  counts = np.bincount(np.asarray(out.tokens_nt[:, 0]),
                       minlength=CONFIG.vocab_size)
  expected = probs * n
  big = expected >= 5  # pool the rare tokens into one cell
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  assert big.sum() > 10
  exp = exp / exp.sum() * n
  p_value = stats.chisquare(obs, exp).pvalue
  assert p_value > 1e-3, p_value
  # And the test has power: frequencies of a different temperature fail it.
  hot = sampling.sample(CONFIG, sharp, [prompt], jax.random.key(0),
                        sampling.SamplingConfig(max_new_tokens=1,
                                                temperature=1.5), n)
  hot_counts = np.bincount(np.asarray(hot.tokens_nt[:, 0]),
                           minlength=CONFIG.vocab_size)
  hot_obs = np.append(hot_counts[big], hot_counts[~big].sum())
  assert stats.chisquare(hot_obs, exp).pvalue < 1e-3


def test_stop_ids_end_rows_and_mask(params):
  prompts = _prompts([5, 8])
  free = sampling.sample(CONFIG, params, prompts, jax.random.key(2),
                         sampling.SamplingConfig(max_new_tokens=12,
                                                 greedy=True))
  # Make the 4th greedy token of row 0 a stop id: row 0 ends there.
  stop = int(free.tokens_nt[0, 3])
  cfg = sampling.SamplingConfig(max_new_tokens=12, greedy=True,
                                stop_ids=(stop,), pad_id=0)
  out = sampling.sample(CONFIG, params, prompts, jax.random.key(2), cfg)
  row0 = list(np.asarray(free.tokens_nt[0]))
  first = row0.index(stop)
  assert int(out.length_n[0]) == first + 1
  assert not bool(out.truncated_n[0])
  np.testing.assert_array_equal(out.tokens_nt[0, :first + 1],
                                free.tokens_nt[0, :first + 1])
  assert np.all(np.asarray(out.tokens_nt[0, first + 1:]) == 0)
  assert np.all(np.asarray(out.logp_nt[0, first + 1:]) == 0)
  np.testing.assert_array_equal(out.mask_nt[0],
                                np.arange(12) < first + 1)


def test_loop_exits_when_all_rows_stop(params):
  """Every token is a stop id: one token per row, and the loop runs 0 steps."""
  cfg = sampling.SamplingConfig(max_new_tokens=50, temperature=1.0,
                                stop_ids=tuple(range(CONFIG.vocab_size)))
  out = sampling.sample(CONFIG, params, _prompts([4, 6]), jax.random.key(0),
                        cfg, num_generations=2)
  assert int(out.steps) == 0
  np.testing.assert_array_equal(out.length_n, 1)
  assert not bool(jnp.any(out.truncated_n))


def test_buckets_bound_compilations(params):
  cfg = sampling.SamplingConfig(max_new_tokens=3, greedy=True)
  before = sampling.COMPILES.count
  for n in (17, 20, 25, 31):   # one bucket: 32
    sampling.sample(CONFIG, params, _prompts([n]), jax.random.key(0), cfg)
  assert sampling.COMPILES.count == before + 1
  assert sampling.bucket(17) == 32 and sampling.bucket(3) == 16


def test_bad_settings_are_named():
  with pytest.raises(ValueError, match="top_p"):
    sampling.SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    sampling.SamplingConfig(max_new_tokens=0)


@pytest.mark.slow
def test_greedy_equals_uncached_argmax_on_bundled_smollm2():
  from grpo_jax.models import load_pretrained  # pylint: disable=import-outside-toplevel
  from grpo_jax.models.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  config, params = load_pretrained("smollm2-135m-instruct")
  tok = load_tokenizer("smollm2-135m-instruct")
  prompts = [tok.encode(tok.apply_chat_template(
      [{"role": "user", "content": q}]))
             for q in ("What is 7 + 5?", "Name a prime number.")]
  steps, width = 16, 128
  cfg = sampling.SamplingConfig(max_new_tokens=steps, greedy=True)
  out = sampling.sample(config, params, prompts, jax.random.key(0), cfg)
  fwd = jax.jit(forward, static_argnums=0)
  for b, prompt in enumerate(prompts):
    seq = list(prompt)
    for _ in range(steps):
      padded = np.zeros((1, width), np.int32)
      padded[0, :len(seq)] = seq
      logits = fwd(config, params, jnp.asarray(padded))[0, len(seq) - 1]
      seq.append(int(jnp.argmax(logits)))
    np.testing.assert_array_equal(out.tokens_nt[b], seq[len(prompt):])


@pytest.mark.parametrize("chunk_rows,top_p", [(4, 1.0), (8, 0.9)])
def test_chunked_sampling_equals_one_call(params, chunk_rows, top_p):
  """Rows in calls of chunk_rows give the samples of one call over all rows
  (each row draws its entry of one noise vector), stop ids included."""
  prompts = _prompts([3, 9, 5, 7, 4])
  one = sampling.SamplingConfig(max_new_tokens=12, top_p=top_p, stop_ids=(7,))
  chunked = sampling.SamplingConfig(max_new_tokens=12, top_p=top_p,
                                    stop_ids=(7,), chunk_rows=chunk_rows)
  a = sampling.sample(CONFIG, params, prompts, jax.random.key(5), one, 4)
  b = sampling.sample(CONFIG, params, prompts, jax.random.key(5), chunked, 4)
  assert a.tokens_nt.shape == b.tokens_nt.shape == (20, 12)
  for name in ("tokens_nt", "mask_nt", "length_n", "truncated_n"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
  # The same tokens; log-probs equal up to float rounding (other row counts
  # take other matmul paths).
  np.testing.assert_allclose(a.logp_nt, b.logp_nt, rtol=1e-5, atol=1e-5)
  assert len(set(map(tuple, np.asarray(a.tokens_nt)))) > 10   # not all equal


def test_automatic_chunks_follow_free_memory(params, monkeypatch):
  """Where the device reports its free memory, rows run in the largest
  chunks whose KV cache fits KV_FRACTION of it, with the same samples."""
  prompts = _prompts([3, 9, 5, 7])
  cfg = sampling.SamplingConfig(max_new_tokens=8)
  a = sampling.sample(CONFIG, params, prompts, jax.random.key(1), cfg, 2)
  calls = []
  real = padded.sample_padded
  monkeypatch.setattr(padded, "sample_padded", lambda *args: calls.append(
      args[2].shape[0]) or real(*args))
  two_prompts = sampling.kv_cache_bytes(CONFIG, 2 * 2, 16 + 8, 4)
  monkeypatch.setattr(sampling, "free_device_memory",
                      lambda: two_prompts / sampling.KV_FRACTION)
  b = sampling.sample(CONFIG, params, prompts, jax.random.key(1), cfg, 2)
  assert calls == [2, 2]
  np.testing.assert_array_equal(np.asarray(a.tokens_nt),
                                np.asarray(b.tokens_nt))


@pytest.mark.parametrize("vocab", [256, 1000])
def test_two_level_inverse_cdf_equals_one_cumsum(vocab):
  """The token is the first whose running mass (float64, one cumulative sum
  over the vocabulary) reaches u times the total, whatever block it is in,
  with vocabularies a multiple of the block and not; tokens masked to -inf
  (top-k / top-p) are never chosen, u = 1 included."""
  from grpo_jax.generate import decoding  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(64, vocab)) * 3
  logits[:, rng.random(vocab) < 0.5] = -np.inf   # truncated columns
  u = np.concatenate([rng.random(62), [1.0, 1e-7]])
  got = np.asarray(decoding._inverse_cdf_sample(  # pylint: disable=protected-access
      jnp.asarray(logits, jnp.float32), jnp.asarray(u, jnp.float32)))
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  cdf = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
  want = np.array([np.searchsorted(c, x * c[-1]) for c, x in zip(cdf, u)])
  assert np.isfinite(logits[np.arange(64), got]).all()
  # Float32 rounding may move a row's pick only where u * total lies within
  # rounding of a running-mass boundary of the pick.
  for i in np.flatnonzero(got != want):
    target = u[i] * cdf[i, -1]
    lo = cdf[i, got[i] - 1] if got[i] else 0.0
    assert min(abs(cdf[i, got[i]] - target), abs(lo - target)) < 1e-5, i
  assert (got == want).mean() >= 0.95
