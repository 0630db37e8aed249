"""Asynchronous rollouts on this CPU: step time at k = 1 against k = 0.

    python benchmarks/async_rollouts.py [--prompts 2] [--generations 4]
        [--new-tokens 64] [--steps 4] [--warmup 1]
        [--micro-batch 4]

The ragged workload of benchmarks/ragged.py (configs/dapo_aime.py:local on
SmolLM2-135M-Instruct, float32, continuous batching, chat-templated
arithmetic of levels 1-5: completion lengths with a long tail) scored by
the real verifier (the `math` reward: grpo_jax.rewards.math's worker pool)
plus DAPO's overlong punishment, trained by `train.run` for --steps steps
in four configurations, each in its own process:

  colocated k=0   sampler and trainer share one CPU device, synchronous
  colocated k=1   the same device, a sampler thread one version ahead
  split k=0       2 fake CPU devices: one samples, one trains; synchronous
  split k=1       the same split, one version ahead

All four run the decoupled objective (rl.old_logp = recompute, token TIS),
which k = 1 needs, so each step does the same work whatever k. Reported,
as means over the steps after --warmup (the first compiles): time/step
(the trainer's step, its wait for rows included), the sampler's own
seconds (sample: device work and detokenising; score: the verifier, on the
host), the trainer's π_old recompute and update seconds, the trainer's and
the sampler's idle fractions, the weight sync's seconds, the mean
completion length, sampler compilations inside the timed steps (0 means
none was timed), each variant's wall-clock seconds (start-up and compiles
included) and its peak RSS. The last line is `ratios: colocated <x>,
split <y>`: k=0 / k=1 step seconds (above 1: the overlap pays).

On 2 shared cores the devices are one thread pool: device work does not get
faster by being split, so what k = 1 can hide here is host work (the
verifier's workers, detokenising, dynamic sampling's bookkeeping) and the
gaps between dispatches, under the other side's device work.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name: (fake CPU devices, config.rollout fields). Every program runs on one
# device, so the four do the same device work. (Colocated over 2 devices,
# data parallel, holds the parameters and Adam state on each: such a run
# reached 9.5 GB RSS at B=2, G=4.)
VARIANTS = {
    "colocated k=0": (1, dict(sampler_devices=0, max_staleness=0)),
    "colocated k=1": (1, dict(sampler_devices=0, max_staleness=1)),
    "split k=0": (2, dict(sampler_devices=1, max_staleness=0)),
    "split k=1": (2, dict(sampler_devices=1, max_staleness=1)),
}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  # The defaults: the four variants in ~10 min on one core, under 4 GB each.
  p.add_argument("--prompts", type=int, default=2)
  p.add_argument("--generations", type=int, default=4)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--micro-batch", type=int, default=4,
                 help="rows per micro-batch (the update's memory)")
  p.add_argument("--only", default="", help="one variant's name")
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def config(args, variant: dict):
  """configs/dapo_aime.py:local at the benchmark's sizes, levels 1-5."""
  from configs import dapo_aime  # pylint: disable=import-outside-toplevel
  c = dapo_aime.get_config("local")
  c.data.kwargs = dict(num_examples=400, levels=5, seed=0)
  c.sampling.max_new_tokens = args.new_tokens
  c.sampling.continuous_batching = True
  c.rl.prompts_per_step, c.rl.num_generations = args.prompts, args.generations
  c.rl.micro_batch_size = min(args.micro_batch, args.prompts * args.generations)
  c.rewards = {"math": 1.0, "overlong": 1.0}
  c.reward_kwargs = {"overlong": dict(max_length=args.new_tokens,
                                      cache_length=args.new_tokens // 4)}
  c.accuracy_reward = "math"
  c.rl.old_logp = "recompute"
  c.rl.rollout_correction.is_level = "token"
  c.train.update(steps=args.steps, eval_at_start=False, eval_at_end=False,
                 progress=False, plot=False)
  c.rollout.update(**variant)
  return c


def child(args) -> None:
  """One variant's run (in a process whose device count is fixed)."""
  from grpo_jax.harness import metrics  # pylint: disable=import-outside-toplevel
  from grpo_jax.rl import train  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as workdir:
    train.run(config(args, VARIANTS[args.child][1]), workdir)
    rows = [r for r in metrics.read_jsonl(os.path.join(workdir,
                                                       "metrics.jsonl"))
            if "loss" in r]
  peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  print("RESULT " + json.dumps({"rows": rows, "peak_gb": peak_gb}), flush=True)


def run_variant(args, name: str) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count="
             f"{VARIANTS[name][0]}")
  cmd = [sys.executable, os.path.abspath(__file__), "--child", name,
         "--prompts", str(args.prompts), "--generations",
         str(args.generations), "--new-tokens", str(args.new_tokens),
         "--steps", str(args.steps),
         "--micro-batch", str(args.micro_batch)]
  proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True,
                        text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise RuntimeError(f"{name} failed (exit {proc.returncode}; -9: killed, "
                       f"e.g. out of memory):\n{proc.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT "):])


def _mean(rows, key):
  values = [r[key] for r in rows if key in r]
  return sum(values) / len(values) if values else float("nan")


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.child:
    child(args)
    return 0
  print(f"# async_rollouts: B={args.prompts} G={args.generations} "
        f"cap={args.new_tokens} micro-batch={args.micro_batch} "
        f"steps={args.steps} (mean over steps > "
        f"{args.warmup}), "
        f"{os.cpu_count()} cores visible, affinity "
        f"{sorted(os.sched_getaffinity(0))}")
  names = [args.only] if args.only else list(VARIANTS)
  step_s = {}
  print(f"{'variant':<15} {'step s':>7} {'sample s':>8} {'score s':>7} "
        f"{'pi_old s':>8} {'update s':>8} {'trainer idle':>12} "
        f"{'sampler idle':>12} {'sync s':>7} {'resp len':>8} "
        f"{'recompiles':>10} {'wall s':>7} {'peak GB':>7}")
  for name in names:
    t0 = time.perf_counter()
    result = run_variant(args, name)
    wall, all_rows = time.perf_counter() - t0, result["rows"]
    rows = all_rows[args.warmup:]
    # sampler compilations inside the timed steps (0: none timed)
    recompiles = (all_rows[-1].get("sampler/compilations", 0)
                  - all_rows[args.warmup - 1].get("sampler/compilations", 0)
                  if args.warmup else float("nan"))
    step_s[name] = _mean(rows, "time/step")
    print(f"{name:<15} {step_s[name]:>7.2f} {_mean(rows, 'time/sample'):>8.2f}"
          f" {_mean(rows, 'time/score'):>7.2f}"
          f" {_mean(rows, 'time/reference'):>8.2f}"
          f" {_mean(rows, 'time/update'):>8.2f}"
          f" {_mean(rows, 'time/trainer_idle_fraction'):>12.2f}"
          f" {_mean(rows, 'time/sampler_idle_fraction'):>12.2f}"
          f" {_mean(rows, 'sync/seconds'):>7.3f}"
          f" {_mean(rows, 'response_length/mean'):>8.1f}"
          f" {recompiles:>10g} {wall:>7.0f} {result['peak_gb']:>7.2f}",
          flush=True)
  if len(step_s) == len(VARIANTS):
    ratio = lambda a, b: step_s[a] / step_s[b]
    print(f"ratios: colocated {ratio('colocated k=0', 'colocated k=1'):.2f}, "
          f"split {ratio('split k=0', 'split k=1'):.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
