"""Ahead-of-time compilation: does a config fit a device topology?

JAX compiles for a TPU topology on a CPU-only machine once `libtpu` is
installed (requirements-tpu.txt): `topologies.get_topology_desc` gives
abstract chips, a jitted function lowered on `ShapeDtypeStruct`s sharded
over a mesh of them compiles with the TPU compiler, and
`memory_analysis()` gives per-chip bytes. The compiler refuses a program
whose peak exceeds the chip's memory (RESOURCE_EXHAUSTED).

`check(config, topology)` compiles, with the project's own functions,
shardings and `init_state` shapes and no weights, every program a training
step and its evaluation run:

  sampler    `sampling.sample_padded` at the rows of one sampler call, or
             with `sampling.continuous_batching` `continuous.sample_slots`
             on all of a step's rows (its slots: `sampling.slots`, or the
             most the chip's free memory holds, `sampling.auto_slots`)
  update     `update.update_step` on one mini-batch split in micro-batches
  score      `update.score_logprobs` (π_ref, or π_old recomputed) when used
  update packed, score packed
             the same on packed rows (`rl.packing` on, or auto: a run picks
             per mini-batch, so both paths are compiled; off: padded only),
             shaped by `packed_shape`: R = the micro-batch's rows of
             s = prompt + max_new_tokens tokens (the most a packed row
             holds; the decoder's worst case, one completion at the cap per
             row), PACKED_SEQUENCES_PER_ROW x R sequence slots
  eval       the evaluation's sampler calls (greedy, and n samples if set)

Per chip it reports argument, output, temporary and peak bytes plus what
stays resident beside the program (the train state during sampling), and
whether the total leaves `SPARE` of the chip's memory free. FLOPs are
counted analytically (`flops.py`): XLA's cost analysis counts a while
loop's body once.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from grpo_jax.generate import continuous
from grpo_jax.aot import flops as flops_lib
from grpo_jax import sharding, validation
from grpo_jax.rl import packing, update
from grpo_jax.rl.step import update_group_size
from grpo_jax.generate import sampling
from grpo_jax.errors import ConfigError
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import hf, transformer
from grpo_jax.models.config import ModelConfig

SPARE = 0.05           # a program fits when it leaves 5% of the chip free
GiB = 1024 ** 3

# Per chip: HBM the compiler may use (its own figure, as it prints in a
# RESOURCE_EXHAUSTED message), peak bf16 FLOP/s and HBM bytes/s (public
# spec sheets). `chip_memory` asks the compiler first; this is the fallback.
CHIPS = {
    "TPU v4": dict(hbm=31.25 * GiB, flops=275e12, bandwidth=1228e9),
    "TPU v5 lite": dict(hbm=15.75 * GiB, flops=197e12, bandwidth=819e9),
    "TPU v5": dict(hbm=95.74 * GiB, flops=459e12, bandwidth=2765e9),
    "TPU v6 lite": dict(hbm=31.25 * GiB, flops=918e12, bandwidth=1640e9),
}


# ----------------------------------------------------------------------------
# Topology and model, without weights.
# ----------------------------------------------------------------------------

def topology_devices(name: str) -> list:
  """The abstract chips of a TPU topology such as 'v5p:8x8x4' (needs
  libtpu; no TPU)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return list(topologies.get_topology_desc(
        platform="tpu", topology_name=name).devices)
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f"--topology={name!r}: JAX cannot describe it ({e}); "
                      "give e.g. v5e:2x2, v5p:8x8x4 or v6e:16x16, and "
                      "install requirements-tpu.txt (libtpu)") from e


def chip_spec(devices) -> dict:
  kind = devices[0].device_kind
  if kind not in CHIPS:
    raise ConfigError(f"no peak FLOP/s / bandwidth figures for {kind!r}; "
                      f"known: {sorted(CHIPS)}")
  return {**CHIPS[kind], "kind": kind}


_AVAILABLE = re.compile(r"available HBM \(([\d.]+)([KMGT])\)")


def chip_memory(devices) -> float:
  """Bytes the compiler lets one chip use: it names them when refusing a
  program that asks for more (falls back to CHIPS)."""
  mesh = jax.sharding.Mesh(devices[:1], ("x",))
  out = NamedSharding(mesh, P())
  try:
    jax.jit(lambda: jnp.zeros((1 << 38,), jnp.float32),
            out_shardings=out).lower().compile()
  except Exception as e:  # pylint: disable=broad-except
    found = _AVAILABLE.search(str(e))
    if found:
      return float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024
  return chip_spec(devices)["hbm"]


def model_config_from_source(source: str) -> ModelConfig:
  """A preset name, or a Hugging Face directory / config.json: the shapes
  only (no weight file is read)."""
  if source in model_config_lib.preset_names():
    return model_config_lib.get_preset(source)
  path = Path(source)
  if path.is_dir() or path.name == "config.json":
    return hf.read_config(path)
  raise ConfigError(f"config field 'model.source' = {source!r}: give a preset "
                    f"({', '.join(model_config_lib.preset_names())}) or a "
                    "directory holding config.json")


def _sds(shape, dtype, sharding_) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_)


def abstract_params(model_config: ModelConfig, dtype, layout) -> Any:
  shardings = sharding.param_shardings(layout.mesh, layout.rules, model_config)
  shapes = transformer.param_shapes(model_config)
  return jax.tree.map(lambda s, sh: _sds(s, jnp.dtype(dtype), sh), shapes,
                      shardings, is_leaf=lambda x: isinstance(x, tuple))


def abstract_state(model_config: ModelConfig, optimizer, param_dtype, layout):
  """TrainState ShapeDtypeStructs with the shardings `Layout.place_state`
  gives the real state."""
  params = abstract_params(model_config, param_dtype, layout)
  state = jax.eval_shape(lambda p: update.init_state(p, optimizer, 0), params)
  shardings = sharding.state_shardings(layout.mesh, layout.rules,
                                       model_config,
                                       update.as_optax(optimizer), state)
  return jax.tree.map(lambda x, sh: _sds(x.shape, x.dtype, sh), state,
                      shardings)


def per_chip_bytes(tree) -> int:
  """Bytes of one chip's shards of a tree of sharded ShapeDtypeStructs."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def _rows(layout, shape, dtype) -> jax.ShapeDtypeStruct:
  return _sds(shape, dtype, sharding.batch_sharding(layout.mesh, layout.rules,
                                                    shape))


def _replicated(layout, x) -> jax.ShapeDtypeStruct:
  return _sds(x.shape, x.dtype, NamedSharding(layout.mesh, P()))


# ----------------------------------------------------------------------------
# One compiled program and its memory.
# ----------------------------------------------------------------------------

class Program(NamedTuple):
  name: str
  rows: int               # rows per call (update: per micro-batch)
  argument: int           # per-chip bytes (memory_analysis)
  output: int
  alias: int
  temp: int
  resident: int           # per-chip bytes alive beside the program
  refused: str = ""       # the compiler's RESOURCE_EXHAUSTED message

  @property
  def peak(self) -> int:
    return self.argument + self.output - self.alias + self.temp

  @property
  def total(self) -> int:
    return self.peak + self.resident

  def fits(self, hbm: float) -> bool:
    return not self.refused and self.total <= (1 - SPARE) * hbm


_REQUIRED = re.compile(r"memory required for HLO temporaries \(([\d.]+)([KMGT])\)"
                       r"|total memory required[^(]*\(([\d.]+)([KMGT])\)")


def compile_program(name: str, rows: int, lower: Callable[[], Any],
                    resident: int) -> Program:
  """Compiles `lower()`'s program; a refusal for memory is a result."""
  try:
    analysis = lower().compile().memory_analysis()
  except Exception as e:  # pylint: disable=broad-except
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    message = str(e).split("\n")[0]
    found = _REQUIRED.search(message)
    need = 0
    if found:
      value, unit = [g for g in found.groups() if g is not None]
      need = int(float(value) * 1024 ** ("KMGT".index(unit) + 1))
    return Program(name, rows, 0, 0, 0, need, resident, message)
  return Program(name, rows, analysis.argument_size_in_bytes,
                 analysis.output_size_in_bytes, analysis.alias_size_in_bytes,
                 analysis.temp_size_in_bytes, resident)


# ----------------------------------------------------------------------------
# The programs of a config.
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
  """What one training step and its evaluation compile, from a config."""
  config: Any
  model_config: ModelConfig
  layout: sharding.Layout
  prompt_len: int
  optimizer: Any = None
  settings: Any = None
  state: Any = None

  def __post_init__(self):
    rl = self.config.rl
    self.rows = rl.prompts_per_step * rl.num_generations
    self.mini = rl.mini_batch_size or self.rows
    self.optimizer = update.OptimizerSpec.from_config(self.config.optim, 1)
    self.settings = update.LossSettings.from_config(self.config)
    self.state = abstract_state(self.model_config, self.optimizer,
                                self.config.model.param_dtype, self.layout)

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.config.sampling.max_new_tokens

  @property
  def state_bytes(self) -> int:
    return per_chip_bytes(self.state)

  def compute_params(self):
    return abstract_params(self.model_config, self.config.model.compute_dtype,
                           self.layout)

  def compute_copy_bytes(self) -> int:
    """A separate compute-dtype copy exists only when the dtypes differ."""
    m = self.config.model
    if m.compute_dtype == m.param_dtype:
      return 0
    return per_chip_bytes(self.compute_params())

  def sampler(self, prompts: int, generations: int, cfg, name: str
              ) -> Program:
    """One sampler call on `prompts` prompts (padded as `sampling.sample`
    pads them) x `generations` rows each."""
    b = sampling.padded_prompts(prompts, prompts, self.layout.batch_shards,
                                generations)
    prompt = _rows(self.layout, (b, self.prompt_len), jnp.int32)
    lens = _rows(self.layout, (b,), jnp.int32)
    key = _replicated(self.layout, jax.eval_shape(lambda: jax.random.key(0)))
    params = self.compute_params()
    # Beside it: the train state (and the reference when β > 0); with equal
    # dtypes the sampler reads the state's own params (its argument).
    resident = self.state_bytes + self.reference_bytes() - (
        0 if self.compute_copy_bytes() else per_chip_bytes(self.state.params))
    lower = lambda: sampling.sample_padded.lower(
        self.model_config, params, prompt, lens, key, cfg, generations,
        self.layout)
    return compile_program(name, b * generations, lower, resident)

  def sampling_config(self, greedy=False) -> sampling.SamplingConfig:
    s = self.config.sampling
    return sampling.SamplingConfig(
        max_new_tokens=s.max_new_tokens, temperature=s.temperature,
        top_p=s.top_p, top_k=s.top_k, greedy=greedy, stop_ids=(0,))

  def sequence_columns(self, n: int) -> tuple:
    """Abstract (tokens, positions, valid) [n, s] of n padded rows, split
    over the batch shards: the update's and scoring's decoder inputs."""
    return tuple(_rows(self.layout, (n, self.seq_len), dtype)
                 for dtype in (jnp.int32, jnp.int32, jnp.bool_))

  def update(self, micro_rows: int) -> Program:
    """update_step on one mini-batch in micro-batches of `micro_rows`."""
    n, T = self.mini, self.config.sampling.max_new_tokens
    batch = update.UpdateBatch(
        *self.sequence_columns(n),
        _rows(self.layout, (n, T), jnp.bool_),
        _rows(self.layout, (n, T), jnp.float32),
        _rows(self.layout, (n, T), jnp.float32),
        _rows(self.layout, (n,), jnp.float32))
    group = update_group_size(self.config.rl, n)
    resident = self.reference_bytes()
    lower = lambda: update.update_step.lower(
        self.state, batch, self.model_config, self.optimizer, n // micro_rows,
        self.settings, self.layout, group)
    return compile_program("update", micro_rows, lower, resident)

  def packed_rows(self, rows: int, micro_rows: int
                  ) -> tuple[packing.PackedRows, int, int]:
    """Abstract `packing.pack_rows` output for `rows` sequences at
    `micro_rows` rows per micro-batch (see `PACKED_SEQUENCES_PER_ROW`),
    with R rows per micro-batch and M micro-batches."""
    R, M, N = packed_shape(rows, micro_rows, self.layout.batch_shards)
    S, T = self.seq_len, self.config.sampling.max_new_tokens
    row = lambda dtype: _rows(self.layout, (R * M, S), dtype)
    return packing.PackedRows(
        row(jnp.int32), row(jnp.int32), row(jnp.bool_), row(jnp.int32),
        row(jnp.int32), _rows(self.layout, (N * M, T), jnp.int32),
        _rows(self.layout, (N * M,), jnp.int32)), R, M

  def packed_update(self, micro_rows: int) -> Program:
    """update_step on one mini-batch packed (`rl.packing`): rows of
    s = prompt + max_new_tokens tokens, `micro_rows` per micro-batch."""
    n, T = self.mini, self.config.sampling.max_new_tokens
    rows, R, num_micro = self.packed_rows(n, micro_rows)
    slots = rows.src_nt.shape[0]
    batch = update.PackedUpdateBatch(
        rows, _rows(self.layout, (slots, T), jnp.bool_),
        _rows(self.layout, (slots, T), jnp.float32),
        _rows(self.layout, (slots, T), jnp.float32),
        _rows(self.layout, (slots,), jnp.float32))
    lower = lambda: update.update_step.lower(
        self.state, batch, self.model_config, self.optimizer, num_micro,
        self.settings, self.layout)
    return compile_program("update packed", R, lower, self.reference_bytes())

  def packed_score(self, micro_rows: int) -> Program:
    """score_packed on the step's rows packed (as `packed_update`)."""
    rows, R, num_micro = self.packed_rows(self.rows, micro_rows)
    resident = self.state_bytes + self.reference_bytes() - per_chip_bytes(
        self.state.params)
    lower = lambda: update.score_packed.lower(
        self.state.params, rows, self.model_config, self.settings, num_micro,
        self.rows, self.layout)
    return compile_program("score packed", R, lower, resident)

  def reference_bytes(self) -> int:
    """The reference model's params, alive all run when β > 0."""
    return per_chip_bytes(self.state.params) if self.settings.use_kl else 0

  def score(self, micro_rows: int) -> Program:
    """score_logprobs on the step's rows in micro-batches of `micro_rows`."""
    T, rows = self.config.sampling.max_new_tokens, self.rows
    cols = self.sequence_columns(rows)
    group = update_group_size(self.config.rl, rows)
    resident = self.state_bytes + self.reference_bytes() - per_chip_bytes(
        self.state.params)
    lower = lambda: update.score_logprobs.lower(
        self.state.params, *cols, self.model_config, T, self.settings, group,
        rows // micro_rows, self.layout)
    return compile_program("score", micro_rows, lower, resident)

  def micro_rows(self) -> int:
    rl = self.config.rl
    return update.micro_batch_rows(self.mini, self.seq_len,
                                   rl.micro_batch_size, rl.micro_batch_tokens)

  @property
  def uses_scoring(self) -> bool:
    return self.settings.use_kl or self.config.rl.old_logp == "recompute"


# Sequences per packed row that aot.py assumes when it sizes the slot arrays
# ([N, T] per micro-batch, N = this x R): completions of a quarter of
# max_new_tokens on average (issue 15's long-tailed workload has a mean of at
# most 0.35). Only the loss's [N, T] float32 arrays depend on it; the
# decoder's activations are the R rows' whatever they hold.
PACKED_SEQUENCES_PER_ROW = 4


def packed_shape(rows: int, micro_rows: int, shards: int
                 ) -> tuple[int, int, int]:
  """(R rows per micro-batch, M micro-batches, N slots per micro-batch) of
  `rows` sequences packed as `step.train_step` packs them
  (`packing.pack_rows(..., micro_rows, shards)`), in its worst case for the
  decoder: every completion at max_new_tokens, so one sequence per row of
  s = prompt + max_new_tokens tokens and as many rows as the padded path
  (`packing.micro_batch_shape`). N: `PACKED_SEQUENCES_PER_ROW` per row, a
  power of two as pack_rows buckets it, a multiple of the shards."""
  R, M = packing.micro_batch_shape(rows, micro_rows, shards)
  return R, M, packing.slot_count(PACKED_SEQUENCES_PER_ROW * R, shards)


def halvings(n: int, floor: int = 1) -> list[int]:
  """n, n/2, n/4, ... while divisible and >= floor."""
  out = [n]
  while out[-1] % 2 == 0 and out[-1] // 2 >= floor:
    out.append(out[-1] // 2)
  return out


def largest_fitting(candidates, build: Callable[[int], Program], hbm: float
                    ) -> Optional[Program]:
  """The first (largest) candidate whose program fits, or None."""
  for size in candidates:
    program = build(size)
    if program.fits(hbm):
      return program
  return None


# ----------------------------------------------------------------------------
# The whole check.
# ----------------------------------------------------------------------------

class Report(NamedTuple):
  topology: str
  chips: int
  kind: str
  hbm: float
  mesh: dict
  programs: list          # Program, as configured
  advice: list            # strings: what would fit instead
  step: dict              # name -> flops.Roofline per training step

  @property
  def fits(self) -> bool:
    return all(p.fits(self.hbm) for p in self.programs)


def sampler_prompts(config, plan: Plan, hbm: float) -> int:
  """Prompts per training sampler call: sampling.chunk_rows, or the
  automatic chunk `sampling.auto_chunk_prompts` picks for this chip."""
  rl = config.rl
  budget = (hbm - plan.state_bytes - plan.reference_bytes()
            - plan.compute_copy_bytes())
  multiple = sampling.prompt_multiple(1, plan.layout.batch_shards,
                                      rl.num_generations)
  return sampling.prompts_per_call(
      plan.model_config, rl.prompts_per_step, rl.num_generations,
      plan.prompt_len + config.sampling.max_new_tokens,
      config.sampling.chunk_rows, budget, plan.layout,
      jnp.dtype(config.model.compute_dtype).itemsize, multiple)


def continuous_sampler(plan: Plan, slots: int) -> Program:
  """The continuous-batching sampler (`continuous.sample_slots`) on all of a
  step's prompts x G rows with `slots` slots (rows: the slots)."""
  rl = plan.config.rl
  b = -(-rl.prompts_per_step // plan.layout.batch_shards) * (
      plan.layout.batch_shards)
  prompt = _rows(plan.layout, (b, plan.prompt_len), jnp.int32)
  lens = _rows(plan.layout, (b,), jnp.int32)
  key = _replicated(plan.layout, jax.eval_shape(lambda: jax.random.key(0)))
  params = plan.compute_params()
  resident = plan.state_bytes + plan.reference_bytes() - (
      0 if plan.compute_copy_bytes() else per_chip_bytes(plan.state.params))
  lower = lambda: continuous.sample_slots.lower(
      plan.model_config, params, prompt, lens, key, plan.sampling_config(),
      rl.num_generations, slots, jnp.int32(b), plan.layout)
  return compile_program("sampler slots", slots, lower, resident)


def auto_slots(config, plan: Plan, hbm: float) -> int:
  """sampling.slots, or the automatic count for this chip's free memory."""
  if config.sampling.slots:
    return config.sampling.slots
  rl = config.rl
  budget = (hbm - plan.state_bytes - plan.reference_bytes()
            - plan.compute_copy_bytes())
  return sampling.auto_slots(
      plan.model_config, rl.prompts_per_step * rl.num_generations,
      rl.prompts_per_step, plan.prompt_len,
      plan.prompt_len + config.sampling.max_new_tokens, budget, plan.layout,
      jnp.dtype(config.model.compute_dtype).itemsize)


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
          log: Callable[[str], None] = print, search: bool = True) -> Report:
  """Compiles every program of `config` for `topology`; see module doc.
  search: when a program does not fit, compile smaller sizes to name the
  largest that does (each one more compile)."""
  validation.validate(config, data_files=False)
  devices = topology_devices(topology)
  spec = chip_spec(devices)
  hbm = chip_memory(devices)
  layout = sharding.Layout(sharding.make_mesh(config.mesh, devices),
                           sharding.logical_rules(config.mesh))
  model_config = model_config_from_source(config.model.source)
  plan = Plan(config, model_config, layout, prompt_len)
  rl, T = config.rl, config.sampling.max_new_tokens
  log(f"topology {topology}: {len(devices)} chips ({spec['kind']}), "
      f"{hbm / GiB:.2f} GiB each; mesh {dict(layout.mesh.shape)}")
  log(f"model {config.model.source}: "
      f"{transformer.count_params(model_config) / 1e9:.2f}B params, "
      f"{config.model.param_dtype} master / {config.model.compute_dtype} "
      f"compute, remat {config.model.remat}; train state "
      f"{plan.state_bytes / GiB:.2f} GiB per chip; prompts {prompt_len} "
      f"tokens (--prompt_len), completions {T}")
  log(HEADER)
  programs, advice = [], []

  def run(program: Program, retry: Callable[[], Optional[Program]], what):
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
  cfg = plan.sampling_config()
  G = rl.num_generations
  rows_per_call = b_call * G
  if config.sampling.continuous_batching:
    slots = rows_per_call = auto_slots(config, plan, hbm)
    build = lambda m: continuous_sampler(plan, m)
    run(build(slots), lambda: largest_fitting(
        halvings(slots, plan.layout.batch_shards)[1:], build, hbm), "slots")
  else:
    build = lambda b: plan.sampler(b, G, cfg, "sampler")
    run(build(b_call), lambda: largest_fitting(
        halvings(b_call)[1:], build, hbm), "sampler chunk (rows)")
  micro = plan.micro_rows()
  padded, packed = update_paths(rl.packing)
  if padded:
    run(plan.update(micro), lambda: largest_fitting(
        halvings(micro)[1:], plan.update, hbm), "micro-batch (rows)")
  if packed:
    run(plan.packed_update(micro), lambda: largest_fitting(
        halvings(micro)[1:], plan.packed_update, hbm),
        "packed micro-batch (rows)")
  if plan.uses_scoring and padded:
    run(plan.score(micro), lambda: largest_fitting(
        halvings(micro)[1:], plan.score, hbm), "scoring micro-batch (rows)")
  if plan.uses_scoring and packed:
    run(plan.packed_score(micro), lambda: largest_fitting(
        halvings(micro)[1:], plan.packed_score, hbm),
        "packed scoring micro-batch (rows)")
  for prompts, g, greedy in _eval_calls(config, plan):
    name = "eval greedy" if greedy else f"eval n={g}"
    build_eval = lambda b, g=g, greedy=greedy, name=name: plan.sampler(
        b, g, plan.sampling_config(greedy), name)
    run(build_eval(prompts), lambda: largest_fitting(
        halvings(prompts)[1:], build_eval, hbm), "eval batch (prompts x g)")
  step = step_roofline(plan, spec, len(devices), rows_per_call)
  return Report(topology, len(devices), spec["kind"], hbm,
                dict(layout.mesh.shape), programs, advice, step)


def step_roofline(plan: Plan, spec: dict, chips: int, rows_per_call: int
                  ) -> dict:
  """Analytic FLOPs and roofline seconds of one training step's stages.
  The sampler decodes `rows_per_call` rows at a time (a static call's
  prompts x G, or continuous batching's slots), every row to the cap: the
  b·g rows take ceil(b·g / rows_per_call) waves of t decode steps."""
  c, config = plan.model_config, plan.config
  rl, p, t = config.rl, plan.prompt_len, config.sampling.max_new_tokens
  b, g = rl.prompts_per_step, rl.num_generations
  calls = -(-(b * g) // rows_per_call)
  compute_item = jnp.dtype(config.model.compute_dtype).itemsize
  weights = per_chip_bytes(plan.state.params) * compute_item / jnp.dtype(
      config.model.param_dtype).itemsize
  shards = plan.layout.batch_shards
  kv_heads = c.num_kv_heads / plan.layout.splits("kv_heads",
                                                 c.num_kv_heads)
  read = calls * flops_lib.decode_bytes_per_chip(
      c, rows_per_call / shards, kv_heads, p, t, weights, compute_item)
  out = {"sampler": flops_lib.roofline(
      flops_lib.sampler_flops(c, b, g, p, t), chips, spec["flops"], read,
      spec["bandwidth"])}
  shared = rl.shared_prompt and g > 1
  out["update"] = flops_lib.roofline(
      rl.num_updates * flops_lib.update_flops(c, b, g, p, t,
                                              config.model.remat, shared),
      chips, spec["flops"])
  passes = int(plan.settings.use_kl) + int(rl.old_logp == "recompute")
  if passes:
    out["score"] = flops_lib.roofline(
        passes * flops_lib.score_flops(c, b, g, p, t, shared), chips,
        spec["flops"])
  return out


def format_program(p: Program, hbm: float) -> str:
  g = lambda x: f"{x / GiB:8.2f}"
  if p.refused:
    return (f"{p.name:14s} {p.rows:7d}  refused by the compiler: needs "
            f"{p.temp / GiB:.2f} GiB + {p.resident / GiB:.2f} GiB resident "
            f"> {hbm / GiB:.2f} GiB   NO")
  verdict = "yes" if p.fits(hbm) else "NO"
  return (f"{p.name:14s} {p.rows:7d} {g(p.argument)} {g(p.output)} "
          f"{g(p.temp)} {g(p.peak)} {g(p.resident)} {g(p.total)} "
          f"{100 * p.total / hbm:6.1f}%  {verdict}")


HEADER = (f"{'program':14s} {'rows':>7s} {'arg GiB':>8s} {'out GiB':>8s} "
          f"{'temp GiB':>8s} {'peak GiB':>8s} {'resident':>8s} "
          f"{'total':>8s} {'of HBM':>7s}  fits (<= {100 * (1 - SPARE):.0f}%)")


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
