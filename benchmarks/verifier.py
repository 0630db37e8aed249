"""Verifications per second: grpo_jax's verifier next to plain math-verify.

Both score the same 1,000 synthetic model-style solutions (a few hundred to a
few thousand characters of chain of thought ending in a boxed answer, an
`Answer:` line or "the answer is"; about half right in the gold's own form,
a quarter right in another form, a quarter wrong). The "= label" column
counts verdicts that agree with how each solution was built.

  python benchmarks/verifier.py [--n 1000] [--workers 0] [--timeout 5]
  python benchmarks/verifier.py --heldout [--file FILE] [--root DIR] [--show]
  python benchmarks/verifier.py --before DIR [--rounds 3]

`--heldout` scores `benchmarks/verifier_heldout.jsonl` (labelled pairs written
before the issue-17 fixes and never used to tune them), or `--file FILE`
(e.g. `benchmarks/verifier_heldout_2.jsonl`, generated per class by
`benchmarks/make_heldout.py` before the issue-29 fixes, or
`benchmarks/verifier_heldout_3.jsonl`, issue 45's cases, one class per clause
of docs/verifier.md's contracts): agreement with the
labels, wrong answers accepted, right answers rejected, per class, next to
plain math-verify. `--before DIR` measures throughput of this checkout and of
the code in DIR (e.g. a `git worktree` of an older commit) interleaved, each
round in a fresh subprocess with the same load, and prints the ratio of
median rates. `--root DIR` imports grpo_jax from DIR instead of this checkout.

math-verify runs as TRL and open-r1 call it: `verify(parse(gold),
parse(solution))` in the calling process, one pair after another, with its
own signal-based timeouts. Ours runs `verify_batch` over the worker pool
(`--workers 0`: one per CPU) and once more with a single worker, so the
per-core cost is visible too. Prints the rates, their ratio, and how often
the two verifiers agree.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT = (sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv[:-1]
         else _HERE)
sys.path.insert(0, os.path.abspath(_ROOT))

from grpo_jax.rewards import math as rmath  # pylint: disable=g-import-not-at-top
from grpo_jax.rewards import pool as pool_lib  # pylint: disable=g-import-not-at-top


def _answers(rng: random.Random) -> tuple[str, str, str]:
  """(gold, an equivalent rendering, a wrong answer) of a random kind."""
  a, b = rng.randint(2, 99), rng.randint(2, 99)
  n = rng.randint(1000, 9_999_999)
  kinds = [
      (str(n), f"{n:,}", str(n + rng.choice([1, 10, -1]))),
      (f"\\frac{{{a}}}{{{a + b}}}", f"{a}/{a + b}", f"\\frac{{{a + 1}}}{{{a + b}}}"),
      ("\\frac{3}{4}", "0.75", "0.7"),
      (f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a}}}", f"{a}\\sqrt{{3}}"),
      (f"\\frac{{{a}\\pi}}{{{b}}}", f"{a}\\pi/{b}", f"\\frac{{{a}}}{{{b}}}"),
      (f"x^2+{2 * a}x+{a * a}", f"(x+{a})^2", f"(x-{a})^2"),
      (f"{a}", f"x={a}", f"{a}{a}"),
      (f"[{a},{a + b}]", f"\\left[{a}, {a + b}\\right]", f"({a},{a + b})"),
      (f"\\{{{a},{b + 100}\\}}", f"\\{{{b + 100},{a}\\}}", f"\\{{{a},{b}\\}}"),
      (f"({a},{b})", f"\\left({a}, {b}\\right)", f"({b},{a + b})"),
      (f"{a}\\%", f"{a} percent", f"{a + 1}\\%"),
      (f"\\begin{{pmatrix}}{a}\\\\{b}\\end{{pmatrix}}",
       f"\\begin{{bmatrix}}{a}\\\\{b}\\end{{bmatrix}}",
       f"\\begin{{pmatrix}}{b}\\\\{a}\\end{{pmatrix}}"),
      (f"{a}^\\circ", f"{a}", f"{a + 90}^\\circ"),
      (f"{a}\\text{{ cm}}", f"{a}", f"{a + 1}"),
      (f"{a}.5", f"\\frac{{{2 * a + 1}}}{{2}}", f"{a}.05"),
      (f"-{a}", f"-{a}.0", f"{a}"),
      ("(-\\infty, 3)", "(-\\infty,3)", "(-\\infty, 3]"),
  ]
  return rng.choice(kinds)


_FILLER = [
    "We start by writing down what the problem gives us.",
    "Substituting $x = {a}$ into the equation gives ${a}^2 + {b} = {c}$.",
    "Note that $\\frac{{{a}}}{{{b}}}$ cannot be simplified further.",
    "Let me double-check this step: {a} + {b} = {c}, which is consistent.",
    "So the sum of the first terms is $\\sum_{{k=1}}^{{{a}}} k = {c}$.",
    "Wait, we must also consider the case $x < 0$, which gives no solution.",
    "Hence the discriminant is ${b}^2 - 4 \\cdot {a} \\cdot {c}$.",
]


def _solution(answer: str, rng: random.Random) -> str:
  """A chain of thought of random length ending in `answer`."""
  lines = []
  for _ in range(rng.randint(4, 30)):
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    lines.append(rng.choice(_FILLER).format(a=a, b=b, c=a * a + b))
  ending = rng.choice([
      f"Therefore, the final answer is $\\boxed{{{answer}}}$.",
      f"So we get \\[ \\boxed{{{answer}}} \\]",
      f"Answer: {answer}",
      f"The answer is ${answer}$.",
  ])
  return "\n".join(lines + [ending])


def make_dataset(n: int, seed: int = 0
                 ) -> tuple[list[str], list[str], list[bool]]:
  """Golds, solutions, and whether each solution's answer is right."""
  rng = random.Random(seed)
  golds, solutions, labels = [], [], []
  for _ in range(n):
    gold, same, wrong = _answers(rng)
    kind = rng.choices([0, 1, 2], weights=[2, 1, 1])[0]
    golds.append(gold)
    solutions.append(_solution((gold, same, wrong)[kind], rng))
    labels.append(kind < 2)
  return golds, solutions, labels


def run_math_verify(golds, solutions, timeout: int) -> tuple[list[bool], float]:
  import math_verify  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  results = []
  for gold, solution in zip(golds, solutions):
    gold_parsed = math_verify.parse(f"${gold}$", parsing_timeout=timeout)
    pred_parsed = math_verify.parse(solution, parsing_timeout=timeout)
    results.append(bool(math_verify.verify(gold_parsed, pred_parsed,
                                           timeout_seconds=timeout)))
  return results, time.perf_counter() - start


def run_ours(golds, solutions, workers: int, timeout: float
             ) -> tuple[list[bool], float]:
  pool = pool_lib.WorkerPool(num_workers=workers or None)
  pool.run("probe", [["echo", 0]] * pool.num_workers, 30.0)  # Start workers.
  start = time.perf_counter()
  results = rmath.verify_batch(golds, solutions, timeout=timeout, pool=pool)
  seconds = time.perf_counter() - start
  pool.close()
  return results, seconds


HELDOUT = os.path.join(_HERE, "benchmarks", "verifier_heldout.jsonl")


def heldout(timeout: float, path: str = HELDOUT, show: bool = False) -> None:
  """Agreement and false accepts on a held-out set, ours and math-verify's."""
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  golds = [r["gold"] for r in rows]
  predictions = [r["prediction"] for r in rows]
  labels = [bool(r["label"]) for r in rows]
  ours, _ = run_ours(golds, predictions, 0, timeout)
  theirs, _ = run_math_verify(golds, predictions, int(timeout))
  print(f"held-out set {os.path.relpath(path, _HERE)}: {len(rows)} pairs "
        f"({sum(labels)} right), grpo_jax from {os.path.abspath(_ROOT)}")
  print(f"{'verifier':12s} {'agree':>12s} {'false accepts':>14s} {'false rejects':>14s}")
  for name, verdicts in (("grpo_jax", ours), ("math-verify", theirs)):
    agree = sum(v == l for v, l in zip(verdicts, labels))
    accepts = sum(v and not l for v, l in zip(verdicts, labels))
    rejects = sum(l and not v for v, l in zip(verdicts, labels))
    print(f"{name:12s} {agree:4d} ({100 * agree / len(rows):5.1f}%) "
          f"{accepts:14d} {rejects:14d}")
  wrong = [(r["class"], v) for r, v, l in zip(rows, ours, labels) if v != l]
  by_class = sorted({c for c, _ in wrong})
  print("grpo_jax disagreements by class:",
        ", ".join(f"{c}: {sum(1 for k, _ in wrong if k == c)}" for c in by_class)
        or "none")
  if show:
    for r, v in zip(rows, ours):
      if v != bool(r["label"]):
        print(f"  {'accepted' if v else 'rejected'} [{r['class']}] gold={r['gold']!r} "
              f"prediction={r['prediction']!r}")


def _rate(root: str, n: int, workers: int, timeout: float) -> float:
  """One throughput run of the code under `root`, in a fresh subprocess."""
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--rate-only", "--root", root,
       "--n", str(n), "--workers", str(workers), "--timeout", str(timeout)],
      capture_output=True, text=True, check=True)
  return float(out.stdout.split()[-1])


def before_after(before: str, rounds: int, n: int, workers: int,
                 timeout: float) -> None:
  """This checkout vs `before`, interleaved (after, before, after, ...)."""
  rates = {"after": [], "before": []}
  for i in range(rounds):
    for name, root in (("after", _HERE), ("before", before))[::1 if i % 2 == 0 else -1]:
      rates[name].append(_rate(root, n, workers, timeout))
      print(f"round {i + 1} {name:6s} {rates[name][-1]:8.1f} verif/s", flush=True)
  after, old = statistics.median(rates["after"]), statistics.median(rates["before"])
  print(f"median verif/s: after {after:.1f}, before {old:.1f} ({before}); "
        f"ratio after/before {after / old:.2f}x")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--n", type=int, default=1000)
  parser.add_argument("--workers", type=int, default=0, help="0: one per CPU")
  parser.add_argument("--timeout", type=float, default=5.0)
  parser.add_argument("--root", default=_HERE, help="import grpo_jax from here")
  parser.add_argument("--heldout", action="store_true")
  parser.add_argument("--file", default=HELDOUT, help="the held-out JSONL to score")
  parser.add_argument("--show", action="store_true", help="list grpo_jax's disagreements")
  parser.add_argument("--before", help="code to compare throughput with")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--rate-only", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  logging.disable(logging.WARNING)
  if args.heldout:
    heldout(args.timeout, args.file, args.show)
    return
  if args.before:
    before_after(args.before, args.rounds, args.n, args.workers, args.timeout)
    return
  if args.rate_only:
    golds, solutions, _ = make_dataset(args.n)
    _, seconds = run_ours(golds, solutions, args.workers, args.timeout)
    print(f"{args.n / seconds:.3f}")
    return
  golds, solutions, labels = make_dataset(args.n)
  fast = sum(isinstance(rmath._prepare(g, s), bool)  # pylint: disable=protected-access
             for g, s in zip(golds, solutions))

  ours, ours_s = run_ours(golds, solutions, args.workers, args.timeout)
  ours1, ours1_s = run_ours(golds, solutions, 1, args.timeout)
  theirs, theirs_s = run_math_verify(golds, solutions, int(args.timeout))

  n = args.n
  workers = args.workers or os.cpu_count()
  print(f"{n} solutions ({sum(labels)} right), {os.cpu_count()} CPUs; decided "
        f"in the trainer process without a worker (fast path): {fast}")
  print(f"{'verifier':34s} {'verif/s':>9s} {'seconds':>8s} {'accepted':>9s} "
        f"{'= label':>8s}")
  rows = [(f"grpo_jax ({workers} workers)", ours, ours_s),
          ("grpo_jax (1 worker)", ours1, ours1_s),
          ("math-verify (in process, serial)", theirs, theirs_s)]
  for name, results, seconds in rows:
    right = sum(r == l for r, l in zip(results, labels))
    print(f"{name:34s} {n / seconds:9.1f} {seconds:8.2f} {sum(results):9d} "
          f"{right:8d}")
  print(f"ratio grpo_jax/math-verify: {theirs_s / ours_s:.2f}x "
        f"({theirs_s / ours1_s:.2f}x with 1 worker)")
  agree = sum(a == b for a, b in zip(ours, theirs))
  print(f"agreement with math-verify: {agree}/{n}; "
        f"1 worker == {workers} workers: {ours1 == ours}")


if __name__ == "__main__":
  main()
