"""Decoder models: configs and presets, pure forward, KV cache, weights in/out."""
from grpo_jax.models import moe
from grpo_jax.models.config import (
  RANDOM_PRESETS,
  ModelConfig,
  RopeScaling,
  get_preset,
  preset_names,
)
from grpo_jax.models.decode import KVCache, decode_step, init_cache
from grpo_jax.models.hf_write import save_pretrained
from grpo_jax.models.loading import load_pretrained
from grpo_jax.models.transformer import (
                                    cast,
                                    count_params,
                                    forward,
                                    hidden_states,
                                    init_params,
                                    param_axes,
                                    param_shapes,
                                    unembed,
)
