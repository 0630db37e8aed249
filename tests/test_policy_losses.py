"""Policy losses by name, REINFORCE++ advantages and rollout correction:
REFERENCE.md "golden example 2", cases where every clip, cap, mask and
rejection binds (values from the plain-Python per-token loops below, an
implementation independent of the jnp code), finite-difference gradients and
micro-batch invariance for every loss."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import errors, registry
from grpo_jax.algorithms import advantages as adv_lib
from grpo_jax.algorithms import losses
from grpo_jax.algorithms import policy_losses as pl
from grpo_jax.algorithms import rollout_correction as rc

# ----------------------------------------------------------------------------
# Golden example 2 (REFERENCE.md): one group, G = 4, T = 4.
# ----------------------------------------------------------------------------

MASK = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]],
                np.float32)
LOGP = np.array([[-1.0, -0.5, 0, 0], [-2.0, -0.1, -0.7, 0], [-0.3, 0, 0, 0],
                 [-1.2, -0.9, -0.4, -2.5]], np.float32)
OLD = np.array([[-1.1, -0.4, 0, 0], [-1.7, -0.1, -0.9, 0], [-0.6, 0, 0, 0],
                [-1.0, -1.0, -0.5, -2.2]], np.float32)
ROLL = np.array([[-1.15, -0.45, 0, 0], [-1.6, -0.2, -0.9, 0],
                 [-0.9, 0, 0, 0], [-1.0, -1.3, -0.5, -2.0]], np.float32)
REWARD = np.array([[1.0, 0.0, 0.0, 1.0]], np.float32)
LENGTH = MASK.sum(axis=1).reshape(1, 4)


def grpo_adv():
  return adv_lib.grpo_advantages(jnp.asarray(REWARD), eps=1e-6).reshape(-1)


@pytest.mark.parametrize("name,expected", [
    ("grpo", [0.866024, -0.866024, -0.866024, 0.866024]),
    ("dr_grpo", [0.5, -0.5, -0.5, 0.5]),
    ("rloo", [0.666667, -0.666667, -0.666667, 0.666667]),
    ("reinforce_pp_baseline", [0.774597, -1.161895, -1.161895, 0.774597]),
])
def test_golden2_advantages(name, expected):
  adv = registry.lookup("advantage", name)(
      jnp.asarray(REWARD), ddof=1, eps=1e-6, length_bg=jnp.asarray(LENGTH))
  np.testing.assert_allclose(np.asarray(adv).ravel(), expected, atol=1e-5)


def test_golden2_gspo_sequence_ratios():
  log_s = ((LOGP - OLD) * MASK).sum(1) / MASK.sum(1)
  np.testing.assert_allclose(np.exp(log_s), [1, 0.967216, 1.349859, 0.927743],
                             atol=1e-5)
  # and the token form's value is s_i on each valid token
  p = pl.LossParams(eps_low=10.0, eps_high=10.0)   # no clip: l = -A·s
  l_nt, _ = pl.gspo_loss(jnp.asarray(LOGP), jnp.asarray(OLD),
                         jnp.ones((4, 4)), jnp.asarray(MASK), p)
  np.testing.assert_allclose(-np.asarray(l_nt)[:, 0], np.exp(log_s),
                             rtol=1e-5)


GOLDEN2 = [  # (policy loss, aggregation, advantage, params, expected)
    ("ppo", "token-mean", "grpo", dict(eps_low=0.2, eps_high=0.2), -0.121991),
    ("ppo", "token-mean", "grpo", dict(eps_low=0.2, eps_high=0.28), -0.121991),
    ("ppo", "seq-mean-token-mean", "grpo", dict(), 0.0886627),
    ("ppo", "seq-mean-token-sum", "grpo", dict(), -0.304978),
    ("ppo", "seq-mean-token-sum-norm", "dr_grpo", dict(), -0.0440199),
    ("gspo", "seq-mean-token-mean", "grpo", dict(eps_low=3e-4, eps_high=4e-4),
     0.0913255),
    ("cispo", "token-mean", "grpo", dict(eps_low=0.2, eps_high=0.2), 0.266457),
    ("cispo", "token-mean", "grpo", dict(eps_low=10.0, eps_high=0.2),
     0.263895),
    ("cispo_cap", "token-mean", "grpo", dict(cispo_cap=5.0), 0.258704),
    ("gmpo", "seq-mean-token-mean", "grpo", dict(gmpo_eps=0.4), 0.0842926),
    ("sapo", "seq-mean-token-mean", "grpo",
     dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05), 0.0422634),
]


@pytest.mark.parametrize("name,agg,adv,params,expected", GOLDEN2)
def test_golden2_losses(name, agg, adv, params, expected):
  adv_n = registry.lookup("advantage", adv)(jnp.asarray(REWARD)).reshape(-1)
  loss, metrics = losses.policy_loss(
      jnp.asarray(LOGP), jnp.asarray(OLD), adv_n, jnp.asarray(MASK),
      spec=losses.PolicyLossSpec(agg=agg, name=name,
                                 params=pl.LossParams(**params)))
  assert float(loss) == pytest.approx(expected, abs=1e-5)
  assert float(metrics["loss/pg"]) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("settings,expected", [
    (rc.CorrectionSettings(is_level="token", is_threshold=2.0), -0.109358),
    (rc.CorrectionSettings(is_level="sequence", is_threshold=2.0), -0.133736),
    (rc.CorrectionSettings(reject="k3_mean", reject_max=0.01), 0.175178),
])
def test_golden2_rollout_correction(settings, expected):
  weight, mask, _ = rc.correct(jnp.asarray(OLD), jnp.asarray(ROLL),
                               jnp.asarray(MASK), settings)
  loss, _ = losses.policy_loss(jnp.asarray(LOGP), jnp.asarray(OLD), grpo_adv(),
                               mask,
                               spec=losses.PolicyLossSpec(agg="token-mean"),
                               is_weight_nt=weight)
  assert float(loss) == pytest.approx(expected, abs=1e-5)


def test_golden2_mismatch_metrics():
  _, _, m = rc.correct(jnp.asarray(OLD), jnp.asarray(ROLL), jnp.asarray(MASK),
                       rc.CorrectionSettings())
  d = (OLD - ROLL)[MASK > 0]
  assert float(m["rollout_is/ratio/max"]) == pytest.approx(1.349859, abs=1e-5)
  assert float(m["rollout_is/ratio/min"]) == pytest.approx(np.exp(-0.2),
                                                           abs=1e-6)
  assert float(m["rollout_is/ratio/mean"]) == pytest.approx(
      np.exp(d).mean(), abs=1e-6)
  assert float(m["rollout_kl/k1"]) == pytest.approx(-d.mean(), abs=1e-6)
  assert float(m["rollout_kl/k3"]) == pytest.approx(
      (np.exp(d) - 1 - d).mean(), abs=1e-6)
  assert float(m["rollout_logp_diff/max"]) == pytest.approx(0.3, abs=1e-6)


# ----------------------------------------------------------------------------
# An independent implementation: plain Python loops over tokens.
# ----------------------------------------------------------------------------

def _clip(x, lo, hi):
  return min(max(x, lo), hi)


def ref_token_losses(name, lp, old, adv, mask, p: pl.LossParams):
  """Per-token loss [N][T] (0 on padding), one token at a time."""
  out = [[0.0] * len(lp[0]) for _ in lp]
  for i in range(len(lp)):
    toks = [t for t in range(len(lp[i])) if mask[i][t] > 0]
    n = max(len(toks), 1)
    if name == "gspo":
      s = math.exp(min(sum(lp[i][t] - old[i][t] for t in toks) / n, 10.0))
    if name == "gmpo":
      x_sum, a_sum = 0.0, 0.0
      for t in toks:
        x = lp[i][t] - old[i][t]
        a = adv[i][t]
        if a > 0:
          x = min(x, p.gmpo_eps)
        elif a < 0:
          x = max(x, -p.gmpo_eps)
        else:
          x = 0.0
        x_sum, a_sum = x_sum + x, a_sum + a
      seq_loss = -(a_sum / n) * math.exp(x_sum / n)
    for t in toks:
      a = adv[i][t]
      r = math.exp(_clip(lp[i][t] - old[i][t], -20, 20))
      if name == "ppo":
        l = -min(r * a, _clip(r, 1 - p.eps_low, 1 + p.eps_high) * a)
        if p.dual_clip is not None and a < 0:
          l = min(l, -a * p.dual_clip)
      elif name == "gspo":
        l = max(-a * s, -a * _clip(s, 1 - p.eps_low, 1 + p.eps_high))
      elif name == "cispo":
        l = -_clip(r, 1 - p.eps_low, 1 + p.eps_high) * a * lp[i][t]
      elif name == "cispo_cap":
        l = -min(r, p.cispo_cap) * a * lp[i][t]
      elif name == "gmpo":
        l = seq_loss
      elif name == "sapo":
        tau = p.sapo_tau_pos if a > 0 else p.sapo_tau_neg
        l = -a * 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))
      out[i][t] = l
  return out


def ref_aggregate(l, mask, agg, weight=None):
  weight = weight or [[1.0] * len(row) for row in l]
  rows = [[l[i][t] * weight[i][t] for t in range(len(l[i])) if mask[i][t] > 0]
          for i in range(len(l))]
  seqs = [r for r in rows if r]
  if agg == "token-mean":
    return sum(sum(r) for r in seqs) / max(sum(len(r) for r in seqs), 1)
  if agg == "seq-mean-token-mean":
    return sum(sum(r) / len(r) for r in seqs) / max(len(seqs), 1)
  if agg == "seq-mean-token-sum":
    return sum(sum(r) for r in seqs) / max(len(seqs), 1)
  return sum(sum(r) for r in seqs) / (max(len(seqs), 1) * len(l[0]))


# A batch where every clip binds: per-token log-ratios from -1.2 (ρ 0.30) to
# +1.5 (ρ 4.5), advantages of both signs, a zero advantage, padding.
BIND_LOG_RATIO = np.array([
    [1.5, 0.1, -1.2, 0.0, 0.0],     # A > 0: high clip, none, (low side free)
    [1.5, 0.3, -1.2, -0.05, 0.0],   # A < 0: dual clip (ρ 4.5 > 3), low clip
    [0.5, 0.45, 0.6, 0.0, 0.0],     # A > 0, whole row high: GSPO s > 1+ε
    [-0.5, -0.6, 0.0, 0.0, 0.0],    # A < 0, whole row low: GSPO s < 1-ε
    [0.2, -0.3, 0.0, 0.0, 0.0],     # A = 0
], np.float32)
BIND_MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0],
                      [1, 1, 0, 0, 0], [1, 1, 0, 0, 0]], np.float32)
BIND_ADV = np.array([1.3, -0.7, 0.9, -1.1, 0.0], np.float32)
BIND_OLD = -np.linspace(0.4, 2.4, 25, dtype=np.float32).reshape(5, 5)
BIND_LP = BIND_OLD + BIND_LOG_RATIO
BIND_PARAMS = {
    "ppo": pl.LossParams(eps_low=0.2, eps_high=0.28, dual_clip=3.0),
    "gspo": pl.LossParams(eps_low=0.2, eps_high=0.28),
    "cispo": pl.LossParams(eps_low=0.2, eps_high=0.28),
    "cispo_cap": pl.LossParams(cispo_cap=2.0),
    "gmpo": pl.LossParams(gmpo_eps=0.4),
    "sapo": pl.LossParams(sapo_tau_pos=1.0, sapo_tau_neg=1.05),
}
LOSS_AGGS = [(name, agg) for name in BIND_PARAMS
             for agg in registry.names("loss_agg")
             if registry.lookup("policy_loss", name).fixed_agg in (None, agg)]


def _bind_case():
  adv_nt = np.broadcast_to(BIND_ADV[:, None], BIND_MASK.shape)
  return BIND_LP, BIND_OLD, adv_nt, BIND_MASK


def test_every_clip_binds_in_the_bind_case():
  lp, old, adv_nt, mask = _bind_case()
  for name in ("ppo", "gspo", "cispo", "gmpo"):
    _, m = losses.policy_loss(
        jnp.asarray(lp), jnp.asarray(old), jnp.asarray(BIND_ADV),
        jnp.asarray(mask),
        spec=losses.PolicyLossSpec(name=name, params=BIND_PARAMS[name],
                                   agg="seq-mean-token-mean"))
    assert float(m["clip/low_frac"]) > 0 and float(m["clip/high_frac"]) > 0, (
        name)
  _, m = losses.policy_loss(
      jnp.asarray(lp), jnp.asarray(old), jnp.asarray(BIND_ADV),
      jnp.asarray(mask), spec=losses.PolicyLossSpec(name="ppo",
                                                    params=BIND_PARAMS["ppo"]))
  assert float(m["clip/dual_frac"]) == pytest.approx(1 / 14)
  _, m = losses.policy_loss(
      jnp.asarray(lp), jnp.asarray(old), jnp.asarray(BIND_ADV),
      jnp.asarray(mask),
      spec=losses.PolicyLossSpec(name="cispo_cap",
                                 params=BIND_PARAMS["cispo_cap"]))
  assert float(m["clip/high_frac"]) == pytest.approx(2 / 14)  # ρ 4.5 > 2


@pytest.mark.parametrize("name,agg", LOSS_AGGS)
def test_binding_case_matches_per_token_loops(name, agg):
  lp, old, adv_nt, mask = _bind_case()
  p = BIND_PARAMS[name]
  expected = ref_aggregate(
      ref_token_losses(name, lp.tolist(), old.tolist(), adv_nt.tolist(),
                       mask.tolist(), p), mask.tolist(), agg)
  loss, _ = losses.policy_loss(
      jnp.asarray(lp), jnp.asarray(old), jnp.asarray(BIND_ADV),
      jnp.asarray(mask), spec=losses.PolicyLossSpec(name=name, params=p,
                                                    agg=agg))
  assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_hand_computed_binding_tokens():
  # PPO ε 0.2/0.28, c = 3, row 1 (A = -0.7): token 0 ρ = e^1.5 = 4.4817:
  # -min(ρA, 1.28·A) = 0.7·4.4817 = 3.137, dual clip caps at 0.7·3 = 2.1.
  # Token 2 ρ = e^-1.2 = 0.3012 < 0.8: -min(ρA, 0.8A) = 0.7·0.8 = 0.56.
  lp, old, adv_nt, mask = _bind_case()
  l_nt, _ = pl.ppo_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv_nt),
                        jnp.asarray(mask), BIND_PARAMS["ppo"])
  assert float(l_nt[1, 0]) == pytest.approx(2.1, abs=1e-6)
  assert float(l_nt[1, 2]) == pytest.approx(0.56, abs=1e-6)
  # GSPO row 2 (A = 0.9): s = exp(mean(0.5, 0.45, 0.6)) = e^0.51666 = 1.6764
  # > 1.28: l = -min(sA, 1.28A) = -1.152 on every token
  l_nt, _ = pl.gspo_loss(jnp.asarray(lp), jnp.asarray(old),
                         jnp.asarray(adv_nt), jnp.asarray(mask),
                         BIND_PARAMS["gspo"])
  np.testing.assert_allclose(l_nt[2, :3], [-1.152] * 3, rtol=1e-6)
  # CISPO cap 2, row 0 token 0: w = min(4.4817, 2) = 2: l = -2·1.3·lp
  l_nt, _ = pl.cispo_cap_loss(jnp.asarray(lp), jnp.asarray(old),
                              jnp.asarray(adv_nt), jnp.asarray(mask),
                              BIND_PARAMS["cispo_cap"])
  assert float(l_nt[0, 0]) == pytest.approx(-2 * 1.3 * lp[0, 0], rel=1e-6)
  # GMPO row 3 (A = -1.1): log-ratios -0.5, -0.6 clipped up to -0.4 each:
  # l = 1.1·e^-0.4 = 0.73734
  l_nt, _ = pl.gmpo_loss(jnp.asarray(lp), jnp.asarray(old),
                         jnp.asarray(adv_nt), jnp.asarray(mask),
                         BIND_PARAMS["gmpo"])
  assert float(l_nt[3, 0]) == pytest.approx(1.1 * math.exp(-0.4), rel=1e-6)
  # SAPO at ρ = 1 (row 0 token 3 is padding; use row 4, A = 0): l = 0;
  # row 0 token 0 (A = 1.3, τ = 1): -1.3·4·σ(3.4817)
  l_nt, _ = pl.sapo_loss(jnp.asarray(lp), jnp.asarray(old),
                         jnp.asarray(adv_nt), jnp.asarray(mask),
                         BIND_PARAMS["sapo"])
  sig = 1 / (1 + math.exp(-(math.exp(1.5) - 1)))
  assert float(l_nt[0, 0]) == pytest.approx(-1.3 * 4 * sig, rel=1e-6)
  assert float(l_nt[4, 0]) == 0.0


def test_gspo_log_ratio_clamp_at_10():
  lp = jnp.array([[12.0, 14.0]])
  l_nt, _ = pl.gspo_loss(lp, jnp.zeros((1, 2)), -jnp.ones((1, 2)),
                         jnp.ones((1, 2)), pl.LossParams(eps_low=10.0,
                                                         eps_high=1e9))
  np.testing.assert_allclose(l_nt, [[math.exp(10.0)] * 2], rtol=1e-5)


# ----------------------------------------------------------------------------
# Rollout correction where every cap, band and rejection binds.
# ----------------------------------------------------------------------------

CORR_LOG_RHO = np.array([
    [1.0, 0.2, 0.0, 0.0],     # ρ_t 2.718 > 2; row Σ 1.2 -> ρ_seq 3.32
    [-0.9, 0.1, 0.05, 0.0],   # ρ_t 0.41 < 0.5 (IcePop band)
    [1.7, 0.0, 0.0, 0.0],     # ρ_t 5.47 > 5 (band); ρ_seq 5.47
    [0.05, -0.05, 0.02, 0.01],
], np.float32)
CORR_MASK = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]],
                     np.float32)


def ref_correct(log_rho, mask, s: rc.CorrectionSettings):
  """(weight, mask) by loops, as the module docstring states the rules."""
  n, t_len = len(log_rho), len(log_rho[0])
  weight = [[0.0] * t_len for _ in range(n)]
  out_mask = [list(map(float, row)) for row in mask]
  for i in range(n):
    toks = [t for t in range(t_len) if mask[i][t] > 0]
    seq = math.exp(_clip(sum(log_rho[i][t] for t in toks), -20, 20))
    k1 = [-log_rho[i][t] for t in toks]
    k3 = [math.exp(log_rho[i][t]) - 1 - log_rho[i][t] for t in toks]
    stat = {"k1_sum": sum(k1), "k1_mean": sum(k1) / max(len(toks), 1),
            "k3_mean": sum(k3) / max(len(toks), 1)}.get(s.reject)
    rejected = stat is not None and not s.reject_min <= stat <= s.reject_max
    for t in toks:
      rho = math.exp(log_rho[i][t])
      w = {"token": rho, "sequence": seq}.get(s.is_level, 1.0)
      if s.is_level != "none":
        w = min(w, s.is_threshold) if s.is_mode == "truncate" else (
            0.0 if w > s.is_threshold else w)
      dropped = rejected or (s.band[1] > 0 and
                             not s.band[0] <= rho <= s.band[1])
      if dropped and s.denominator == "verl":
        out_mask[i][t] = 0.0
      weight[i][t] = 0.0 if dropped and s.denominator == "trl" else w
      if out_mask[i][t] == 0:
        weight[i][t] = 0.0
  return weight, out_mask


CORR_CASES = [
    rc.CorrectionSettings(is_level="token", is_threshold=2.0),
    rc.CorrectionSettings(is_level="token", is_mode="mask", is_threshold=2.0),
    rc.CorrectionSettings(is_level="sequence", is_threshold=2.0),
    rc.CorrectionSettings(is_level="sequence", is_mode="mask",
                          is_threshold=3.0),
    rc.CorrectionSettings(band=(0.5, 5.0)),
    rc.CorrectionSettings(band=(0.5, 5.0), denominator="trl"),
    rc.CorrectionSettings(reject="k1_sum", reject_min=-1.0, reject_max=0.5),
    rc.CorrectionSettings(reject="k1_mean", reject_min=-0.5, reject_max=0.5,
                          denominator="trl"),
    rc.CorrectionSettings(reject="k3_mean", reject_max=0.1,
                          is_level="token", is_threshold=2.0),
]


@pytest.mark.parametrize("s", CORR_CASES, ids=range(len(CORR_CASES)))
def test_correction_binding_cases_match_loops(s):
  roll = -np.linspace(0.3, 2.0, 16, dtype=np.float32).reshape(4, 4)
  old = roll + CORR_LOG_RHO
  weight, mask, _ = rc.correct(jnp.asarray(old), jnp.asarray(roll),
                               jnp.asarray(CORR_MASK), s)
  ref_w, ref_m = ref_correct(CORR_LOG_RHO.tolist(), CORR_MASK.tolist(), s)
  np.testing.assert_allclose(mask, ref_m, atol=0)
  np.testing.assert_allclose(weight, ref_w, rtol=2e-6, atol=1e-7)
  # something binds in every case: the weights or the mask differ from 1 / in
  assert not (np.allclose(np.asarray(weight), CORR_MASK)
              and np.array_equal(np.asarray(mask), CORR_MASK))


def test_correction_rejection_denominators_differ():
  # verl removes rejected rows from the token count, TRL keeps them
  roll = -np.ones((4, 4), np.float32)
  old = roll + CORR_LOG_RHO
  adv = jnp.asarray([0.5, -0.5, 1.0, -1.0])
  out = {}
  for den in ("verl", "trl"):
    s = rc.CorrectionSettings(reject="k1_sum", reject_min=-1.0,
                              reject_max=1.0, denominator=den)
    w, m, metrics = rc.correct(jnp.asarray(old), jnp.asarray(roll),
                               jnp.asarray(CORR_MASK), s)
    out[den] = float(losses.policy_loss(jnp.asarray(old), jnp.asarray(old), adv, m, is_weight_nt=w)[0])
    # rows 0 (Σk1 = -1.2) and 2 (-1.7) are rejected
    assert float(metrics["rollout_is/rejected_seq_frac"]) == 0.5
  # ρ = 1 so l = -A per token: kept rows 1 (3 tokens, A -0.5), 3 (4, A -1)
  assert out["verl"] == pytest.approx((3 * 0.5 + 4 * 1.0) / 7, rel=1e-6)
  assert out["trl"] == pytest.approx((3 * 0.5 + 4 * 1.0) / 10, rel=1e-6)


def test_correction_settings_validation_names_the_field():
  with pytest.raises(ValueError, match="is_level"):
    rc.validate(rc.CorrectionSettings(is_level="tokens"), "recompute")
  with pytest.raises(ValueError, match="band"):
    rc.validate(rc.CorrectionSettings(band=(2.0, 5.0)), "recompute")
  with pytest.raises(ValueError, match="denominator"):
    rc.validate(rc.CorrectionSettings(reject="k3_mean", reject_max=0.01),
                "sampler")
  rc.validate(rc.CorrectionSettings(reject="k3_mean", reject_max=0.01,
                                    denominator="trl"), "sampler")


# ----------------------------------------------------------------------------
# Gradients against central finite differences.
# ----------------------------------------------------------------------------

def _fd_grad(f, x, h=1e-3):
  g = np.zeros_like(x)
  for idx in np.ndindex(*x.shape):
    e = np.zeros_like(x)
    e[idx] = h
    g[idx] = (f(x + e) - f(x - e)) / (2 * h)
  return g


# Points away from every kink (|log ρ| not near a clip edge) where clips
# still bind on some tokens: the bind case moved off the edges.
FD_LOG_RATIO = np.array([
    [1.5, 0.1, -1.2, 0.0], [1.5, 0.05, -1.2, 0.12],
    [0.5, 0.45, 0.6, 0.0], [-0.5, -0.7, 0.0, 0.0]], np.float64)
FD_MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]],
                   np.float64)
FD_ADV = np.array([1.3, -0.7, 0.9, -1.1])
FD_WEIGHT = np.array([[1.0, 0.5, 2.0, 0], [1.5, 1.0, 0.7, 1.1],
                      [1.0, 1.0, 1.0, 0], [0.3, 1.8, 0, 0]])
# A sequence-level loss's token form (verl) gives token t the gradient
# w_t·s·∇lp_t: the gradient of its value only when w is constant along the row
# (sequence-level IS), so those are checked with row weights.
FD_WEIGHT_SEQ = np.array([[1.0], [1.5], [0.6], [2.0]]) * FD_MASK


@pytest.mark.parametrize("name,agg", LOSS_AGGS)
@pytest.mark.parametrize("weighted", [False, True])
def test_gradient_matches_finite_differences(name, agg, weighted):
  old = -np.linspace(0.4, 2.0, 16).reshape(4, 4)
  lp0 = old + FD_LOG_RATIO
  adv_nt = np.broadcast_to(FD_ADV[:, None], FD_MASK.shape)
  p = BIND_PARAMS[name]
  weight = None
  if weighted:
    weight = FD_WEIGHT_SEQ if name in ("gspo", "gmpo") else FD_WEIGHT
  ref_name = name
  frozen = None
  if name.startswith("cispo"):
    # CISPO's gradient is -sg(w)·A·∇lp: differentiate with w frozen at lp0
    r0 = np.exp(lp0 - old)
    frozen = (np.clip(r0, 1 - p.eps_low, 1 + p.eps_high) if name == "cispo"
              else np.minimum(r0, p.cispo_cap))

  def ref_loss(lp):
    if frozen is not None:
      l = (-frozen * adv_nt * lp).tolist()
    else:
      l = ref_token_losses(ref_name, lp.tolist(), old.tolist(),
                           adv_nt.tolist(), FD_MASK.tolist(), p)
    return ref_aggregate(l, FD_MASK.tolist(), agg,
                         None if weight is None else weight.tolist())

  expected = _fd_grad(ref_loss, lp0)
  grad = jax.grad(lambda lp: losses.policy_loss(
      lp, jnp.asarray(old, jnp.float32), jnp.asarray(FD_ADV, jnp.float32),
      jnp.asarray(FD_MASK, jnp.float32), spec=losses.PolicyLossSpec(
          name=name, params=p, agg=agg), is_weight_nt=None
      if weight is None else jnp.asarray(weight, jnp.float32))[0])(jnp.asarray(
          lp0, jnp.float32))
  np.testing.assert_allclose(grad, expected, rtol=1e-3, atol=2e-5)
  assert np.abs(expected).sum() > 1e-2      # the check is not vacuous
  assert np.all(np.asarray(grad)[FD_MASK == 0] == 0)


# ----------------------------------------------------------------------------
# Micro-batch invariance of every loss, with and without correction.
# ----------------------------------------------------------------------------

N, T, D, V = 8, 6, 5, 11


def _problem():
  k = jax.random.split(jax.random.PRNGKey(1), 6)
  w_dv = 0.5 * jax.random.normal(k[0], (D, V))
  x_ntd = jax.random.normal(k[1], (N, T, D))
  tgt_nt = jax.random.randint(k[2], (N, T), 0, V)
  logits = jax.nn.log_softmax(x_ntd @ w_dv)
  lp_nt = jnp.take_along_axis(logits, tgt_nt[..., None], -1)[..., 0]
  # old within ±0.8 of the current log-probs: some clips bind
  old_nt = lp_nt + 0.8 * jax.random.uniform(k[3], (N, T), minval=-1, maxval=1)
  roll_nt = old_nt + 0.6 * jax.random.normal(k[4], (N, T))
  lengths = np.array([1, 6, 2, 5, 3, 6, 1, 4])
  mask_nt = jnp.array(np.arange(T)[None] < lengths[:, None], jnp.float32)
  adv_n = jax.random.normal(k[5], (N,))
  return w_dv, (x_ntd, tgt_nt, old_nt, roll_nt, mask_nt, adv_n)


def _mb_loss(w_dv, part, weight_nt, norm, name, agg, bypass):
  x_ntd, tgt_nt, old_nt, roll_nt, mask_nt, adv_n = part
  logits = jax.nn.log_softmax(x_ntd @ w_dv)
  lp_nt = jnp.take_along_axis(logits, tgt_nt[..., None], -1)[..., 0]
  if bypass is not None:      # π_old := π_rollout, corrected in the loss
    old_nt = roll_nt
  return losses.policy_loss(
      lp_nt, old_nt, adv_n, mask_nt,
      spec=losses.PolicyLossSpec(agg=agg, name=name, params=BIND_PARAMS[name],
                                 bypass_correction=bypass), norm=norm,
      is_weight_nt=weight_nt)


DECOUPLED = rc.CorrectionSettings(is_level="token", is_threshold=1.5,
                                  reject="k3_mean", reject_max=0.15)
BYPASS = rc.CorrectionSettings(is_level="sequence", is_threshold=2.0,
                               band=(0.5, 2.0), denominator="trl")


# every loss with every aggregation it allows; the corrections with one each
MB_CASES = ([(name, agg, "plain") for name, agg in LOSS_AGGS]
            + [(name, pl_agg, mode) for name, pl_agg in
               [(n, registry.lookup("policy_loss", n).fixed_agg
                 or "token-mean") for n in BIND_PARAMS]
               for mode in ("decoupled", "bypass")])


@pytest.mark.parametrize("name,agg,mode", MB_CASES)
def test_loss_gradient_metrics_independent_of_microbatching(name, agg, mode):
  w_dv, batch = _problem()
  x_ntd, tgt_nt, old_nt, roll_nt, mask_nt, adv_n = batch
  weight_nt, bypass = None, None
  if mode == "decoupled":   # once on the whole batch, before splitting
    weight_nt, mask_nt, _ = rc.correct(old_nt, roll_nt, mask_nt, DECOUPLED)
    assert 0 < float(mask_nt.sum()) < float(batch[4].sum())  # rows rejected
    batch = (x_ntd, tgt_nt, old_nt, roll_nt, mask_nt, adv_n)
  if mode == "bypass":
    bypass = BYPASS
  norm = losses.normalisers(mask_nt)
  grad_fn = jax.jit(jax.grad(_mb_loss, has_aux=True),
                    static_argnames=("name", "agg", "bypass"))
  results = []
  for k in (1, 2, 4):
    grads, total = 0, None
    for i in range(k):
      rows = slice(i * N // k, (i + 1) * N // k)
      part = tuple(x[rows] for x in batch)
      w = None if weight_nt is None else weight_nt[rows]
      g, m = grad_fn(w_dv, part, w, norm, name=name, agg=agg, bypass=bypass)
      grads = grads + g
      total = losses.accumulate_metrics(total, m)
    results.append((grads, total))
  full_grad, full_metrics = results[0]
  assert float(jnp.abs(full_grad).sum()) > 1e-3
  for grads, metrics in results[1:]:
    np.testing.assert_allclose(grads, full_grad, rtol=1e-5, atol=1e-7)
    for key, value in full_metrics.items():
      np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-7,
                                 err_msg=key)


def test_reinforce_pp_baseline_needs_the_whole_batch():
  # whitening per micro-batch would give other advantages: the trainer
  # computes them once per step on the host's global batch (train.advantages)
  reward = jnp.asarray([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0]])
  length = jnp.asarray([[2.0, 3.0, 1.0, 4.0], [5.0, 1.0, 2.0, 2.0]])
  fn = adv_lib.reinforce_pp_baseline_advantages
  whole = np.asarray(fn(reward, length_bg=length))
  halves = np.concatenate([np.asarray(fn(reward[i:i + 1],
                                         length_bg=length[i:i + 1]))
                           for i in range(2)])
  assert np.abs(whole - halves).max() > 1e-2
  # the token-weighted mean of the whole batch's advantages is 0, var 1
  w = np.asarray(length).ravel()
  a = whole.ravel()
  assert abs((w * a).sum() / w.sum()) < 1e-6
  assert (w * a ** 2).sum() / (w.sum() - 1) == pytest.approx(1.0, abs=1e-5)
  with pytest.raises(ValueError, match="length_bg"):
    fn(reward)


def test_reinforce_pp_whitens_rewards_over_tokens():
  reward = jnp.asarray([[1.0, 0.0, 0.0, 1.0]])
  adv = adv_lib.reinforce_pp_advantages(reward, length_bg=jnp.asarray(LENGTH))
  # no group baseline: the same as the baseline version here (mean 0.5 is
  # removed by the whitening either way)
  np.testing.assert_allclose(np.asarray(adv).ravel(),
                             [0.774597, -1.161895, -1.161895, 0.774597],
                             atol=1e-5)


def test_fixed_aggregation_is_enforced():
  for name in ("gspo", "gmpo", "sapo"):
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
      losses.policy_loss(
          jnp.asarray(LOGP), jnp.asarray(OLD), grpo_adv(), jnp.asarray(MASK),
          spec=losses.PolicyLossSpec(name=name, agg="token-mean"))
  with pytest.raises(KeyError, match="cispo_cap"):
    losses.policy_loss(jnp.asarray(LOGP), jnp.asarray(OLD), grpo_adv(),
                       jnp.asarray(MASK),
                       spec=losses.PolicyLossSpec(name="cispo-trl"))


def test_config_validation_of_losses_and_correction():
  from configs import dapo_aime, tiny  # pylint: disable=import-outside-toplevel
  from grpo_jax import validation
  c = tiny.get_config()
  c.rl.policy_loss = "gspo"                   # loss_agg is token-mean
  with pytest.raises(errors.ConfigError, match="seq-mean-token-mean"):
    validation.validate(c)
  c.rl.loss_agg = "seq-mean-token-mean"
  validation.validate(c)
  c.rl.dual_clip = 3.0
  with pytest.raises(errors.ConfigError, match="dual_clip"):
    validation.validate(c)
  c = tiny.get_config()
  c.rl.policy_loss = "cispo_trl"
  with pytest.raises(errors.ConfigError, match="cispo_cap"):
    validation.validate(c)
  c = tiny.get_config()
  c.rl.rollout_correction.reject = "k3_mean"  # bypass (old_logp = sampler)
  with pytest.raises(errors.ConfigError, match="denominator"):
    validation.validate(c)
  c.rl.old_logp = "recompute"
  validation.validate(c)
  c.rl.rollout_correction.is_mode = "clip"
  with pytest.raises(errors.ConfigError, match="is_mode"):
    validation.validate(c)
  c = tiny.get_config()
  c.sampling.compute_dtype = "float16"
  with pytest.raises(errors.ConfigError, match="sampling.compute_dtype"):
    validation.validate(c)
  for variant in ("local_gspo", "local_cispo", "local_cispo_cap",
                  "local_gmpo", "local_sapo", "local_bf16", "local_bf16_tis"):
    validation.validate(dapo_aime.get_config(variant))


@pytest.mark.parametrize("old_logp", [
    pytest.param("recompute", marks=pytest.mark.slow), "sampler"])
def test_bf16_sampler_run_logs_the_mismatch(tmp_path, old_logp):
  import json  # pylint: disable=import-outside-toplevel

  from configs import tiny  # pylint: disable=import-outside-toplevel
  from grpo_jax.rl import train  # pylint: disable=import-outside-toplevel
  c = tiny.get_config()
  c.train.steps = 1
  c.train.eval_at_start = c.train.eval_at_end = False
  c.sampling.compute_dtype = "bfloat16"        # the trainer stays float32
  c.rl.old_logp = old_logp
  c.rl.policy_loss, c.rl.loss_agg = "gspo", "seq-mean-token-mean"
  c.rl.rollout_correction.is_level = "token"
  c.rl.rollout_correction.reject = "k3_mean"
  c.rl.rollout_correction.reject_max = 1.0
  c.rl.rollout_correction.denominator = "trl"
  train.run(c, str(tmp_path))
  row = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")][-1]
  for key in ("rollout_is/ratio/mean", "rollout_is/ratio/max",
              "rollout_is/ratio/min", "rollout_is/truncated_frac",
              "rollout_is/rejected_seq_frac", "rollout_kl/k1",
              "rollout_kl/k3", "rollout_logp_diff/max"):
    assert key in row, key
  # bf16 sampling against a float32 trainer: the log-probs differ
  assert row["rollout_logp_diff/max"] > 0
  assert row["rollout_is/ratio/max"] > 1 > row["rollout_is/ratio/min"]
  assert np.isfinite(row["loss"])


def test_run_list_names_each_loss_variant():
  from grpo_jax.harness import runs  # pylint: disable=import-outside-toplevel
  listed = dict(runs.list_experiments("configs"))
  for variant in ("local_gspo", "local_cispo", "local_cispo_cap",
                  "local_gmpo", "local_sapo", "local_bf16", "local_bf16_tis"):
    assert f"dapo_aime:{variant}" in listed, variant
  assert "gspo" in listed["dapo_aime:local_gspo"]
  assert listed["grpo_process:local"].startswith("Process supervision")
