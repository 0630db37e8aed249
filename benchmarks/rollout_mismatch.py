"""Sampler vs trainer log-prob mismatch on SmolLM2-135M-Instruct.

The same completions, sampled by our jitted sampler with the weights in one
dtype, scored by the trainer's log-prob program in another: the rollout
correction's statistics (algorithms/rollout_correction.py) per pair, with
ρ_t = π_trainer / π_sampler on every completion token.

    python benchmarks/rollout_mismatch.py            # 32 prompts x G=8, 64 tokens

Columns: ρ mean / min / max over tokens; max |Δ log p|; KL(π_sampler ‖
π_trainer) by k1 and k3 (token means); the range of the sequence log-ratio
Σ_t log ρ_t; fractions of tokens a correction would touch: ρ_t > 2 (token
TIS at C = 2 truncates), ρ_t outside IcePop's [0.5, 5]; fraction of
sequences with ρ_seq > 2 and with mean k3 > 0.01 (rejected by that rule).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

from configs import dapo_aime
from grpo_jax import models
from grpo_jax.algorithms import rollout_correction
from grpo_jax.generate import rollout, sampling
from grpo_jax.harness import experiment
from grpo_jax.rl import update
from grpo_jax.rl.batch import to_rows

PAIRS = (("float32", "float32"), ("bfloat16", "float32"),
         ("bfloat16", "bfloat16"))


def mismatch_row(trainer_nt, sampler_nt, mask_nt) -> dict[str, float]:
  """The correction's metrics plus the fractions a correction would touch."""
  s = rollout_correction.CorrectionSettings()
  _, _, m = rollout_correction.correct(trainer_nt, sampler_nt, mask_nt, s)
  mask = np.asarray(mask_nt, bool)
  log_rho = np.where(mask, np.asarray(trainer_nt) - np.asarray(sampler_nt), 0)
  rho = np.exp(log_rho)
  rows = mask.any(axis=1)
  k3_seq = ((rho - 1 - log_rho) * mask).sum(1) / np.maximum(mask.sum(1), 1)
  return {
      "tokens": int(mask.sum()),
      "rho_mean": float(m["rollout_is/ratio/mean"]),
      "rho_min": float(m["rollout_is/ratio/min"]),
      "rho_max": float(m["rollout_is/ratio/max"]),
      "max_abs_dlogp": float(m["rollout_logp_diff/max"]),
      "k1": float(m["rollout_kl/k1"]),
      "k3": float(m["rollout_kl/k3"]),
      "seq_log_rho_min": float(m["rollout_is/seq_log_ratio/min"]),
      "seq_log_rho_max": float(m["rollout_is/seq_log_ratio/max"]),
      "tok_rho_gt_2": float((rho > 2)[mask].mean()),
      "tok_outside_band": float(((rho < 0.5) | (rho > 5))[mask].mean()),
      "seq_rho_gt_2": float((log_rho.sum(1) > np.log(2))[rows].mean()),
      "seq_k3_gt_0.01": float((k3_seq > 0.01)[rows].mean()),
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=32)
  ap.add_argument("--generations", type=int, default=8)
  ap.add_argument("--max_new_tokens", type=int, default=64)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()

  config = dapo_aime.get_config("local")
  config.sampling.max_new_tokens = args.max_new_tokens
  model_config, params, tokenizer = experiment.load_model_and_tokenizer(config)
  examples = experiment.load_examples(config)[0][:args.prompts]
  spec = rollout.RewardSpec.from_config(config)
  cfg = experiment.sampling_config(config, tokenizer)
  samples = {}
  for dtype in sorted({s for s, _ in PAIRS}):
    t0 = time.perf_counter()
    batch, _ = rollout.generate_groups(
        sampling.Sampler(model_config, cfg), models.cast(params, dtype),
        tokenizer, examples, jax.random.key(args.seed),
        rollout.GroupSettings(args.generations, spec, config.data.template,
                              config.data.system_prompt))
    samples[dtype] = to_rows(batch, tokenizer.pad_id or 0, False)
    print(f"sampled {args.prompts}x{args.generations} in {dtype}: "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
  rows = []
  for sampler_dtype, trainer_dtype in PAIRS:
    sampled = samples[sampler_dtype]
    loss = update.LossSettings.from_config(config)
    loss = dataclasses.replace(loss, compute_dtype=trainer_dtype)
    trainer_nt = update.score_logprobs(
        update.Policy(params), update.UpdateBatch(
            jnp.asarray(sampled.tokens_ns), jnp.asarray(sampled.positions_ns),
            jnp.asarray(sampled.valid_ns)),
        update.UpdateProgram(model_config, loss,
                             logp_shape=sampled.mask_nt.shape))
    rows.append((sampler_dtype, trainer_dtype,
                 mismatch_row(trainer_nt, jnp.asarray(sampled.old_logp_nt),
                              jnp.asarray(sampled.mask_nt))))
  keys = list(rows[0][2])
  print(f"\nSmolLM2-135M-Instruct, {args.prompts} arithmetic prompts x "
        f"G={args.generations}, <= {args.max_new_tokens} tokens, T=1.0; "
        f"ρ = π_trainer / π_sampler per token\n")
  print("| sampler | trainer | " + " | ".join(keys) + " |")
  print("|---" * (len(keys) + 2) + "|")
  for s, t, r in rows:
    cells = [f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k])
             for k in keys]
    print(f"| {s} | {t} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
