"""Shared helpers of the side-by-side benchmarks (not a benchmark itself).

The hardware line, thread settings, the float32 matmul peak measured in the
same run, the arithmetic prompts both sides see, and table printing.
"""
from __future__ import annotations

import os
import platform
import resource
import sys
import time
from typing import Any, Callable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import torch
import transformers

import grpo_jax.data  # noqa: F401  registers the datasets and templates
from grpo_jax import registry

# pylint: enable=g-import-not-at-top,wrong-import-position

MODEL = "smollm2-135m-instruct"
SYSTEM_PROMPT = "You are a concise math assistant."  # dapo_aime.py:local's


# ----------------------------------------------------------------------------
# Hardware and threads.
# ----------------------------------------------------------------------------

def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def usable_cores() -> int:
  """What `nproc` prints: the CPUs this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def peak_rss_gib() -> float:
  """This process's peak resident memory so far (Linux: ru_maxrss in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def set_torch_threads(n: int) -> int:
  """torch intra-op threads = n (all cores by default: a fair peer)."""
  torch.set_num_threads(n)
  return torch.get_num_threads()


def hardware_lines(torch_threads: int) -> list[str]:
  """What the numbers were measured on, including how busy the machine was."""
  load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",) * 3
  return [
      f"cpu: {cpu_model()}",
      f"cores: os.cpu_count()={os.cpu_count()}, nproc={usable_cores()}, "
      f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
      "(above nproc means other work shares these cores)",
      f"jax {jax.__version__} on {jax.default_backend()} "
      f"({len(jax.devices())} device(s)); torch {torch.__version__} with "
      f"{torch_threads} thread(s); transformers {transformers.__version__}",
      f"python {platform.python_version()}",
  ]


def print_header(title: str, settings: dict[str, Any], torch_threads: int):
  print(f"# {title}")
  for line in hardware_lines(torch_threads):
    print(f"  {line}")
  print("settings:")
  for k, v in settings.items():
    print(f"  {k} = {v}")
  if os.getloadavg()[0] > usable_cores():
    print("WARNING: load average above nproc: other processes share these "
          "cores. torch's OpenMP threads slow down far more than XLA's under "
          "contention (seen: 2 threads 10x slower than 1), so ratios are "
          "inflated. Rerun on a quiet machine for figures to publish.")
  sys.stdout.flush()


# ----------------------------------------------------------------------------
# Timing.
# ----------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  """(fn(), wall seconds); fn must block until its result is ready."""
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
  """The last result and the fastest of `repeats` timed calls."""
  best, out = float("inf"), None
  for _ in range(max(repeats, 1)):
    out, seconds = timed(fn)
    best = min(best, seconds)
  return out, best


class CompileClock:
  """JAX compilations (backend compiles) and the seconds spent tracing,
  lowering and compiling, from jax.monitoring events, since creation."""

  _PREFIX = "/jax/core/compile/"
  _BACKEND = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.count, self.seconds = 0, 0.0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, seconds: float, **kwargs):
    del kwargs
    if event.startswith(self._PREFIX):
      self.seconds += seconds
      self.count += event == self._BACKEND

  def since(self, mark: tuple[int, float]) -> tuple[int, float]:
    """(compilations, seconds) since `mark` = an earlier `self.mark()`."""
    return self.count - mark[0], self.seconds - mark[1]

  def mark(self) -> tuple[int, float]:
    return self.count, self.seconds


def matmul_peak(n: int = 2048, repeats: int = 8) -> dict[str, float]:
  """Float32 GFLOP/s of an (n, n) @ (n, n) matmul, best of `repeats`, in jax
  (jitted) and torch.mm: the machine's practical peak for this run."""
  flops = 2.0 * n ** 3
  kx, ky = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (n, n), jnp.float32)
  y = jax.random.normal(ky, (n, n), jnp.float32)
  mm = jax.jit(jnp.matmul)
  mm(x, y).block_until_ready()
  _, jax_s = best_of(lambda: mm(x, y).block_until_ready(), repeats)
  tx, ty = torch.randn(n, n), torch.randn(n, n)
  torch.mm(tx, ty)
  _, torch_s = best_of(lambda: torch.mm(tx, ty), repeats)
  return {"jax": flops / jax_s / 1e9, "torch": flops / torch_s / 1e9}


# ----------------------------------------------------------------------------
# Prompts: the same chat-templated arithmetic questions on both sides.
# ----------------------------------------------------------------------------

def arithmetic_examples(num_prompts: int, levels: Sequence[int], seed: int):
  """`num_prompts` generated arithmetic problems (grpo_jax.data's task)."""
  return registry.lookup("dataset", "arithmetic")(
      num_examples=num_prompts, levels=list(levels), seed=seed)


def chat_messages(question: str, template: str = "last_number",
                  system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
  """The messages grpo_jax's rollout renders for `question` (system first)."""
  messages = registry.lookup("template", template)(question)
  if system_prompt:
    messages = [{"role": "system", "content": system_prompt}, *messages]
  return messages


def hf_prompt_ids(hf_tokenizer, messages_list) -> list[list[int]]:
  """transformers' own rendering of the chat template, as token ids."""
  out = []
  for messages in messages_list:
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True)
    if hasattr(ids, "keys"):       # BatchEncoding in transformers >= 5
      ids = ids["input_ids"]
    out.append(list(ids))
  return out


def parse_ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


# ----------------------------------------------------------------------------
# Output.
# ----------------------------------------------------------------------------

def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
  """A markdown table (aligned for the console too)."""
  cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  line = lambda r: "| " + " | ".join(
      c.ljust(w) if i == 0 else c.rjust(w)
      for i, (c, w) in enumerate(zip(r, widths))) + " |"
  print(line(cells[0]))
  print("|" + "|".join("-" * (w + 1) + ("-" if i == 0 else ":")
                       for i, w in enumerate(widths)) + "|")
  for r in cells[1:]:
    print(line(r))
  sys.stdout.flush()


def ratio(ours: float, theirs: float, higher_is_better: bool) -> str:
  """How many times better grpo_jax is (>1: grpo_jax wins)."""
  if not ours or not theirs:
    return "-"
  r = ours / theirs if higher_is_better else theirs / ours
  return f"{r:.2f}x"


def _fmt(x: Any) -> str:
  if x is None:
    return "-"
  if isinstance(x, float):
    if x == 0:
      return "0"
    if abs(x) >= 100:
      return f"{x:,.0f}"
    if abs(x) >= 10:
      return f"{x:.1f}"
    return f"{x:.2f}" if abs(x) >= 0.1 else f"{x:.3f}"
  return str(x)
