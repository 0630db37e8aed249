"""LoRA: low-rank adapters beside a frozen base (Hu et al. 2021).

A projection y = x·W (W: the base's (L, in..., out...) weight, e.g. wq
(L, D, H, E)) becomes

    y = x·W + (α/r)·(x·A)·B        A (L, in..., r), B (L, r, out...)

A is random (PEFT's kaiming-uniform: U(±1/sqrt(fan_in))) and B zeros, so
the adapted model starts equal to the base, bit for bit.

The adapters are their own pytree, shaped like a slice of the params:

    adapters = {"layers": {"lora": {"wq": {"a": A, "b": B}, ...}}}

`attach(base, adapters, scale)` puts them beside the base's weights
(`params["layers"]["lora"]`), where the decoder (`transformer._project`)
adds the low-rank term; the base is not copied. The trainer differentiates
w.r.t. the adapters only: the base is an argument it does not
differentiate, kept in the compute dtype. The KL reference is the base with
no adapters attached. `merge` folds them into a copy of the weights
(W + α/r·A·B), which the sampler decodes with (`policy_params`).

Logical axes (`transformer.lora_axes`): A keeps its weight's input axes, B
its output axes, and the rank axis is replicated, so `sharding.Layout`
splits them as it splits the base weight.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from grpo_jax.models import transformer
from grpo_jax.models.config import ModelConfig

Params = dict[str, Any]
PROJECTIONS = tuple(transformer.PROJECTION_INPUTS)
# Where the decoder looks for adapters, inside params["layers"].
KEY = transformer.LORA_KEY
SAMPLERS = ("merged", "unmerged")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """config.model.lora as a hashable value. rank 0: off (full fine-tuning)."""
  rank: int = 0
  alpha: float = 32.0
  targets: tuple[str, ...] = PROJECTIONS
  dropout: float = 0.0
  sampler: str = "merged"

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    """α/r, the adapters' scale (PEFT's `scaling`, not rsLoRA's)."""
    return self.alpha / self.rank if self.rank else 0.0

  @property
  def names(self) -> tuple[str, ...]:
    return target_names(self.targets)

  @classmethod
  def from_config(cls, config) -> "LoraSpec":
    c = config.model.lora
    return cls(rank=int(c.rank), alpha=float(c.alpha),
               targets=tuple(c.targets), dropout=float(c.dropout),
               sampler=c.sampler)


def target_names(patterns) -> tuple[str, ...]:
  """The projections (in decoder order) that the patterns name: fnmatch
  patterns over a projection's name or its param path, e.g. "wq",
  "w_*", "layers/w*". A pattern that matches none is an error."""
  chosen = set()
  for pattern in patterns:
    hits = [n for n in PROJECTIONS if fnmatch.fnmatchcase(n, pattern)
            or fnmatch.fnmatchcase(f"layers/{n}", pattern)]
    if not hits:
      raise ValueError(f"target {pattern!r} matches no projection; the "
                       f"projections LoRA adapts: {list(PROJECTIONS)}")
    chosen.update(hits)
  return tuple(n for n in PROJECTIONS if n in chosen)


def adapter_shapes(model_config: ModelConfig, spec: LoraSpec) -> Params:
  """{"layers": {"lora": {name: {"a": (L, in..., r), "b": (L, r, out...)}}}}."""
  shapes = transformer.param_shapes(model_config)["layers"]
  out = {}
  for name in spec.names:
    shape, k = shapes[name], 1 + transformer.PROJECTION_INPUTS[name]
    out[name] = {"a": shape[:k] + (spec.rank,),
                 "b": shape[:1] + (spec.rank,) + shape[k:]}
  return {"layers": {KEY: out}}


def init_adapters(model_config: ModelConfig, spec: LoraSpec, key: jax.Array,
                  dtype=jnp.float32) -> Params:
  """A ~ U(±1/sqrt(fan_in)) (PEFT: kaiming_uniform_(a=sqrt(5))), B = 0."""
  shapes = adapter_shapes(model_config, spec)["layers"][KEY]
  keys = jax.random.split(key, len(shapes))
  out = {}
  for k, (name, s) in zip(keys, shapes.items()):
    fan_in = math.prod(s["a"][1:-1])
    bound = 1.0 / math.sqrt(fan_in)
    out[name] = {"a": jax.random.uniform(k, s["a"], dtype, -bound, bound),
                 "b": jnp.zeros(s["b"], dtype)}
  return {"layers": {KEY: out}}


def is_adapters(params: Params) -> bool:
  """Whether a params tree is adapters alone (a LoRA RL checkpoint's),
  not full weights (e.g. STaR's merged M_n)."""
  return (isinstance(params, dict) and set(params) == {"layers"}
          and set(params["layers"]) == {KEY})


def _scaled(adapters: Params, scale: float) -> Params:
  """The adapters with α/r folded into A: (x·sA)·B = s·(x·A)·B."""
  return {name: {"a": ab["a"] * jnp.asarray(scale, ab["a"].dtype),
                 "b": ab["b"]}
          for name, ab in adapters["layers"][KEY].items()}


def attach(base: Params, adapters: Params, scale: float) -> Params:
  """The base's params with the adapters beside its weights (no copy of
  the base): what `transformer` runs as x·W + s·(x·A)·B."""
  return {**base, "layers": {**base["layers"], KEY: _scaled(adapters, scale)}}


def merge(base: Params, adapters: Params, scale: float, dtype=None) -> Params:
  """A copy of the base with W + s·A·B in every adapted weight, in `dtype`
  (default: the base's); the product is formed in float32, layer by layer."""
  base = base if dtype is None else transformer.cast(base, dtype)
  layers = dict(base["layers"])
  for name, ab in adapters["layers"][KEY].items():
    w = layers[name]
    delta = jax.vmap(lambda a, b: jnp.tensordot(
        a.astype(jnp.float32), b.astype(jnp.float32), axes=1))(ab["a"], ab["b"])
    layers[name] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
  return {**base, "layers": layers}


@jax.jit
def _merge_jit(base: Params, adapters: Params, scale: jax.Array) -> Params:
  return merge(base, adapters, scale)


def policy_params(base: Params, adapters: Params, spec: LoraSpec,
                  dtype: str) -> Params:
  """The policy as the sampler runs it, in `dtype`: the adapters merged into
  a copy of the base (spec.sampler = merged) or attached unmerged."""
  if spec.sampler == "merged":
    return _merge_jit(transformer.cast(base, dtype), adapters,
                      jnp.float32(spec.scale))
  return transformer.cast(attach(base, adapters, spec.scale), dtype)


# ----------------------------------------------------------------------------
# PEFT interchange: adapter_config.json + adapter_model.safetensors.
# ----------------------------------------------------------------------------

# Our projection -> the module PEFT adapts in a Llama / Qwen2 / Qwen3 /
# Mistral decoder layer (transformers' names; models/hf.py's layout).
PEFT_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
                "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
                "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                "w_down": "mlp.down_proj"}
_PEFT_NAME = "base_model.model.model.layers.{i}.{module}.lora_{ab}.weight"


def peft_tensors(adapters: Params) -> dict[str, Any]:
  """PEFT's tensors of the adapters: lora_A.weight (r, in) and lora_B.weight
  (out, r) per layer, `in`/`out` flattened as transformers' nn.Linear
  flattens them (our (H, E) -> H*E, row-major, as models/hf.py)."""
  out = {}
  for name, ab in adapters["layers"][KEY].items():
    a, b = np.asarray(ab["a"]), np.asarray(ab["b"])
    r = a.shape[-1]
    for i in range(a.shape[0]):
      fill = dict(i=i, module=PEFT_MODULES[name])
      out[_PEFT_NAME.format(ab="A", **fill)] = np.ascontiguousarray(
          a[i].reshape(-1, r).T)
      out[_PEFT_NAME.format(ab="B", **fill)] = np.ascontiguousarray(
          b[i].reshape(r, -1).T)
  return out


def peft_config(spec: LoraSpec, base_model: str = "") -> dict:
  """adapter_config.json: plain LoRA, scale lora_alpha / r (not rsLoRA)."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM",
          "base_model_name_or_path": base_model, "r": spec.rank,
          "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
          "target_modules": sorted(PEFT_MODULES[n].split(".")[-1]
                                   for n in spec.names),
          "bias": "none", "use_rslora": False, "fan_in_fan_out": False,
          "init_lora_weights": True, "inference_mode": True,
          "modules_to_save": None}


def save_peft_adapter(adapters: Params, spec: LoraSpec, directory,
                      base_model: str = ""):
  """Writes a directory `peft.PeftModel.from_pretrained(model, directory)`
  loads onto the transformers model of the base; returns its path."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  save_file(peft_tensors(adapters), str(directory / "adapter_model.safetensors"),
            metadata={"format": "pt"})
  (directory / "adapter_config.json").write_text(
      json.dumps(peft_config(spec, base_model), indent=2))
  return directory
