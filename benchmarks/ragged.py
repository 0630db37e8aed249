"""Ragged (long-tailed) completion lengths: sampler, update and GRPO step.

    python benchmarks/ragged.py [--prompts 8] [--generations 8]
        [--new-tokens 256] [--slots 0] [--micro-batch 16] [--threads N]
        [--skip-trl] [--samplers-only] [--quick] [--paged [--page-size 16]]
        [--seeds 0,1,2] [--dtype float32|bfloat16 (with --samplers-only)]
    python benchmarks/ragged.py --partial [--steps 4] ...   (partial
        rollouts against per-step sampling: benchmarks/partial_rollouts.py)

SmolLM2-135M-Instruct in float32, EOS on, temperature 1: completion lengths
are the model's own on chat-templated arithmetic prompts of mixed
difficulty (levels 1-5 cycled, the last_number template and system prompt
of configs/dapo_aime.py:local). At the defaults (8 prompts x G = 8, cap
256) their mean is about 0.3 of the cap (p50 well below it, a tail to the
cap); the run prints the distribution (mean, p50, p90, max) and a NOTE if
the mean is above 0.35 of the cap.

Side by side, in one process:
  1. sampler, useful (non-padding: through each row's stop token) tokens/s
     on the same prompts: grpo_jax's static sampler (all rows decode in
     lockstep until the longest ends), its continuous-batching sampler
     (`SamplingConfig(continuous_batching=True, slots=m)` for each --slots
     count, 0 = automatic; with --paged also on the paged KV cache,
     `kv_cache="paged"`) and transformers `generate` (EOS on). The grpo_jax
     samplers (benchmarks/sampler.py's runners) run once to compile, then
     --repeats rounds interleaved so load hits them alike (best kept; a
     compilation inside a timed round is an error); both draw the same
     noise per (row, token), so the rows that differ from the static
     sampler's (float rounding of different matmul shapes flipping a
     near-tie) are counted. Such a flip makes the samplers decode different
     rows, so one key compares their lengths as much as their speed: with
     --seeds s1,s2,... each grpo_jax sampler runs on the same prompts with
     each sampling key (compiled once: the key is an argument), and the
     run reports per-key and mean useful tokens/s, mean ms per decode step,
     and each sampler's ratio of means to the static sampler's (with
     --paged, paged / dense too). --dtype bfloat16 (samplers only) casts
     the weights, so the KV cache is bf16 as well (the
     sampling.compute_dtype of configs/dapo_aime.py:local_bf16).
     transformers: a 2-token warm-up call, then one
     timed call (nothing to compile; a full warm-up would double the
     longest part of the run).
  2. the update (step_lib.train_step, beta = 0, mu = 1) on the static sampler's
     rollout from part 1 (scored by rollout.score_samples, no new sampling):
     padded rows (rl.packing = "off"; each group's prompt once,
     rl.shared_prompt) vs packed rows (rl.packing = "on"), the same
     micro-batch token budget; each compiled first, then timed alternately.
     If that rollout's mean is above 0.35 of the cap, each row is cut at a
     length drawn from a lognormal (`impose_lengths`: median cap/8, sigma
     1) and both distributions are printed.
  3. one GRPO step: grpo_jax is benchmarks/grpo_step.py's step and config
     with sampling.continuous_batching on (automatic slots) and rl.packing
     "auto", after --warmup-steps steps (default 0: parts 1 and 2 compiled
     its programs already; a compilation in the measured step is reported
     and its seconds excluded); TRL GRPOTrainer with grpo_step.py's rules
     (per_device_train_batch_size = --micro-batch, gradient accumulation
     over B*G rows, one generation batch of B*G rows, max_completion_length
     = cap, stopping at EOS), one warm-up step then the measured one.

The last line is `ratios: sampler <x>, update <y>, step_vs_trl <z>`:
continuous-batching (the best --slots count) / static useful tokens/s,
padded / packed update seconds, TRL step / grpo_jax step seconds.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import _common
import grpo_step
import numpy as np
import partial_rollouts
import sampler as sampler_bench
import torch
import transformers

from grpo_jax.data import templates
from grpo_jax.generate import rollout
from grpo_jax.models import loading, transformer
from grpo_jax.rl import step as step_lib
from grpo_jax.rl import train
from grpo_jax.rl.batch import to_rows

# pylint: enable=g-import-not-at-top,wrong-import-position

MAX_MEAN_FRACTION = 0.35


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=8, help="B prompts")
  p.add_argument("--generations", type=int, default=8, help="G per prompt")
  p.add_argument("--new-tokens", type=int, default=256,
                 help="the length cap (max_new_tokens)")
  p.add_argument("--slots", default="0",
                 help="comma-separated slot counts of continuous batching "
                      "(0: automatic, sampling.auto_slots)")
  p.add_argument("--paged", action="store_true",
                 help="also the paged KV cache (sampling.kv_cache='paged', "
                      "automatic pool) at each --slots count")
  p.add_argument("--page-size", type=int, default=16,
                 help="columns per page with --paged")
  p.add_argument("--repeats", type=int, default=1,
                 help="timed rounds of the grpo_jax samplers (best kept)")
  p.add_argument("--micro-batch", type=int, default=16,
                 help="rows per forward/backward, both sides (grpo_jax "
                      "micro_batch_size; packed: rows of P+T tokens)")
  p.add_argument("--levels", default="1,2,3,4,5",
                 help="arithmetic levels, cycled over the prompts")
  p.add_argument("--seed", type=int, default=0,
                 help="the prompts' seed (and the sampling key's, without "
                      "--seeds)")
  p.add_argument("--seeds", default="",
                 help="comma-separated sampling keys for the grpo_jax "
                      "samplers (default: --seed); per-key and mean figures")
  p.add_argument("--dtype", default="float32",
                 choices=("float32", "bfloat16"),
                 help="the grpo_jax samplers' weights and KV cache "
                      "(bfloat16 needs --samplers-only)")
  p.add_argument("--lr", type=float, default=1e-6)
  p.add_argument("--warmup-steps", type=int, default=0,
                 help="grpo_jax GRPO steps before the measured one")
  p.add_argument("--threads", type=int, default=os.cpu_count(),
                 help="torch intra-op threads (default: all cores)")
  p.add_argument("--skip-trl", action="store_true")
  p.add_argument("--samplers-only", action="store_true",
                 help="part 1's grpo_jax samplers alone (no transformers, "
                      "update or GRPO step): continuous batching at larger "
                      "sizes; the last line is then `ratios: sampler <x>`")
  p.add_argument("--quick", action="store_true",
                 help="smoke check: 2 prompts x 4 generations x 32 tokens")
  p.add_argument("--partial", action="store_true",
                 help="partial rollouts against per-step sampling over "
                      "--steps steps at the first --slots count "
                      "(benchmarks/partial_rollouts.py) instead")
  p.add_argument("--steps", type=int, default=4,
                 help="steps of B*G rows with --partial")
  args = p.parse_args(argv)
  if args.quick:
    args.prompts, args.generations, args.new_tokens = 2, 4, 32
    args.micro_batch = 4
  args.slot_counts = _common.parse_ints(args.slots)
  args.seed_list = _common.parse_ints(args.seeds) or [args.seed]
  if len(set(args.seed_list)) != len(args.seed_list):
    p.error(f"--seeds {args.seeds}: repeated keys")
  if args.dtype != "float32" and not args.samplers_only:
    p.error("--dtype bfloat16 needs --samplers-only (the update, the GRPO "
            "step and transformers run in float32)")
  rows = args.prompts * args.generations
  args.micro_batch = min(args.micro_batch or rows, rows)
  if rows % args.micro_batch:
    p.error(f"--micro-batch {args.micro_batch} must divide B*G = {rows}")
  return args


def distribution(length_n) -> dict[str, float]:
  x = np.asarray(length_n, np.float64)
  return {"mean": x.mean(), "p50": np.percentile(x, 50),
          "p90": np.percentile(x, 90), "max": x.max()}


def hf_lengths(tokens_nt: np.ndarray, stop_ids) -> np.ndarray:
  """Generated tokens per row through its first stop token (or all)."""
  stop = np.isin(tokens_nt, list(stop_ids))
  first = np.where(stop.any(axis=1), stop.argmax(axis=1) + 1,
                   tokens_nt.shape[1])
  return first


# ----------------------------------------------------------------------------
# 1. Samplers.
# ----------------------------------------------------------------------------

def jax_samplers(args, step, params, prompt_ids, seed: int) -> dict:
  """benchmarks/sampler.py's runners for sampling key `seed`: the static
  sampler and continuous batching at each slot count, with the GRPO step's
  sampler settings."""
  cfg = step.sample_cfg
  common = (step.model_config, params, prompt_ids, args.generations,
            args.new_tokens, cfg.pad_id, seed, cfg.stop_ids)
  runners = {"static": sampler_bench.ours_runner(*common)}
  for m in args.slot_counts:
    runners[f"continuous, {m or 'auto'} slots"] = sampler_bench.ours_runner(
        *common, continuous_batching=True, slots=m)
    if args.paged:
      runners[f"continuous paged, {m or 'auto'} slots"] = (
          sampler_bench.ours_runner(*common, continuous_batching=True, slots=m,
                                    kv_cache="paged",
                                    page_size=args.page_size))
  return runners


def _seed_figures(samples, seconds: float, static_tokens) -> dict:
  lengths = np.asarray(samples.length_n)
  differ = int(np.sum(np.any(np.asarray(samples.tokens_nt) != static_tokens,
                             axis=1)))
  return {"seconds": seconds, "lengths": lengths, "steps": int(samples.steps),
          "differ": differ, "samples": samples,
          "useful_tps": float(lengths.sum()) / seconds,
          "ms_per_step": 1e3 * seconds / max(int(samples.steps), 1)}


def _mean_figures(per_seed: list) -> dict:
  """A sampler's figures over the keys: mean seconds, steps, useful
  tokens/s and ms per step; lengths of every key's rows; the first key's
  samples (the update's rollout)."""
  mean = lambda k: float(np.mean([r[k] for r in per_seed]))
  return {"seconds": mean("seconds"), "steps": mean("steps"),
          "useful_tps": mean("useful_tps"), "ms_per_step": mean("ms_per_step"),
          "lengths": np.concatenate([r["lengths"] for r in per_seed]),
          "differ": int(sum(r["differ"] for r in per_seed)),
          "samples": per_seed[0]["samples"], "seeds": per_seed}


def time_samplers(args, step, hf_model, prompt_ids, clock) -> dict:
  """Useful tokens/s of each sampler, per sampling key (--seeds) and their
  mean (`_mean_figures`); the returned entries hold the Samples (grpo_jax)
  or token ids (transformers) of the first key's timed call. Each grpo_jax
  sampler compiles on a first call with the first key; then, for each key,
  --repeats rounds over the samplers interleaved (best kept)."""
  G, T = args.generations, args.new_tokens
  params = transformer.cast(step.state.params, args.dtype)
  runners = {seed: jax_samplers(args, step, params, prompt_ids, seed)
             for seed in args.seed_list}
  first_seed = args.seed_list[0]
  for name, run in runners[first_seed].items():
    mark = clock.mark()
    _, first = _common.timed(run)
    compiles, compile_s = clock.since(mark)
    print(f"sampler {name}: first call {first:.1f} s, of which "
          f"{compile_s:.1f} s tracing + compiling ({compiles} compile(s))")
    sys.stdout.flush()
  per_seed = {name: [] for name in runners[first_seed]}
  for seed in args.seed_list:
    best = {name: float("inf") for name in per_seed}
    out = {}
    for _ in range(args.repeats):
      for name, run in runners[seed].items():
        mark = clock.mark()
        out[name], seconds = _common.timed(run)
        if clock.since(mark)[0]:
          raise RuntimeError(f"sampler {name}: a JAX compilation inside a "
                             "timed run")
        best[name] = min(best[name], seconds)
    static_tokens = np.asarray(out["static"].tokens_nt)
    for name, samples in out.items():
      r = _seed_figures(samples, best[name], static_tokens)
      per_seed[name].append(r)
      print(f"sampler {name}, key {seed}: best {r['seconds']:.1f} s, "
            f"{r['lengths'].sum()} useful tokens, {r['steps']} decode steps "
            f"({r['ms_per_step']:.0f} ms each), {r['useful_tps']:.1f} useful "
            f"tok/s, {r['differ']} rows != static")
      sys.stdout.flush()
  result = {name: _mean_figures(rs) for name, rs in per_seed.items()}
  if hf_model is None:
    return result
  cfg = step.sample_cfg
  hf_run = lambda n: sampler_bench.hf_runner(
      hf_model, prompt_ids, G, n, cfg.pad_id, cfg.stop_ids, args.seed,
      ignore_eos=False)
  hf_run(2)()                                       # one-off set-up costs
  tokens, seconds = _common.timed(hf_run(T))
  lengths = hf_lengths(tokens, cfg.stop_ids)
  result["transformers"] = {"seconds": seconds, "lengths": lengths,
                            "steps": tokens.shape[1], "differ": None,
                            "useful_tps": float(lengths.sum()) / seconds}
  print(f"sampler transformers: {seconds:.1f} s, {lengths.sum()} useful "
        "tokens")
  sys.stdout.flush()
  return result


# ----------------------------------------------------------------------------
# 2. The update, padded vs packed, on one rollout.
# ----------------------------------------------------------------------------

def impose_lengths(groups: rollout.Groups, seed: int) -> rollout.Groups:
  """The rollout's real tokens, each row cut at min(its length, L) with L
  drawn from a lognormal of median cap/8 and sigma 1 (mean about 0.21 of
  the cap, p90 about 0.45, a tail to the cap): a long-tailed workload
  imposed on real decoding when the natural lengths are not long-tailed."""
  B, G, T = groups.tokens_bgt.shape
  rng = np.random.default_rng(seed)
  cap_bg = np.clip(np.ceil(rng.lognormal(np.log(T / 8), 1.0, (B, G))), 1, T)
  length_bg = np.minimum(groups.length_bg, cap_bg).astype(np.int32)
  keep_bgt = np.arange(T)[None, None, :] < length_bg[..., None]
  return groups._replace(
      tokens_bgt=np.where(keep_bgt, groups.tokens_bgt, 0),
      logp_bgt=np.where(keep_bgt, groups.logp_bgt, 0.0),
      mask_bgt=groups.mask_bgt & keep_bgt, length_bg=length_bg,
      truncated_bg=groups.truncated_bg | (length_bg < groups.length_bg))


def time_updates(args, step, texts, samples, repeats: int = 1) -> dict:
  """time/update of step_lib.train_step on the static sampler's rollout,
  padded and packed: each compiled by a first call, then timed
  alternately."""
  c = step.config
  rl = c.rl
  groups, _ = rollout.score_samples(
      step.spec, texts, step.prompt_ids(), [e.answer for e in step.examples],
      samples, step.tokenizer, rl.num_generations)
  natural = np.asarray(groups.length_bg).reshape(-1)
  imposed = natural.mean() > MAX_MEAN_FRACTION * args.new_tokens
  if imposed:
    groups = impose_lengths(groups, args.seed)
  batch = to_rows(groups, step.tokenizer.pad_id or 0, rl.overlong_filter)
  adv_n = train.advantages(c, batch.reward_bg, batch.mask_nt)
  configs = {}
  for name, packing in (("padded", "off"), ("packed", "on")):
    cfg = c.copy_and_resolve_references()
    cfg.rl.packing = packing
    configs[name] = cfg
  times = {name: [] for name in configs}
  extra = {}
  for i in range(repeats + 1):
    for name, cfg in configs.items():
      spec = step_lib.UpdateSpec.from_config(cfg)
      step.state, m = step_lib.train_step(
          spec, spec.program(step.model_config, step.optimizer), step.state,
          batch, adv_n, step_lib.Frozen(), np.random.default_rng(i))
      if i:
        times[name].append(m["time/update"])
      else:
        print(f"update {name}: first call (compiles) {m['time/update']:.1f} s")
      extra.update({k: v for k, v in m.items() if k.startswith("pack/")})
      sys.stdout.flush()
  out = {name: min(t) for name, t in times.items()}
  out.update(extra)
  out["lengths"] = np.asarray(groups.length_bg).reshape(-1)
  out["natural"], out["imposed"] = natural, imposed
  out["seq_len"] = batch.tokens_ns.shape[1]
  return out


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------

def step_config(args):
  """grpo_step.py's config with continuous batching on (automatic slots);
  rl.packing stays "auto"."""
  c = grpo_step.ours_config(args)
  c.sampling.continuous_batching = True
  return c


def main(argv=None) -> int:
  args = parse_args(argv)
  threads = _common.set_torch_threads(args.threads)
  B, G, T = args.prompts, args.generations, args.new_tokens
  _common.print_header("ragged lengths: sampler, update, GRPO step", {
      "model": f"{_common.MODEL} ({args.dtype} grpo_jax samplers; "
               "float32 elsewhere and in transformers)",
      "rows": f"{B} prompts x G={G} = {B * G}, <= {T} new tokens, EOS on, "
              "temperature 1, top_k 0, top_p 1",
      "prompts": f"arithmetic levels {args.levels} cycled, seed {args.seed}, "
                 "last_number template + system prompt (dapo_aime:local)",
      "continuous batching slots": ", ".join(
          str(m or "auto") for m in args.slot_counts),
      "micro-batch": f"{args.micro_batch} rows (padded rows of P+T tokens; "
                     "packed: as many rows of P+T tokens)",
      "sampling keys": ", ".join(map(str, args.seed_list)),
      "timing": f"grpo_jax samplers: compile call + best of {args.repeats} "
                "interleaved round(s) per key; transformers: 1 timed call; update: "
                "compile call, then timed alternately; step: grpo_jax "
                f"{args.warmup_steps} warm-up step(s) (compiles excluded), "
                "TRL 1, then 1 each",
  }, threads)
  examples = _common.arithmetic_examples(
      B * (args.steps if args.partial else 1),
      _common.parse_ints(args.levels), args.seed)
  if args.partial:
    return partial_rollouts.run(
        args, grpo_step.OursStep(step_config(args), examples), examples)
  messages = [_common.chat_messages(e.question) for e in examples]
  step = grpo_step.OursStep(step_config(args), examples)
  c = step.config
  texts = templates.render_prompts(step.tokenizer, c.data.template,
                                 [e.question for e in examples],
                                 c.data.system_prompt)
  prompt_ids = step.prompt_ids()
  directory = loading.preset_directory(_common.MODEL)
  hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
  if _common.hf_prompt_ids(hf_tok, messages) != prompt_ids:
    raise RuntimeError("grpo_jax and transformers render the prompts to "
                       "different token ids")
  hf_model = None if args.samplers_only else (
      transformers.AutoModelForCausalLM.from_pretrained(
          directory, dtype=torch.float32).eval())
  clock = step.clock
  samplers = time_samplers(args, step, hf_model, prompt_ids, clock)
  if args.samplers_only:
    report_samplers(args, samplers)
    return 0
  del hf_model
  updates = time_updates(args, step, texts,
                         samplers["static"].pop("samples"))
  print(f"update: padded {updates['padded']:.1f} s, packed "
        f"{updates['packed']:.1f} s")
  sys.stdout.flush()
  ours_steps = []
  for i in range(args.warmup_steps + 1):
    ours_steps.append(step(100 + i))
    print(f"grpo_jax step {i + 1}: {ours_steps[-1]['total']:.1f} s, "
          f"{ours_steps[-1]['compiles']} compilation(s), "
          f"{ours_steps[-1]['compile_s']:.1f} s")
    sys.stdout.flush()
  theirs = None
  if not args.skip_trl:
    del step
    theirs = grpo_step.trl_step_times(args, examples, messages)
    for i, t in enumerate(theirs):
      print(f"TRL step {i + 1}: {t['total']:.1f} s (sample {t['sample']:.1f},"
            f" update {t['update']:.1f}; mean length {t['mean_length']:.0f})")
  report(args, samplers, updates, ours_steps, theirs)
  return 0


def report_samplers(args, samplers) -> None:
  """--samplers-only: the lengths, each sampler's means over the keys and
  its ratio of means to the static sampler (and paged / dense at each slot
  count); the last line is `ratios: sampler <best continuous / static>`."""
  T, n = args.new_tokens, len(args.seed_list)
  d = distribution(samplers["static"]["lengths"])
  print(f"lengths (static sampler, {n} key(s)): mean {d['mean']:.1f} "
        f"({d['mean'] / T:.2f} of the cap), p50 {d['p50']:.0f}, p90 "
        f"{d['p90']:.0f}, max {d['max']:.0f}")
  base = samplers["static"]["useful_tps"]
  rows = []
  for name, r in samplers.items():
    useful = np.mean([x["lengths"].sum() for x in r["seeds"]])
    rows.append((name, f"{r['seconds']:.1f} s", f"{r['steps']:.0f}",
                 f"{r['ms_per_step']:.0f}", f"{useful:.0f}",
                 f"{r['useful_tps']:.1f}",
                 " / ".join(f"{x['useful_tps']:.1f}" for x in r["seeds"]),
                 f"{r['useful_tps'] / base:.2f}x"))
  print(f"means over {n} key(s) ({', '.join(map(str, args.seed_list))}):")
  _common.print_table(("sampler", "wall", "decode steps", "ms per step",
                       "useful tokens", "useful tok/s", "per key",
                       "vs static"), rows)
  for m in args.slot_counts if args.paged else ():
    dense = samplers[f"continuous, {m or 'auto'} slots"]
    paged = samplers[f"continuous paged, {m or 'auto'} slots"]
    per_key = " / ".join(f"{p['useful_tps'] / q['useful_tps']:.2f}"
                         for p, q in zip(paged["seeds"], dense["seeds"]))
    print(f"paged / dense, {m or 'auto'} slots: useful tok/s (ratio of the "
          f"means) {paged['useful_tps'] / dense['useful_tps']:.2f}x (per key "
          f"{per_key}); ms per decode step "
          f"{paged['ms_per_step'] / dense['ms_per_step']:.2f}x")
  best = max(r["useful_tps"] for name, r in samplers.items()
             if name != "static")
  print(f"ratios: sampler {best / base:.2f}")


def report(args, samplers, updates, ours_steps, theirs) -> None:
  T = args.new_tokens
  lengths = samplers["static"]["lengths"]
  d = distribution(lengths)
  print(f"\nlength distribution (static sampler's rollout, {len(lengths)} "
        f"rows, cap {T}): mean {d['mean']:.1f}, p50 {d['p50']:.0f}, p90 "
        f"{d['p90']:.0f}, max {d['max']:.0f}; mean / cap = "
        f"{d['mean'] / T:.2f}")
  if d["mean"] > MAX_MEAN_FRACTION * T:
    print(f"NOTE: mean length above {MAX_MEAN_FRACTION} of the cap: not the "
          "long-tailed workload this benchmark is for; raise --new-tokens")
  u = distribution(updates["lengths"])
  if updates["imposed"]:
    n = distribution(updates["natural"])
    print(f"update rollout's natural lengths: mean {n['mean']:.1f}, p50 "
          f"{n['p50']:.0f}, p90 {n['p90']:.0f}, max {n['max']:.0f}: mean "
          f"above {MAX_MEAN_FRACTION} of the cap, so each row is cut at a "
          "lognormal length (impose_lengths)")
  print(f"update rollout{' (imposed)' if updates['imposed'] else ''}: mean "
        f"{u['mean']:.1f}, p50 {u['p50']:.0f}, p90 {u['p90']:.0f}, max "
        f"{u['max']:.0f}; padded rows of {updates['seq_len']} tokens; packed "
        "rows paid for = "
        f"{updates.get('pack/token_ratio', float('nan')):.2f} of padded, "
        f"fill {updates.get('pack/fill', float('nan')):.2f}\n")
  static = samplers["static"]["useful_tps"]
  rows = []
  for name, s in samplers.items():
    label = {"static": "grpo_jax static sampler",
             "transformers": "transformers generate"}.get(
                 name, f"grpo_jax {name}")
    detail = f"{s['seconds']:.1f} s, {s['steps']:.0f} steps, mean len " \
             f"{s['lengths'].mean():.0f}"
    if s["differ"] is not None:
      detail += f", {s['differ']} rows != static"
    rows.append((f"sampler: {label}", f"{s['useful_tps']:.1f} tok/s", detail,
                 _common.ratio(s["useful_tps"], static, True)))
  rows.append(("update: padded rows", f"{updates['padded']:.1f} s", "-",
               "1.00x"))
  rows.append(("update: packed rows", f"{updates['packed']:.1f} s", "-",
               _common.ratio(updates["packed"], updates["padded"], False)))
  o = ours_steps[-1]
  # A compilation inside the measured step (a new packed-shape bucket, say)
  # is not step time: its seconds are excluded and reported.
  ours_s = o["total"] - o["compile_s"]
  rows.append(("GRPO step: grpo_jax", f"{ours_s:.1f} s",
               f"sample {o['sample']:.1f}, update {o['update']:.1f}; "
               f"{o['compiles']} compile(s), {o['compile_s']:.1f} s excluded",
               "-"))
  if theirs:
    t = theirs[-1]
    rows.append(("GRPO step: TRL GRPOTrainer", f"{t['total']:.1f} s",
                 f"sample {t['sample']:.1f}, update {t['update']:.1f}",
                 _common.ratio(ours_s, t["total"], False)))
  _common.print_table(("what", "time / rate", "detail",
                       "vs first of its kind"), rows)
  continuous = [s["useful_tps"] for name, s in samplers.items()
                if name.startswith("continuous")]
  sampler_ratio = f"{max(continuous) / static:.2f}" if continuous else "n/a"
  step_ratio = f"{theirs[-1]['total'] / ours_s:.2f}" if theirs else "n/a"
  print(f"ratios: sampler {sampler_ratio}, update "
        f"{updates['padded'] / updates['packed']:.2f}, step_vs_trl "
        f"{step_ratio}")


if __name__ == "__main__":
  try:
    sys.exit(main())
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.exit(1)
