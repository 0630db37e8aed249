"""One registry mechanism for everything that is chosen by name in a config.

Advantages, losses, rewards, datasets, prompt templates, model presets and
experiments all register here:

    @register("advantage", "grpo")
    def grpo_advantages(...): ...

    fn = lookup("advantage", config.rl.advantage)

An unknown name fails with the list of names that exist for that kind.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

_T = TypeVar("_T")
_REGISTRY: dict[str, dict[str, Any]] = {}


def register(kind: str, name: str) -> Callable[[_T], _T]:
  """Decorator that files `obj` under (kind, name); a duplicate name is an error."""

  def deco(obj: _T) -> _T:
    table = _REGISTRY.setdefault(kind, {})
    if name in table and table[name] is not obj:
      raise ValueError(f"{kind} {name!r} is registered twice")
    table[name] = obj
    return obj

  return deco


def lookup(kind: str, name: str) -> Any:
  """Returns what was registered under (kind, name), or raises naming the options."""
  table = _REGISTRY.get(kind, {})
  if name not in table:
    raise KeyError(f"unknown {kind} {name!r}; known {kind}s: {sorted(table)}")
  return table[name]


def names(kind: str) -> list[str]:
  """The registered names of one kind, sorted."""
  return sorted(_REGISTRY.get(kind, {}))
