"""Decoder models: configs and presets, pure forward, KV cache, weights in/out."""
from grpo_jax.models.config import (ModelConfig, RopeScaling, get_preset,
                                    preset_names)
from grpo_jax.models.transformer import (KVCache, cast, count_params, decode_step,
                                         forward, hidden_states, init_cache,
                                         init_params, param_axes, param_shapes,
                                         unembed)
from grpo_jax.models.hf_write import save_pretrained
from grpo_jax.models.loading import load_pretrained
