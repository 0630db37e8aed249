"""The sampler, ragged and update benchmarks on one accelerator, with the
achieved HBM bandwidth and MFU (run by benchmarks/accelerator.sh).

    python benchmarks/accelerator.py [--dry-run] [--dtype bfloat16]
        [--prompts 16] [--generations 8] [--new-tokens 256]

Three parts, each compiled by a first call and timed on the second:

  sampler   the static sampler, EOS off: B*G rows x T tokens in lockstep
            (`sampling.sample`). tokens/s = B*G*T / s; HBM bytes: every
            decode step reads the weights and every row's KV cache up to
            its length (`aot.flops.decode_bytes_per_chip`); FLOPs:
            `aot.flops.sampler_flops`.
  ragged    ragged lengths, EOS on: the static sampler, continuous batching
            on dense slots and on pages (`sampling.kv_cache`). With the
            bundled SmolLM2 weights the lengths are the model's own; with
            random weights (no weights package on the machine, or
            --dry-run) a stop set of V * 1 / (0.3 T) token ids makes each
            token stop with that chance, so lengths are geometric with a
            mean of about 0.3 of the cap. useful tokens/s = tokens through
            each row's stop / s; FLOPs: the useful tokens' forward; HBM:
            decode steps x weight bytes (a lower bound: KV reads aside).
  update    one optimizer update (`update.update_step`, AdamW) on B*G
            random rows of P + T tokens, one micro-batch; tokens/s = rows x
            (P + T) / s; FLOPs: `aot.flops.update_flops`; HBM: the compiled
            program's `cost_analysis()` bytes accessed.

MFU = FLOPs / s / the chip's peak dense bf16 FLOP/s; HBM GB/s = bytes / s
(peaks: PEAKS, by `jax.devices()[0].device_kind`; none on CPU). --dry-run:
the tiny model, 2 prompts x 2 x 8 tokens, on whatever backend is there
(CPU here), to check the script end to end.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import config as config_lib
from grpo_jax.aot import flops
from grpo_jax.generate import sampling
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import loading, transformer
from grpo_jax.rl import update

# pylint: enable=g-import-not-at-top,wrong-import-position

# device_kind substring -> (peak dense bf16 FLOP/s, HBM bytes/s), vendors'
# figures per chip.
PEAKS = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12),
    "v5 lite": (197e12, 0.82e12),       # v5e
    "v5e": (197e12, 0.82e12),
    "v5p": (459e12, 2.76e12),
    "v6 lite": (918e12, 1.64e12),       # v6e (Trillium)
    "v6e": (918e12, 1.64e12),
}
MODEL = "smollm2-135m-instruct"
MEAN_FRACTION = 0.3          # random weights: mean length / cap


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dry-run", action="store_true",
                 help="tiny model, a few steps, any backend (CPU)")
  p.add_argument("--model", default=MODEL)
  p.add_argument("--dtype", default="bfloat16", help="weights and KV dtype")
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--generations", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=64)
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.dry_run:
    args.model, args.prompts, args.generations = "tiny", 2, 2
    args.prompt_len, args.new_tokens = 8, 8
  return args


def peaks(kind: str):
  """(FLOP/s, bytes/s) of the device kind, or (None, None)."""
  for name, peak in PEAKS.items():
    if name.lower() in kind.lower():
      return peak
  return None, None


def weights(args):
  """(model_config, params, real): the bundled weights where their package
  is installed, else random weights of the preset's shapes."""
  if args.model == MODEL and not args.dry_run:
    try:
      c, params = loading.load_pretrained(MODEL, dtype=jnp.dtype(args.dtype))
      return c, params, True
    except Exception as e:  # pylint: disable=broad-except
      print(f"note: no bundled weights ({type(e).__name__}: {e}); random "
            "weights of the same shapes")
  c = model_config_lib.get_preset(args.model)
  params = transformer.cast(transformer.init_params(c, jax.random.key(0)),
                            args.dtype)
  return c, params, False


def prompts_for(args, c) -> list[list[int]]:
  rng = np.random.default_rng(args.seed)
  lengths = rng.integers(args.prompt_len // 2, args.prompt_len + 1,
                         args.prompts)
  return [list(rng.integers(1, c.vocab_size, n)) for n in lengths]


def second_call(fn):
  """(result, seconds) of fn's second call (the first compiles)."""
  jax.block_until_ready(fn())
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def weight_bytes(params) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def report(name: str, tokens: float, seconds: float, flop: float,
           bytes_: float, peak) -> dict:
  peak_flops, peak_bw = peak
  row = {"part": name, "seconds": seconds, "tokens_per_s": tokens / seconds,
         "tflops": flop / seconds / 1e12, "hbm_gbs": bytes_ / seconds / 1e9}
  mfu = f"{100 * flop / seconds / peak_flops:.1f}%" if peak_flops else "-"
  bw = f"{100 * bytes_ / seconds / peak_bw:.0f}% of peak" if peak_bw else "-"
  print(f"{name}: {seconds:.2f} s, {row['tokens_per_s']:,.0f} tok/s, "
        f"{row['tflops']:.2f} TFLOP/s (MFU {mfu}), HBM "
        f"{row['hbm_gbs']:,.0f} GB/s ({bw})")
  sys.stdout.flush()
  return row


def sampler_part(args, c, params, prompts, peak) -> dict:
  B, G, T = args.prompts, args.generations, args.new_tokens
  P = sampling.bucket(max(map(len, prompts)))
  cfg = sampling.SamplingConfig(max_new_tokens=T, stop_ids=())
  run = lambda: sampling.sample(c, params, prompts, jax.random.key(1), cfg, G)
  _, seconds = second_call(run)
  item = jnp.dtype(args.dtype).itemsize
  bytes_ = flops.decode_bytes_per_chip(c, B * G, c.num_kv_heads, P, T,
                                       weight_bytes(params), item)
  return report("sampler (static, EOS off)", B * G * T, seconds,
                flops.sampler_flops(c, flops.StepShape(B, G, P, T)), bytes_,
                peak)


def stop_set(c, T: int) -> tuple:
  """Token ids whose union has chance 1 / (MEAN_FRACTION * T) per token
  under a near-uniform (random-weight) next-token distribution."""
  k = max(1, round(c.vocab_size / (MEAN_FRACTION * T)))
  return tuple(range(c.vocab_size - k, c.vocab_size))


def ragged_part(args, c, params, prompts, real: bool, peak) -> list:
  G, T = args.generations, args.new_tokens
  P = sampling.bucket(max(map(len, prompts)))
  stops = (2,) if real else stop_set(c, T)       # SmolLM2's <|im_end|>: 2
  base = sampling.SamplingConfig(max_new_tokens=T, stop_ids=stops)
  kinds = {"static": base,
           "continuous dense": dataclasses.replace(
               base, continuous_batching=True),
           "continuous paged": dataclasses.replace(
               base, continuous_batching=True, kv_cache="paged")}
  rows, static = [], None
  for name, cfg in kinds.items():
    run = lambda cfg=cfg: sampling.sample(c, params, prompts,
                                          jax.random.key(2), cfg, G)
    out, seconds = second_call(run)
    lengths = np.asarray(out.length_n)
    useful = float(lengths.sum())
    pairs = sum(flops.causal_pairs(int(n), P) for n in lengths)
    flop = flops.forward_flops(c, useful, useful, pairs)
    bytes_ = int(out.steps) * weight_bytes(params)
    row = report(f"ragged {name} (EOS on, mean length "
                 f"{lengths.mean() / T:.2f} of the cap, {int(out.steps)} "
                 "steps)", useful, seconds, flop, bytes_, peak)
    static = static or row["tokens_per_s"]
    print(f"  {name} / static useful tokens/s: "
          f"{row['tokens_per_s'] / static:.2f}x")
    rows.append(row)
  return rows


def update_part(args, c, params, peak) -> dict:
  B, G, T = args.prompts, args.generations, args.new_tokens
  P, N = args.prompt_len, args.prompts * args.generations
  S = P + T
  rng = np.random.default_rng(args.seed)
  batch = update.UpdateBatch(
      tokens_ns=jnp.asarray(rng.integers(1, c.vocab_size, (N, S)), jnp.int32),
      positions_ns=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (N, S)),
      valid_ns=jnp.ones((N, S), bool), mask_nt=jnp.ones((N, T), jnp.float32),
      old_logp_nt=jnp.full((N, T), -1.0), ref_logp_nt=jnp.zeros((N, T)),
      adv_n=jnp.asarray(rng.normal(size=N), jnp.float32))
  config = config_lib.base_config()
  config.model.compute_dtype = args.dtype
  loss = update.LossSettings.from_config(config)
  optimizer = optax.adamw(1e-6)
  program = update.UpdateProgram(c, loss, optimizer)
  state = [update.init_state(transformer.cast(params, "float32"), optimizer,
                             0)]

  def run():
    state[0], metrics = update.update_step(state[0], batch, program)
    return metrics["loss"]
  _, seconds = second_call(run)
  compiled = update.update_step.lower(state[0], batch, program).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flop = flops.update_flops(c, flops.StepShape(B, G, P, T), loss.remat,
                            shared_prompt=False)
  return report("update (one AdamW step, one micro-batch)", N * S, seconds,
                flop, float(cost.get("bytes accessed", 0.0)), peak)


def main(argv=None) -> int:
  args = parse_args(argv)
  t0 = time.perf_counter()
  device = jax.devices()[0]
  peak = peaks(device.device_kind)
  c, params, real = weights(args)
  print(f"# accelerator benchmarks: {device.device_kind} "
        f"({jax.default_backend()}, {jax.device_count()} device(s)), jax "
        f"{jax.__version__}; {args.model} in {args.dtype} "
        f"({'bundled' if real else 'random'} weights); {args.prompts} prompts "
        f"x G={args.generations}, prompts <= {args.prompt_len} tokens, "
        f"<= {args.new_tokens} new; peak "
        f"{peak[0] / 1e12 if peak[0] else '-'} TFLOP/s, "
        f"{peak[1] / 1e9 if peak[1] else '-'} GB/s")
  prompts = prompts_for(args, c)
  sampler_part(args, c, params, prompts, peak)
  ragged_part(args, c, params, prompts, real, peak)
  update_part(args, c, params, peak)
  print(f"total {time.perf_counter() - t0:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
