"""Peak memory of token log-probs + entropy, forward and gradient, naive vs
chunked (grpo_jax.algorithms.logprobs), for one long completion.

    python benchmarks/logprob_memory.py                 # Qwen2.5-0.5B head
    python benchmarks/logprob_memory.py --no-run        # compile-only numbers
    python benchmarks/logprob_memory.py --chunk 64 --dim 256

Two measurements per path:
  * XLA's compiled memory analysis: the temporary buffers of the jitted
    forward + backward (gradients w.r.t. the hidden states and the head),
    and of the backward w.r.t. the hidden states only (a frozen head);
  * with --run (default), the process's peak resident memory while the
    computation runs, in a fresh child process per path (VmHWM from
    /proc/self/status, reset after the inputs exist and the code compiled).
    On CPU the measured peak was about twice XLA's temp figure for the naive
    path (19 GB at the defaults), so a path whose expected peak exceeds half
    of MemAvailable is not run unless --force-run: this machine is shared.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from grpo_jax.algorithms import logprobs  # noqa: E402
from grpo_jax.models.config import ModelConfig  # noqa: E402

MIB = 2 ** 20


def _config(args) -> ModelConfig:
  return ModelConfig(architecture="qwen2", vocab_size=args.vocab, dim=args.dim,
                     num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64,
                     mlp_dim=64, tie_embeddings=True)


def _path_fn(args, path: str):
  if path == "naive":
    return logprobs.token_logprobs_naive
  return functools.partial(logprobs.token_logprobs, chunk_size=args.chunk)


def _step(args, path: str, wrt_head: bool):
  """jit(value and grad) of Σ logp + 0.01 Σ entropy, as a policy loss needs."""
  config, fn = _config(args), _path_fn(args, path)

  def loss(head, h_nsd, targets_ns):
    logp_ns, entropy_ns = fn(config, head, h_nsd, targets_ns)
    return logp_ns.sum() + 0.01 * entropy_ns.sum()

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1) if wrt_head else 1))


def _abstract_inputs(args):
  return ({"embed": jax.ShapeDtypeStruct((args.vocab, args.dim), jnp.float32)},
          jax.ShapeDtypeStruct((args.batch, args.length, args.dim),
                               jnp.float32),
          jax.ShapeDtypeStruct((args.batch, args.length), jnp.int32))


def compiled_mib(args, path: str, wrt_head: bool) -> tuple[float, float]:
  """(temp, output) MiB of the compiled step."""
  compiled = _step(args, path, wrt_head).lower(*_abstract_inputs(args)).compile()
  stats = compiled.memory_analysis()
  return stats.temp_size_in_bytes / MIB, stats.output_size_in_bytes / MIB


def _available_mib() -> float:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) / 1024
  return float("inf")


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise KeyError(field)


def child(args) -> None:
  """Runs one path once; prints peak RSS above the inputs, as JSON."""
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  head = {"embed": 0.02 * jax.random.normal(k[0], (args.vocab, args.dim))}
  h_nsd = jax.random.normal(k[1], (args.batch, args.length, args.dim))
  targets_ns = jax.random.randint(k[2], (args.batch, args.length), 0,
                                  args.vocab)
  step = _step(args, args.child, wrt_head=True)
  compiled = step.lower(head, h_nsd, targets_ns).compile()
  jax.block_until_ready((head, h_nsd, targets_ns))
  base_kib = _status_kib("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM (peak RSS) to the current RSS
  start = time.perf_counter()
  jax.block_until_ready(compiled(head, h_nsd, targets_ns))
  seconds = time.perf_counter() - start
  peak_kib = _status_kib("VmHWM")
  print(json.dumps({"peak_above_inputs_mib": (peak_kib - base_kib) / 1024,
                    "peak_rss_mib": peak_kib / 1024, "seconds": seconds}))


def measured_rss(args, path: str) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--child", path,
         *[f"--{k}={getattr(args, k)}" for k in
           ("vocab", "dim", "length", "batch", "chunk")]]
  out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--dim", type=int, default=896)
  parser.add_argument("--length", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--chunk", type=int, default=256)
  parser.add_argument("--run", action=argparse.BooleanOptionalAction,
                      default=True)
  parser.add_argument("--force-run", action="store_true",
                      help="run a path even if it may not fit in memory")
  parser.add_argument("--child", choices=("naive", "chunked"))
  args = parser.parse_args()
  if args.child:
    return child(args)

  B, T, V, D, c = args.batch, args.length, args.vocab, args.dim, args.chunk
  print(f"B={B} T={T} V={V} D={D} chunk={c}, float32, {jax.devices()[0]}")
  print(f"one [B,T,V] logits buffer: {B * T * V * 4 / MIB:9.1f} MiB   "
        f"one [B,c,V] chunk: {B * c * V * 4 / MIB:7.1f} MiB   "
        f"one [D,V] head: {D * V * 4 / MIB:7.1f} MiB")
  rows = {}
  for path in ("naive", "chunked"):
    temp, output = compiled_mib(args, path, True)
    rows[path] = {"temp (h, head)": temp,
                  "temp (h only)": compiled_mib(args, path, False)[0]}
    expected_peak = 2 * (temp + output)
    if args.run and (args.force_run or expected_peak < _available_mib() / 2):
      rss = measured_rss(args, path)
      rows[path].update({"peak RSS above inputs": rss["peak_above_inputs_mib"],
                         "seconds": rss["seconds"]})
    elif args.run:
      print(f"not running {path}: may need ~{expected_peak / 1024:.1f} GiB, "
            f"{_available_mib() / 1024:.1f} GiB available (--force-run)")
  print(f"{'':28s}{'naive':>12s}{'chunked':>12s}{'ratio':>8s}")
  for key in rows["chunked"]:
    n, ch = rows["naive"].get(key, float("nan")), rows["chunked"][key]
    unit = "s" if key == "seconds" else "MiB"
    print(f"{key + ' [' + unit + ']':28s}{n:12.1f}{ch:12.1f}{n / ch:8.1f}")
  print("bound (temp): naive   ~ 4·B·T·V·4 bytes (logits, probabilities and "
        "their cotangents)\n"
        "              chunked ~ k·B·c·V·4 + D·V·4 bytes, k ≈ 2-3 (chunk "
        "buffers + one copy of the head weight, independent of T)")


if __name__ == "__main__":
  main()
