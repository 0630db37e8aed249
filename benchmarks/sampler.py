"""Group sampling tokens/s: grpo_jax's jitted sampler next to transformers.

    python benchmarks/sampler.py [--prompts 8] [--generations 8]
        [--new-tokens 128] [--threads N] [--repeats 1] [--quick]

SmolLM2-135M-Instruct in float32, the same chat-templated arithmetic prompts
(the same token ids, left-padded) and the same sampling settings on both
sides (temperature 1, top-k 0, top-p 1), in one process. EOS is ignored so
both decode exactly --new-tokens tokens for every row: grpo_jax with
stop_ids=(), transformers with min_new_tokens = max_new_tokens.

grpo_jax: `sampling.sample` (one prefill per prompt, its KV cache copied to
the G rows, a while-loop decode). transformers: `model.generate(do_sample=
True, num_return_sequences=G)` with its default dynamic cache (it prefills
each of the B*G rows).

Each side runs once to warm up (grpo_jax: the compile, whose seconds are
reported from jax.monitoring) and then is timed (best of --repeats; a
compilation inside a timed run is an error). Both also run with one new
token (prefill and the first token only), so ms per decode step =
(t(T) - t(1)) / (T - 1). The
decode steps' useful float32 FLOPs, 2 * (non-embedding + head params) per
token plus attention over the real context, are divided by the decode time
and by the float32 matmul peak (a 2048x2048 matmul in jax and torch, best
of several, measured in the same run).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import _common
import jax
import numpy as np
import torch
import transformers

from grpo_jax import models
from grpo_jax.generate import sampling
from grpo_jax.models import loading
from grpo_jax.models import tokenizer as tok_lib

# pylint: enable=g-import-not-at-top,wrong-import-position


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=8, help="B prompts")
  p.add_argument("--generations", type=int, default=8, help="G per prompt")
  p.add_argument("--new-tokens", type=int, default=128, help="T per row")
  p.add_argument("--levels", default="1,2,3,4,5",
                 help="arithmetic levels, cycled over the prompts")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--threads", type=int, default=os.cpu_count(),
                 help="torch intra-op threads (default: all cores)")
  p.add_argument("--repeats", type=int, default=1,
                 help="timed runs per side after the warm-up (best is kept)")
  p.add_argument("--quick", action="store_true",
                 help="smoke check: 2 prompts x 4 generations x 16 tokens")
  args = p.parse_args(argv)
  if args.quick:
    args.prompts, args.generations, args.new_tokens = 2, 4, 16
  if args.new_tokens < 2:
    p.error("--new-tokens must be >= 2 (decode steps are timed apart "
            "from the first token)")
  return args


# ----------------------------------------------------------------------------
# FLOPs.
# ----------------------------------------------------------------------------

def matmul_params(config) -> tuple[int, int]:
  """(non-embedding params, head params): what each generated token
  multiplies through once (norm weights included; negligible)."""
  head = config.vocab_size * config.dim
  embed_tables = head * (1 if config.tie_embeddings else 2)
  return models.count_params(config) - embed_tables, head


def decode_flops(config, prompt_lens: list[int], generations: int,
                 new_tokens: int) -> float:
  """Useful FLOPs of decode steps 1..T-1 (the first token is prefill's).

  Step t feeds token t-1 at position len + t - 1, which attends to len + t
  keys: 4 * H * hd FLOPs per key per layer (q.k and p.v).
  """
  body, head = matmul_params(config)
  per_key = 4 * config.num_layers * config.num_heads * config.head_dim
  total = 0.0
  for n in prompt_lens:
    keys = sum(n + t for t in range(1, new_tokens))
    total += generations * (2.0 * (body + head) * (new_tokens - 1)
                            + per_key * keys)
  return total


def step_matmul_floor(config, rows: int, repeats: int = 5) -> tuple[float, float]:
  """(seconds, FLOPs) of one decode step's weight matmuls and nothing else:
  the L layers' q, k, v, o, gate, up, down projections and the LM head on
  (rows, D) activations, chained as in the model, one jitted program over
  per-layer float32 weights of the model's shapes (streamed from memory as a
  real step streams them), best of `repeats`. No decode step can go below."""
  D, F, L = config.dim, config.mlp_dim, config.num_layers
  q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  shapes = {"q": (D, q), "k": (D, kv), "v": (D, kv), "o": (q, D),
            "gate": (D, F), "up": (D, F), "down": (F, D)}
  keys = iter(jax.random.split(jax.random.key(0), L * len(shapes) + 2))
  init = lambda shape: jax.random.normal(next(keys), shape) / np.sqrt(shape[0])
  layers = [{n: init(sh) for n, sh in shapes.items()} for _ in range(L)]
  head = init((D, config.vocab_size))
  x = jax.random.normal(next(keys), (rows, D))

  @jax.jit
  def matmuls(x, layers, head):
    for w in layers:
      side = (x @ w["k"]).sum() + (x @ w["v"]).sum()   # keep k, v alive
      x = x + (x @ w["q"]) @ w["o"] + 1e-9 * side
      x = x + ((x @ w["gate"]) * (x @ w["up"])) @ w["down"]
    return x @ head

  matmuls(x, layers, head).block_until_ready()
  _, best = _common.best_of(
      lambda: matmuls(x, layers, head).block_until_ready(), repeats)
  per_token = L * sum(a * b for a, b in shapes.values()) + D * config.vocab_size
  return best, 2.0 * rows * per_token


# ----------------------------------------------------------------------------
# The two samplers.
# ----------------------------------------------------------------------------

def ours_runner(model_config, params, prompt_ids, generations, new_tokens,
                pad_id, seed, stop_ids=(), **cfg_fields):
  """A no-argument function that samples B*G rows of `new_tokens` tokens and
  returns the Samples on the host (so it blocks until they are ready).
  stop_ids () ignores EOS; cfg_fields: other SamplingConfig fields."""
  cfg = sampling.SamplingConfig(max_new_tokens=new_tokens, temperature=1.0,
                                top_p=1.0, top_k=0, stop_ids=tuple(stop_ids),
                                pad_id=pad_id, **cfg_fields)
  key = jax.random.key(seed)

  def run():
    out = sampling.sample(model_config, params, prompt_ids, key, cfg,
                          num_generations=generations)
    return jax.device_get(out)
  return run


def hf_runner(model, prompt_ids, generations, new_tokens, pad_id, eos_ids,
              seed, ignore_eos=True):
  """The same for transformers: left-padded ids, EOS suppressed by
  min_new_tokens (unless not ignore_eos), sampling settings explicit."""
  P = max(len(p) for p in prompt_ids)
  ids = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long)
  mask = torch.zeros((len(prompt_ids), P), dtype=torch.long)
  for i, p in enumerate(prompt_ids):
    ids[i, P - len(p):] = torch.tensor(p)
    mask[i, P - len(p):] = 1
  gen = transformers.GenerationConfig(
      do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
      max_new_tokens=new_tokens,
      min_new_tokens=new_tokens if ignore_eos else 0,
      num_return_sequences=generations, eos_token_id=list(eos_ids),
      pad_token_id=pad_id)

  def run():
    torch.manual_seed(seed)
    with torch.inference_mode():
      out = model.generate(input_ids=ids, attention_mask=mask,
                           generation_config=gen)
    return out[:, P:].numpy()
  return run


def check_tokens(name: str, tokens, rows: int, new_tokens: int,
                 stop_ids) -> None:
  """Both sides must have decoded exactly `new_tokens` real tokens per row."""
  tokens = np.asarray(tokens)
  if tokens.shape != (rows, new_tokens):
    raise RuntimeError(f"{name}: tokens shape {tokens.shape}, expected "
                       f"{(rows, new_tokens)}")
  early_stop = np.isin(tokens, list(stop_ids)).any()
  if name == "transformers" and early_stop:
    raise RuntimeError("transformers emitted an EOS although "
                       "min_new_tokens = max_new_tokens")


def measure(run, repeats: int, check, clock: _common.CompileClock) -> dict:
  """First call (warm-up, compile) and the best of `repeats` after it; the
  timed calls must not compile."""
  mark = clock.mark()
  out, first = _common.timed(run)
  check(out)
  _, compile_s = clock.since(mark)
  mark = clock.mark()
  out, best = _common.best_of(run, repeats)
  check(out)
  compiles, _ = clock.since(mark)
  if compiles:
    raise RuntimeError(f"{compiles} JAX compilation(s) inside timed runs")
  return {"first": first, "best": best, "compile": compile_s}


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------

def summarise(t_full, t_one, rows, new_tokens, flops, peak) -> dict:
  """Figures of one side from its T-token and 1-token timings (seconds).
  The decode figures are None when noise made the 1-token run the slower."""
  decode_s = t_full["best"] - t_one["best"]
  per_s = lambda x: x / decode_s if decode_s > 0 else None
  gflops = per_s(flops / 1e9)
  return {
      "tokens_s": rows * new_tokens / t_full["best"],
      "wall_s": t_full["best"],
      "ms_step": 1e3 * t_full["best"] / new_tokens,
      "prefill_ms": 1e3 * t_one["best"],
      "decode_ms": (1e3 * decode_s / (new_tokens - 1) if decode_s > 0
                    else None),
      "gflops": gflops,
      "peak_pct": 100.0 * gflops / peak if gflops else None,
      "first_s": t_full["first"],
      "warmup_s": t_full["first"] - t_full["best"],
      "compile_s": t_full["compile"] + t_one["compile"],
  }


def print_report(ours: dict, hf: dict, peaks: dict, args, threads) -> None:
  r = _common.ratio
  rows = [
      ("tokens/s (B*G*T / wall)", ours["tokens_s"], hf["tokens_s"],
       r(ours["tokens_s"], hf["tokens_s"], True)),
      ("wall, T tokens (s)", ours["wall_s"], hf["wall_s"],
       r(ours["wall_s"], hf["wall_s"], False)),
      ("ms per step (wall / T)", ours["ms_step"], hf["ms_step"],
       r(ours["ms_step"], hf["ms_step"], False)),
      ("prefill + 1st token (ms)", ours["prefill_ms"], hf["prefill_ms"],
       r(ours["prefill_ms"], hf["prefill_ms"], False)),
      ("ms per decode step", ours["decode_ms"], hf["decode_ms"],
       r(ours["decode_ms"], hf["decode_ms"], False)),
      ("decode GFLOP/s (useful)", ours["gflops"], hf["gflops"],
       r(ours["gflops"], hf["gflops"], True)),
      ("% of fp32 matmul peak", ours["peak_pct"], hf["peak_pct"], "-"),
      ("first call, T tokens (s)", ours["first_s"], hf["first_s"], "-"),
      ("first call - timed call (s)", ours["warmup_s"], hf["warmup_s"], "-"),
      ("JAX compile, both programs (s)", ours["compile_s"], "-", "-"),
  ]
  print(f"\nfloat32 matmul peak (2048^2): jax {peaks['jax']:.1f} GFLOP/s, "
        f"torch {peaks['torch']:.1f} GFLOP/s; % of peak uses the higher")
  if None in (ours["decode_ms"], hf["decode_ms"]):
    print("decode-step figures missing: a 1-token run took longer than the "
          "T-token run (machine noise); rerun")
  print("ratio: how many times better grpo_jax is (> 1: grpo_jax faster); "
        "JAX compile = trace + lower + compile seconds (jax.monitoring) of "
        "the T-token and 1-token programs\n")
  _common.print_table(("", "grpo_jax", "transformers", "ratio"), rows)
  B, G, T = args.prompts, args.generations, args.new_tokens
  print("\nREADME row:")
  print("| sampler: SmolLM2-135M fp32, "
        f"{B} prompts x G={G}, {T} tokens, {threads} CPU threads | "
        f"{ours['tokens_s']:.0f} tok/s | {hf['tokens_s']:.0f} tok/s | "
        f"**{ours['tokens_s'] / hf['tokens_s']:.2f}x** | "
        f"{_pct(ours['peak_pct'])} vs {_pct(hf['peak_pct'])} of fp32 peak | "
        f"`python benchmarks/sampler.py` |")


def _pct(x) -> str:
  return "-" if x is None else f"{x:.0f}%"


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------

def load():
  """(model_config, params, our tokenizer, hf model, hf tokenizer)."""
  model_config, params = models.load_pretrained(_common.MODEL)
  tok = tok_lib.load_tokenizer(_common.MODEL)
  directory = loading.preset_directory(_common.MODEL)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32).eval()
  hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
  return model_config, params, tok, hf_model, hf_tok


def prompts(args, tok, hf_tok) -> list[list[int]]:
  """Our rendering of the prompts; transformers' must give the same ids."""
  examples = _common.arithmetic_examples(args.prompts,
                                         _common.parse_ints(args.levels),
                                         args.seed)
  messages = [_common.chat_messages(e.question) for e in examples]
  ours = [tok.encode(tok.apply_chat_template(m)) for m in messages]
  theirs = _common.hf_prompt_ids(hf_tok, messages)
  if ours != theirs:
    raise RuntimeError("grpo_jax and transformers render the chat template "
                       "to different token ids")
  return ours


def main(argv=None) -> int:
  args = parse_args(argv)
  threads = _common.set_torch_threads(args.threads)
  B, G, T = args.prompts, args.generations, args.new_tokens
  _common.print_header("sampler: grpo_jax vs transformers generate", {
      "model": f"{_common.MODEL} (float32)",
      "rows": f"{B} prompts x G={G} = {B * G}",
      "new tokens": f"{T} per row, EOS ignored (grpo_jax stop_ids=(); "
                    "transformers min_new_tokens=max_new_tokens)",
      "sampling": "temperature 1.0, top_k 0, top_p 1.0",
      "prompts": f"arithmetic levels {args.levels}, seed {args.seed}, "
                 "last_number template + system prompt, chat template",
      "timing": f"1 warm-up + best of {args.repeats}; also a 1-token run",
  }, threads)
  model_config, params, tok, hf_model, hf_tok = load()
  prompt_ids = prompts(args, tok, hf_tok)
  lens = [len(p) for p in prompt_ids]
  print(f"prompt lengths: {lens} (identical ids on both sides)")
  peaks = _common.matmul_peak()
  peak = max(peaks.values())
  floor_s, floor_flops = step_matmul_floor(model_config, B * G)
  print(f"one decode step's weight matmuls alone ({B * G} rows, one jitted "
        f"chain, no attention or sampling): {floor_s * 1e3:.0f} ms, "
        f"{floor_flops / 1e9:.1f} GFLOP at {floor_flops / floor_s / 1e9:.0f} "
        "GFLOP/s")
  pad_id = tok.pad_id or 0
  stop_ids = tuple(tok.stop_ids)

  def check(name, t):
    return lambda out: check_tokens(
        name, out.tokens_nt if hasattr(out, "tokens_nt") else out, B * G, t,
        stop_ids)

  clock = _common.CompileClock()
  timings = {}
  for name, make in (
      ("grpo_jax", lambda t: ours_runner(model_config, params, prompt_ids, G,
                                         t, pad_id, args.seed)),
      ("transformers", lambda t: hf_runner(hf_model, prompt_ids, G, t, pad_id,
                                           stop_ids, args.seed))):
    full = measure(make(T), args.repeats, check(name, T), clock)
    one = measure(make(1), args.repeats, check(name, 1), clock)
    timings[name] = (full, one)
    print(f"{name}: first call {full['first']:.2f} s, timed {full['best']:.2f}"
          f" s; 1-token run {one['best'] * 1e3:.0f} ms")
    sys.stdout.flush()
  flops = decode_flops(model_config, lens, G, T)
  ours = summarise(*timings["grpo_jax"], B * G, T, flops, peak)
  hf = summarise(*timings["transformers"], B * G, T, flops, peak)
  print_report(ours, hf, peaks, args, threads)
  return 0


if __name__ == "__main__":
  try:
    sys.exit(main())
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.exit(1)
