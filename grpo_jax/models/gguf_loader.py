"""GGUF (llama.cpp) checkpoints, read through the `gguf` package.

`GGUFCheckpoint` serves the same interface as `hf_read.SafetensorsCheckpoint`:
tensors by their transformers name, in transformers layout, dequantised to
float32 one at a time. llama.cpp stores Llama's Q and K projections with the
rows of each head interleaved for its rotary layout; that is undone here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
from gguf.quants import dequantize

from grpo_jax.errors import WeightsError
from grpo_jax.models.attention import rope_frequencies
from grpo_jax.models.config import ModelConfig, RopeScaling
from grpo_jax.models.hf import TensorSpec, tensor_specs
from grpo_jax.models.weights import field, open_reader

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Architectures whose converter permutes Q/K (Llama's rotate-half -> GPT-J's
# interleaved pairs); Qwen files keep the HF row order.
_PERMUTED = ("llama", "mistral")

# HF name pattern -> GGUF name pattern ({i} is the layer).
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight":
        "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
# Present in llama.cpp files but not parameters (rope_freqs is checked).
_NOT_PARAMS = ("rope_freqs.weight",)


def gguf_name_map(specs: list[TensorSpec], num_layers: int) -> dict[str, str]:
  """HF tensor name -> GGUF tensor name for every tensor of `specs`."""
  return {spec.hf_name.format(i=i): _GGUF_NAMES[spec.hf_name].format(i=i)
          for spec in specs for i in range(num_layers if spec.per_layer else 1)}


class GGUFCheckpoint:
  """A GGUF file's tensors by HF name and in HF layout, dequantised on read."""

  def __init__(self, path: Path):
    self.path = Path(path)
    self.source = str(self.path)
    self.reader = open_reader(self.path)
    self._tensors = {t.name: t for t in self.reader.tensors}
    self.config = config_from_gguf(self.reader, self._tensors, self.source)
    self._arch = field(self.reader, "general.architecture")
    self._names = gguf_name_map(tensor_specs(self.config),
                                self.config.num_layers)
    self._check_names()

  def _check_names(self):
    known = set(self._names.values()) | set(_NOT_PARAMS)
    extra = sorted(set(self._tensors) - known)
    if extra:
      raise WeightsError(f"{self.source}: tensors that a {self._arch} model "
                            f"as configured does not have: {extra[:8]}")

  def names(self) -> list[str]:
    return [hf for hf, g in self._names.items() if g in self._tensors]

  def where(self, name: str) -> str:
    return f"tensor {self._names.get(name, name)!r} ({name}) in {self.path}"

  def shape(self, name: str) -> Optional[tuple[int, ...]]:
    t = self._tensors.get(self._names.get(name))
    # GGUF lists dimensions fastest-first; numpy (and HF) are row-major.
    return None if t is None else tuple(int(d) for d in reversed(t.shape))

  def read(self, name: str) -> np.ndarray:
    """The tensor as float32 in HF layout."""
    t = self._tensors[self._names[name]]
    try:
      w = dequantize(t.data, t.tensor_type).reshape(self.shape(name))
    except NotImplementedError as e:
      raise WeightsError(f"{self.where(name)}: cannot dequantise "
                            f"{t.tensor_type.name}: {e}") from e
    w = w.astype(np.float32, copy=False)
    if self._arch in _PERMUTED and name.endswith(("q_proj.weight",
                                                  "k_proj.weight")):
      heads = (self.config.num_heads if "q_proj" in name
               else self.config.num_kv_heads)
      w = unpermute_qk(w, heads)
    return w

  def close(self):
    self.reader = self._tensors = None  # drops the file mapping


def unpermute_qk(w_hf: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row order: within each head the converter stores
  rows (hd/2, 2) interleaved; HF keeps the two rotary halves (2, hd/2)."""
  rows, cols = w_hf.shape
  hd = rows // heads
  w = w_hf.reshape(heads, hd // 2, 2, cols).swapaxes(1, 2)
  return w.reshape(rows, cols)


def permute_qk(w_hf: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's conversion (the inverse of `unpermute_qk`), for writing."""
  rows, cols = w_hf.shape
  hd = rows // heads
  w = w_hf.reshape(heads, 2, hd // 2, cols).swapaxes(1, 2)
  return w.reshape(rows, cols)


# ----------------------------------------------------------------------------
# Metadata -> ModelConfig.
# ----------------------------------------------------------------------------

def config_from_gguf(reader, tensors: dict[str, Any], source: str
                     ) -> ModelConfig:
  """The ModelConfig that the `{arch}.*` metadata and tensor set describe."""
  arch = field(reader, "general.architecture")
  if arch not in GGUF_ARCHITECTURES:
    raise WeightsError(f"{source}: unknown architecture {arch!r}; "
                          f"supported: {list(GGUF_ARCHITECTURES)}")

  def meta(key, default=None):
    value = field(reader, f"{arch}.{key}", default)
    if value is None:
      raise WeightsError(f"{source}: metadata {arch}.{key} is missing")
    return value

  heads, dim = meta("attention.head_count"), meta("embedding_length")
  head_dim = meta("attention.key_length", dim // heads)
  if meta("rope.dimension_count", head_dim) != head_dim:
    raise WeightsError(f"{source}: partial rotary embeddings "
                          f"({arch}.rope.dimension_count) are not supported")
  scaling_type = field(reader, f"{arch}.rope.scaling.type", "none")
  if scaling_type != "none":
    raise WeightsError(f"{source}: rope scaling {scaling_type!r} is not "
                          "supported")
  vocab = field(reader, f"{arch}.vocab_size") or int(
      tensors["token_embd.weight"].shape[1])
  config = ModelConfig(
      architecture=arch,
      vocab_size=vocab, dim=dim, num_layers=meta("block_count"),
      num_heads=heads, num_kv_heads=meta("attention.head_count_kv", heads),
      head_dim=head_dim, mlp_dim=meta("feed_forward_length"),
      rope_theta=_f32(meta("rope.freq_base", 10_000.0)),
      norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
      qkv_bias="blk.0.attn_q.bias" in tensors,
      qk_norm="blk.0.attn_q_norm.weight" in tensors,
      tie_embeddings="output.weight" not in tensors,
      sliding_window=field(reader, f"{arch}.attention.sliding_window"),
      max_seq_len=meta("context_length", 4096))
  if "rope_freqs.weight" in tensors:
    config = config.replace(
        rope_scaling=_llama3_scaling(config, tensors["rope_freqs.weight"],
                                     source))
  return config


def _f32(x: float) -> float:
  """The decimal a float32 field was written from (1e-05, not
  9.999999747378752e-06): the shortest repr that rounds to the same float32."""
  return float(str(np.float32(x)))


def _llama3_scaling(model_config: ModelConfig, rope_freqs, source: str
                    ) -> RopeScaling:
  """llama.cpp stores Llama-3.1's rope scaling as per-frequency divisors
  (`rope_freqs`), not as parameters. Accept them when they are Llama 3.1's."""
  factors = np.asarray(rope_freqs.data, np.float32)
  scaled = model_config.replace(rope_scaling=RopeScaling())
  expected = rope_frequencies(model_config) / rope_frequencies(scaled)
  if factors.shape != expected.shape or not np.allclose(factors, expected,
                                                        rtol=1e-4):
    raise WeightsError(f"{source}: rope_freqs.weight does not match "
                          "Llama-3 rope scaling (factor 8, low 1, high 4, "
                          "original context 8192); not supported")
  return RopeScaling()
