"""Hugging Face checkpoints: config.json <-> ModelConfig, reading safetensors
(reading the files: `hf_read.py`; writing: `hf_write.py`).

Parameters map to transformers tensor names through `tensor_specs(config)`:
each leaf of the params tree is one HF tensor (or one per layer, stacked on
our leading L axis), stored transposed for matrices (HF keeps nn.Linear's
(out, in)) and with heads flattened. Readers here and in `gguf_loader.py`
hand out tensors in that HF layout; `TensorSpec.to_ours` turns them into ours.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from grpo_jax.errors import WeightsError
from grpo_jax.models import hf_gemma, hf_moe
from grpo_jax.models.config import ModelConfig, RopeScaling
from grpo_jax.models.transformer import param_shapes

# transformers class name -> our architecture (its `model_type` is the same).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    **hf_gemma.CLASSES,
    **hf_moe.CLASSES,
}
_HF_CLASS = {arch: cls for cls, arch in HF_ARCHITECTURES.items()}
# config.json's model_type -> our architecture (Gemma 3's text model is
# "gemma3_text").
_MODEL_TYPES = {**{a: a for a in _HF_CLASS}, **hf_gemma.MODEL_TYPES,
                **hf_moe.MODEL_TYPES}


# ----------------------------------------------------------------------------
# config.json -> ModelConfig (transformers 4 and 5 spellings).
# ----------------------------------------------------------------------------

def read_config(path: Path) -> ModelConfig:
  """Parses a model directory's config.json (or the file itself)."""
  path = Path(path)
  if path.is_dir():
    path = path / "config.json"
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found: a Hugging Face model directory "
                            "needs config.json next to its *.safetensors")
  try:
    hf = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise WeightsError(f"{path} is not valid JSON: {e}") from e
  return config_from_hf(hf_gemma.text_config(hf), source=str(path))


_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "intermediate_size")


def config_from_hf(hf: dict[str, Any], source: str = "config.json"
                   ) -> ModelConfig:
  """A ModelConfig from a transformers config dict; unsupported ones raise."""
  arch = _architecture(hf, source)

  def unsupported(what):
    return WeightsError(f"{source}: {what} is not supported by grpo_jax")

  if arch == "deepseek_v3":
    theta, scaling = _rope(hf, unsupported)
    if scaling is not None:
      raise unsupported("DeepSeek-V3 rope scaling (yarn)")
    return ModelConfig(**hf_moe.deepseek_from_hf(hf, unsupported),
                       rope_theta=theta)
  gemma = arch in hf_gemma.MODEL_TYPES.values()
  if hf.get("hidden_act", "silu") != "silu" and not gemma:
    raise unsupported(f"hidden_act={hf['hidden_act']!r}")
  if hf.get("mlp_bias") or (arch != "qwen2" and hf.get("attention_bias")):
    raise unsupported("attention_bias/mlp_bias=true")
  missing = [k for k in _REQUIRED_KEYS if k not in hf]
  if missing:
    raise WeightsError(f"{source} lacks {', '.join(missing)}, which a "
                          f"{arch} config.json must give: is it complete?")
  if gemma:
    return _config(hf, arch, **hf_gemma.config_from_hf(hf, arch, unsupported))
  theta, scaling = _rope(hf, unsupported)
  moe = arch == "qwen3_moe"
  return _config(hf, arch, rope_theta=theta, rope_scaling=scaling,
                 qkv_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "qwen3_moe"),
                 moe=hf_moe.moe_from_hf(hf, unsupported) if moe else None,
                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                 sliding_window=_sliding_window(hf, arch, unsupported))


def _config(hf: dict[str, Any], arch: str, **fields) -> ModelConfig:
  """The fields every family reads the same way, plus `fields`."""
  heads = hf["num_attention_heads"]
  return ModelConfig(
      architecture=arch, vocab_size=hf["vocab_size"], dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
      max_seq_len=hf.get("max_position_embeddings") or 4096, **fields)


def _architecture(hf: dict[str, Any], source: str) -> str:
  classes = hf.get("architectures") or []
  for cls in classes:
    if cls in HF_ARCHITECTURES:
      return HF_ARCHITECTURES[cls]
  if not classes and hf.get("model_type") in _MODEL_TYPES:
    return _MODEL_TYPES[hf["model_type"]]
  found = classes or hf.get("model_type")
  raise WeightsError(
      f"{source}: unknown architecture {found!r}; supported: "
      f"{sorted(HF_ARCHITECTURES)} (model_type {sorted(_MODEL_TYPES)})")


def _rope(hf: dict[str, Any], unsupported: Callable[[str], Exception]
          ) -> tuple[float, Optional[RopeScaling]]:
  """(theta, scaling). transformers 5 nests both in `rope_parameters`; the
  4.x top-level `rope_theta`/`rope_scaling` win when present, as in 5.x."""
  params = hf.get("rope_parameters") or {}
  theta = hf.get("rope_theta", params.get("rope_theta", 10_000.0))
  scaling = hf.get("rope_scaling") or params
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return float(theta), None
  if kind == "linear":
    return float(theta), RopeScaling(factor=scaling["factor"], kind="linear")
  if kind != "llama3":
    raise unsupported(f"rope type {kind!r}")
  return float(theta), RopeScaling(
      factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
      high_freq_factor=scaling["high_freq_factor"],
      original_max_position_embeddings=scaling[
          "original_max_position_embeddings"])


def _sliding_window(hf: dict[str, Any], arch: str,
                    unsupported: Callable[[str], Exception]) -> Optional[int]:
  """One window for every layer, or None; a per-layer mix is not supported."""
  if arch == "llama":
    return None
  if arch == "mistral":
    return hf.get("sliding_window")
  # Qwen: transformers 5 lists `layer_types`; 4.x has use_sliding_window and
  # windows only the layers from index max_window_layers on.
  num_layers = hf["num_hidden_layers"]
  kinds = hf.get("layer_types")
  if kinds is None:
    first = hf.get("max_window_layers", num_layers)
    windowed = hf.get("use_sliding_window", False)
    kinds = ["sliding_attention" if windowed and i >= first
             else "full_attention" for i in range(num_layers)]
  if set(kinds) == {"full_attention"}:
    return None
  if set(kinds) == {"sliding_attention"}:
    return hf["sliding_window"]
  raise unsupported("a mix of sliding-window and full-attention layers")


def _scaling_to_hf(scaling: RopeScaling) -> dict[str, Any]:
  if scaling.kind == "linear":
    return {"rope_type": "linear", "factor": scaling.factor}
  fields = dataclasses.asdict(scaling)
  del fields["kind"]
  return {"rope_type": "llama3", **fields}


def config_to_hf(model_config: ModelConfig, dtype_name: str,
                 token_ids: Optional[dict[str, Any]] = None) -> dict[str, Any]:
  """config.json content that transformers 4.x and 5.x both read."""
  c = model_config
  if c.sliding_window is not None and c.architecture == "llama":
    raise ValueError("a llama config with sliding_window has no "
                     "transformers equivalent; use architecture='mistral'")
  scaling = None if c.rope_scaling is None else _scaling_to_hf(c.rope_scaling)
  hf = {
      "architectures": [_HF_CLASS[c.architecture]],
      "model_type": c.architecture,
      "vocab_size": c.vocab_size, "hidden_size": c.dim,
      "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
      "intermediate_size": c.mlp_dim, "hidden_act": "silu",
      "rms_norm_eps": c.norm_eps, "max_position_embeddings": c.max_seq_len,
      "tie_word_embeddings": c.tie_embeddings,
      # 4.x spelling, then 5.x's; both say the same thing.
      "rope_theta": c.rope_theta, "rope_scaling": scaling,
      "rope_parameters": {**(scaling or {"rope_type": "default"}),
                          "rope_theta": c.rope_theta},
      "dtype": dtype_name, "torch_dtype": dtype_name,
      **(token_ids or {}),
  }
  if c.gemma:
    hf.update(hf_gemma.config_to_hf(c))
  if c.architecture != "qwen2":
    hf.update(attention_bias=False, mlp_bias=False)
  if c.architecture == "mistral":
    hf["sliding_window"] = c.sliding_window
  if c.architecture == "qwen3_moe":
    hf.update(hf_moe.moe_to_hf(c))
  if c.architecture == "deepseek_v3":
    hf.update(hf_moe.deepseek_to_hf(c))
  if c.architecture in ("qwen2", "qwen3", "qwen3_moe"):
    windowed = c.sliding_window is not None
    kind = "sliding_attention" if windowed else "full_attention"
    hf.update(use_sliding_window=windowed, sliding_window=c.sliding_window,
              max_window_layers=0 if windowed else c.num_layers,
              layer_types=[kind] * c.num_layers)
  return hf


# ----------------------------------------------------------------------------
# Parameter leaf <-> HF tensor name and layout.
# ----------------------------------------------------------------------------

_LAYER = "model.layers.{i}."


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One leaf of the params tree and the HF tensor(s) it is made of.

  path: leaf path in the params tree, e.g. ("layers", "wq").
  hf_name: the HF tensor name, with "{i}" for the layer when `per_layer`.
  hf_shape: one HF tensor's shape; matrices are (out, in) as in nn.Linear.
  shape: our shape of one layer's slice (the leaf without its L axis).
  transposed: ours is the HF matrix transposed, then reshaped.
  offset: ours is HF's + offset (Gemma's norms: 1 + w), added in float32.
  layers: the HF layers stacked on our axis 0 (None: all; an MoE model's
    expert and dense-MLP leaves stack only theirs).
  experts: > 0: our axis 1 stacks that many HF tensors, "{x}" in hf_name.
  """
  path: tuple[str, ...]
  hf_name: str
  hf_shape: tuple[int, ...]
  shape: tuple[int, ...]
  transposed: bool
  offset: float = 0.0
  layers: Optional[tuple[int, ...]] = None
  experts: int = 0
  perm: Optional[tuple[int, ...]] = None   # ours[..., j] = HF's[..., perm[j]]

  @property
  def per_layer(self) -> bool:
    return self.path[0] == "layers"

  def slices(self, num_layers: int) -> list[list[str]]:
    """The HF names of each index of our axis 0 (one, or one per expert)."""
    if not self.per_layer:
      return [[self.hf_name]]
    ids = range(num_layers) if self.layers is None else self.layers
    return [[self.hf_name.format(i=i, x=x) for x in range(self.experts)]
            if self.experts else [self.hf_name.format(i=i)] for i in ids]

  def names(self, num_layers: int) -> list[str]:
    return [n for names in self.slices(num_layers) for n in names]

  def read_slice(self, read: Callable, names: list[str], dtype=None):
    """Ours of one index of axis 0 from its HF tensors (`read(name)`)."""
    if not self.experts:
      return self.to_ours(read(names[0]), dtype)
    return np.stack([self.to_ours(read(n), dtype) for n in names])

  def to_ours(self, w_hf: np.ndarray, dtype=None) -> np.ndarray:
    """Ours in `dtype` (None: the stored one)."""
    shape = self.shape[1:] if self.experts else self.shape
    w = (w_hf.T if self.transposed else w_hf).reshape(shape)
    if self.perm is not None:
      w = w[..., list(self.perm)]
    if self.offset:
      w = np.asarray(w, np.float32) + np.float32(self.offset)
    return w.astype(w_hf.dtype if dtype is None else dtype, copy=False)

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    if self.perm is not None:
      w = np.asarray(w)[..., list(np.argsort(self.perm))]
    if self.offset:
      w = (np.asarray(w, np.float32) - np.float32(self.offset)).astype(w.dtype)
    if self.transposed:
      return np.ascontiguousarray(w.reshape(self.hf_shape[::-1]).T)
    return w.reshape(self.hf_shape)


def _hf_layout(c: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
  """leaf name -> (HF name, HF shape, transposed)."""
  H, K, hd, D, F, V = (c.num_heads, c.num_kv_heads, c.head_dim, c.dim,
                       c.mlp_dim, c.vocab_size)
  attn = _LAYER + "self_attn."
  return {
      "embed": ("model.embed_tokens.weight", (V, D), False),
      "lm_head": ("lm_head.weight", (V, D), True),
      "final_norm": ("model.norm.weight", (D,), False),
      "attn_norm": (_LAYER + "input_layernorm.weight", (D,), False),
      "mlp_norm": (_LAYER + "post_attention_layernorm.weight", (D,), False),
      "wq": (attn + "q_proj.weight", (H * hd, D), True),
      "wk": (attn + "k_proj.weight", (K * hd, D), True),
      "wv": (attn + "v_proj.weight", (K * hd, D), True),
      "wo": (attn + "o_proj.weight", (D, H * hd), True),
      "bq": (attn + "q_proj.bias", (H * hd,), False),
      "bk": (attn + "k_proj.bias", (K * hd,), False),
      "bv": (attn + "v_proj.bias", (K * hd,), False),
      "q_norm": (attn + "q_norm.weight", (hd,), False),
      "k_norm": (attn + "k_norm.weight", (hd,), False),
      "w_gate": (_LAYER + "mlp.gate_proj.weight", (F, D), True),
      "w_up": (_LAYER + "mlp.up_proj.weight", (F, D), True),
      "w_down": (_LAYER + "mlp.down_proj.weight", (D, F), True),
  } | ({leaf: (_LAYER + name + ".weight", (D,), False)
        for leaf, name in hf_gemma.NORM_NAMES.items()} if c.gemma else {}
       ) | hf_moe.layout(c)


def tensor_specs(model_config: ModelConfig) -> list[TensorSpec]:
  """Every leaf of `param_shapes(config)` with its HF tensor, in HF order."""
  layout = _hf_layout(model_config)
  shapes = param_shapes(model_config)
  offset = lambda leaf: (hf_gemma.NORM_OFFSET if model_config.gemma
                         and leaf.endswith("norm") else 0.0)
  specs = []
  for key in ("embed", "layers", "final_norm", "lm_head"):
    if key not in shapes:
      continue
    if key == "layers":
      for leaf, shape in shapes["layers"].items():
        name, hf_shape, t = layout[leaf]
        layers, experts = hf_moe.stacking(model_config, leaf)
        specs.append(TensorSpec(("layers", leaf), name, hf_shape, shape[1:], t,
                                offset(leaf), layers, experts,
                                hf_moe.rope_perm(model_config, leaf)))
    else:
      name, hf_shape, t = layout[key]
      specs.append(TensorSpec((key,), name, hf_shape, shapes[key], t,
                              offset(key)))
  return specs


# Stored by some exporters but not parameters of the model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_names(model_config: ModelConfig, names: Iterable[str], source: str):
  """Raises on HF tensors we would silently drop (the model would differ)."""
  expected = {n for spec in tensor_specs(model_config)
              for n in spec.names(model_config.num_layers)}
  if model_config.tie_embeddings:
    expected.add("lm_head.weight")  # some exporters write the tied copy too
  extra = sorted(n for n in names if n not in expected
                 and not n.endswith(_IGNORED_SUFFIXES))
  if extra:
    raise WeightsError(f"{source}: tensors that a {model_config.architecture} "
                          f"model as configured does not have: {extra[:8]}")
