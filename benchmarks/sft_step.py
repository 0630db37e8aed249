"""One SFT step of the R1 recipe's cold start: rows padded to the length bucket vs to `sft.row_length`.

    python benchmarks/sft_step.py [--repeats 2] [--row-lengths 128,80]

SmolLM2-135M-Instruct on the 16 worked examples of
`configs/data/r1_cold_start_tiny.jsonl` as `configs/distill_local.py:r1`'s
cold start renders them (prompt 50 tokens, completion 20-22), one
`sft.sft_step` of `star.batch_size` = 16 rows (one micro-batch, remat
"dots", float32), at each row length: 128 is the power-of-two bucket the
fine-tune padded to before, the other `sft.row_length` (the longest,
rounded up to an eighth of its bucket). Per row length: the compile, the
fastest of --repeats steps (wall and CPU seconds) and, over the first row
length's, the ratio of the step's wall time and of XLA's flop count of the
compiled step (a property of the program, not of how busy the cores are;
only the ratio: XLA counts a scan's body, the layers, once). The
steps alternate between the row lengths (one train state, updated by
both), so load from other processes falls on both.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax

from benchmarks import _common
from configs import distill_local
from grpo_jax.harness import experiment, pipeline
from grpo_jax.star import loop, sft, sft_run

# pylint: enable=g-import-not-at-top,wrong-import-position


def cold_start_examples():
  """(the cold start's stage config, its SFT examples)."""
  config = pipeline.stage_configs(distill_local.get_config("r1"), "/tmp/unused")[0]
  problems, _ = experiment.load_examples(config)
  tokenizer = experiment.load_tokenizer(config)
  return config, sft_run.sft_examples(config, tokenizer, problems)


def flops(compiled) -> float:
  """XLA's flop count of a compiled program."""
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost).get("flops", float("nan"))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--row-lengths", default="")
  args = parser.parse_args()
  config, examples = cold_start_examples()
  lengths = [sft.example_length(e) for e in examples]
  row_lengths = ([int(x) for x in args.row_lengths.split(",")] if args.row_lengths
                 else [128, sft.row_length(examples)])
  rows = config.star.batch_size
  _common.print_header(__doc__.splitlines()[0], {
      "examples": f"{len(examples)}, {min(lengths)}-{max(lengths)} tokens",
      "rows per step": rows, "remat": config.model.remat,
      "row lengths": row_lengths}, 1)
  model_config, params = experiment.load_model(config)
  tunes, compiled = {}, {}
  for n in row_lengths:
    config.star.row_length = n
    tunes[n] = loop.tuning(config, model_config, params, examples, 100, 0, 0)
  state = loop.fresh_state(config, tunes[n], params, 0)   # one, for every length
  del params
  for n in row_lengths:
    batch = jax.tree.map(tunes[n].put, next(tunes[n].batches))
    t0 = time.perf_counter()
    compiled[n] = (sft.sft_step.lower(state, batch, tunes[n].program).compile(),
                   time.perf_counter() - t0)
  wall = {n: [] for n in row_lengths}
  cpu = {n: [] for n in row_lengths}
  for _ in range(args.repeats + 1):   # the first round warms up
    for n in row_lengths:
      t0, c0 = time.perf_counter(), time.process_time()
      state, _ = loop.tune_steps(tunes[n], state, 1)
      wall[n].append(time.perf_counter() - t0)
      cpu[n].append(time.process_time() - c0)
  first, table = row_lengths[0], []
  for n in row_lengths:
    best, best_cpu = min(wall[n][1:]), min(cpu[n][1:])
    table.append([n, f"{compiled[n][1]:.1f}", f"{best:.2f}", f"{best / rows:.3f}",
                  f"{best_cpu / rows:.3f}", f"{best / min(wall[first][1:]):.2f}",
                  f"{flops(compiled[n][0]) / flops(compiled[first][0]):.2f}"])
  _common.print_table(["row length", "compile s", "step s", "s/row",
                       "CPU s/row", "ratio (s)", "ratio (flops)"], table)


if __name__ == "__main__":
  main()
