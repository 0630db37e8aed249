"""Code-reward throughput, and how much a hostile completion costs the
trainer, this checkout next to an older one.

One batch of MBPP-style completions (default 64: a quarter correct, a quarter
wrong, a quarter that raise, a quarter that loop forever), each against
three assert tests, scored by `code_reward` with its default parallelism
and `--timeout` seconds per run. `--before` is a directory holding another
checkout (e.g. a `git worktree` of an older commit) or a git revision,
exported with `git archive`; both run in fresh subprocesses, interleaved,
`--rounds` times each.

  python benchmarks/code_reward.py [--before DIR|REV] [--n 64] [--timeout 2]
      [--rounds 2] [--workers 0]
  python benchmarks/code_reward.py --stalls [--before DIR|REV]

Prints seconds per batch, completions per second, the ratio, and the mean
score of each kind (correct must be 1, the rest 0, in both).

`--stalls` scores one completion per probe of issue 30 (results that are
slow to rebuild or to compare: a set or dict of 40,000 ints that all hash
alike, written straight to the result pipe; multi-million-bit `%`, `*`,
`//`, `gcd`; 5 MB of junk lines), each once, after a warm-up completion, while
a thread of the scoring process sleeps 10 ms at a time, and prints the
longest gap that thread saw and the scoring process's own CPU seconds
(getrusage, all its threads; children not counted).
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


_STALLS = r"""
import json, resource, sys, threading, time
import numpy as np
from grpo_jax.rewards import code
M = 2**61 - 1  # k * M hashes to 0 for every k.
WRITE = ("import json, os\n"
         "line = json.dumps({'i': 0, 'v': VALUE}) + '\\n'\n"
         "for fd in range(3, 64):\n"
         "  try:\n"
         "    os.write(fd, line.encode())\n"
         "  except OSError:\n"
         "    pass\n"
         "def f():\n"
         "  return 0\n")
ints = "[{'i': format(k * %d, 'x')} for k in range(1, 40001)]" % M
big = ("def add(a, b):\n"
       "  return (1 << 3_000_000) + 3 if (a, b) == (1, 2) else (1 << 1_500_000) + 5\n")
dense = ("import random\n"
         "def add(a, b):\n"
         "  return random.Random(a).getrandbits(6_000_000)\n")
probes = {
    "set of colliding ints": (WRITE.replace("VALUE", "{'s': %s}" % ints),
                              "assert len(f()) == 40000"),
    "dict of colliding keys": (
        WRITE.replace("VALUE", "{'d': [[k, None] for k in %s]}" % ints),
        "assert len(f()) == 40000"),
    "big %": (big, "assert add(1, 2) % add(2, 1) == 3"),
    "big //": (big, "assert add(1, 2) // add(2, 1) == 3"),
    "big gcd": (big, "import math\nassert math.gcd(add(1, 2), add(2, 1)) == 3"),
    "big *": (dense, "assert add(1, 2) * add(2, 1) == 3"),
    "5 MB of junk lines": (
        "import os\njunk = b'x\\n' * (5 << 19)\n"
        "for fd in range(3, 64):\n"
        "  try:\n"
        "    os.write(fd, junk)\n"
        "  except OSError:\n"
        "    pass\n"
        "def f():\n"
        "  return 0\n", "assert f() == 1"),
}

def score(program, test):
  return code.code_reward(None, ["```python\n" + program + "\n```"], [[test]],
                          np.ones(1), timeout=30.0)[0]

score("def f():\n  return 1", "assert f() == 1")  # Warm-up: start-up costs.
out = {}
for name, (program, test) in probes.items():
  gaps, stop = [0.0], threading.Event()
  def beat():
    last = time.perf_counter()
    while not stop.is_set():
      time.sleep(0.01)
      now = time.perf_counter()
      gaps[0], last = max(gaps[0], now - last), now
  thread = threading.Thread(target=beat)
  before = resource.getrusage(resource.RUSAGE_SELF)
  thread.start()
  got = score(program, test)
  stop.set()
  thread.join()
  after = resource.getrusage(resource.RUSAGE_SELF)
  cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
  out[name] = {"gap": gaps[0], "cpu": cpu, "score": float(got)}
print(json.dumps(out))
"""


def _stalls(path: str) -> dict:
  out = subprocess.run([sys.executable, "-c", _STALLS], cwd=path,
                       capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": path}, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _time(path: str, n: int, timeout: float, workers: int) -> dict:
  out = subprocess.run([sys.executable, "-c", _TIMING, str(n), str(timeout),
                        str(workers)], cwd=path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": path}, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--before", default="ce314ec",
                      help="a directory holding the checkout to compare with, "
                           "or a git revision (default: the last commit with "
                           "the old sandbox)")
  parser.add_argument("--stalls", action="store_true",
                      help="the trainer's longest pause and CPU per hostile "
                           "completion instead of throughput")
  parser.add_argument("--n", type=int, default=64)
  parser.add_argument("--timeout", type=float, default=2.0)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--workers", type=int, default=0,
                      help="max_parallel for both (0: each one's default)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as old:
    if os.path.isdir(args.before):
      old = os.path.abspath(args.before)
    else:
      archive = subprocess.run(["git", "archive", args.before, "grpo_jax"],
                               cwd=REPO, capture_output=True, check=True).stdout
      subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
    if args.stalls:
      _print_stalls(args.before, _stalls(old), _stalls(REPO))
      return
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


def _print_stalls(before_name: str, before: dict, after: dict) -> None:
  print("one hostile completion each; the scoring process's longest pause "
        "(10 ms heartbeat) and own CPU seconds; its score")
  print(f"{'probe':<24} {'before (' + before_name + ')':>30} "
        f"{'after (this checkout)':>30}")
  cell = lambda r: f"{r['gap'] * 1e3:8.0f} ms {r['cpu']:6.2f} s  {r['score']:.0f}"
  for name in after:
    print(f"{name:<24} {cell(before[name]):>30} {cell(after[name]):>30}")


if __name__ == "__main__":
  main()
