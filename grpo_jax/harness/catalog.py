"""The named experiments: `configs/*.py` and the variants each lists
(`python experiments/run.py --list`), read without running them."""
from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path


def _load_module(path: Path):
  spec = importlib.util.spec_from_file_location(f"_grpo_jax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def experiment_description(path: os.PathLike) -> str:
  """The first line of a config file's docstring, else `get_config().description`
  (the file is only imported when it has no docstring)."""
  path = Path(path)
  doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
  if doc and doc.strip():
    return doc.strip().splitlines()[0]
  config = _load_module(path).get_config()
  return str(getattr(config, "description", "") or "")


def config_variants(path: os.PathLike) -> list[tuple[str, str]]:
  """[(variant, description)] from a config file's module-level `VARIANTS`
  (config.VARIANTS), read without importing: a dict literal {variant:
  function} gives each function's docstring (first line), else the
  expression that makes it (e.g. `_loss('gspo', ...)`); a tuple of names
  gives the names ("", the default alone, is not listed)."""
  tree = ast.parse(Path(path).read_text(), filename=str(path))
  docs = {n.name: (ast.get_docstring(n) or "").strip()
          for n in tree.body if isinstance(n, ast.FunctionDef)}
  for node in tree.body:
    if not (isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == "VARIANTS" for t in node.targets)):
      continue
    if isinstance(node.value, ast.Dict):
      out = []
      for key, value in zip(node.value.keys, node.value.values):
        doc = docs.get(getattr(value, "id", ""), "")
        out.append((key.value, doc.splitlines()[0] if doc
                    else ast.unparse(value)))
      return out
    if isinstance(node.value, (ast.Tuple, ast.List)):
      return [(e.value, "") for e in node.value.elts
              if isinstance(e, ast.Constant) and e.value]
  return []


def list_experiments(configs_dir: os.PathLike = "configs") -> list[tuple[str, str]]:
  """[(name, one-line description)] of every `configs/*.py` (not `_*.py`)
  and of each variant its `VARIANTS` names (`name:variant`), sorted by
  name; `python experiments/run.py --list` prints these."""
  out = []
  for p in sorted(Path(configs_dir).glob("*.py")):
    if not p.name.startswith("_"):
      out.append((p.stem, experiment_description(p)))
      out.extend((f"{p.stem}:{v}", d) for v, d in config_variants(p))
  return out
