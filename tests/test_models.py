"""Presets: shapes and parameter counts of the big configs, without memory.

`jax.eval_shape` traces `init_params` abstractly, so a 32B model costs no
memory; its count must match the published one (model cards, to the
precision they state).
"""
import math

import jax
import pytest

from grpo_jax.models import (
  RANDOM_PRESETS,
  count_params,
  get_preset,
  init_params,
  param_axes,
  param_shapes,
  preset_names,
)

# Published parameter counts (embeddings included; tied ones once).
PUBLISHED = {
    "qwen2.5-0.5b": 0.494e9,
    "qwen2.5-1.5b": 1.54e9,
    "qwen2.5-7b": 7.62e9,
    "qwen2.5-32b": 32.76e9,
    "qwen2.5-math-7b": 7.62e9,
    "llama-3.1-8b": 8.03e9,
    "qwen3-0.6b": 0.596e9,
    "qwen3-8b": 8.19e9,
    "smollm2-135m-instruct": 134.5e6,
    # Gemma 2 and Gemma 3 1B/270M: the safetensors totals of the HF pages.
    "gemma-2-2b": 2.61e9,
    "gemma-2-9b": 9.24e9,
    "gemma-2-27b": 27.2e9,
    "gemma-3-270m": 268.1e6,
    "gemma-3-1b": 999.9e6,
    # Gemma 3 4B/12B/27B: the multimodal totals (4.30B, 12.2B, 27.4B) less
    # the SigLIP vision tower and projector (0.42B).
    "gemma-3-4b": 3.88e9,
    "gemma-3-12b": 11.77e9,
    "gemma-3-27b": 27.0e9,
    # Qwen3 mixtures of experts (Qwen3 technical report: 30.5B and 235B).
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235.0e9,
    # DeepSeek-V3 without its multi-token-prediction module (671B).
    "deepseek-v3": 671.0e9,
}


def _abstract_params(name):
  config = get_preset(name)
  return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name):
  params = _abstract_params(name)
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  assert total == pytest.approx(PUBLISHED[name], rel=5e-3)
  assert total == count_params(get_preset(name))


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3-8b", "llama-3.1-8b"])
def test_abstract_params_follow_param_shapes_and_axes(name):
  config = get_preset(name)
  params = _abstract_params(name)
  shapes = param_shapes(config)
  axes = param_axes(config)
  is_tuple = lambda x: isinstance(x, tuple)
  got = jax.tree.map(lambda x: tuple(x.shape), params)
  assert got == shapes
  ranks = jax.tree.map(len, shapes, is_leaf=is_tuple)
  assert jax.tree.map(len, axes, is_leaf=is_tuple) == ranks


def test_published_table_covers_every_big_preset():
  assert set(preset_names()) - set(RANDOM_PRESETS) == set(PUBLISHED)
