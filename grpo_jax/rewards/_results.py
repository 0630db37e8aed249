"""The sandbox's result lines and the values they hold, rebuilt: plain data,
`Iterated` items and `Raised` names. Imported by the trainer (`sandbox.py`)
and by the checkers (`_checker.py`), which import nothing heavier.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class Raised:
  """A call raised (or the program did, or it never ran): the type's name."""
  name: str


NOT_RUN = Raised("not run")


class Iterated:
  """A returned iterable that is not plain data (generator, map, range,
  deque, ...), as its items: it iterates (so `list(f(x)) == [...]` holds as
  in Python) but, like a generator, equals nothing but itself."""
  __slots__ = ("items",)

  def __init__(self, items: tuple[Any, ...]):
    self.items = items

  def __iter__(self):
    return iter(self.items)

  def __repr__(self) -> str:
    return f"Iterated({self.items!r})"


def decode(obj: Any, depth: int = 0) -> Any:
  """The runner's tagged JSON back to plain Python data (exact types)."""
  if depth > 200:
    raise ValueError("nested too deeply")
  if obj is None or isinstance(obj, (bool, str)):
    return obj
  if not isinstance(obj, dict) or len(obj) != 1:
    raise ValueError(f"not a serialised value: {type(obj).__name__}")
  (tag, body), = obj.items()
  items = lambda: [decode(x, depth + 1) for x in body]
  if tag == "i":
    return int(body, 16)
  if tag == "f":
    return float.fromhex(body)
  if tag == "c":
    return complex(float.fromhex(body[0]), float.fromhex(body[1]))
  if tag == "b":
    return bytes.fromhex(body)
  if tag == "d":
    return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
  kinds = {"l": list, "t": tuple, "s": set, "z": frozenset,
           "it": lambda xs: Iterated(tuple(xs))}
  if tag in kinds:
    return kinds[tag](items())
  raise ValueError(f"unknown tag {tag!r}")


READY = b'{"ready": true}'


def parse_results(out: bytes, num_calls: int, num_stdin: int = 0
                  ) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
  """Values by call index from the runner's lines; None if it never started
  (no ready line first). Only the runner's worker writes lines, one per call
  or stdin (and one if the program does not compile): more are not read.
  Garbage lines are skipped; a call's first line wins. Its values are the
  model's data: rebuilding them and comparing them can take unbounded time
  (hash collisions, huge ints), so the code reward does both in `_checker`."""
  most = num_calls + num_stdin + 2  # With the ready and program lines.
  lines = out.split(b"\n", most)[:most]
  if not lines or lines[0] != READY:
    return None
  found = {"i": [NOT_RUN] * num_calls, "o": [NOT_RUN] * num_stdin}
  seen = set()
  for line in lines[1:]:
    try:
      record = json.loads(line.decode("ascii"))
      kind = "i" if "i" in record else "o"
      i = record[kind]
      if type(i) is not int or not 0 <= i < len(found[kind]) or (  # pylint: disable=unidiomatic-typecheck
          kind, i) in seen:
        continue
      seen.add((kind, i))
      if "e" in record:
        found[kind][i] = Raised(str(record["e"])[:100])
      elif kind == "i":
        found[kind][i] = decode(record["v"])
      elif isinstance(record["v"], str):
        found[kind][i] = record["v"]
    except Exception:  # pylint: disable=broad-except
      continue  # Malformed, too deep, unhashable set items: not a value.
  return tuple(found["i"]), tuple(found["o"])
