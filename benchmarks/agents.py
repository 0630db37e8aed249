"""Multi-turn episodes with slow tools: the parked engine vs the per-turn path.

    python benchmarks/agents.py [--prompts 4] [--generations 4] [--turns 4]
        [--new-tokens 64] [--stops 8] [--tool-mean 0.5] [--tool-sigma 1.0]
        [--slots 0] [--seeds 0,1,2]

The tiny preset (random weights, byte tokenizer), temperature 1, so a turn
ends at one of --stops stop ids (a geometric length, mean 256 / stops, cut
at --new-tokens). Each episode runs --turns model turns: after each of the
first turns - 1 the env sleeps a lognormal latency (mean --tool-mean s,
log-sigma --tool-sigma: at the defaults 3% of calls over 2 s) and
answers with a short observation; after the last it ends at once. Row i's
k-th call sleeps the same draw on both sides (seeded by (seed, i, k)); the
seed is the sampling key's too.

Side by side, the same sampler settings (paged continuous batching):
  turns    env.engine "turns": a sampler call per turn for the whole batch,
           each row's history prefilled again, the turn waiting for the
           batch's slowest tool (generate/agent.py);
  parked   env.engine "parked": rows leave their slots with their pages
           while their tool runs, the others keep decoding, only the
           observation is prefilled when a row comes back
           (generate/agent_parked.py).
For each latency seed, each runs once to compile (the same key and draws:
the per-turn path then meets no new shape), then once timed; a
compilation inside a timed run (the parked engine's prefill shapes depend
on how many rows come back together) is counted and its seconds
excluded. Useful tokens: the model's tokens (observations excluded). A
batch ends with its slowest episode, so the parked engine's gain is
bounded by the tail of the sums of a row's latencies, the per-turn path's
by the sum of each turn's slowest; more turns or rows widen the gap. The
last line is `ratios: parked_vs_turns <x>` (useful tokens/s over all
seeds, parked / turns).
"""
from __future__ import annotations

import argparse
import itertools
import time

import _common  # noqa: F401  (sys.path, registrations)
import jax
import numpy as np

from grpo_jax import registry
from grpo_jax.data.example import Example
from grpo_jax.envs import base
from grpo_jax.generate import agent, agent_parked, sampling
from grpo_jax.models import get_preset, init_params
from grpo_jax.models.byte_tokenizer import byte_tokenizer

_ids = itertools.count()


@registry.register("env", "benchmark_latency")
class Latency:
  """A tool of lognormal latency: the episode's calls sleep draws fixed by
  (seed, episode, call); `turns - 1` observations, then Done at once."""

  def __init__(self, timeout_s: float = 30.0, turns: int = 4,
               mean_s: float = 0.5, sigma: float = 1.0, seed: int = 0):
    self.episode, self.turns, self.calls = next(_ids), turns, 0
    self.mu = np.log(mean_s) - sigma ** 2 / 2     # E[lognormal] = mean_s
    self.sigma, self.seed = sigma, seed
    self.slept = []

  def initial_messages(self, example):
    return [{"role": "user", "content": example.question}]

  def step(self, turn_text, turn_ids):
    self.calls += 1
    if self.calls >= self.turns:
      return base.Done()
    rng = np.random.default_rng((self.seed, self.episode, self.calls))
    delay = float(rng.lognormal(self.mu, self.sigma))
    self.slept.append(delay)
    time.sleep(delay)
    return base.Observation(f"result {self.calls}: {len(turn_ids)}")


def _run(engine: str, sampler, params, examples, args, stats=None):
  global _ids
  _ids = itertools.count()          # episode i draws the same on both sides
  spec = base.EnvSpec(
      "benchmark_latency", max_turns=args.turns, max_observation_tokens=32,
      tool_timeout_s=30.0, engine=engine,
      kwargs=(("mean_s", args.tool_mean), ("seed", args.seed),
              ("sigma", args.tool_sigma), ("turns", args.turns)))
  run = agent_parked.run_episodes if engine == "parked" else agent.run_episodes
  kw = {"stats": stats} if engine == "parked" else {}
  t0 = time.perf_counter()
  ep = run(sampler, params, byte_tokenizer(), examples,
           jax.random.key(args.seed), args.generations, spec, **kw)
  return ep, time.perf_counter() - t0


def turns_prefilled(ep) -> int:
  """Tokens the per-turn path prefills: each prompt once (its G rows share
  it), then at each later turn every live row's whole history."""
  total = sum(len(p) for p in ep.prompt_ids)
  G = len(ep.length_n) // len(ep.prompt_ids)
  for i in range(len(ep.length_n)):
    act, obs = ep.action_nt[i], ep.observation_nt[i]
    starts = np.nonzero(act[1:] & obs[:-1])[0] + 1     # turns k >= 1
    total += int(np.sum(len(ep.prompt_ids[i // G]) + starts))
  return total


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--generations", type=int, default=4)
  p.add_argument("--turns", type=int, default=4)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--stops", type=int, default=8)
  p.add_argument("--tool-mean", type=float, default=0.5)
  p.add_argument("--tool-sigma", type=float, default=1.0)
  p.add_argument("--slots", type=int, default=0)
  p.add_argument("--seeds", type=_common.parse_ints, default=[0, 1, 2])
  args = p.parse_args()
  _common.print_header("agents: parked engine vs per-turn path",
                       vars(args), _common.set_torch_threads(1))
  config = get_preset("tiny")
  params = init_params(config, jax.random.key(0))
  stops = tuple(range(0, 256, 256 // args.stops))[:args.stops]
  sampler = sampling.Sampler(config, sampling.SamplingConfig(
      max_new_tokens=args.new_tokens, temperature=1.0, stop_ids=stops,
      pad_id=1, continuous_batching=True, kv_cache="paged", slots=args.slots))
  examples = [Example(f"question {i}: {i} * {i + 3} = ?", "")
              for i in range(args.prompts)]
  engines = ("turns", "parked")
  total = {e: [0, 0.0, 0.0] for e in engines}   # tokens, seconds, compile s
  rows, clock = [], _common.CompileClock()
  for seed in args.seeds:
    args.seed = seed
    for engine in engines:
      _run(engine, sampler, params, examples, args)         # compile
      mark, stats = clock.mark(), {}
      ep, seconds = _run(engine, sampler, params, examples, args, stats)
      compiles, compile_s = clock.since(mark)
      tokens = int(ep.action_nt.sum())
      for i, x in enumerate((tokens, seconds, compile_s)):
        total[engine][i] += x
      rows.append([seed, engine, tokens, seconds - compile_s,
                   tokens / (seconds - compile_s), float(ep.turns_n.mean()),
                   compiles, stats.get("decode_steps"),
                   stats.get("prefilled", turns_prefilled(ep))])
  _common.print_table(
      ["seed", "engine", "useful tokens", "seconds", "tokens/s",
       "turns/episode", "compiles (s excluded)", "decode steps", "prefilled"],
      rows)
  rate = {e: t / (s - c) for e, (t, s, c) in total.items()}
  print("all seeds: " + ", ".join(f"{e} {rate[e]:.0f} tokens/s"
                                  for e in engines))
  print(f"ratios: parked_vs_turns "
        f"{_common.ratio(rate['parked'], rate['turns'], True)}")


if __name__ == "__main__":
  main()
