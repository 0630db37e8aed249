"""Ahead-of-time compilation: does a config fit a device topology?

JAX compiles for a TPU topology on a CPU-only machine once `libtpu` is
installed (requirements-tpu.txt): `topologies.get_topology_desc` gives
abstract chips, a jitted function lowered on `ShapeDtypeStruct`s sharded
over a mesh of them compiles with the TPU compiler, and
`memory_analysis()` gives per-chip bytes (the compiler's peak: `Program.peak`);
the compiler refuses a program whose peak exceeds the chip (RESOURCE_EXHAUSTED).

`check(config, topology)` compiles, with the project's own functions,
shardings and `init_state` shapes and no weights, every program a training
step and its evaluation run:

  sampler    `padded.sample_padded` at the rows of one sampler call, or
             with `sampling.continuous_batching` `continuous.sample_slots`
             on all of a step's rows (its slots: `sampling.slots`, or the
             most the chip's free memory holds, `sampling.auto_slots`), or
             with `sampling.kv_cache = paged` `paged_slots.sample_pages`
             (the TPU kernel; a pool of the dense slots' bytes, its slots
             from the simulated schedule: `sampler.compare`)
  engine     with an env on the parked engine (`env.engine = parked`), in
             the sampler's place: the engine's decode call and prefills per
             row shard (`engine.py`)
  update     `update.update_step` on one mini-batch split in micro-batches
             (rows of prompt + max_new_tokens, or with an env the
             episode's budget: `Plan.completion_tokens`)
  score      `update.score_logprobs` (π_ref, or π_old recomputed) when used
  update packed, score packed
             the same on packed rows (`rl.packing` on, or auto: a run picks
             per mini-batch, so both paths are compiled; off: padded only),
             shaped by `packed_shape`: R = the micro-batch's rows of
             s = prompt + max_new_tokens tokens (the most a packed row
             holds; the decoder's worst case, one completion at the cap per
             row), PACKED_SEQUENCES_PER_ROW x R sequence slots
  eval       the evaluation's sampler calls (greedy, and n samples if set);
             with a parked env, the engine's at each call's episodes
             (`engine.eval_programs`)

`only` (experiments/aot.py --programs) compiles a subset of those kinds
(`PROGRAMS`); the others are named as not compiled, and the verdict then
covers the compiled ones only (`Report.skipped`).

Per chip it reports argument, output, temporary and peak bytes plus what
stays resident beside the program (the train state during sampling), and
whether the total leaves `SPARE` of the chip's memory free. FLOPs are
counted analytically (`flops.py`): XLA's cost analysis counts a while
loop's body once.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp

from grpo_jax import sharding, validation
from grpo_jax.aot import engine as pod_engine
from grpo_jax.aot import flops as flops_lib
from grpo_jax.aot import sampler as pod_sampler
from grpo_jax.aot import schedule
from grpo_jax.aot.plan import Plan
from grpo_jax.aot.programs import (
  HEADER,
  Chips,
  GiB,
  Program,
  compile_program,
  format_program,
  halvings,
  largest_fitting,
  model_config_from_source,
  topology_devices,
)
from grpo_jax.generate import continuous, sampling
from grpo_jax.models import decode, transformer

# ----------------------------------------------------------------------------
# The whole check.
# ----------------------------------------------------------------------------

PROGRAMS = ("sampler", "update", "update_packed", "score", "score_packed",
            "eval")


def check_programs(only) -> tuple:
  """The kinds of `only` (None or empty: all of `PROGRAMS`), validated."""
  if not only:
    return PROGRAMS
  unknown = [k for k in only if k not in PROGRAMS]
  if unknown:
    raise ValueError(f"--programs: unknown {unknown}; choose from "
                     f"{', '.join(PROGRAMS)}")
  return tuple(only)


class Report(NamedTuple):
  topology: str
  chips: int
  kind: str
  hbm: float
  mesh: dict
  programs: list          # Program, as configured
  advice: list            # strings: what would fit instead
  step: dict              # name -> flops.Roofline per training step
  comparison: Optional[pod_sampler.Comparison] = None   # continuous batching
  skipped: tuple = ()     # programs the config runs, not compiled (`only`)

  @property
  def fits(self) -> bool:
    return all(p.fits(self.hbm) for p in self.programs)


def sampler_prompts(config, plan: Plan, hbm: float) -> int:
  """Prompts per training sampler call: sampling.chunk_rows, or the
  automatic chunk `sampling.auto_chunk_prompts` picks for this chip."""
  rl = config.rl
  budget = plan.sampler_budget(hbm)
  multiple = sampling.prompt_multiple(1, plan.layout.batch_shards,
                                      rl.num_generations)
  return sampling.prompts_per_call(
      _cache_size(config, plan),
      rl.prompts_per_step, rl.num_generations,
      plan.prompt_len + config.sampling.max_new_tokens,
      config.sampling.chunk_rows, budget, multiple)


def _cache_size(config, plan: Plan) -> sampling.CacheSize:
  """The cache a sampler holds: one array per layer for MLA's latent, two
  otherwise (`decode.cache_arrays`, every sampler's)."""
  return sampling.CacheSize(plan.model_config,
                            jnp.dtype(config.model.compute_dtype).itemsize,
                            plan.layout, decode.cache_arrays(plan.model_config))


def continuous_sampler(plan: Plan, slots: int) -> Program:
  """The continuous-batching sampler (`continuous.sample_slots`) on all of a
  step's prompts x G rows with `slots` slots (rows: the slots)."""
  x = pod_sampler.sampler_inputs(plan)
  params, resident = plan.sampler_params(), plan.sampler_resident()
  call = sampling.CallSpec(plan.model_config, plan.sampling_config(),
                           plan.run.batch.generations, plan.layout, slots)
  lower = lambda: continuous.sample_slots.lower(
      call, params, x.prompt_bp, x.prompt_len_b, x.key, jnp.int32(x.prompts))
  return compile_program("sampler slots", slots, lower, resident)


def padded_rows(plan: Plan) -> int:
  return pod_sampler.padded_prompts(plan) * plan.run.batch.generations


def auto_slots(config, plan: Plan, hbm: float, configured: bool = True
               ) -> int:
  """sampling.slots (when `configured`), or the automatic count for this
  chip's free memory."""
  if configured and config.sampling.slots:
    return config.sampling.slots
  rl = config.rl
  budget = plan.sampler_budget(hbm)
  return sampling.auto_slots(
      _cache_size(config, plan), rl.prompts_per_step * rl.num_generations,
      rl.prompts_per_step, plan.prompt_len,
      plan.prompt_len + config.sampling.max_new_tokens, budget)


def _eval_calls(config, plan: Plan):
  """(prompts, generations, greedy) of each evaluation sampler call."""
  examples = config.train.eval_examples
  size = min(config.eval.batch_size, examples)
  calls = [(size, 1, True)]
  if config.eval.n:
    calls.append((size, config.eval.n, False))
  return calls


def update_paths(mode: str) -> tuple[bool, bool]:
  """(padded, packed): which update / scoring programs a run with
  `rl.packing = mode` may execute. auto decides per mini-batch from its
  lengths (`packing.wins`): either can run, so both must fit."""
  return mode != "on", mode != "off"


def check(config, topology: str, prompt_len: int,
          log: Callable[[str], None] = print, search: bool = True,
          lengths: Optional[tuple] = None, compile_programs: bool = True,
          only: Optional[tuple] = None) -> Report:
  """Compiles every program of `config` for `topology`; see module doc.
  search: when a program does not fit, compile smaller sizes to name the
  largest that does (each one more compile). lengths: (completion lengths
  of a step's rows, a description) for the continuous sampler's simulated
  schedule (`schedule.lengths_from_flag`; None: every row at the cap).
  compile_programs False: the schedule and the roofline only. only: the
  kinds of program to compile (`check_programs`), the rest skipped."""
  kinds = check_programs(only)
  validation.validate(config, data_files=False)
  chips = Chips.of(topology_devices(topology))
  devices, spec, hbm = chips
  layout = sharding.Layout(sharding.make_mesh(config.mesh, devices),
                           sharding.logical_rules(config.mesh))
  model_config = model_config_from_source(config.model.source)
  plan = Plan(config, model_config, layout, prompt_len)
  rl, T = config.rl, plan.completion_tokens
  env = plan.run.groups.env
  log(f"topology {topology}: {len(devices)} chips ({spec['kind']}), "
      f"{hbm / GiB:.2f} GiB each; mesh {dict(layout.mesh.shape)}")
  log(f"model {config.model.source}: "
      f"{transformer.count_params(model_config) / 1e9:.2f}B params, "
      f"{config.model.param_dtype} master / {config.model.compute_dtype} "
      f"compute, remat {config.model.remat}; train state "
      f"{plan.state_bytes / GiB:.2f} GiB per chip"
      + (f" (LoRA rank {plan.lora.rank}: adapters + optimizer state; frozen "
         f"base {plan.base_bytes / GiB:.2f} GiB per chip)"
         if plan.base is not None else "")
      + f"; prompts {prompt_len} "
      f"tokens (--prompt_len), completions {T}"
      + (f" (an episode's budget, env {env.name!r})" if env else ""))
  programs, advice, skipped = [], [], []

  def run(build_one: Callable[[], Program],
          retry: Callable[[], Optional[Program]], what, kind: str, name: str):
    if not compile_programs:
      return
    if kind not in kinds:
      skipped.append(name)
      log(f"{name:14s} not compiled (--programs)")
      return
    program = build_one()
    programs.append(program)
    log(format_program(program, hbm))
    if not program.fits(hbm):
      if not search:
        advice.append(f"{program.name} does not fit with {program.rows} rows")
        log("  -> " + advice[-1])
        return
      better = retry()
      advice.append(f"{program.name} does not fit with {program.rows} rows; "
                    + (f"{what} {better.rows} fits "
                       f"({better.total / GiB:.2f} GiB)" if better else
                       f"no {what} fits"))
      log("  -> " + advice[-1])

  b_call = sampler_prompts(config, plan, hbm)
  sampling_config = plan.sampling_config()
  G = rl.num_generations
  rows_per_call = b_call * G
  comparison = None

  def run_engine(engine_programs: list, kind: str):
    for name, build, rows in engine_programs:
      run(lambda build=build, rows=rows: build(rows),
          lambda build=build, rows=rows: largest_fitting(
              halvings(rows)[1:], build, hbm), f"{name} rows", kind, name)

  parked_env = env is not None and env.engine == "parked"
  if parked_env:
    espec = pod_engine.engine_spec(plan)
    log(pod_engine.describe(plan, espec))
    if compile_programs:
      log(HEADER)
    run_engine(pod_engine.programs(plan, espec), "sampler")
    rows_per_call = espec.slots * plan.layout.batch_shards
  elif config.sampling.continuous_batching:
    paged = config.sampling.kv_cache == "paged"
    dense_slots = auto_slots(config, plan, hbm, configured=not paged)
    comparison = pod_sampler.compare(
        plan, chips, dense_slots,
        *(lengths or schedule.lengths_from_flag(
            "cap", padded_rows(plan), T)), log=log)
    for line in pod_sampler.format_comparison(comparison,
                                              plan.layout.batch_shards):
      log(line)
    if paged:
      pages = comparison.paged.pages
      slots = comparison.paged.slots * plan.layout.batch_shards
      log(f"  paged: {pages} pages of {config.sampling.page_size} columns per "
          f"row shard (the KV bytes of {dense_slots} dense slots), "
          f"{slots} slots, decode attention {plan.paged_kernel()!r}")
      build = lambda m: pod_sampler.paged_sampler(plan, m, pages)
    else:
      slots = dense_slots
      build = lambda m: continuous_sampler(plan, m)
    rows_per_call = slots
    if compile_programs:
      log(HEADER)
    run(lambda: build(slots), lambda: largest_fitting(
        halvings(slots, plan.layout.batch_shards)[1:], build, hbm), "slots",
        "sampler", "sampler")
  else:
    if compile_programs:
      log(HEADER)
    build = lambda b: plan.sampler(b, G, sampling_config, "sampler")
    run(lambda: build(b_call), lambda: largest_fitting(
        halvings(b_call)[1:], build, hbm), "sampler chunk (rows)",
        "sampler", "sampler")
  micro = plan.micro_rows()
  padded, packed = update_paths(rl.packing)
  if padded:
    run(lambda: plan.update(micro), lambda: largest_fitting(
        halvings(micro)[1:], plan.update, hbm), "micro-batch (rows)",
        "update", "update")
  if packed:
    run(lambda: plan.packed_update(micro), lambda: largest_fitting(
        halvings(micro)[1:], plan.packed_update, hbm),
        "packed micro-batch (rows)", "update_packed", "update packed")
  if plan.uses_scoring and padded:
    run(lambda: plan.score(micro), lambda: largest_fitting(
        halvings(micro)[1:], plan.score, hbm), "scoring micro-batch (rows)",
        "score", "score")
  if plan.uses_scoring and packed:
    run(lambda: plan.packed_score(micro), lambda: largest_fitting(
        halvings(micro)[1:], plan.packed_score, hbm),
        "packed scoring micro-batch (rows)", "score_packed", "score packed")
  for prompts, g, greedy in _eval_calls(config, plan):
    if parked_env:
      line, engine_programs = pod_engine.eval_programs(plan, prompts, g,
                                                       greedy)
      log(line)
      run_engine(engine_programs, "eval")
      continue
    name = "eval greedy" if greedy else f"eval n={g}"
    build_eval = lambda b, g=g, greedy=greedy, name=name: plan.sampler(
        b, g, plan.sampling_config(greedy), name)
    run(lambda: build_eval(prompts), lambda: largest_fitting(
        halvings(prompts)[1:], build_eval, hbm), "eval batch (prompts x g)",
        "eval", name)
  if not config.sampling.continuous_batching:
    for line in window_lines(plan, rows_per_call):
      log(line)
  step = step_roofline(plan, spec, len(devices), rows_per_call, (
      None if comparison is None else
      comparison.paged if config.sampling.kv_cache == "paged" else
      comparison.dense), None if lengths is None or env else lengths[0])
  return Report(topology, len(devices), spec["kind"], hbm,
                dict(layout.mesh.shape), programs, advice, step, comparison,
                tuple(skipped))


def static_decode_bytes(plan: Plan, rows_per_call: int,
                        skip_windows: bool = False) -> float:
  """HBM bytes per chip the sampler's decode reads over a step, every row
  to the cap, `rows_per_call` rows at a time (ceil(b·g / rows_per_call)
  waves of t steps, `flops.decode_bytes_per_chip`)."""
  c, config = plan.model_config, plan.config
  rows = config.rl.prompts_per_step * config.rl.num_generations
  kv_heads = c.num_kv_heads / plan.layout.splits("kv_heads", c.num_kv_heads)
  return -(-rows // rows_per_call) * flops_lib.decode_bytes_per_chip(
      c, rows_per_call / plan.layout.batch_shards, kv_heads,
      plan.prompt_len, plan.completion_tokens, plan.weight_bytes(),
      jnp.dtype(config.model.compute_dtype).itemsize, skip_windows)


def window_lines(plan: Plan, rows_per_call: int) -> list[str]:
  """For a model with sliding windows: the decode's reads as the roofline
  counts them (every layer every column: the static and dense-slot
  samplers mask a window, they do not skip its columns) and with sliding
  layers reading only their windows (the paged reference,
  `paged.window_attention`)."""
  c = plan.model_config
  windows = flops_lib.layer_windows(c)
  if all(w is None for w in windows):
    return []
  x = plan.seq_len
  at_cap = sum(x if w is None else min(x, w) for w in windows)
  every, skip = (static_decode_bytes(plan, rows_per_call, s) / 1e12
                 for s in (False, True))
  return [f"sliding windows ({sum(w is not None for w in windows)} of "
          f"{len(windows)} layers): a decode step at the cap reads "
          f"{len(windows) * x:,} key columns per row over all layers, "
          f"{at_cap:,} if sliding layers read only their windows; the step's "
          f"decode reads {every:,.1f} TB per chip (the roofline below), "
          f"{skip:,.1f} TB skipping the columns behind the windows"]


def step_roofline(plan: Plan, spec: dict, chips: int, rows_per_call: int,
                  slot_schedule: Optional[schedule.Schedule] = None,
                  lengths_n=None) -> dict:
  """Analytic FLOPs and roofline seconds of one training step's stages.
  The sampler: with a simulated `slot_schedule` (continuous batching), its
  decode steps' roofline; else it decodes `rows_per_call` rows at a time
  (a static call's prompts x G), every row to the cap: the b·g rows take
  ceil(b·g / rows_per_call) waves of t decode steps. The update and
  scoring: at the rows' `lengths_n` when they may run packed (rl.packing
  on or auto: packed rows hold only real tokens), else at t."""
  c, config = plan.model_config, plan.config
  rl, p, t = config.rl, plan.prompt_len, plan.completion_tokens
  b, g = rl.prompts_per_step, rl.num_generations
  shape = flops_lib.StepShape(b, g, p, t)
  read = static_decode_bytes(plan, rows_per_call)
  out = {"sampler": flops_lib.roofline(
      flops_lib.sampler_flops(c, shape), chips, spec["flops"], read,
      spec["bandwidth"])}
  if slot_schedule is not None:   # + the prefill, compute-bound
    prefill = flops_lib.forward_flops(c, b * p, b,
                                      b * flops_lib.causal_pairs(p, 0))
    out["sampler"] = flops_lib.Roofline(
        prefill + float(slot_schedule.flops_k.sum()) * chips,
        prefill / (chips * spec["flops"]) + slot_schedule.seconds,
        "memory" if slot_schedule.memory_bound > 0.5 else "compute")
  shared = rl.shared_prompt and g > 1
  rows = None if rl.packing == "off" else lengths_n
  out["update"] = flops_lib.roofline(
      rl.num_updates * flops_lib.update_flops(c, shape, config.model.remat,
                                              shared, rows),
      chips, spec["flops"])
  passes = int(plan.spec.loss.use_kl) + int(plan.spec.recompute_old)
  if passes:
    out["score"] = flops_lib.roofline(
        passes * flops_lib.score_flops(c, shape, shared, rows), chips,
        spec["flops"])
  return out


def format_step(report: Report) -> list[str]:
  lines = []
  total = 0.0
  for name, r in report.step.items():
    total += r.seconds
    lines.append(f"{name:8s} {r.flops:10.3e} FLOPs  roofline "
                 f"{r.seconds:9.2f} s ({r.bound}-bound)")
  lines.append(f"step     {sum(r.flops for r in report.step.values()):10.3e}"
               f" FLOPs  roofline {total:9.2f} s")
  return lines
