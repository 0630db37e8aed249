"""What `check` compiles: the chips of a topology (HBM, FLOP/s, bandwidth),
the model and train state as abstract arrays (no weights), one compiled
program with its per-chip memory (`Program`), and `Plan`: every program of a
config, lowered with the trainer's own functions and shardings.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from grpo_jax import sharding
from grpo_jax.rl import optimizer as optimizer_lib
from grpo_jax.rl import packing, update
from grpo_jax.rl.step import update_group_size
from grpo_jax.generate import decoding, padded, sampling
from grpo_jax.errors import ConfigError
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import hf, lora, paged, transformer
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


def abstract_adapters(model_config: ModelConfig, spec, dtype, layout) -> Any:
  """LoRA adapters (models/lora.py) as the trainer places them."""
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)),
                        lora.adapter_shapes(model_config, spec),
                        is_leaf=lambda x: isinstance(x, tuple))
  shardings = sharding.param_shardings(layout.mesh, layout.rules, model_config,
                                       shapes)
  return jax.tree.map(lambda x, sh: _sds(x.shape, x.dtype, sh), shapes,
                      shardings)


def abstract_state(model_config: ModelConfig, optimizer, param_dtype, layout,
                   params=None):
  """TrainState ShapeDtypeStructs with the shardings `Layout.place_state`
  gives the real state (of `params`, e.g. LoRA adapters; default: the
  model's params in param_dtype)."""
  if params is None:
    params = abstract_params(model_config, param_dtype, layout)
  state = jax.eval_shape(lambda p: update.init_state(p, optimizer, 0), params)
  shardings = sharding.state_shardings(layout.mesh, layout.rules,
                                       model_config,
                                       optimizer_lib.as_optax(optimizer), state)
  return jax.tree.map(lambda x, sh: _sds(x.shape, x.dtype, sh), state,
                      shardings)


def per_chip_bytes(tree) -> int:
  """Bytes of one chip's shards of a tree of sharded ShapeDtypeStructs."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def row_sharded(layout, shape, dtype) -> jax.ShapeDtypeStruct:
  return _sds(shape, dtype, sharding.batch_sharding(layout.mesh, layout.rules,
                                                    shape))


def replicated(layout, x) -> jax.ShapeDtypeStruct:
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
  collectives: tuple = ()  # samplers: (kind, per-chip bytes) of one decode
                           # step (`decode_collectives`)

  @property
  def peak(self) -> int:
    return self.argument + self.output - self.alias + self.temp

  @property
  def total(self) -> int:
    return self.peak + self.resident

  def fits(self, hbm: float) -> bool:
    return not self.refused and self.total <= (1 - SPARE) * hbm


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
                "u64": 8}
_COLLECTIVE = re.compile(
    r"= (\(?[a-z0-9]+\[[^=]*?) (all-gather|all-reduce|reduce-scatter|all-to-all"
    r"|collective-permute)(?:-start)?\(.*op_name=\"[^\"]*/"
    + decoding.DECODE_SCOPE + r"/while/body/")
_ARRAY = re.compile(r"([a-z0-9]+)\[([\d,]*)\]")


def decode_collectives(hlo: str) -> tuple:
  """(kind, bytes) of each collective kind in one step of a compiled
  sampler's decode loop, per chip: the result arrays of the collectives
  whose op_name is under the decode loop's body (`decoding.DECODE_SCOPE`),
  each op once (an async op's last result array). What crosses ICI each
  decode step, which the slot schedule's roofline leaves out."""
  total = {}
  for m in _COLLECTIVE.finditer(hlo):
    dtype, dims = _ARRAY.findall(m.group(1))[-1]
    size = _DTYPE_BYTES.get(dtype, 4) * math.prod(
        int(d) for d in dims.split(",") if d)
    total[m.group(2)] = total.get(m.group(2), 0) + size
  return tuple(sorted(total.items()))


_REQUIRED = re.compile(r"memory required for HLO temporaries \(([\d.]+)([KMGT])\)"
                       r"|total memory required[^(]*\(([\d.]+)([KMGT])\)")


def compile_program(name: str, rows: int, lower: Callable[[], Any],
                    resident: int) -> Program:
  """Compiles `lower()`'s program; a refusal for memory is a result."""
  try:
    compiled = lower().compile()
    analysis = compiled.memory_analysis()
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
                 analysis.temp_size_in_bytes, resident,
                 collectives=decode_collectives(compiled.as_text()))


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
  base: Any = None     # LoRA: the frozen base (compute dtype), else None

  def __post_init__(self):
    rl, m = self.config.rl, self.config.model
    self.rows = rl.prompts_per_step * rl.num_generations
    self.mini = rl.mini_batch_size or self.rows
    self.optimizer = optimizer_lib.OptimizerSpec.from_config(self.config.optim, 1)
    self.settings = update.LossSettings.from_config(self.config)
    self.lora = lora.LoraSpec.from_config(self.config)
    adapters = None
    if self.lora.enabled:   # state = adapters + their optimizer state
      self.base = abstract_params(self.model_config, m.compute_dtype,
                                  self.layout)
      adapters = abstract_adapters(self.model_config, self.lora,
                                   m.param_dtype, self.layout)
    self.state = abstract_state(self.model_config, self.optimizer,
                                m.param_dtype, self.layout, adapters)

  @property
  def base_bytes(self) -> int:
    """LoRA: the frozen base, resident all run (0 without LoRA)."""
    return 0 if self.base is None else per_chip_bytes(self.base)

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
    """A separate compute-dtype copy exists only when the dtypes differ
    (LoRA: the merged copy, model.lora.sampler = merged)."""
    m = self.config.model
    if self.base is not None:
      return (per_chip_bytes(self.compute_params())
              if self.lora.sampler == "merged" else 0)
    if m.compute_dtype == m.param_dtype:
      return 0
    return per_chip_bytes(self.compute_params())

  def sampler_params(self):
    """What the sampler decodes with: the compute-dtype params (LoRA: the
    merged copy, or the base with the adapters attached)."""
    if self.base is not None and self.lora.sampler == "unmerged":
      cast = lambda x: _sds(x.shape, jnp.dtype(self.config.model.compute_dtype),
                            x.sharding)
      return lora.attach(self.base, jax.tree.map(cast, self.state.params),
                         1.0)
    return self.compute_params()

  def sampler(self, prompts: int, generations: int, cfg, name: str
              ) -> Program:
    """One sampler call on `prompts` prompts (padded as `sampling.sample`
    pads them) x `generations` rows each."""
    b = sampling.padded_prompts(prompts, prompts, self.layout.batch_shards,
                                generations)
    prompt = row_sharded(self.layout, (b, self.prompt_len), jnp.int32)
    lens = row_sharded(self.layout, (b,), jnp.int32)
    key = replicated(self.layout, jax.eval_shape(lambda: jax.random.key(0)))
    params, resident = self.sampler_params(), self.sampler_resident()
    call = decoding.CallSpec(self.model_config, cfg, generations, self.layout)
    lower = lambda: padded.sample_padded.lower(call, params, prompt, lens, key)
    return compile_program(name, b * generations, lower, resident)

  def sampler_resident(self) -> int:
    """Bytes alive beside a sampler call: the train state (and the reference
    when β > 0); with equal dtypes the sampler reads the state's own params
    (its argument). LoRA: the base too, unless the sampler reads it
    (unmerged)."""
    if self.base is not None:
      return self.state_bytes + (self.base_bytes
                                 if self.compute_copy_bytes() else 0)
    return self.state_bytes + self.reference_bytes() - (
        0 if self.compute_copy_bytes() else per_chip_bytes(self.state.params))

  def sampler_budget(self, hbm: float) -> float:
    """Per-chip bytes the sampler's caches may take a share of (sampling
    .KV_FRACTION): what the train state, the reference and the compute copy
    leave."""
    return (hbm - self.state_bytes - self.reference_bytes()
            - self.compute_copy_bytes() - self.base_bytes)

  def weight_bytes(self) -> int:
    """The per-chip bytes of the weights the sampler reads each decode step."""
    if self.base is not None:
      return self.base_bytes
    return per_chip_bytes(self.state.params) * jnp.dtype(
        self.config.model.compute_dtype).itemsize // jnp.dtype(
            self.config.model.param_dtype).itemsize

  def sampling_config(self, greedy=False) -> sampling.SamplingConfig:
    s = self.config.sampling
    return sampling.SamplingConfig(
        max_new_tokens=s.max_new_tokens, temperature=s.temperature,
        top_p=s.top_p, top_k=s.top_k, greedy=greedy, stop_ids=(0,),
        stop_check_every=s.stop_check_every)

  def paged_kernel(self) -> str:
    """The paged decode attention a TPU run uses: `sampling.paged_kernel`
    resolved as on a TPU backend (auto: the Pallas kernel where it can take
    the model, `paged.kernel_refuses`); this process itself runs on the
    CPU backend."""
    return paged.resolve(self.config.sampling.paged_kernel, self.model_config,
                         backend="tpu")

  def paged_sampling_config(self) -> sampling.SamplingConfig:
    """The training sampler's config with the paged KV cache."""
    return dataclasses.replace(
        self.sampling_config(), continuous_batching=True, kv_cache="paged",
        page_size=self.config.sampling.page_size,
        paged_kernel=self.paged_kernel())

  def sequence_columns(self, n: int) -> tuple:
    """Abstract (tokens, positions, valid) [n, s] of n padded rows, split
    over the batch shards: the update's and scoring's decoder inputs."""
    return tuple(row_sharded(self.layout, (n, self.seq_len), dtype)
                 for dtype in (jnp.int32, jnp.int32, jnp.bool_))

  def update(self, micro_rows: int) -> Program:
    """update_step on one mini-batch in micro-batches of `micro_rows`."""
    n, T = self.mini, self.config.sampling.max_new_tokens
    batch = update.UpdateBatch(
        *self.sequence_columns(n),
        row_sharded(self.layout, (n, T), jnp.bool_),
        row_sharded(self.layout, (n, T), jnp.float32),
        row_sharded(self.layout, (n, T), jnp.float32),
        row_sharded(self.layout, (n,), jnp.float32))
    group = update_group_size(self.config.rl, n)
    resident = self.reference_bytes()
    lower = lambda: update.update_step.lower(
        self.state, batch, self.model_config, self.optimizer, n // micro_rows,
        self.settings, self.layout, group, self.base)
    return compile_program("update", micro_rows, lower, resident)

  def packed_rows(self, rows: int, micro_rows: int
                  ) -> tuple[packing.PackedRows, int, int]:
    """Abstract `packing.pack_rows` output for `rows` sequences at
    `micro_rows` rows per micro-batch (see `PACKED_SEQUENCES_PER_ROW`),
    with R rows per micro-batch and M micro-batches."""
    R, M, N = packed_shape(rows, micro_rows, self.layout.batch_shards)
    S, T = self.seq_len, self.config.sampling.max_new_tokens
    row = lambda dtype: row_sharded(self.layout, (R * M, S), dtype)
    return packing.PackedRows(
        row(jnp.int32), row(jnp.int32), row(jnp.bool_), row(jnp.int32),
        row(jnp.int32), row_sharded(self.layout, (N * M, T), jnp.int32),
        row_sharded(self.layout, (N * M,), jnp.int32)), R, M

  def packed_update(self, micro_rows: int) -> Program:
    """update_step on one mini-batch packed (`rl.packing`): rows of
    s = prompt + max_new_tokens tokens, `micro_rows` per micro-batch."""
    n, T = self.mini, self.config.sampling.max_new_tokens
    rows, R, num_micro = self.packed_rows(n, micro_rows)
    slots = rows.src_nt.shape[0]
    batch = update.PackedUpdateBatch(
        rows, row_sharded(self.layout, (slots, T), jnp.bool_),
        row_sharded(self.layout, (slots, T), jnp.float32),
        row_sharded(self.layout, (slots, T), jnp.float32),
        row_sharded(self.layout, (slots,), jnp.float32))
    lower = lambda: update.update_step.lower(
        self.state, batch, self.model_config, self.optimizer, num_micro,
        self.settings, self.layout, base=self.base)
    return compile_program("update packed", R, lower, self.reference_bytes())

  def packed_score(self, micro_rows: int) -> Program:
    """score_packed on the step's rows packed (as `packed_update`)."""
    rows, R, num_micro = self.packed_rows(self.rows, micro_rows)
    resident = self.state_bytes + self.reference_bytes() - per_chip_bytes(
        self.state.params)
    lower = lambda: update.score_packed.lower(
        self.state.params, rows, self.model_config, self.settings, num_micro,
        self.rows, self.layout, self.base)
    return compile_program("score packed", R, lower, resident)

  def reference_bytes(self) -> int:
    """The reference model's params, alive all run when β > 0 (LoRA: none,
    the reference is the base, an argument of every program)."""
    if self.base is not None:
      return 0
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
        rows // micro_rows, self.layout, self.base)
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
