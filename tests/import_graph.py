"""The grpo_jax module graph: which module imports which, read from the source.

    python tests/import_graph.py [ROOT]     # adjacency list of ROOT/grpo_jax

An edge A -> B is an `import` of B written in A, at module level or inside a
function (marked `*` in the listing: a lazy import). `from grpo_jax import x`
points at the submodule `grpo_jax.x` when there is one, else at the package.
Importing a submodule also runs its parent packages' `__init__` first; the
listing leaves those implied edges out, the cycle check (`with_parents`) does
not: `tokenizer -> models.gguf_loader` runs `models/__init__`, which imports
`models.loading`, so `models.loading -> tokenizer` closes a cycle. A module's
own packages are exempt (they are already being initialised).
"""
from __future__ import annotations

import ast
import os
import sys
from typing import NamedTuple

PACKAGE = "grpo_jax"


class Edge(NamedTuple):
  source: str
  target: str
  lazy: bool   # written inside a function or method


def modules(root: str) -> dict[str, str]:
  """{dotted module name: file path} of every .py file under root/grpo_jax."""
  found = {}
  for directory, _, files in os.walk(os.path.join(root, PACKAGE)):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        rel = os.path.relpath(path, root)[:-3].split(os.sep)
        if rel[-1] == "__init__":
          rel = rel[:-1]
        found[".".join(rel)] = path
  return found


def _resolve(name: str, known: dict[str, str]) -> str | None:
  """The longest known module that `name` starts with (a.b.C -> a.b)."""
  parts = name.split(".")
  while parts:
    candidate = ".".join(parts)
    if candidate in known:
      return candidate
    parts.pop()
  return None


def _targets(node: ast.AST, module: str, known: dict[str, str]) -> list[str]:
  if isinstance(node, ast.Import):
    return [t for alias in node.names
            if (t := _resolve(alias.name, known)) is not None]
  assert isinstance(node, ast.ImportFrom)
  base = node.module or ""
  if node.level:  # relative: from the importing module's package
    package = module.split(".")
    if not known[module].endswith("__init__.py"):
      package = package[:-1]
    package = package[:len(package) - node.level + 1]
    base = ".".join(package + ([base] if base else []))
  out = []
  for alias in node.names:
    target = _resolve(f"{base}.{alias.name}", known) or _resolve(base, known)
    if target is not None:
      out.append(target)
  return out


def edges(root: str) -> list[Edge]:
  """Every import between grpo_jax modules, lazy ones marked."""
  known = modules(root)
  found = set()
  for module, path in known.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(n) for fn in functions for n in ast.walk(fn)}
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        for target in _targets(node, module, known):
          if target != module:
            found.add(Edge(module, target, id(node) in inside))
  # An edge written both ways counts as module level.
  eager = {(e.source, e.target) for e in found if not e.lazy}
  return sorted(e for e in found
                if not e.lazy or (e.source, e.target) not in eager)


def with_parents(graph: list[Edge]) -> list[Edge]:
  """`graph` plus the implied edges to the packages above each target that
  the source is not itself inside (`grpo_jax` never counts: every module is
  inside it)."""
  out = set(graph)
  for e in graph:
    parts = e.target.split(".")
    for i in range(2, len(parts)):
      package = ".".join(parts[:i])
      if not e.source.startswith(package + ".") and e.source != package:
        out.add(Edge(e.source, package, e.lazy))
  return sorted(out)


def find_cycle(graph: list[Edge]) -> list[str] | None:
  """One cycle (a list of modules, first == last), or None."""
  adjacency: dict[str, list[str]] = {}
  for e in graph:
    adjacency.setdefault(e.source, []).append(e.target)
  state: dict[str, int] = {}   # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in adjacency.get(node, ()):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(adjacency):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def adjacency_text(graph: list[Edge]) -> str:
  """One line per importing module: `a.b -> c, d*` (`*`: lazy), names
  without the `grpo_jax.` prefix."""
  short = lambda m: m[len(PACKAGE) + 1:] if m != PACKAGE else PACKAGE
  lines: dict[str, list[str]] = {}
  for e in graph:
    lines.setdefault(short(e.source), []).append(
        short(e.target) + ("*" if e.lazy else ""))
  return "\n".join(f"{m} -> {', '.join(ts)}" for m, ts in sorted(lines.items()))


if __name__ == "__main__":
  root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(
      os.path.dirname(os.path.abspath(__file__)))
  graph = edges(root)
  print(adjacency_text(graph))
  print(f"# {len(graph)} edges, {sum(e.lazy for e in graph)} lazy; cycle: "
        f"{find_cycle(with_parents(graph))}")
