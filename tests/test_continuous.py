"""The continuous-batching sampler (grpo_jax/generate/continuous.py): the static
sampler's guarantees, tested the same way (tests/test_sampling.py), with
fewer slots than rows so that rows take over slots mid-call."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from grpo_jax import config as config_lib
from grpo_jax import errors, validation
from grpo_jax.generate import sampling
from grpo_jax.models import attention, blockwise, forward, get_preset, init_params, ragged

CONFIG = get_preset("tiny")


@pytest.fixture(scope="module")
def params():
  return init_params(CONFIG, jax.random.key(0))


def _cb(slots=3, **kwargs):
  return sampling.SamplingConfig(continuous_batching=True, slots=slots,
                                 **kwargs)


def _prompts(lengths, seed=0):
  rng = np.random.RandomState(seed)
  return [list(rng.randint(1, CONFIG.vocab_size, n)) for n in lengths]


_WIDTH = 64
_forward = jax.jit(forward, static_argnums=0)


def _logits(params, seq):
  padded = jnp.zeros((1, _WIDTH), jnp.int32).at[0, :len(seq)].set(
      jnp.asarray(seq, jnp.int32))
  return _forward(CONFIG, params, padded)[0, :len(seq)]


def _forward_logprobs(params, prompt, completion, temperature=1.0):
  logp = jax.nn.log_softmax(
      _logits(params, list(prompt) + list(completion)) / temperature, axis=-1)
  n = len(prompt)
  return np.array([logp[n - 1 + t, tok] for t, tok in enumerate(completion)])


def test_greedy_equals_uncached_argmax(params):
  prompts = _prompts([5, 12, 9])
  out = sampling.sample(CONFIG, params, prompts, jax.random.key(1),
                        _cb(max_new_tokens=12, greedy=True), 2)
  for b, prompt in enumerate(prompts):
    seq = list(prompt)
    for _ in range(12):
      seq.append(int(jnp.argmax(_logits(params, seq)[-1])))
    for g in range(2):
      np.testing.assert_array_equal(out.tokens_nt[2 * b + g], seq[len(prompt):])
  assert bool(jnp.all(out.truncated_n)) and bool(jnp.all(out.length_n == 12))


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 20)])
def test_logprobs_equal_forward_log_softmax(params, temperature, top_k):
  """Stop ids end rows at different steps, so later rows start in slots
  that held other rows: their log-probs are still exact."""
  prompts = _prompts([7, 3, 10])
  cfg = _cb(slots=2, max_new_tokens=10, temperature=temperature, top_k=top_k,
            stop_ids=tuple(range(0, CONFIG.vocab_size, 9)))
  out = sampling.sample(CONFIG, params, prompts, jax.random.key(3), cfg, 3)
  lengths = np.asarray(out.length_n)
  assert len(set(lengths)) > 2, lengths     # ragged
  for i in range(9):
    comp = np.asarray(out.tokens_nt[i, :lengths[i]])
    ref = _forward_logprobs(params, prompts[i // 3], comp, temperature)
    np.testing.assert_allclose(out.logp_nt[i, :lengths[i]], ref, atol=1e-4)
    assert np.all(np.asarray(out.logp_nt[i, lengths[i]:]) == 0)


def test_mixed_lengths_equal_each_prompt_alone(params):
  prompts = _prompts([2, 15, 7, 11])        # one bucket: two programs
  cfg = _cb(slots=2, max_new_tokens=10, greedy=True)
  batch = sampling.sample(CONFIG, params, prompts, jax.random.key(0), cfg)
  for b, prompt in enumerate(prompts):
    alone = sampling.sample(CONFIG, params, [prompt], jax.random.key(0), cfg)
    np.testing.assert_array_equal(batch.tokens_nt[b], alone.tokens_nt[0])


@pytest.mark.parametrize("slots,top_p", [(1, 1.0), (4, 0.9)])
def test_same_samples_as_the_static_sampler(params, slots, top_p):
  """The noise is a function of (key, row, token): any slot schedule gives
  the static sampler's samples (stop ids included); the same key gives the
  same output, another key another."""
  prompts = _prompts([3, 9, 5, 7, 4])
  static = sampling.SamplingConfig(max_new_tokens=12, top_p=top_p,
                                   stop_ids=(7, 11, 200))
  a = sampling.sample(CONFIG, params, prompts, jax.random.key(5), static, 4)
  b = sampling.sample(CONFIG, params, prompts, jax.random.key(5),
                      dataclasses.replace(static, continuous_batching=True,
                                          slots=slots), 4)
  for name in ("tokens_nt", "mask_nt", "length_n", "truncated_n"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
  np.testing.assert_allclose(a.logp_nt, b.logp_nt, rtol=1e-5, atol=1e-5)
  assert len(set(np.asarray(a.length_n))) > 2
  assert len(set(map(tuple, np.asarray(a.tokens_nt)))) > 10
  cfg = dataclasses.replace(static, continuous_batching=True, slots=slots)
  again = sampling.sample(CONFIG, params, prompts, jax.random.key(5), cfg, 4)
  other = sampling.sample(CONFIG, params, prompts, jax.random.key(6), cfg, 4)
  np.testing.assert_array_equal(again.tokens_nt, b.tokens_nt)
  assert not np.array_equal(other.tokens_nt, b.tokens_nt)


def test_second_token_frequencies_match_softmax(params):
  """Chi-square goodness of fit of the SECOND token (chosen in a slot, after
  the slot has held other rows) given the most frequent first token."""
  prompt = _prompts([6], seed=3)[0]
  sharp = {**params, "embed": params["embed"] * 4.0}
  n = 8192
  cfg = _cb(slots=512, max_new_tokens=2)
  out = sampling.sample(CONFIG, sharp, [prompt], jax.random.key(0), cfg, n)
  tokens = np.asarray(out.tokens_nt)
  first = np.bincount(tokens[:, 0]).argmax()
  second = tokens[tokens[:, 0] == first, 1]
  logits = forward(CONFIG, sharp, jnp.asarray([prompt + [first]]))[0, -1]
  probs = np.asarray(jax.nn.softmax(logits), np.float64)
  counts = np.bincount(second, minlength=CONFIG.vocab_size)
  expected = probs * len(second)
  big = expected >= 5
  assert big.sum() > 10 and len(second) > 1000
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  assert stats.chisquare(obs, exp / exp.sum() * len(second)).pvalue > 1e-3
  # Power: the second tokens of a hotter distribution fail it.
  hot = sampling.sample(CONFIG, sharp, [prompt], jax.random.key(0),
                        dataclasses.replace(cfg, temperature=1.5), n)
  hot_tokens = np.asarray(hot.tokens_nt)
  hot_second = hot_tokens[hot_tokens[:, 0] == first, 1]
  hot_counts = np.bincount(hot_second, minlength=CONFIG.vocab_size)
  hot_obs = np.append(hot_counts[big], hot_counts[~big].sum())
  hot_exp = exp / exp.sum() * len(hot_second)
  assert stats.chisquare(hot_obs, hot_exp).pvalue < 1e-3


def test_padded_prompts_are_not_decoded(params):
  """batch_multiple pads 3 prompts to 8; only the real rows decode, so the
  loop runs the steps 3 prompts' rows need on their slots."""
  prompts = _prompts([4, 6, 5])
  cfg = _cb(slots=2, max_new_tokens=6, greedy=True)
  a = sampling.sample(CONFIG, params, prompts, jax.random.key(0), cfg, 2)
  b = sampling.sample(CONFIG, params, prompts, jax.random.key(0), cfg, 2,
                      batch_multiple=8)
  assert b.tokens_nt.shape == (6, 6)
  np.testing.assert_array_equal(a.tokens_nt, b.tokens_nt)
  # 6 rows of 5 decode steps each on 2 slots: 15 steps (+1 slack).
  assert int(a.steps) == int(b.steps) <= 16


def test_first_token_stop_and_one_token(params):
  """Rows that end at their first token never take a slot."""
  every = tuple(range(CONFIG.vocab_size))
  out = sampling.sample(CONFIG, params, _prompts([4, 6]), jax.random.key(0),
                        _cb(slots=2, max_new_tokens=50, stop_ids=every), 2)
  np.testing.assert_array_equal(out.length_n, 1)
  one = sampling.sample(CONFIG, params, _prompts([4, 6]), jax.random.key(0),
                        _cb(slots=2, max_new_tokens=1), 2)
  assert int(one.steps) == 0 and bool(jnp.all(one.truncated_n))


@pytest.mark.parametrize("window", [None, 5])
def test_filled_attention_equals_dense(window):
  """Ragged decode attention (blocks up to `filled`, each row at its own
  column) equals attention.attention over the whole cache."""
  N, K, H, E, S, block = 3, 2, 4, 8, 32, 8
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (N, 1, H, E))
  k = jax.random.normal(ks[1], (N, K, S, E))
  v = jax.random.normal(ks[2], (N, K, S, E))
  cols = jnp.arange(S)
  filled_n = jnp.array([5, 19, 11])          # row n's columns [0, filled_n)
  valid = (cols[None] < filled_n[:, None]) & (cols[None] != 2)  # a pad column
  pos = jnp.broadcast_to(cols, (N, S))
  q_pos = filled_n - 1
  mask = (q_pos[:, None] - pos >= 0) & valid
  if window is not None:
    mask &= q_pos[:, None] - pos < window
  want = attention.attention(q, k, v, mask[:, None])
  got = ragged.filled_attention(
      q, k, v, blockwise.MaskInfo(q_pos[:, None], pos, valid), jnp.int32(19),
      window, block)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_auto_slots():
  c = CONFIG
  size = sampling.CacheSize(c, 4)
  assert sampling.auto_slots(size, 64, 8, 16, 80, None) == 64 // 4
  per_slot = sampling.kv_cache_bytes(c, 1, 80, 4)
  prompts = sampling.kv_cache_bytes(c, 8, 16, 4)
  budget = (prompts + 10 * per_slot) / sampling.KV_FRACTION
  assert sampling.auto_slots(size, 64, 8, 16, 80, budget) == 10
  assert sampling.auto_slots(size, 8, 8, 16, 80, budget * 100) == 8


def test_config_fields_are_validated():
  c = config_lib.base_config()
  c.sampling.slots = -1
  with pytest.raises(errors.ConfigError, match="sampling.slots"):
    validation.validate(c)
  with pytest.raises(ValueError, match="slots"):
    sampling.SamplingConfig(slots=-2)


SHARDED_MESHES = ["8,1,1", "2,2,2"]   # 8 row shards; 4 row shards x tensor 2


def test_sharded_rows_on_eight_fake_devices(run_sharding_checks):
  """tests/continuous_sharding_checks.py in a subprocess (the device count is
  fixed before JAX starts): sharded continuous batching gives one device's
  static samples, rows split over the row shards, the slot cache sliced."""
  run_sharding_checks("continuous_sharding_checks.py", SHARDED_MESHES)
