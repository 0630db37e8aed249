"""Policy loss, aggregation, KL: REFERENCE.md golden vector, micro-batching."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import registry
from grpo_jax.algorithms import advantages as adv_lib
from grpo_jax.algorithms import losses, policy_losses

# REFERENCE.md golden vector: one group of G = 4, T = 5.
REWARD = jnp.array([[1.0, 0.0, 0.0, 1.0]])
RATIOS = [[1.10, 1.40], [4.00, 1.05, 0.50], [0.95], [1.30, 0.90, 1.20, 0.50]]
T = 5
EPS = dict(eps_low=0.2, eps_high=0.28)


def golden_arrays():
  """(logp_nt, old_logp_nt, mask_nt) with exp(logp - old) = RATIOS on valid
  tokens; old log-probs are arbitrary negative numbers, padding is junk."""
  ratio_nt = np.ones((4, T), np.float32)
  mask_nt = np.zeros((4, T), np.float32)
  for i, row in enumerate(RATIOS):
    ratio_nt[i, :len(row)] = row
    mask_nt[i, :len(row)] = 1.0
  old_nt = -np.linspace(0.5, 3.0, 4 * T, dtype=np.float32).reshape(4, T)
  logp_nt = np.where(mask_nt > 0, old_nt + np.log(ratio_nt), 7.0)
  return jnp.array(logp_nt), jnp.array(old_nt), jnp.array(mask_nt)


def golden_loss(adv_n, agg, dual_clip):
  logp, old, mask = golden_arrays()
  loss, _ = losses.policy_loss(
      logp, old, adv_n, mask, spec=losses.PolicyLossSpec(
          agg=agg, params=policy_losses.LossParams(**EPS, dual_clip=dual_clip)))
  return float(loss)


GOLDEN = [  # (δ, dual clip c, aggregation, REFERENCE value)
    (1e-6, 10.0, "token-mean", 0.046765),
    (1e-6, 10.0, "seq-mean-token-sum", 0.116913),
    (1e-6, 10.0, "seq-mean-token-mean", 0.160214),
    (1e-6, 3.0, "token-mean", -0.039837),
    (1e-6, 3.0, "seq-mean-token-mean", 0.088046),
    (1e-4, None, "seq-mean-token-mean", 0.160187),
    (1e-4, None, "token-mean", 0.046757),
]


@pytest.mark.parametrize("delta,dual_clip,agg,expected", GOLDEN)
def test_golden_grpo_losses(delta, dual_clip, agg, expected):
  adv_n = adv_lib.grpo_advantages(REWARD, eps=delta).reshape(-1)
  assert golden_loss(adv_n, agg, dual_clip) == pytest.approx(expected,
                                                             abs=1e-6)


def test_golden_sum_of_token_losses():
  # REFERENCE: Σ m·l = 0.467653 (δ = 1e-6, c = 10)
  logp, old, mask = golden_arrays()
  adv_n = adv_lib.grpo_advantages(REWARD).reshape(-1)
  loss_nt = losses.clipped_surrogate(losses.ratio(logp, old), adv_n[:, None],
                                     dual_clip=10.0, **EPS)
  assert float((loss_nt * mask).sum()) == pytest.approx(0.467653, abs=1e-6)


def test_golden_dr_grpo_sum_norm():
  # REFERENCE: Dr. GRPO A, no dual clip: Σ m·l / (B·T) = 0.013500
  adv_n = adv_lib.dr_grpo_advantages(REWARD).reshape(-1)
  assert golden_loss(adv_n, "seq-mean-token-sum-norm", None) == pytest.approx(
      0.013500, abs=1e-6)


@pytest.mark.parametrize("estimator,expected", [
    ("k1", 0.076860), ("k2", 0.156160), ("k3", 0.136067)])
def test_golden_kl(estimator, expected):
  # d = log ρ: the reference policy is the sampling policy of the golden vector
  logp, old, mask = golden_arrays()
  kl_nt = registry.lookup("kl_estimator", estimator)(logp, old)
  norm = losses.normalisers(mask)
  assert float(losses.token_mean(kl_nt, mask, norm)) == pytest.approx(
      expected, abs=1e-6)
  # and through policy_loss: the metric, and loss = pg + β·KL
  adv_n = adv_lib.grpo_advantages(REWARD).reshape(-1)
  loss, metrics = losses.policy_loss(
      logp, old, adv_n, mask, old,
      spec=losses.PolicyLossSpec(agg="token-mean", kl_estimator=estimator,
                                 params=policy_losses.LossParams(**EPS)),
      kl_beta=0.5)
  assert float(metrics["kl"]) == pytest.approx(expected, abs=1e-6)
  assert float(loss) == pytest.approx(0.046765 + 0.5 * expected, abs=2e-6)


def test_ratio_one_beta_zero_loss_is_zero_but_gradient_is_not():
  _, old, mask = golden_arrays()
  adv_n = adv_lib.grpo_advantages(REWARD).reshape(-1)

  def loss_fn(logp):
    return losses.policy_loss(
        logp, old, adv_n, mask,
        spec=losses.PolicyLossSpec(agg="seq-mean-token-mean",
                                   params=policy_losses.LossParams(**EPS)),
        kl_beta=0.0)[0]

  loss, grad = jax.value_and_grad(loss_fn)(old)  # logp = old: ρ ≡ 1
  # 0 because the advantages sum to 0 in the group; up to float32 rounding of
  # Σ_t A / |o_i| (one ulp of A / 4 here)
  assert abs(float(loss)) < 1e-7
  # ∂/∂lp_t = -A_i / (|o_i| · N) on valid tokens, 0 on padding
  lengths = np.array([2.0, 3.0, 1.0, 4.0])
  expected = -np.asarray(adv_n)[:, None] / (lengths[:, None] * 4) * mask
  np.testing.assert_allclose(grad, expected, rtol=1e-6)
  assert float(jnp.abs(grad).sum()) > 0.1
  # on-policy: passing logp itself as old gives the same (old is a constant)
  on_policy = jax.grad(lambda lp: losses.policy_loss(
      lp, lp, adv_n, mask, spec=losses.PolicyLossSpec(
          agg="seq-mean-token-mean", params=policy_losses.LossParams(**EPS)))[0]
                      )(old)
  np.testing.assert_allclose(on_policy, expected, rtol=1e-6)


def test_kl_gradient_flows_into_the_policy_only():
  # ∂k3/∂lp = 1 - exp(-d); the reference gets none
  lp, ref = jnp.array([[0.3, -0.2]]), jnp.array([[0.0, 0.1]])
  g_lp, g_ref = jax.grad(lambda a, b: losses.kl_k3(a, b).sum(),
                         argnums=(0, 1))(lp, ref)
  np.testing.assert_allclose(g_lp, 1 - np.exp(-(lp - ref)), rtol=1e-6)
  np.testing.assert_array_equal(g_ref, np.zeros((1, 2)))


def test_clip_metrics_on_golden_vector():
  logp, old, mask = golden_arrays()
  adv_n = adv_lib.grpo_advantages(REWARD).reshape(-1)
  _, m = losses.policy_loss(
      logp, old, adv_n, mask, spec=losses.PolicyLossSpec(
          params=policy_losses.LossParams(**EPS, dual_clip=3.0)))
  # 10 valid tokens. low: A<0, ρ<0.8 -> seq1's 0.50. high: A>0, ρ>1.28 ->
  # seq0's 1.40 and seq3's 1.30. dual: A<0, ρ>3 -> seq1's 4.00.
  assert float(m["clip/low_frac"]) == pytest.approx(0.1)
  assert float(m["clip/high_frac"]) == pytest.approx(0.2)
  assert float(m["clip/dual_frac"]) == pytest.approx(0.1)
  assert float(m["ratio/max"]) == pytest.approx(4.0, rel=1e-6)
  assert float(m["ratio/min"]) == pytest.approx(0.5, rel=1e-6)
  assert float(m["ratio/mean"]) == pytest.approx(np.mean(sum(RATIOS, [])),
                                                 rel=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
  ratio_nt = jnp.array([[5.0, 5.0, 0.5]])
  adv_nt = jnp.array([[-2.0, 2.0, -2.0]])
  loss_nt = losses.clipped_surrogate(ratio_nt, adv_nt, eps_low=0.2,
                                     eps_high=0.2, dual_clip=3.0)
  # A<0, ρ=5: min(10, 2·3) = 6. A>0, ρ=5: -1.2·2. A<0, ρ=0.5: -A·0.8 = 1.6
  np.testing.assert_allclose(loss_nt, [[6.0, -2.4, 1.6]], rtol=1e-6)


def test_clamps_keep_extreme_log_ratios_finite():
  lp = jnp.array([[50.0, -50.0]])
  assert np.all(np.isfinite(losses.ratio(lp, jnp.zeros_like(lp))))
  np.testing.assert_allclose(losses.ratio(lp, jnp.zeros_like(lp)),
                             [[np.exp(20.0), np.exp(-20.0)]], rtol=1e-5)
  # k3 = exp(-d) + d - 1 at d = -15 is ~3.3e6; verl clamps it to 10
  k3 = losses.kl_k3(jnp.array([[-15.0, 0.3]]), jnp.zeros((1, 2)))
  np.testing.assert_allclose(k3, [[10.0, np.exp(-0.3) + 0.3 - 1]], rtol=1e-6)


def test_kl_beta_schedule():
  sched = functools.partial(losses.kl_beta_schedule, beta=0.04, start_step=10,
                            ramp_steps=4)
  got = [float(sched(s)) for s in (0, 9, 10, 11, 12, 14, 100)]
  np.testing.assert_allclose(got, [0, 0, 0, 0.01, 0.02, 0.04, 0.04],
                             rtol=1e-6, atol=1e-9)
  step_fn = functools.partial(losses.kl_beta_schedule, beta=0.04, start_step=3)
  assert [float(step_fn(s)) for s in (2, 3)] == [0.0, pytest.approx(0.04)]
  assert float(jax.jit(sched)(jnp.int32(13))) == pytest.approx(0.03)


def test_bad_arguments_fail_with_names():
  logp, old, mask = golden_arrays()
  adv_n = jnp.zeros(4)
  with pytest.raises(KeyError, match="seq-mean-token-mean"):
    losses.policy_loss(logp, old, adv_n, mask,
                       spec=losses.PolicyLossSpec(agg="sequence-mean"))
  with pytest.raises(ValueError, match="ref_logp_nt"):
    losses.policy_loss(logp, old, adv_n, mask, kl_beta=0.1)
  with pytest.raises(ValueError, match="dual_clip"):
    losses.policy_loss(
        logp, old, adv_n, mask, spec=losses.PolicyLossSpec(
            params=policy_losses.LossParams(dual_clip=0.5)))
  with pytest.raises(ValueError, match="advantages"):
    losses.policy_loss(logp, old, jnp.zeros(3), mask)


# ----------------------------------------------------------------------------
# Micro-batching: the loss and gradient do not depend on the split.
# ----------------------------------------------------------------------------

N, TT, D, V = 8, 6, 5, 11


def _microbatch_problem():
  """A tiny shared-weight 'policy': logp = log_softmax(x @ W)[target]."""
  k = jax.random.split(jax.random.PRNGKey(0), 6)
  w_dv = 0.5 * jax.random.normal(k[0], (D, V))
  x_ntd = jax.random.normal(k[1], (N, TT, D))
  tgt_nt = jax.random.randint(k[2], (N, TT), 0, V)
  old_nt = jnp.log(jax.random.uniform(k[3], (N, TT), minval=0.02, maxval=0.3))
  ref_nt = old_nt + 0.1 * jax.random.normal(k[4], (N, TT))
  lengths = np.array([1, 6, 2, 5, 3, 6, 1, 4])  # ragged: splits differ
  mask_nt = jnp.array(np.arange(TT)[None] < lengths[:, None], jnp.float32)
  adv_n = jax.random.normal(k[5], (N,))
  return w_dv, (x_ntd, tgt_nt, old_nt, ref_nt, mask_nt, adv_n)


def _loss(w_dv, batch, norm, agg):
  x_ntd, tgt_nt, old_nt, ref_nt, mask_nt, adv_n = batch
  logits = jax.nn.log_softmax(x_ntd @ w_dv)
  logp_nt = jnp.take_along_axis(logits, tgt_nt[..., None], -1)[..., 0]
  return losses.policy_loss(
      logp_nt, old_nt, adv_n, mask_nt, ref_nt, spec=losses.PolicyLossSpec(
          agg=agg, params=policy_losses.LossParams(**EPS, dual_clip=3.0)),
      kl_beta=0.1, norm=norm)


SPLITS = (1, 2, 4)
AGGS = tuple(registry.names("loss_agg"))


@functools.lru_cache(maxsize=None)
@jax.jit
def _split_results():
  """For every aggregation and every split into k micro-batches, what the
  trainer computes: normalisers of the whole batch once, then the sum of the
  micro-batch gradients and the accumulated metrics (vmap over micro-batches
  = one call per micro-batch; one compile for the whole test)."""
  w_dv, batch = _microbatch_problem()
  norm = losses.normalisers(batch[4])
  out = {}
  for agg in AGGS:
    grad_fn = jax.grad(_loss, has_aux=True)
    for k in SPLITS:
      parts = [x.reshape(k, N // k, *x.shape[1:]) for x in batch]
      grads, metrics = jax.vmap(lambda *p: grad_fn(w_dv, p, norm, agg))(*parts)
      total = None
      for i in range(k):
        total = losses.accumulate_metrics(
            total, jax.tree.map(lambda m: m[i], metrics))
      out[f"{agg}@{k}"] = grads.sum(axis=0), total
  # the trap the global normalisers avoid: the mean of per-micro-batch
  # token-means (each with its own token count) is not the token-mean
  local = jax.vmap(lambda *p: _loss(w_dv, p, None, "token-mean")[0])(
      *[x.reshape(4, N // 4, *x.shape[1:]) for x in batch])
  out["naive_mean_of_means"] = local.mean()
  return out


@pytest.mark.parametrize("agg", AGGS)
def test_loss_and_gradient_independent_of_microbatching(agg):
  results = _split_results()
  full_grad, full_metrics = results[f"{agg}@1"]
  assert float(jnp.abs(full_grad).sum()) > 1e-3
  for k in SPLITS[1:]:
    grad, metrics = results[f"{agg}@{k}"]
    np.testing.assert_allclose(grad, full_grad, rtol=1e-5, atol=1e-7)
    for key, value in full_metrics.items():
      np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-7,
                                 err_msg=key)


def test_averaging_microbatch_means_would_be_wrong():
  # Makes sure the problem above has unequal token counts per micro-batch,
  # so a wrong accumulation would be caught.
  results = _split_results()
  full = float(results["token-mean@1"][1]["loss"])
  assert abs(float(results["naive_mean_of_means"]) - full) > 1e-3
