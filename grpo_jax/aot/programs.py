"""What `check` compiles on: the chips of a topology (`Chips`: HBM, FLOP/s,
bandwidth), the model and train state as abstract arrays (no weights), and
one compiled program with its per-chip memory (`Program`). `plan.Plan`
lowers a config's programs on them.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax import sharding
from grpo_jax.errors import ConfigError
from grpo_jax.generate import decoding
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import hf, lora, quant, transformer
from grpo_jax.models.config import ModelConfig
from grpo_jax.rl import optimizer as optimizer_lib
from grpo_jax.rl import update

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


class Chips(NamedTuple):
  """Chips a program or a side of a split runs on: the devices, their spec
  (`chip_spec`) and HBM per chip (`chip_memory`)."""
  devices: list
  spec: dict
  hbm: float

  @classmethod
  def of(cls, devices: list) -> "Chips":
    return cls(devices, chip_spec(devices), chip_memory(devices))

  @property
  def count(self) -> int:
    return len(self.devices)


def model_config_from_source(source: str) -> ModelConfig:
  """A preset name, or a Hugging Face directory / config.json: the shapes
  only (no weight file is read)."""
  if source in model_config_lib.preset_names():
    return model_config_lib.get_preset(source)
  path = Path(source)
  config_json = path / "config.json" if path.is_dir() else path
  if config_json.name == "config.json" and config_json.is_file():
    return hf.read_config(config_json)
  if path.is_dir():
    raise ConfigError(f"config field 'model.source' = {source!r} is a directory "
                      "without config.json: the model's shapes are read from it; "
                      "give the Hugging Face model directory, or a preset name")
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


def quantized(params) -> Any:
  """`params` (sharded ShapeDtypeStructs) as the sampler holds them with
  `sampling.weights_dtype = int8` (`quant.sampler_weights`): int8 values
  sharded as their weights, scales as their weights along the axes they
  keep (replicated along the input axes they reduce)."""
  out = jax.eval_shape(
      lambda p: quant.sampler_weights(p, "int8", transformer.PROJECTION_INPUTS),
      params)

  def place(w, q):
    if not quant.is_quantized(q):
      return w
    spec = tuple(w.sharding.spec) + (None,) * (w.ndim - len(w.sharding.spec))
    kept = P(*(a if n > 1 else None for a, n in zip(spec, q.scale.shape)))
    return dataclasses.replace(
        q, qvalue=_sds(q.qvalue.shape, q.qvalue.dtype, w.sharding),
        scale=_sds(q.scale.shape, q.scale.dtype,
                   NamedSharding(w.sharding.mesh, kept)))
  return jax.tree.map(place, params, out)


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
  compiler_peak: int = 0  # memory_analysis().peak_memory_in_bytes (0: not
                          # reported): `peak` says why it is preferred
  collectives: tuple = ()  # samplers: (kind, per-chip bytes) of one decode
                           # step (`decode_collectives`)
  program_collectives: tuple = ()  # update / scoring: (kind, per-chip
                                   # bytes) of the program's text, each op
                                   # once (`hlo_collectives`)

  @property
  def peak(self) -> int:
    """Per-chip bytes live at once: the compiler's own peak where it
    reports one, else arguments + outputs - aliased + temporaries. The sum
    can overstate: for the int8 paged sampler of the paper config XLA:TPU
    reported 104.53 GiB of temporaries, more than the chip holds, and
    compiled it; its peak was 53.85 GiB, and the dumped buffer assignment
    holds 54.73 GiB in all (docs/pod.md)."""
    if self.compiler_peak:
      return self.compiler_peak
    return self.argument + self.output - self.alias + self.temp

  @property
  def total(self) -> int:
    return self.peak + self.resident

  def fits(self, hbm: float) -> bool:
    return not self.refused and self.total <= (1 - SPARE) * hbm


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
                "u64": 8}
_OP = (r"= (\(?[a-z0-9]+\[[^=]*?) (all-gather|all-reduce|reduce-scatter"
       r"|all-to-all|collective-permute)(?:-start)?\(")
_COLLECTIVE = re.compile(_OP + r".*op_name=\"[^\"]*/" + decoding.DECODE_SCOPE
                         + r"/while/body/")
_ARRAY = re.compile(r"([a-z0-9]+)\[([\d,]*)\]")


def decode_collectives(hlo: str) -> tuple:
  """(kind, bytes) of each collective kind in one step of a compiled
  sampler's decode loop, per chip: the result arrays of the collectives
  whose op_name is under the decode loop's body (`decoding.DECODE_SCOPE`),
  each op once (an async op's last result array). What crosses ICI each
  decode step, which the slot schedule's roofline leaves out."""
  return hlo_collectives(hlo, _COLLECTIVE)


def hlo_collectives(hlo: str, pattern: re.Pattern = re.compile(_OP)
                    ) -> tuple:
  """(kind, bytes) of each collective kind among the ops `pattern` matches
  (default: every collective of the program), per chip, each op once: a
  loop's body counts once (an update: one layer's forward and backward of
  one micro-batch, plus what is outside the loops)."""
  total = {}
  for m in pattern.finditer(hlo):
    dtype, dims = _ARRAY.findall(m.group(1))[-1]
    size = _DTYPE_BYTES.get(dtype, 4) * math.prod(
        int(d) for d in dims.split(",") if d)
    total[m.group(2)] = total.get(m.group(2), 0) + size
  return tuple(sorted(total.items()))


_REQUIRED = re.compile(r"memory required for HLO temporaries \(([\d.]+)([KMGT])\)"
                       r"|total memory required[^(]*\(([\d.]+)([KMGT])\)")


def compile_program(name: str, rows: int, lower: Callable[[], Any],
                    resident: int, whole_collectives: bool = False
                    ) -> Program:
  """Compiles `lower()`'s program; a refusal for memory is a result.
  whole_collectives: also count every collective of its text
  (`Program.program_collectives`; the update and scoring)."""
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
  hlo = compiled.as_text()
  return Program(name, rows, analysis.argument_size_in_bytes,
                 analysis.output_size_in_bytes, analysis.alias_size_in_bytes,
                 analysis.temp_size_in_bytes, resident,
                 compiler_peak=getattr(analysis, "peak_memory_in_bytes", 0),
                 collectives=decode_collectives(hlo),
                 program_collectives=(hlo_collectives(hlo)
                                      if whole_collectives else ()))


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


def format_program(p: Program, hbm: float) -> str:
  g = lambda x: f"{x / GiB:8.2f}"
  if p.refused:
    return (f"{p.name:14s} {p.rows:7d}  refused by the compiler: needs "
            f"{p.temp / GiB:.2f} GiB + {p.resident / GiB:.2f} GiB resident "
            f"> {hbm / GiB:.2f} GiB   NO")
  verdict = "yes" if p.fits(hbm) else "NO"
  line = (f"{p.name:14s} {p.rows:7d} {g(p.argument)} {g(p.output)} "
          f"{g(p.temp)} {g(p.peak)} {g(p.resident)} {g(p.total)} "
          f"{100 * p.total / hbm:6.1f}%  {verdict}")
  if p.collectives:
    each = ", ".join(f"{kind} {b / 1e6:.2f}" for kind, b in p.collectives)
    line += (f"\n{'':14s} one decode step's collectives per chip, MB: {each}"
             f" (total {sum(b for _, b in p.collectives) / 1e6:.2f}; not in "
             "the slot schedule)")
  if p.program_collectives:
    each = ", ".join(f"{kind} {b / 1e6:.2f}"
                     for kind, b in p.program_collectives)
    line += (f"\n{'':14s} collectives per chip, each op of the program once "
             f"(a loop's body once), MB: {each} (total "
             f"{sum(b for _, b in p.program_collectives) / 1e6:.2f})")
  return line


HEADER = (f"{'program':14s} {'rows':>7s} {'arg GiB':>8s} {'out GiB':>8s} "
          f"{'temp GiB':>8s} {'peak GiB':>8s} {'resident':>8s} "
          f"{'total':>8s} {'of HBM':>7s}  fits (<= {100 * (1 - SPARE):.0f}%)")
