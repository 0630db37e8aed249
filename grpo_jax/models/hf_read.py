"""Reading a Hugging Face model directory's safetensors (one file or many
with model.safetensors.index.json), tensors by HF name in HF layout
(`hf.tensor_specs` maps them to ours)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Optional

import numpy as np
from safetensors import SafetensorError, safe_open

from grpo_jax.errors import WeightsError
from grpo_jax.models import hf_gemma
from grpo_jax.models.hf import check_names, read_config


class SafetensorsCheckpoint:
  """A model directory's tensors by HF name, in HF layout; files stay mapped.

  Every file is opened (and its header checked) on construction, so a
  missing or truncated file fails before anything is loaded.
  """

  def __init__(self, directory: Path):
    self.directory = Path(directory)
    self.config = read_config(self.directory)
    self._stack = contextlib.ExitStack()
    try:
      self._files = {f: self._open(f) for f in self._weight_files()}
      self._where = {name: f for f, handle in self._files.items()
                     for name in handle.keys()}
      # our name -> the stored one (a multimodal Gemma 3's text decoder)
      self._stored = hf_gemma.text_names(self._where)
      self._where = {ours: self._where[s] for ours, s in self._stored.items()}
      check_names(self.config, self._where, str(self.directory))
    except BaseException:
      self._stack.close()
      raise
    self.source = str(self.directory)

  def _weight_files(self) -> list[Path]:
    index = self.directory / "model.safetensors.index.json"
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise WeightsError(f"{index}: not a safetensors index ({e})") from e
      files = [self.directory / f for f in sorted(set(weight_map.values()))]
    else:
      files = sorted(self.directory.glob("*.safetensors"))
    if not files:
      raise FileNotFoundError(
          f"no *.safetensors in {self.directory} (PyTorch .bin checkpoints "
          "are not read: re-save them with transformers' save_pretrained)")
    for f in files:
      if not f.is_file():
        raise FileNotFoundError(f"{f} is listed in {index.name} but missing")
    return files

  def _open(self, path: Path):
    try:
      return self._stack.enter_context(safe_open(str(path), framework="numpy"))
    except SafetensorError as e:
      raise WeightsError(f"{path}: unreadable safetensors file "
                            f"(truncated or corrupt?): {e}") from e

  def names(self) -> list[str]:
    return list(self._where)

  def where(self, name: str) -> str:
    return f"tensor {name!r} in {self._where.get(name, self.directory)}"

  def shape(self, name: str) -> Optional[tuple[int, ...]]:
    if name not in self._where:
      return None
    handle = self._files[self._where[name]]
    return tuple(handle.get_slice(self._stored[name]).get_shape())

  def read(self, name: str) -> np.ndarray:
    return self._files[self._where[name]].get_tensor(self._stored[name])

  def close(self):
    self._stack.close()
