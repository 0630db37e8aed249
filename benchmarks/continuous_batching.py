"""Useful tokens/s: the static sampler vs continuous batching, ragged lengths.

    python benchmarks/continuous_batching.py [--prompts 8] [--generations 8]
        [--new-tokens 256] [--slots 16,32] [--repeats 1] [--quick]

SmolLM2-135M-Instruct in float32 samples G completions of chat-templated
arithmetic prompts at temperature 1 with its own stop ids, so lengths are
the model's natural ones: long-tailed (most answers are short, a few run to
--new-tokens). The script prints their distribution (mean, p50, p90, max,
mean / max), then for the static sampler (`sampling.sample`: all rows
decode in lockstep until the longest ends) and for continuous batching with
each --slots count (`SamplingConfig(continuous_batching=True, slots=m)`):
wall seconds, decode steps, useful tokens/s (generated tokens up to and
including the stop token, divided by the wall time) and the ratio to the
static sampler. Both draw the same noise per (row, token), so they sample
the same completions (the script counts rows that differ: float rounding
of different matmul shapes can flip a near-tie).

Timing: every program runs once to compile (its compile time, from
jax.monitoring, is printed) and then --repeats times, the samplers
interleaved round by round so machine load hits them alike; the best of the
rounds is kept. The last line is `ratio: continuous <x> (slots <m>)` for
the best slot count.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import numpy as np

import _common
from grpo_jax import models, sampling
from grpo_jax import tokenizer as tok_lib
# pylint: enable=g-import-not-at-top,wrong-import-position


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=8, help="B prompts")
  p.add_argument("--generations", type=int, default=8, help="G per prompt")
  p.add_argument("--new-tokens", type=int, default=256,
                 help="max_new_tokens (the length cap)")
  p.add_argument("--slots", default="16,32",
                 help="comma-separated slot counts of continuous batching")
  p.add_argument("--levels", default="1,2,3,4,5",
                 help="arithmetic levels, cycled over the prompts")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--repeats", type=int, default=1,
                 help="timed rounds after the compile run (best is kept)")
  p.add_argument("--quick", action="store_true",
                 help="smoke check: 2 prompts x 4 generations x 32 tokens")
  args = p.parse_args(argv)
  if args.quick:
    args.prompts, args.generations, args.new_tokens, args.slots = 2, 4, 32, "4"
  return args


def length_line(length_n: np.ndarray, cap: int) -> str:
  return (f"lengths: mean {length_n.mean():.1f}, p50 {np.median(length_n):.0f},"
          f" p90 {np.percentile(length_n, 90):.0f}, max {length_n.max()}"
          f" (cap {cap}); mean / max = {length_n.mean() / length_n.max():.2f}")


def main(argv=None) -> int:
  args = parse_args(argv)
  B, G, T = args.prompts, args.generations, args.new_tokens
  slot_counts = _common.parse_ints(args.slots)
  _common.print_header("sampler: static vs continuous batching, ragged", {
      "model": f"{_common.MODEL} (float32)",
      "rows": f"{B} prompts x G={G} = {B * G}",
      "lengths": f"natural (the model's stop ids), at most {T} tokens",
      "sampling": "temperature 1.0, top_k 0, top_p 1.0",
      "prompts": f"arithmetic levels {args.levels}, seed {args.seed}, "
                 "last_number template + system prompt, chat template",
      "slots": ", ".join(map(str, slot_counts)),
      "timing": f"1 compile run + best of {args.repeats} interleaved rounds",
  }, _common.set_torch_threads(os.cpu_count()))
  config, params = models.load_pretrained(_common.MODEL)
  tok = tok_lib.load_tokenizer(_common.MODEL)
  examples = _common.arithmetic_examples(B, _common.parse_ints(args.levels),
                                         args.seed)
  prompts = [tok.encode(tok.apply_chat_template(_common.chat_messages(
      e.question))) for e in examples]
  static = sampling.SamplingConfig(
      max_new_tokens=T, temperature=1.0, stop_ids=tuple(tok.stop_ids),
      pad_id=tok.pad_id or 0)
  cfgs = {"static": static}
  for m in slot_counts:
    cfgs[f"continuous, {m} slots"] = dataclasses.replace(
        static, continuous_batching=True, slots=m)
  key = jax.random.key(args.seed)
  run = lambda cfg: jax.device_get(
      sampling.sample(config, params, prompts, key, cfg, G))

  clock = _common.CompileClock()
  outs, best = {}, {name: float("inf") for name in cfgs}
  for name, cfg in cfgs.items():
    mark = clock.mark()
    outs[name], first = _common.timed(lambda cfg=cfg: run(cfg))
    compiles, seconds = clock.since(mark)
    print(f"{name}: first call {first:.1f} s, of which {seconds:.1f} s "
          f"tracing + compiling ({compiles} compile(s))")
    sys.stdout.flush()
  for _ in range(args.repeats):
    for name, cfg in cfgs.items():
      mark = clock.mark()
      _, seconds = _common.timed(lambda cfg=cfg: run(cfg))
      if clock.since(mark)[0]:
        raise RuntimeError(f"{name}: a JAX compilation inside a timed run")
      best[name] = min(best[name], seconds)

  print("\n" + length_line(np.asarray(outs["static"].length_n), T))
  tok_s = {name: int(np.asarray(out.length_n).sum()) / best[name]
           for name, out in outs.items()}
  ratios = {name: tok_s[name] / tok_s["static"] for name in cfgs}
  rows = []
  for name, out in outs.items():
    differ = int(np.sum(np.any(np.asarray(out.tokens_nt)
                               != np.asarray(outs["static"].tokens_nt), 1)))
    rows.append((name, f"{best[name]:.1f}", int(out.steps),
                 f"{tok_s[name]:.1f}", f"{ratios[name]:.2f}x", differ))
  print()
  _common.print_table(("sampler", "wall (s)", "decode steps",
                       "useful tok/s", "vs static", "rows != static"), rows)
  del ratios["static"]
  top = max(ratios, key=ratios.get)
  print(f"\nratio: continuous {ratios[top]:.2f} ({top.split(', ')[1]})")
  return 0


if __name__ == "__main__":
  try:
    sys.exit(main())
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.exit(1)
