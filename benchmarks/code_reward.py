"""Code-reward throughput: this checkout next to an older revision.

One batch of MBPP-style completions (default 64: a quarter correct, a quarter
wrong, a quarter that raise, a quarter that loop forever), each against
three assert tests, scored by `code_reward` with its default parallelism
and `--timeout` seconds per run. The older revision is exported with
`git archive` into a temporary folder; both run in fresh subprocesses,
interleaved, `--rounds` times each.

  python benchmarks/code_reward.py [--before ce314ec] [--n 64] [--timeout 2]
      [--rounds 2] [--workers 0]

Prints seconds per batch, completions per second, the ratio, and the mean
score of each kind (correct must be 1, the rest 0, in both).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TIMING = r"""
import json, sys, time
import numpy as np
from grpo_jax.rewards import code
n, timeout, workers = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
tests = ["assert fib(0) == 0", "assert fib(10) == 55", "assert fib(20) == 6765"]
programs = {
    "correct": "def fib(n):\n  a, b = 0, 1\n  for _ in range(n):\n    a, b = b, a + b\n  return a",
    "wrong": "def fib(n):\n  return n + 1",
    "raises": "def fib(n):\n  return fib(n - 1) + fib(n - 2)",
    "loops": "def fib(n):\n  while True:\n    n += 1",
}
kinds = [list(programs)[i % 4] for i in range(n)]
completions = ["```python\n" + programs[k] + "\n```" for k in kinds]
kwargs = {"timeout": timeout}
if workers:
  kwargs["max_parallel"] = workers
start = time.perf_counter()
scores = code.code_reward(None, completions, [tests] * n, np.ones(n), **kwargs)
seconds = time.perf_counter() - start
means = {k: float(np.mean([s for s, kk in zip(scores, kinds) if kk == k]))
         for k in programs}
print(json.dumps({"seconds": seconds, "means": means}))
"""


def _time(path: str, n: int, timeout: float, workers: int) -> dict:
  out = subprocess.run([sys.executable, "-c", _TIMING, str(n), str(timeout),
                        str(workers)], cwd=path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": path}, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--before", default="ce314ec",
                      help="git revision to compare with (default: the last "
                           "commit with the old sandbox)")
  parser.add_argument("--n", type=int, default=64)
  parser.add_argument("--timeout", type=float, default=2.0)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--workers", type=int, default=0,
                      help="max_parallel for both (0: each one's default)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as old:
    archive = subprocess.run(["git", "archive", args.before, "grpo_jax"],
                             cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
    results = {"before": [], "after": []}
    for _ in range(args.rounds):
      results["before"].append(_time(old, args.n, args.timeout, args.workers))
      results["after"].append(_time(REPO, args.n, args.timeout, args.workers))
  print(f"{args.n} completions (1/4 correct, wrong, raising, looping), "
        f"timeout {args.timeout} s, workers {args.workers or 'default'}")
  for name, runs in results.items():
    seconds = [r["seconds"] for r in runs]
    rates = " / ".join(f"{args.n / s:.1f}" for s in seconds)
    print(f"{name:>6} ({args.before if name == 'before' else 'this checkout'}):"
          f" {' / '.join(f'{s:.1f}' for s in seconds)} s per batch, "
          f"{rates} completions/s, mean score by kind {runs[-1]['means']}")
  ratio = [b["seconds"] / a["seconds"]
           for b, a in zip(results["before"], results["after"])]
  print("speed-up (before seconds / after seconds): "
        + " / ".join(f"{r:.2f}" for r in ratio))


if __name__ == "__main__":
  main()
