"""Unit tests in the dataset format, decided by the trusted parent.

A test is Python source of `assert` statements (MBPP style), optionally with
imports and assignments before them:

    assert add(1, 2) == 3
    assert math.isclose(area(2), 12.566, rel_tol=1e-3)
    assert set(pairs([1, 2])) == {(1, 2)}
    assert not is_prime(8)

Each assert's expression is split here (with `ast`, never executed): every
maximal sub-expression that needs the model's code ("leaf": `add(1, 2)`,
`area(2)`, `pairs([1, 2])`, `is_prime(8)`) is evaluated in the sandbox, in
a process of its own with only the assignments it reads, and comes back as
plain data (other iterables as `_results.Iterated` items, which
`list()`/`sorted()`/... accept and `==` rejects, as in Python); the rest
(literals, arithmetic, comparisons, `not`/`and`/`or`, and the builtins in
`_FUNCTIONS` and `math.*` in `_MATH` applied to those values) is evaluated
outside it, on rebuilt builtin values, by `count_passed` in a checker
process (`_checker.py`: the values are the model's, so that work is bounded
there, not in the trainer). So an object whose `__eq__` is always true, a
patched `exec`/`compile`/`os.write` or a rewritten test list inside the
sandbox changes only the values it reports, and it never learns the values
expected of them.

A leaf may not itself contain a comparison or `and`/`or`/`not` (its value
would be a verdict the sandbox could fake: `all(f(x) == y for ...)`), and a
test may not hold other statements (loops, `def check(candidate)`, ...).
Such a test cannot be decided outside the sandbox: it counts as failed and
is logged once; write it as `assert <call> == <value>` instead.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import operator
from typing import Any, Mapping, Sequence

from grpo_jax.rewards import _results, _trusted

_FUNCTIONS = _trusted.FUNCTIONS
_MATH = _trusted.MATH
_VERDICT_NODES = (ast.Compare, ast.BoolOp, ast.IfExp, ast.NamedExpr)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub,
           ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow, ast.LShift: operator.lshift,
           ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
           ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos,
          ast.Not: operator.not_, ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
            ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
            ast.Is: operator.is_, ast.IsNot: operator.is_not,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_LEAF = "__leaf_"


class Unsplittable(ValueError):
  """This test cannot be decided outside the sandbox."""


@dataclasses.dataclass(frozen=True)
class Check:
  """One assert: its expression with leaves as names `__leaf_<k>`."""
  expression: ast.expr
  first_leaf: int  # Index of its first leaf in the test's `calls`.
  env: tuple[tuple[str, Any], ...]  # Names the test assigned literals to.


@dataclasses.dataclass(frozen=True)
class Test:
  calls: tuple[tuple[str, str], ...]  # (setup, leaf expression), in order.
  checks: tuple[Check, ...]


def _is_verdict(node: ast.AST) -> bool:
  return any(isinstance(n, _VERDICT_NODES) or (
      isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not))
             for n in ast.walk(node))


class _Splitter:
  """Replaces leaves by names; collects their source."""

  def __init__(self, env: dict[str, Any], imported: frozenset[str] = frozenset()):
    self.env, self.leaves, self.imported = env, [], imported

  def _is_local_function(self, func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
      if func.id in self.env:  # `from math import isclose`, or data.
        return callable(self.env[func.id])
      return func.id in _FUNCTIONS
    return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "math" and func.attr in _MATH)

  def split(self, node: ast.expr) -> ast.expr:
    names = _trusted.free_names(node)
    if names & self.imported and _trusted.is_trusted(node, {**self.env, **dict.fromkeys(self.imported)}):
      raise Unsplittable(f"the expected side `{ast.unparse(node)[:80]}` uses "
                         f"{sorted(names & self.imported)}, which the checker does not have")
    if _trusted.is_trusted(node, self.env):  # Issue 45: never the sandbox's.
      try:
        _trusted.check_evaluable(node)
      except ValueError as e:
        raise Unsplittable(f"the expected side `{ast.unparse(node)[:80]}` names only "
                           f"trusted values but holds {e}, which the checker cannot "
                           "evaluate") from None
      return node
    local = (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.UnaryOp,
             ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp)
    if isinstance(node, ast.Name) and node.id in self.env:
      return node
    if isinstance(node, ast.Attribute) and self._is_local_function(node):
      return node
    if isinstance(node, ast.Call) and self._is_local_function(node.func) and (
        not any(isinstance(a, ast.Starred) for a in node.args)) and not any(
            isinstance(n, ast.Lambda) for n in ast.walk(node)):
      node = ast.Call(node.func, [self.split(a) for a in node.args],
                      [ast.keyword(k.arg, self.split(k.value))
                       for k in node.keywords])
      if any(k.arg is None for k in node.keywords):
        raise Unsplittable("**kwargs")
      return node
    if isinstance(node, local) and not isinstance(node, ast.Dict):
      if any(isinstance(c, ast.Starred) for c in ast.iter_child_nodes(node)):
        raise Unsplittable("starred expression")
      fields = {}
      for name, value in ast.iter_fields(node):
        if isinstance(value, ast.expr):
          fields[name] = self.split(value)
        elif isinstance(value, list):
          fields[name] = [self.split(v) if isinstance(v, ast.expr) else v
                          for v in value]
        else:
          fields[name] = value
      return type(node)(**fields)
    if isinstance(node, ast.Dict):
      if any(k is None for k in node.keys):
        raise Unsplittable("dict unpacking")
      return ast.Dict([self.split(k) for k in node.keys],
                      [self.split(v) for v in node.values])
    if _is_verdict(node):
      raise Unsplittable(f"the sandbox would compute a verdict: "
                         f"{ast.unparse(node)[:80]}")
    if isinstance(node, ast.GeneratorExp):  # Its values, as a list.
      node = ast.ListComp(node.elt, node.generators)
    self.leaves.append(ast.unparse(node))
    return ast.Name(f"{_LEAF}{len(self.leaves) - 1}", ast.Load())


def _literal(node: ast.expr, env: dict[str, Any]) -> Any:
  """The value of an expression with no leaves (else Unsplittable)."""
  splitter = _Splitter(env)
  tree = splitter.split(node)
  if splitter.leaves:
    raise Unsplittable("not a literal")
  return evaluate(tree, env, ())


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> Test:
  """The test's calls for the sandbox and its checks; raises Unsplittable."""
  try:
    module = ast.parse(text)
  except (SyntaxError, ValueError, UnicodeError, MemoryError, RecursionError
          ) as e:
    raise Unsplittable(f"not Python: {type(e).__name__}") from e
  env: dict[str, Any] = {}
  leaves: list[str] = []
  checks: list[Check] = []
  setup: list[tuple[int, str, ast.Assign | None]] = []  # Before leaf k.
  imported: set[str] = set()  # Names the test imports that the checker lacks.
  for statement in module.body:
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
      trusted = (_trusted.MODULES.get(statement.module, {})
                 if isinstance(statement, ast.ImportFrom) else _trusted.MODULES)
      for alias in statement.names:
        name = alias.asname or alias.name.split(".")[0]
        if alias.name in trusted:
          if isinstance(statement, ast.ImportFrom):
            env[name] = trusted[alias.name]
          elif name != alias.name:
            imported.add(name)  # `import math as m`: refused, not guessed.
        else:
          imported.add(name)
      setup.append((len(leaves), ast.unparse(statement), None))
    elif isinstance(statement, ast.Assign) and len(statement.targets) == 1 and (
        isinstance(statement.targets[0], ast.Name)):
      name = statement.targets[0].id
      trusted = _trusted.is_trusted(statement.value, {**env, **dict.fromkeys(imported)})
      try:
        env[name] = _literal(statement.value, env)
      except (Unsplittable, Exception) as e:  # pylint: disable=broad-except
        if trusted:  # Issue 45: an expected value is never the sandbox's.
          raise Unsplittable(f"`{ast.unparse(statement)[:80]}` cannot be evaluated "
                             f"outside the sandbox ({e})") from None
        env.pop(name, None)  # The sandbox computes it: a leaf wherever used.
        if _is_verdict(statement.value):
          raise Unsplittable("an assignment computes a verdict") from None
      setup.append((len(leaves), ast.unparse(statement), statement))
    elif isinstance(statement, ast.Assert):
      splitter = _Splitter(env, frozenset(imported))
      tree = ast.fix_missing_locations(
          ast.Expression(splitter.split(statement.test)))
      checks.append(Check(tree.body, len(leaves), tuple(env.items())))
      leaves.extend(splitter.leaves)
    else:
      raise Unsplittable(f"a {type(statement).__name__} statement")
  if not checks:
    raise Unsplittable("no assert statement")
  return Test(_with_setup(leaves, setup), tuple(checks))


def _names(node: ast.AST) -> set[str]:
  return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _with_setup(leaves: list[str], setup: list[tuple[int, str, Any]]
                ) -> tuple[tuple[str, str], ...]:
  """(setup, leaf) pairs. Each leaf gets the imports before it and only the
  assignments it reads (the last one of each name before it, and what that
  one reads, in order), and runs in a fresh copy of the program: a value one
  call compares with (`expected = [1, 2]`, or another call's argument) is
  never visible to another."""
  calls = []
  for k, leaf in enumerate(leaves):
    needed, chosen = _names(ast.parse(leaf, mode="eval")), []
    for before, source, assign in reversed(setup):
      if before > k:  # It comes after this leaf.
        continue
      if assign is None or assign.targets[0].id in needed:
        chosen.append(source)
      if assign is not None and assign.targets[0].id in needed:
        needed = (needed - {assign.targets[0].id}) | _names(assign.value)
    calls.append(("\n".join(reversed(chosen)), leaf))
  return tuple(calls)


_MAX_SIZE = 10**7  # Bits of an int, items of a sequence, a result may have.


def _guarded_binary(op: ast.operator, a: Any, b: Any) -> Any:
  """Arithmetic on values the model chose, refusing results over _MAX_SIZE
  (a huge power, shift or repetition would stall the trainer): the test
  then fails."""
  ints = lambda *xs: all(isinstance(x, int) for x in xs)
  if isinstance(op, ast.Pow) and ints(a, b) and abs(a) > 1 and (
      abs(b) * abs(a).bit_length() > _MAX_SIZE):
    raise OverflowError("power too large")
  if isinstance(op, ast.LShift) and ints(a, b) and (
      b + abs(a).bit_length() > _MAX_SIZE):
    raise OverflowError("shift too large")
  if isinstance(op, ast.Mult):
    for seq, n in ((a, b), (b, a)):
      if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and (
          len(seq) * n > _MAX_SIZE):
        raise OverflowError("repetition too large")
  return _BINARY[type(op)](a, b)


def evaluate(node: ast.expr, env: dict[str, Any], values: tuple[Any, ...]
             ) -> Any:
  """A split expression on the leaves' values, here, on plain data only."""
  ev = lambda n: evaluate(n, env, values)
  if isinstance(node, ast.Constant):
    return node.value
  if isinstance(node, ast.Name):
    if node.id.startswith(_LEAF):
      value = values[int(node.id[len(_LEAF):])]
      if isinstance(value, _results.Raised):
        raise ValueError(f"the call raised {value.name}")
      return value
    if node.id in env:
      return env[node.id]
    return _FUNCTIONS[node.id] if node.id in _FUNCTIONS else _trusted.MODULES[node.id]
  if isinstance(node, ast.Attribute):
    return _trusted.attribute(ev(node.value), node.attr)
  if isinstance(node, ast.Subscript):
    return ev(node.value)[ev(node.slice)]
  if isinstance(node, ast.Slice):
    return slice(*(None if n is None else ev(n) for n in (node.lower, node.upper, node.step)))
  scoped = lambda n, scope: evaluate(n, scope, values)
  if isinstance(node, _trusted.COMPREHENSIONS):
    return _trusted.comprehension(node, env, scoped)
  if isinstance(node, ast.Lambda):
    return _trusted.function(node, env, scoped)
  if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
    kind = {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)]
    return kind(ev(e) for e in node.elts)
  if isinstance(node, ast.Dict):
    return {ev(k): ev(v) for k, v in zip(node.keys, node.values)}
  if isinstance(node, ast.UnaryOp):
    return _UNARY[type(node.op)](ev(node.operand))
  if isinstance(node, ast.BinOp):
    return _guarded_binary(node.op, ev(node.left), ev(node.right))
  if isinstance(node, ast.BoolOp):
    result = None
    for operand in node.values:
      result = ev(operand)
      if bool(result) == isinstance(node.op, ast.Or):
        return result
    return result
  if isinstance(node, ast.Compare):
    left = ev(node.left)
    for op, comparator in zip(node.ops, node.comparators):
      right = ev(comparator)
      if not _COMPARE[type(op)](left, right):
        return False
      left = right
    return True
  if isinstance(node, ast.IfExp):
    return ev(node.body) if ev(node.test) else ev(node.orelse)
  if isinstance(node, ast.Call):
    return ev(node.func)(*[ev(a) for a in node.args],
                         **{k.arg: ev(k.value) for k in node.keywords})
  raise ValueError(f"cannot evaluate a {type(node).__name__}")


def passes(test: Test, values: tuple[Any, ...]) -> bool:
  """Whether every assert of `test` holds on the sandbox's leaf values."""
  for check in test.checks:
    try:
      if not evaluate(check.expression, dict(check.env),
                      values[check.first_leaf:]):
        return False
    except Exception:  # pylint: disable=broad-except
      return False  # A leaf raised, or the values do not support the test.
  return True


def io_case(test: Any) -> tuple[str, str] | None:
  """(stdin, expected stdout) of an I/O-style test, else None."""
  if isinstance(test, Mapping) and isinstance(test.get("input"), str) and (
      isinstance(test.get("output"), str)):
    return test["input"], test["output"]
  return None


def same_output(got: Any, want: str) -> bool:
  """Printed output against the expected, line by line, ignoring trailing
  whitespace and blank lines at either end."""
  lines = lambda text: [line.rstrip() for line in text.strip().splitlines()]
  return isinstance(got, str) and lines(got) == lines(want)


def calls_of(tests: Sequence[Any]) -> tuple[list[tuple[str, str]], list[str]]:
  """The sandbox's calls (assert tests, in order) and stdins (I/O cases)."""
  calls, stdin = [], []
  for test in tests:
    case = io_case(test)
    if case:
      stdin.append(case[0])
    else:
      parsed = parse_or_warn(test)
      calls.extend(parsed.calls if parsed is not None else ())
  return calls, stdin


def count_passed(tests: Sequence[Any], results: bytes) -> int:
  """How many of `tests` hold on a run's result lines (`calls_of(tests)`
  run in the sandbox). Decoding and comparing the model's values can take
  unbounded time and memory: run this only under a hard bound (`_checker`)."""
  cases = [io_case(t) for t in tests]
  parsed = [None if case else _parse_quietly(t)
            for t, case in zip(tests, cases)]
  num_calls = sum(len(t.calls) for t in parsed if t is not None)
  found = _results.parse_results(results, num_calls, sum(map(bool, cases)))
  if found is None:
    return 0
  values, outputs = found[0], iter(found[1])
  passed, start = 0, 0
  for test, case in zip(parsed, cases):
    if case:
      passed += same_output(next(outputs), case[1])
    elif test is not None:
      passed += passes(test, values[start:start + len(test.calls)])
      start += len(test.calls)
  return passed


def _parse_quietly(text: Any) -> Test | None:
  try:
    return parse(text) if isinstance(text, str) else None
  except Unsplittable:
    return None


_warned: set[str] = set()


def parse_or_warn(text: Any) -> Test | None:
  """`parse`, or None after logging (once per test text) why not."""
  try:
    if not isinstance(text, str):
      raise Unsplittable(f"a test is Python source or an I/O case, not "
                         f"{text!r:.80}")
    return parse(text)
  except Unsplittable as e:
    key = repr(text)[:200]
    if len(_warned) < 100 and key not in _warned:
      _warned.add(key)
      import logging  # pylint: disable=import-outside-toplevel
      logging.warning("code reward: a test cannot be decided outside the "
                      "sandbox (%s); it counts as failed. Write it as "
                      "`assert <call> == <value>`: %s", e, key)
    return None
