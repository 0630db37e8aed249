"""Writing Hugging Face checkpoints: shards, index, config.json and the
tokenizer's files, staged in a temp dir, then moved in place (all or
nothing). The tensor names and layouts are `hf.tensor_specs`'."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from safetensors.numpy import save_file

from grpo_jax.models.config import ModelConfig
from grpo_jax.models.hf import TensorSpec, config_to_hf, tensor_specs


@dataclasses.dataclass(frozen=True)
class OutTensor:
  """One HF tensor to write: `load()` gives it, so only a shard is in memory."""
  name: str
  nbytes: int
  load: Callable[[], np.ndarray]


def plan_shards(tensors: list[OutTensor], max_shard_bytes: int
                ) -> list[list[OutTensor]]:
  shards, size = [[]], 0
  for t in tensors:
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += t.nbytes
  return shards


def write_weights(directory: Path, tensors: list[OutTensor],
                  max_shard_bytes: int):
  """model.safetensors, or model-0000k-of-0000n.safetensors plus the index."""
  shards = plan_shards(tensors, max_shard_bytes)
  n = len(shards)
  weight_map = {}
  for k, shard in enumerate(shards, 1):
    fname = ("model.safetensors" if n == 1
             else f"model-{k:05d}-of-{n:05d}.safetensors")
    save_file({t.name: t.load() for t in shard}, str(directory / fname),
              metadata={"format": "pt"})
    weight_map.update({t.name: fname for t in shard})
  if n > 1:
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
             "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps(index, indent=2))


@contextlib.contextmanager
def staged_directory(directory: Path):
  """Yields an empty temp dir beside `directory`; when the block succeeds its
  files are moved into `directory`, else they are deleted.

  A new directory appears whole (one rename). Into an existing one each file
  is replaced atomically, config.json last, and weight files of an older
  save that the new one does not have are removed.
  """
  directory = Path(directory)
  directory.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-",
                              dir=directory.parent))
  try:
    yield tmp
    _publish(tmp, directory)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, directory: Path):
  _default_permissions(tmp)
  try:
    os.rename(tmp, directory)
    return
  except OSError:
    if not directory.is_dir():
      raise
  new = {p.name for p in tmp.iterdir()}
  for p in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
    os.replace(p, directory / p.name)
  for p in directory.glob("model*.safetensors*"):
    if p.name not in new:
      p.unlink()


def _default_permissions(tmp: Path):
  """mkdtemp (and safetensors) create owner-only entries; give the output
  the modes that a plain mkdir/open gives under the process umask."""
  probe = tmp / ".mode-probe"
  probe.mkdir()
  dir_mode = probe.stat().st_mode & 0o777
  probe.rmdir()
  probe.touch()
  file_mode = probe.stat().st_mode & 0o777
  probe.unlink()
  for p in tmp.iterdir():
    os.chmod(p, file_mode)
  os.chmod(tmp, dir_mode)


def dtype_name(dtype) -> str:
  """transformers' name for a numpy/JAX dtype (bfloat16, float32, ...)."""
  return np.dtype(dtype).name


def save_pretrained(model_config: ModelConfig, params: dict[str, Any],
                    directory: str | os.PathLike, tokenizer=None,
                    max_shard_bytes: int = 4 << 30) -> Path:
  """Writes `params` as a transformers model directory; returns its path.

  Tensors keep the params' dtype. With a `grpo_jax.models.tokenizer.Tokenizer`, its
  files and a generation_config.json (stop ids) are written too, so
  `AutoModelForCausalLM` / `AutoTokenizer` / pipelines load the directory.
  Leaves go to the host one at a time (sharded arrays are gathered per leaf).
  """
  specs = tensor_specs(model_config)
  _check_params(model_config, params)
  dtype = dtype_name(_leaf(params, specs[0].path).dtype)
  return write_checkpoint(model_config,
                          list(_out_tensors(model_config, params, specs)),
                          directory, dtype, tokenizer, max_shard_bytes)


def write_checkpoint(model_config: ModelConfig, tensors: list[OutTensor],
                     directory: str | os.PathLike, dtype: str, tokenizer=None,
                     max_shard_bytes: int = 4 << 30) -> Path:
  """Weights, config.json and (with a tokenizer) its files, all or nothing."""
  token_ids = {} if tokenizer is None else tokenizer.special_token_ids()
  with staged_directory(Path(directory)) as tmp:
    write_weights(tmp, tensors, max_shard_bytes)
    if tokenizer is not None:
      tokenizer.save_pretrained(tmp)
      generation = {"bos_token_id": token_ids.get("bos_token_id"),
                    "eos_token_id": tokenizer.stop_ids,
                    "pad_token_id": token_ids.get("pad_token_id")}
      (tmp / "generation_config.json").write_text(
          json.dumps(generation, indent=2))
    hf = config_to_hf(model_config, dtype, token_ids)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
  return Path(directory)


def _leaf(params: dict[str, Any], path: tuple[str, ...]):
  for key in path:
    params = params[key]
  return params


def _check_params(model_config: ModelConfig, params: dict[str, Any]):
  for spec in tensor_specs(model_config):
    try:
      shape = tuple(_leaf(params, spec.path).shape)
    except KeyError:
      raise ValueError(f"params has no leaf {'/'.join(spec.path)}") from None
    want = ((len(spec.slices(model_config.num_layers)),) if spec.per_layer
            else ()) + spec.shape
    if shape != want:
      raise ValueError(f"params leaf {'/'.join(spec.path)} has shape {shape}, "
                       f"expected {want} for this config")


def _out_tensors(model_config: ModelConfig, params: dict[str, Any],
                 specs: list[TensorSpec]) -> Iterable[OutTensor]:
  """HF tensors of `params`; a one-leaf host cache serves a leaf's layers."""
  cache: dict[tuple[str, ...], np.ndarray] = {}

  def host_leaf(path):
    if path not in cache:
      cache.clear()
      cache[path] = np.asarray(_leaf(params, path))
    return cache[path]

  for spec in specs:
    itemsize = np.dtype(_leaf(params, spec.path).dtype).itemsize
    nbytes = math.prod(spec.hf_shape) * itemsize
    for i, names in enumerate(spec.slices(model_config.num_layers)):
      for x, name in enumerate(names):
        def load(spec=spec, i=i, x=x):
          w = host_leaf(spec.path)
          w = w[i] if spec.per_layer else w
          return spec.to_hf(w[x] if spec.experts else w)
        yield OutTensor(name, nbytes, load)
