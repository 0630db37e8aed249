"""Gemma 2 and Gemma 3 checkpoints (`Gemma2ForCausalLM`,
`Gemma3ForCausalLM`): their config.json <-> ModelConfig and their tensors'
names, for `hf.py`.

Gemma's RMSNorm scales by (1 + w) (transformers' `Gemma2RMSNorm`); the
loader stores 1 + w (`NORM_OFFSET`, added in float32) so the decoder's norm
is the one function every family uses, and the writer subtracts it again.
Both transformers spellings are read: 4.x's top-level `rope_theta`,
`rope_local_base_freq`, `rope_scaling`, and 5.x's `rope_parameters` per
layer kind.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from grpo_jax.models.config import ModelConfig, RopeScaling

CLASSES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
# Gemma 3 4B and up ship as this class: its `text_config` and its text
# tensors are a Gemma3ForCausalLM (the vision tower is not read).
MULTIMODAL = "Gemma3ForConditionalGeneration"
# transformers' Gemma3TextConfig defaults, which the published multimodal
# config.json files rely on (their text_config omits most keys).
TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
    num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
    head_dim=256, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072, rms_norm_eps=1e-6,
    tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096)
# Where the text decoder's tensors are: transformers 4.50's files, then
# 4.52+ and 5.x's; ours are under "model.".
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.",
                   "model.vision_tower.", "model.multi_modal_projector.")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
  """A multimodal config.json's text decoder as a Gemma3ForCausalLM config
  (itself for any other config)."""
  if MULTIMODAL not in (hf.get("architectures") or []):
    return hf
  return {**TEXT_DEFAULTS, **hf.get("text_config", {}),
          "architectures": ["Gemma3ForCausalLM"],
          "model_type": "gemma3_text"}


def text_names(names) -> dict[str, str]:
  """A multimodal checkpoint's tensor names -> ours: the text decoder's
  renamed under "model.", lm_head kept, the vision tower's dropped. Names
  of any other checkpoint map to themselves."""
  if not any(name.startswith(TEXT_PREFIXES) for name in names):
    return {name: name for name in names}
  out = {}
  for name in names:
    prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
    if prefix is not None:
      out["model." + name[len(prefix):]] = name
    elif name in ("lm_head.weight", "language_model.lm_head.weight"):
      out["lm_head.weight"] = name
    elif not name.startswith(VISION_PREFIXES):
      out[name] = name      # unexpected: check_names names it
  return out
MODEL_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
NORM_OFFSET = 1.0
ACTIVATION = "gelu_pytorch_tanh"

# Our norm leaves -> transformers' names (a Gemma block has four norms; its
# `post_attention_layernorm` is the attention output's, not the MLP input's).
NORM_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


def config_from_hf(hf: dict[str, Any], arch: str,
                   unsupported: Callable[[str], Exception]) -> dict:
  """The Gemma-only ModelConfig fields of a transformers config dict."""
  act = hf.get("hidden_activation") or hf.get("hidden_act") or ACTIVATION
  if act != ACTIVATION:
    raise unsupported(f"hidden_activation={act!r}")
  if hf.get("use_bidirectional_attention"):
    raise unsupported("use_bidirectional_attention=true")
  if hf.get("attention_bias"):
    raise unsupported("attention_bias=true")
  L = hf["num_hidden_layers"]
  kinds = hf.get("layer_types")
  if kinds is None:   # older configs: a period ("sliding_window_pattern")
    period = 2 if arch == "gemma2" else hf.get("sliding_window_pattern", 6)
    kinds = ["sliding_attention" if (i + 1) % period else "full_attention"
             for i in range(L)]
  fields = dict(
      layer_types=tuple(kinds), sliding_window=hf.get("sliding_window"),
      attn_softcap=hf.get("attn_logit_softcapping"),
      final_softcap=hf.get("final_logit_softcapping"),
      query_scale=float(hf.get("query_pre_attn_scalar", 256)),
      qk_norm=arch == "gemma3", tie_embeddings=bool(
          hf.get("tie_word_embeddings", True)))
  if "sliding_attention" not in kinds:
    fields["sliding_window"] = None
  fields.update(_rope(hf, arch, unsupported))
  return fields


def _rope(hf: dict[str, Any], arch: str,
          unsupported: Callable[[str], Exception]) -> dict:
  params = hf.get("rope_parameters") or {}
  if arch == "gemma2":
    theta = hf.get("rope_theta", params.get("rope_theta", 10_000.0))
    if params.get("rope_type", "default") != "default":
      raise unsupported(f"rope type {params['rope_type']!r}")
    return dict(rope_theta=float(theta))
  full = params.get("full_attention", {})
  local = params.get("sliding_attention", {})
  theta = hf.get("rope_theta", full.get("rope_theta", 1_000_000.0))
  local_theta = hf.get("rope_local_base_freq",
                       local.get("rope_theta", 10_000.0))
  if local.get("rope_type", "default") != "default":
    raise unsupported(f"sliding layers' rope type {local['rope_type']!r}")
  scaling = hf.get("rope_scaling") or full
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind not in ("default", "linear"):
    raise unsupported(f"rope type {kind!r}")
  return dict(rope_theta=float(theta), rope_local_theta=float(local_theta),
              rope_scaling=RopeScaling(factor=float(scaling["factor"]),
                                       kind="linear")
              if kind == "linear" else None)


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
  """The Gemma-only keys of config.json (transformers 4.x and 5.x)."""
  kinds = list(c.layer_types or (
      ["sliding_attention" if c.sliding_window else "full_attention"]
      * c.num_layers))
  out = {
      "model_type": "gemma2" if c.architecture == "gemma2" else "gemma3_text",
      "hidden_activation": ACTIVATION, "hidden_act": ACTIVATION,
      "query_pre_attn_scalar": int(c.query_scale or c.head_dim),
      "sliding_window": c.sliding_window, "layer_types": kinds,
      "attn_logit_softcapping": c.attn_softcap,
      "final_logit_softcapping": c.final_softcap,
      "attention_bias": False,
  }
  scaling: Optional[dict] = None
  if c.rope_scaling is not None:
    if c.rope_scaling.kind != "linear":
      raise ValueError(f"a {c.architecture} config with rope_scaling kind "
                       f"{c.rope_scaling.kind!r} has no transformers "
                       "equivalent; Gemma uses 'linear'")
    scaling = {"rope_type": "linear", "factor": c.rope_scaling.factor}
  full = {**(scaling or {"rope_type": "default"}), "rope_theta": c.rope_theta}
  if c.architecture == "gemma2":
    out.update(rope_theta=c.rope_theta, rope_parameters=full)
    return out
  local = c.rope_local_theta or c.rope_theta
  out.update(rope_theta=c.rope_theta, rope_local_base_freq=local,
             rope_scaling=scaling, rope_parameters={
                 "full_attention": full,
                 "sliding_attention": {"rope_type": "default",
                                       "rope_theta": local}})
  return out
