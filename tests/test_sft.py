"""SFT: completion-only loss (checked against the full logits), exact
token-mean under micro-batching, packing == no packing, segment isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax import config as config_lib
from grpo_jax.models import forward, get_preset, hidden_states, init_params
from grpo_jax.rl import optimizer as optimizer_lib
from grpo_jax.rl import update
from grpo_jax.rl.update import init_state
from grpo_jax.star import sft

CONFIG = get_preset("tiny")
S = sft.SFTSettings(chunk=8)
EXAMPLES = [  # (prompt, completion) of different lengths
    sft.SFTExample((5, 6, 7), (8, 9)),
    sft.SFTExample((10, 11), (12, 13, 14, 15)),
    sft.SFTExample((20, 21, 22, 23, 24), (25,)),
    sft.SFTExample((30,), (31, 32, 33)),
]


@pytest.fixture(scope="module")
def params():
  return init_params(CONFIG, jax.random.key(0))


_WIDTH = 16
_forward = jax.jit(forward, static_argnums=0)


def _nll_reference(params, example):
  """-log p of each completion token from the full forward pass of the
  example alone (no SFT code): the hand-written definition of the loss."""
  seq = example.prompt_ids + example.completion_ids
  padded = jnp.zeros((1, _WIDTH), jnp.int32).at[0, :len(seq)].set(
      jnp.asarray(seq, jnp.int32))   # right padding: causal, so harmless
  logq = jax.nn.log_softmax(_forward(CONFIG, params, padded)[0], axis=-1)
  P = len(example.prompt_ids)
  return [-float(logq[t - 1, seq[t]]) for t in range(P, len(seq))]


_loss_and_grad = jax.jit(
    lambda p, b, m: sft.accumulate_gradients(
        update.Policy(p), b, update.UpdateProgram(CONFIG, S, num_micro=m))[:2],
    static_argnums=2)


def _batch(examples, row_len=_WIDTH, pack=False, num_rows=4):
  """Rows as arrays, topped up with all-padding rows to `num_rows` (one
  compiled shape for every test; empty rows add nothing to the loss)."""
  rows = sft.group_rows(examples, row_len, pack)
  rows += [[] for _ in range(num_rows - len(rows))]
  return jax.tree.map(jnp.asarray, sft.rows_to_batch(rows, row_len, pad_id=0))


def test_rows_hand_checked_layout():
  batch = sft.rows_to_batch(sft.group_rows(EXAMPLES[:2], 12, pack=True), 12,
                            pad_id=0)
  np.testing.assert_array_equal(
      batch.tokens_ns, [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0]])
  np.testing.assert_array_equal(batch.positions_ns,
                                [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0]])
  np.testing.assert_array_equal(batch.segments_ns,
                                [[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0]])
  np.testing.assert_array_equal(batch.loss_mask_ns,
                                [[0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0]])
  # Without packing each example has its own row; one too long is an error.
  assert [len(r) for r in sft.group_rows(EXAMPLES, 12, pack=False)] == [1] * 4
  with pytest.raises(ValueError, match="does not fit"):
    sft.group_rows(EXAMPLES, 5, pack=True)


def test_loss_is_completion_token_mean(params):
  # Hand-checked: the mean of -log p over the 2 + 4 + 1 + 3 completion
  # tokens only, each from the example's own forward pass.
  nll = sum((_nll_reference(params, e) for e in EXAMPLES), [])
  loss, _ = _loss_and_grad(params, _batch(EXAMPLES), 1)
  assert len(nll) == 10
  assert float(loss) == pytest.approx(np.mean(nll), rel=1e-5)
  # Changing a prompt token changes the context, never adds a target: the
  # loss still averages the same 10 completion positions.
  swapped = [EXAMPLES[0]._replace(prompt_ids=(99, 6, 7)), *EXAMPLES[1:]]
  want = sum((_nll_reference(params, e) for e in swapped), [])
  loss, _ = _loss_and_grad(params, _batch(swapped), 1)
  assert float(loss) == pytest.approx(np.mean(want), rel=1e-5)
  assert abs(np.mean(want) - np.mean(nll)) > 1e-4


def test_prompt_tokens_get_no_gradient_as_targets(params):
  # With the completion mask zeroed the loss and gradient vanish, although
  # the prompt tokens are still in the rows.
  batch = _batch(EXAMPLES)
  batch = batch._replace(loss_mask_ns=jnp.zeros_like(batch.loss_mask_ns))
  loss, grads = _loss_and_grad(params, batch, 1)
  assert float(loss) == 0.0
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) == 0.0


def test_token_mean_exact_under_micro_batching(params):
  batch = _batch(EXAMPLES)       # 4 rows, 2 + 4 + 1 + 3 completion tokens
  loss1, grads1 = _loss_and_grad(params, batch, 1)
  loss2, grads2 = _loss_and_grad(params, batch, 2)
  assert float(loss2) == pytest.approx(float(loss1), rel=1e-6)
  for g1, g2 in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads2)):
    np.testing.assert_allclose(g2, g1, atol=1e-7, rtol=1e-5)
  # Averaging per-micro-batch means (rows 0, 2 and rows 1, 3) would not be
  # the token-mean: the rows have unequal token counts. On this near-uniform
  # model the gap is small, but 10x the tolerance asserted above.
  nll = [_nll_reference(params, e) for e in EXAMPLES]
  per_micro = np.mean([np.mean(nll[0] + nll[2]), np.mean(nll[1] + nll[3])])
  assert abs(per_micro / float(loss1) - 1) > 1e-5


def test_packed_equals_unpacked(params):
  unpacked = _batch(EXAMPLES, pack=False)           # one example per row
  packed = _batch(EXAMPLES, pack=True)              # rows 0-1; 2-3 empty
  # first fit: the last example goes back to row 0 (5 + 6 + 4 tokens)
  assert [len(r) for r in sft.group_rows(EXAMPLES, _WIDTH, True)] == [3, 1]
  assert int(packed.segments_ns[2:].max()) == 0
  loss_u, grads_u = _loss_and_grad(params, unpacked, 1)
  loss_p, grads_p = _loss_and_grad(params, packed, 1)
  assert float(loss_p) == pytest.approx(float(loss_u), rel=1e-5)
  for gu, gp in zip(jax.tree.leaves(grads_u), jax.tree.leaves(grads_p)):
    np.testing.assert_allclose(gp, gu, atol=1e-6, rtol=1e-4)
  # Without segment isolation the second example of a row would see the
  # first: the loss changes, so the segment mask is what makes them equal.
  leaky = packed._replace(segments_ns=jnp.where(packed.segments_ns > 0, 1, 0))
  loss_leaky, _ = _loss_and_grad(params, leaky, 1)
  assert abs(float(loss_leaky) - float(loss_u)) > 1e-4


def test_segment_ids_isolate_examples_in_the_decoder(params):
  # Hidden states of the second packed example equal those of it alone.
  a, b = EXAMPLES[0], EXAMPLES[1]
  seq_a, seq_b = a.prompt_ids + a.completion_ids, b.prompt_ids + b.completion_ids
  tokens = jnp.asarray([seq_a + seq_b], jnp.int32)
  positions = jnp.asarray([list(range(len(seq_a))) + list(range(len(seq_b)))])
  segments = jnp.asarray([[1] * len(seq_a) + [2] * len(seq_b)])
  states = jax.jit(hidden_states, static_argnums=0)
  packed = states(CONFIG, params, tokens, positions, segment_ns=segments)
  alone = states(CONFIG, params, jnp.asarray([seq_b], jnp.int32))
  np.testing.assert_allclose(packed[0, len(seq_a):], alone[0], atol=1e-5)
  # Without segment ids the second example attends to the first.
  leaky = states(CONFIG, params, tokens, positions)
  assert float(jnp.abs(leaky[0, len(seq_a):] - alone[0]).max()) > 1e-3


def test_sft_step_lowers_the_loss_and_donates_the_state(params):
  optimizer = optax.adam(1e-2)
  batch = _batch(EXAMPLES)
  own = jax.tree.map(jnp.copy, params)
  state = init_state(own, optimizer, 0)
  losses = []
  for _ in range(5):
    old = state
    state, metrics = sft.sft_step(
        state, batch, update.UpdateProgram(CONFIG, S, optimizer, 2))
    losses.append(float(metrics["loss"]))
  assert float(metrics["tokens"]) == 10
  assert losses[-1] < losses[0] - 0.5
  assert int(state.step) == 5
  assert old.params["embed"].is_deleted()          # donated
  assert not params["embed"].is_deleted()          # the caller's copy lives


def test_equal_optimizer_specs_share_one_compile_and_match_optax(params):
  """STaR makes a fresh optimizer every outer iteration: as OptimizerSpec
  values they compile the step once, and step exactly as make_optimizer's
  optax transformation does."""
  optim = config_lib.base_config().optim
  optim.learning_rate = 1e-3
  batch = _batch(EXAMPLES)
  before = sft.sft_step._cache_size()
  states = []
  for _ in range(2):
    spec = optimizer_lib.OptimizerSpec.from_config(optim, 0)
    state = init_state(jax.tree.map(jnp.copy, params), spec, 0)
    states.append(sft.sft_step(
        state, batch, update.UpdateProgram(CONFIG, S, spec, 2))[0])
  assert sft.sft_step._cache_size() == before + 1
  tx = optimizer_lib.make_optimizer(optim, 0)
  direct = sft.sft_step(init_state(jax.tree.map(jnp.copy, params), tx, 0),
                        batch, update.UpdateProgram(CONFIG, S, tx, 2))[0]
  assert sft.sft_step._cache_size() == before + 2     # optax: by identity
  for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(direct)):
    np.testing.assert_array_equal(a, b)


def test_sft_batches_cycle_epochs_with_full_batches():
  rng = np.random.default_rng(0)
  stream = sft.sft_batches(EXAMPLES, rows_per_step=3, row_len=16, pack=False,
                           pad_id=0, rng=rng)
  seen = []
  for _ in range(4):   # 12 rows = 3 epochs of 4 examples
    batch = next(stream)
    assert batch.tokens_ns.shape == (3, 16)
    seen += [tuple(r[r > 0]) for r in batch.tokens_ns]
  whole = sorted(tuple(e.prompt_ids + e.completion_ids) for e in EXAMPLES)
  assert sorted(seen) == sorted(whole * 3)
