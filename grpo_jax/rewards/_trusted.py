"""The trusted side of a code test: what is evaluated outside the sandbox (issue 45, item 4).

The expected side of `assert squares(4) == [i * i for i in range(4)]` must
never be computed where the model's program ran (the program would choose
it). A sub-expression whose free names are all trusted (the builtins and the
`math`, `collections` and `str` functions below, names the test bound to
literals, comprehension and lambda variables) is therefore evaluated here, by
`evaluate` in `_code_checks`, on plain data, in the checker process; one that
names anything else (the model's functions) is a leaf for the sandbox. A
trusted sub-expression that this evaluator cannot evaluate makes the test
unevaluable, and `code.check_tests` refuses it when the data is loaded.
"""
from __future__ import annotations

import ast
import collections
import math
from typing import Any, Callable

MAX_RANGE = 10**6  # A range the checker may iterate: the dataset's, but bounded.


def _range(*args: int) -> range:
  values = range(*args)
  if len(values) > MAX_RANGE:
    raise OverflowError("range too large")
  return values


FUNCTIONS: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (abs, all, any, bool, dict, float, frozenset, int,
                            len, list, max, min, round, set, sorted, str, sum,
                            tuple, enumerate, zip, reversed, chr, ord, divmod,
                            bin, hex, oct, map, filter)}
FUNCTIONS["range"] = _range
MATH = {name: getattr(math, name) for name in (
    "isclose", "sqrt", "floor", "ceil", "fabs", "isnan", "isinf", "pi", "e",
    "inf", "nan", "log", "exp", "gcd", "factorial", "comb", "perm", "prod",
    "lcm", "isqrt", "log2", "log10", "sin", "cos", "tan", "atan2", "hypot",
    "trunc", "copysign", "fsum", "radians", "degrees")}
COLLECTIONS = {name: getattr(collections, name) for name in (
    "Counter", "OrderedDict", "deque")}
MODULES = {"math": MATH, "collections": COLLECTIONS}
# Methods that only read their receiver, by the receiver's type.
_STR_METHODS = frozenset((
    "upper lower title capitalize swapcase strip lstrip rstrip split rsplit "
    "splitlines join replace startswith endswith count find rfind index "
    "rindex isdigit isalpha isalnum isspace isupper islower zfill center "
    "ljust rjust casefold partition rpartition removeprefix removesuffix").split())
_METHODS: dict[type, frozenset[str]] = {
    str: _STR_METHODS,
    list: frozenset(("count", "index", "copy")),
    tuple: frozenset(("count", "index")),
    dict: frozenset(("keys", "values", "items", "get", "copy")),
    set: frozenset(("union", "intersection", "difference", "issubset",
                    "issuperset", "symmetric_difference", "copy")),
    frozenset: frozenset(("union", "intersection", "difference", "issubset",
                          "issuperset")),
    collections.Counter: frozenset(("most_common", "total", "keys", "values",
                                    "items", "get")),
}
_ANY_METHOD = frozenset().union(*_METHODS.values())
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
# The node types `evaluate` reads (with the operators `_code_checks` maps).
NODES = (ast.Constant, ast.Name, ast.Attribute, ast.List, ast.Tuple, ast.Set,
         ast.Dict, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp,
         ast.Call, ast.Subscript, ast.Slice, ast.Lambda, ast.keyword,
         ast.comprehension, ast.arguments, ast.arg, ast.Load, ast.Store,
         ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop,
         *COMPREHENSIONS)


def bound_names(node: ast.AST) -> set[str]:
  """Names a comprehension or lambda inside `node` binds."""
  names = set()
  for sub in ast.walk(node):
    if isinstance(sub, ast.comprehension):
      names |= {n.id for n in ast.walk(sub.target) if isinstance(n, ast.Name)}
    elif isinstance(sub, ast.Lambda):
      names |= {a.arg for a in sub.args.args}
  return names


def free_names(node: ast.AST) -> set[str]:
  loaded = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
  return loaded - bound_names(node)


def is_trusted(node: ast.AST, env: dict[str, Any]) -> bool:
  """Every free name is the test's own or a trusted function: evaluated here."""
  return all(name in env or name in FUNCTIONS or name in MODULES
             for name in free_names(node))


def check_evaluable(node: ast.AST) -> None:
  """Raises ValueError naming what `evaluate` cannot read in a trusted node."""
  for sub in ast.walk(node):
    if not isinstance(sub, NODES):
      raise ValueError(f"a {type(sub).__name__}")
    if isinstance(sub, ast.Attribute):
      module = MODULES.get(sub.value.id) if isinstance(sub.value, ast.Name) else None
      known = module if module is not None else _ANY_METHOD
      if sub.attr not in known:
        raise ValueError(f"the attribute .{sub.attr}")
    if isinstance(sub, ast.Lambda) and (sub.args.vararg or sub.args.kwarg
                                        or sub.args.kwonlyargs or sub.args.defaults):
      raise ValueError("a lambda with more than positional arguments")


def attribute(value: Any, name: str) -> Any:
  """`math.factorial`, `collections.Counter`, or a reading method of a plain value."""
  if any(value is module for module in MODULES.values()):
    return value[name]
  if name in _METHODS.get(type(value), ()):
    return getattr(value, name)
  raise ValueError(f"no trusted attribute {name!r} of a {type(value).__name__}")


def comprehension(node: ast.expr, env: dict[str, Any],
                  ev: Callable[[ast.expr, dict[str, Any]], Any]) -> Any:
  """A list/set/dict comprehension or generator (as a list), evaluated here."""
  out: list[Any] = []

  def loop(level: int, scope: dict[str, Any]) -> None:
    if level == len(node.generators):
      out.append((ev(node.key, scope), ev(node.value, scope))
                 if isinstance(node, ast.DictComp) else ev(node.elt, scope))
      if len(out) > MAX_RANGE:
        raise OverflowError("comprehension too large")
      return
    generator = node.generators[level]
    for item in ev(generator.iter, scope):
      inner = dict(scope)
      _bind(generator.target, item, inner)
      if all(ev(test, inner) for test in generator.ifs):
        loop(level + 1, inner)

  loop(0, dict(env))
  if isinstance(node, ast.DictComp):
    return dict(out)
  return set(out) if isinstance(node, ast.SetComp) else out


def _bind(target: ast.expr, value: Any, scope: dict[str, Any]) -> None:
  if isinstance(target, ast.Name):
    scope[target.id] = value
  elif isinstance(target, (ast.Tuple, ast.List)):
    items = list(value)
    if len(items) != len(target.elts):
      raise ValueError("cannot unpack")
    for sub, item in zip(target.elts, items):
      _bind(sub, item, scope)
  else:
    raise ValueError(f"cannot bind a {type(target).__name__}")


def function(node: ast.Lambda, env: dict[str, Any],
             ev: Callable[[ast.expr, dict[str, Any]], Any]) -> Callable[..., Any]:
  """A lambda of the test (`key=lambda p: p[1]`), evaluated here when called."""
  names = [a.arg for a in node.args.args]

  def call(*args: Any) -> Any:
    if len(args) != len(names):
      raise TypeError("wrong number of arguments")
    return ev(node.body, {**env, **dict(zip(names, args))})

  return call
