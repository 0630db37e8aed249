"""Packed sequences (grpo_jax/rl/packing.py) compute what padded rows compute:
the same loss, gradient and metrics for every aggregation and policy loss,
the same scored log-probs, on ragged lengths with EOS, in micro-batches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.algorithms import losses, policy_losses, rollout_correction
from grpo_jax.models import get_preset, init_params, transformer
from grpo_jax.rl import packing, update
from grpo_jax.star import sft

CONFIG = get_preset("tiny")
B, G, P, T = 3, 4, 7, 9


def _ragged_batch(seed=0, weights=False):
  """B groups of G completions of one left-padded prompt each, lengths from
  1 to T (EOS inside the row, or truncated at T); one row fully masked."""
  rng = np.random.RandomState(seed)
  prompt_lens = rng.randint(2, P + 1, B)
  N = B * G
  length_n = rng.randint(1, T + 1, N)
  length_n[1] = T                                    # truncated
  rows = []
  for b, p in enumerate(prompt_lens):
    prompt = rng.randint(1, 256, p)
    for _ in range(G):
      rows.append(np.concatenate([np.zeros(P - p, int), prompt,
                                  rng.randint(1, 256, T)]))
  col = np.arange(P + T)[None]
  pad = np.repeat(P - prompt_lens, G)[:, None]
  valid = (col >= pad) & ((col < P) | (col - P < length_n[:, None]))
  mask = (np.arange(T)[None] < length_n[:, None]).astype(np.float32)
  mask[5] = 0.0                                      # e.g. overlong-filtered
  old = rng.randn(N, T).astype(np.float32) * 0.3 - 2.0
  is_weight = (rng.uniform(0.5, 1.5, (N, T)).astype(np.float32)
               if weights else None)
  return update.UpdateBatch(
      jnp.asarray(np.array(rows, np.int32)),
      jnp.asarray(np.maximum(col - pad, 0), jnp.int32), jnp.asarray(valid),
      jnp.asarray(mask), jnp.asarray(old),
      jnp.asarray(old + rng.randn(N, T).astype(np.float32) * 0.2),
      jnp.asarray(rng.randn(N).astype(np.float32)),
      None if is_weight is None else jnp.asarray(is_weight))


def _packed(batch, group_size, rows_per_micro):
  rows, num_micro = packing.pack_rows(
      np.asarray(batch.tokens_ns), np.asarray(batch.valid_ns),
      np.asarray(batch.mask_nt), group_size, rows_per_micro)
  return update.pack_update_batch(batch, rows), num_micro


def _assert_metrics(got, want):
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6,
                               err_msg=k)


def test_packed_update_step_equals_padded_step():
  """The jitted step end to end (model, loss, micro-batches, optimizer):
  with SGD at lr 1 the parameter change is the gradient itself."""
  s = update.LossSettings(
      chunk=4, loss=losses.PolicyLossSpec(agg="seq-mean-token-mean"),
      kl_beta=0.1)
  opt = optax.sgd(1.0)
  batch = _ragged_batch(seed=5, weights=True)
  params = init_params(CONFIG, jax.random.key(0))
  fresh = lambda: update.init_state(jax.tree.map(jnp.copy, params), opt, 0)
  want_state, want = update.update_step(fresh(), batch,
                                        update.UpdateProgram(CONFIG, s, opt))
  packed, num_micro = _packed(batch, G, 2)   # groups split over rows
  assert num_micro > 1
  got_state, got = update.update_step(
      fresh(), packed, update.UpdateProgram(CONFIG, s, opt, num_micro))
  _assert_metrics(got, want)
  for a, b, p in zip(jax.tree.leaves(got_state.params),
                     jax.tree.leaves(want_state.params),
                     jax.tree.leaves(params)):
    np.testing.assert_allclose(a - p, b - p, rtol=1e-4, atol=1e-7)


CASES = {
    "ppo token-mean, dual clip, KL, decoupled weights": dict(
        agg="token-mean", kl_beta=0.1, weights=True,
        params=policy_losses.LossParams(eps_low=0.2, eps_high=0.28,
                                             dual_clip=1.5)),
    "ppo seq-mean-token-mean": dict(agg="seq-mean-token-mean"),
    "ppo seq-mean-token-sum": dict(agg="seq-mean-token-sum"),
    "dr-grpo constant normaliser": dict(agg="seq-mean-token-sum-norm",
                                        max_len_norm=12),
    "gspo": dict(agg="seq-mean-token-mean", name="gspo",
                 params=policy_losses.LossParams(eps_low=3e-4,
                                                      eps_high=4e-4)),
    "gmpo": dict(agg="seq-mean-token-mean", name="gmpo"),
    "sapo": dict(agg="seq-mean-token-mean", name="sapo"),
    "cispo": dict(name="cispo"),
    "cispo_cap": dict(name="cispo_cap",
                      params=policy_losses.LossParams(cispo_cap=1.2)),
    "bypass correction: token TIS, IcePop band, k1 rejection": dict(
        bypass_correction=rollout_correction.CorrectionSettings(
            is_level="token", is_threshold=1.1, band=(0.9, 1.3),
            reject="k1_mean", reject_min=-0.2, reject_max=0.2,
            denominator="trl")),
    "bypass correction: sequence mask": dict(
        bypass_correction=rollout_correction.CorrectionSettings(
            is_level="sequence", is_mode="mask", is_threshold=1.5)),
}


def _slot_loss(logp_nt, batch, packed, num_micro, s):
  """The packed path's loss on given log-probs: gathered into slots, split
  into micro-batches, each normalised by the whole batch, summed."""
  norm = update.global_normalisers(packed.mask_nt, s)
  logp_slots = packing.gather_slots(logp_nt, packed.rows.row_n)
  micro = update.micro_batches((logp_slots, packed._replace(rows=None)),
                               num_micro)
  total, metrics = 0.0, None
  for m in range(num_micro):
    lp, mb = jax.tree.map(lambda x: x[m], micro)
    loss, mets = update.policy_loss(lp, lp * 0.0, mb, norm, s.kl_beta, s)
    total, metrics = total + loss, losses.accumulate_metrics(metrics, mets)
  return total, metrics


@pytest.mark.parametrize("case", list(CASES))
def test_every_loss_is_exact_on_packed_slots(case):
  """Given the same token log-probs (the test above and the scoring test
  show the packed model gives them), every aggregation, policy loss and
  rollout correction gives the padded value, metrics and gradient on the
  packed slots, over micro-batches. Caps, clips and masks bind here."""
  kwargs = dict(CASES[case])
  weights = kwargs.pop("weights", False)
  spec = {k: kwargs.pop(k) for k in ("agg", "name", "params",
                                     "bypass_correction") if k in kwargs}
  s = update.LossSettings(chunk=4, loss=losses.PolicyLossSpec(**spec), **kwargs)
  batch = _ragged_batch(seed=11, weights=weights)
  rng = np.random.RandomState(2)
  logp = batch.old_logp_nt + jnp.asarray(
      rng.randn(B * G, T).astype(np.float32) * 0.3)   # ratios far from 1
  def padded(lp):
    norm = update.global_normalisers(batch.mask_nt, s)
    return update.policy_loss(lp, lp * 0.0, batch, norm, s.kl_beta, s)
  (want, want_metrics), want_grad = jax.value_and_grad(
      padded, has_aux=True)(logp)
  mask = np.asarray(batch.mask_nt) > 0
  assert want_metrics["ratio/max"] > 1.3 and want_metrics["ratio/min"] < 0.7
  for group_size, rows_per_micro in ((G, 2), (1, 64)):
    packed, num_micro = _packed(batch, group_size, rows_per_micro)
    (got, got_metrics), got_grad = jax.value_and_grad(
        _slot_loss, has_aux=True)(logp, batch, packed, num_micro, s)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    _assert_metrics(got_metrics, want_metrics)
    np.testing.assert_allclose(np.asarray(got_grad)[mask],
                               np.asarray(want_grad)[mask], rtol=1e-5,
                               atol=1e-8)


def test_packed_scoring_equals_padded_under_the_mask():
  params = init_params(CONFIG, jax.random.key(1))
  batch = _ragged_batch(seed=3)
  s = update.LossSettings(chunk=4)
  want = update.score_logprobs(
      update.Policy(params), update.UpdateBatch(
          batch.tokens_ns, batch.positions_ns, batch.valid_ns),
      update.UpdateProgram(CONFIG, s, num_micro=2, group_size=G,
                           logp_shape=(B * G, T)))
  mask = np.asarray(batch.mask_nt) > 0
  for group_size, rows_per_micro in ((G, 3), (1, 64)):
    rows, num_micro = packing.pack_rows(
        np.asarray(batch.tokens_ns), np.asarray(batch.valid_ns),
        np.asarray(batch.mask_nt), group_size, rows_per_micro)
    got = update.score_logprobs(
        update.Policy(params), update.UpdateBatch(rows=rows),
        update.UpdateProgram(CONFIG, s, num_micro=num_micro,
                             logp_shape=(B * G, T)))
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask],
                               rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[~mask.any(axis=1)] == 0)   # not packed


def test_blockwise_attention_reads_shared_prompt_segments():
  """The blockwise path applies the same segment rule as the dense one."""
  batch = _ragged_batch(seed=7)
  rows, _ = packing.pack_rows(np.asarray(batch.tokens_ns),
                              np.asarray(batch.valid_ns),
                              np.asarray(batch.mask_nt), G, 64)
  params = init_params(CONFIG, jax.random.key(2))
  run = lambda impl: transformer.hidden_states(
      CONFIG, params, jnp.asarray(rows.tokens_rs),
      jnp.asarray(rows.positions_rs), jnp.asarray(rows.valid_rs),
      jnp.asarray(rows.segments_rs), transformer.ForwardSettings(attention=impl))
  valid = rows.valid_rs
  np.testing.assert_allclose(np.asarray(run("blockwise"))[valid],
                             np.asarray(run("dense"))[valid],
                             rtol=1e-4, atol=1e-5)


def test_rows_hold_each_prompt_once_per_group_and_row():
  batch = _ragged_batch()
  rows, num_micro = packing.pack_rows(
      np.asarray(batch.tokens_ns), np.asarray(batch.valid_ns),
      np.asarray(batch.mask_nt), G, 2)
  prompt_n, comp_n = packing.sequence_lengths(np.asarray(batch.valid_ns),
                                              np.asarray(batch.mask_nt))
  member = rows.segments_rs % packing.SEGMENT_MEMBERS
  group = rows.segments_rs // packing.SEGMENT_MEMBERS
  copies = 0
  for r in range(rows.tokens_rs.shape[0]):
    for gid in set(group[r][rows.valid_rs[r]]):
      prompt = (group[r] == gid) & (member[r] == 0) & rows.valid_rs[r]
      assert list(rows.positions_rs[r][prompt]) == list(
          range(prompt.sum()))                  # the whole prompt, once
      copies += prompt.sum()
  assert rows.valid_rs.sum() - copies == comp_n.sum()   # every completion
  assert copies < (prompt_n * (comp_n > 0)).sum()       # fewer prompt copies
  packed_rows = rows.row_n[rows.row_n < B * G]
  assert sorted(packed_rows) == list(np.flatnonzero(comp_n > 0))
  assert num_micro == -(-rows.tokens_rs.shape[0] // 2) and num_micro > 1


def test_sft_rows_use_the_same_assignment():
  examples = [sft.SFTExample((1, 2), (3,)), sft.SFTExample((4,), (5, 6)),
              sft.SFTExample((8, 9, 10), (11, 12))]
  rows = sft.group_rows(examples, 6, pack=True)
  assert [len(r) for r in rows] == [2, 1]
  assert packing.assign_rows([0, 1, 2], [2, 1, 3], [1, 2, 2], 6) == [[0, 1],
                                                                      [2]]
  # a group's completions after its prompt cost only themselves
  assert packing.assign_rows([0, 0, 0], [3, 3, 3], [1, 1, 1], 6) == [[0, 1,
                                                                      2]]
  with pytest.raises(ValueError, match="does not fit a row of 5"):
    packing.assign_rows([0], [4], [2], 5)


def test_first_fit_goes_back_to_a_row_holding_the_prompt():
  """Group 0 (prompt 3; completions 4, 1, 2) and group 1 (prompt 2;
  completions 3, 3) in rows of 8: longest first, the 2 opens row 1 (row 0
  has 7 used), the 1 goes back to row 0 after its prompt (next fit would
  have copied the prompt again), group 1 needs a row of its own."""
  rows = packing.assign_rows([0, 0, 0, 1, 1], [3, 3, 3, 2, 2],
                             [4, 1, 2, 3, 3], 8)
  assert rows == [[0, 1], [2], [3, 4]]
  # every row within budget, each prompt paid once per row it is in
  for row in rows:
    cost = sum([3, 3, 3, 2, 2][i] for i in {[0, 0, 0, 1, 1][i]: i
                                             for i in row}.values())
    assert cost + sum([4, 1, 2, 3, 3][i] for i in row) <= 8


@pytest.mark.parametrize("rows, micro, multiple", [
    (20, 16, 1), (25, 16, 1), (5, 16, 1), (33, 16, 1), (16, 2, 4),
    (512, 64, 64), (8192, 64, 8), (3, 2, 1), (1, 1, 1), (100, 64, 8)])
def test_micro_batch_shape_spreads_rows_over_the_fewest_micro_batches(
    rows, micro, multiple):
  R, M = packing.micro_batch_shape(rows, micro, multiple)
  most = -(-micro // multiple) * multiple
  step = -(-max(1, most // packing.ROW_STEPS) // multiple) * multiple
  assert R % multiple == 0 and R <= most
  assert M == -(-rows // most)                           # fewest
  assert rows <= R * M < rows + M * step                 # little padding
  if (rows, micro) == (20, 16):                          # 2 x 10, not 2 x 16
    assert (R, M) == (10, 2)


def test_auto_packs_only_when_packed_rows_cost_fewer_tokens():
  """rl.packing = auto: long-tailed lengths pack; every completion at the
  cap (one per row) stays padded, where the prompt runs once per group."""
  batch = _ragged_batch()
  valid = np.asarray(batch.valid_ns)
  short = np.zeros((B * G, T), np.float32)
  short[:, :2] = 1.0                                  # 2 tokens each
  full = np.ones((B * G, T), np.float32)
  for need, want in ((short, True), (full, False)):
    rows, _ = packing.pack_rows(np.asarray(batch.tokens_ns), valid, need, G,
                                64)
    assert packing.wins(rows, B * G, P, T, G) == want
  assert packing.padded_cost(8, 5, 3, 4) == 2 * 5 + 8 * 3
  assert packing.padded_cost(8, 5, 3, 1) == 8 * 8


# 8 row shards; 4 row shards x tensor 2; 2 row shards x tensor 4 with the
# residual's length over tensor (mesh.sequence_parallel).
SHARDED_MESHES = ["1,8,1", "2,2,2", "1,2,4"]


@pytest.mark.slow
def test_packed_update_and_scoring_on_eight_fake_devices(
    run_sharding_checks):
  """tests/packing_sharding_checks.py in a subprocess (the device count is
  fixed before JAX starts): the packed update and scoring with a layout give
  one device's loss, metrics, gradient and log-probs, keep the state's
  shardings, and hold the residual stream per device."""
  run_sharding_checks("packing_sharding_checks.py", SHARDED_MESHES)
