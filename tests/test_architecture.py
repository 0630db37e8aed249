"""The package's shape: no import cycles, the pure layer stays pure, every
config in configs/ validates with every name it uses registered after a bare
`import grpo_jax`, and every shape suffix in grpo_jax/ uses the one table of
shape letters in grpo_jax/__init__.py's docstring."""
import ast
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import grpo_jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import import_graph  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------
# The module graph.
# ----------------------------------------------------------------------------

def _package(tmp_path, files: dict[str, str]) -> str:
  for name, text in {"grpo_jax/__init__.py": "", **files}.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
  return str(tmp_path)


def test_graph_finds_a_cycle_hidden_in_a_function(tmp_path):
  root = _package(tmp_path, {
      "grpo_jax/a.py": "from grpo_jax import b\n",
      "grpo_jax/b.py": "def f():\n  from grpo_jax import a\n  return a\n",
      "grpo_jax/c.py": "import grpo_jax.a\n"})
  graph = import_graph.edges(root)
  assert set(graph) == {
      import_graph.Edge("grpo_jax.a", "grpo_jax.b", False),
      import_graph.Edge("grpo_jax.b", "grpo_jax.a", True),
      import_graph.Edge("grpo_jax.c", "grpo_jax.a", False)}
  assert import_graph.find_cycle(graph) == ["grpo_jax.a", "grpo_jax.b",
                                            "grpo_jax.a"]


def test_graph_finds_a_cycle_through_a_package_init(tmp_path):
  # t -> p.x runs p/__init__ first, which imports p.y, which imports t.
  root = _package(tmp_path, {
      "grpo_jax/t.py": "from grpo_jax.p.x import X\n",
      "grpo_jax/p/__init__.py": "from grpo_jax.p import y\n",
      "grpo_jax/p/x.py": "X = 1\n",
      "grpo_jax/p/y.py": "from grpo_jax.t import *\nfrom grpo_jax.p.x import X\n"})
  graph = import_graph.edges(root)
  assert import_graph.find_cycle(graph) is None        # explicit edges only
  cycle = import_graph.find_cycle(import_graph.with_parents(graph))
  assert cycle is not None and "grpo_jax.t" in cycle
  # p.y importing its own sibling runs no other package's __init__.
  assert import_graph.Edge("grpo_jax.p.y", "grpo_jax.p", False) not in \
      import_graph.with_parents(graph)


def test_grpo_jax_has_no_import_cycle():
  graph = import_graph.with_parents(import_graph.edges(ROOT))
  assert import_graph.find_cycle(graph) is None


def test_no_in_function_import_dodges_a_cycle():
  """A lazy import between grpo_jax modules is allowed only where it saves
  start-up time: made module-level, none of them may close a cycle."""
  graph = import_graph.edges(ROOT)
  eager = [e._replace(lazy=False) for e in graph]
  assert import_graph.find_cycle(import_graph.with_parents(eager)) is None


def test_algorithms_import_nothing_above_them():
  allowed = ("grpo_jax.algorithms", "grpo_jax.models", "grpo_jax.registry",
             "grpo_jax.data.example")
  above = [e for e in import_graph.edges(ROOT)
           if e.source.startswith("grpo_jax.algorithms")
           and not e.target.startswith(allowed)]
  assert not above


def _readme() -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def _layout_rows() -> list[str]:
  """The grpo_jax packages and top-level modules the README's layout tree
  names, top row first: the lines `  name/` or `  name.py` of the first code
  block under `## Layout`."""
  readme = _readme()
  section = readme[readme.index("\n## Layout\n"):]
  section = section[:section.find("\n## ", 1)]
  block = section.split("```")[1]
  return [m.group(1) for line in block.splitlines()
          if (m := re.match(r"  ([a-z_]+)(?:/|\.py)(?:\s|$)", line))]


def test_readme_layout_names_every_module_in_import_order():
  rows = _layout_rows()
  top = lambda m: m.split(".")[1]
  assert len(rows) == len(set(rows)), f"listed twice: {rows}"
  assert set(rows) == {top(m) for m in import_graph.modules(ROOT)
                       if m != "grpo_jax"}
  row_of = {name: i for i, name in enumerate(rows)}
  upward = sorted({(e.source, e.target) for e in import_graph.edges(ROOT)
                   if e.source != "grpo_jax" and e.target != "grpo_jax"
                   and row_of[top(e.target)] < row_of[top(e.source)]})
  assert not upward, f"imports of a module listed above: {upward}"


# ----------------------------------------------------------------------------
# Every config in configs/ in a fresh interpreter that imports only grpo_jax.
# ----------------------------------------------------------------------------

_CHECK_CONFIGS = r'''
import importlib.util, json, os, re, sys
import grpo_jax
from grpo_jax import errors
from grpo_jax import config as config_lib, registry
from grpo_jax import validation

# Fields a config may leave for the user to set (validation names them).
USER_FIELDS = ("model.source", "data.kwargs.path", "data.eval_kwargs.path",
               "data.kwargs.data_dir", "data.eval_kwargs.data_dir")

def get(c, path):
  *head, last = path.split(".")
  for part in head:
    c = c[part]
  return c, last

def names_used(c):
  """(kind, name) of every registry name the config uses."""
  used = [("method", c.method), ("dataset", c.data.source),
          ("dataset", c.data.eval_source or c.data.source),
          ("template", c.data.template), ("advantage", c.rl.advantage),
          ("loss_agg", c.rl.loss_agg), ("kl_estimator", c.rl.kl_estimator),
          ("final_answer", c.accuracy_reward)]
  used += [("reward", name) for name in c.rewards]
  used += [("layout", kw["layout"]) for kw in (c.data.kwargs, c.data.eval_kwargs)
           if kw.get("layout") not in (None, "auto")]
  if not os.path.exists(c.model.source):
    used.append(("model", c.model.source))
  return used

out = {}
for path in sys.argv[1:]:
  spec = importlib.util.spec_from_file_location("cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for variant in module.VARIANTS:
    c = module.get_config(variant or None)
    unset = []   # fields validation asked for, in the order it named them
    while True:
      try:
        validation.validate(c)
        break
      except errors.ConfigError as e:
        field = re.match(r"config field '([\w.]+)' is unset", str(e))
        if not field or field[1] not in USER_FIELDS or field[1] in unset:
          raise
        unset.append(field[1])
        group, key = get(c, field[1])
        group[key] = "qwen2.5-0.5b" if field[1] == "model.source" else "/data/set"
    for kind, name in names_used(c):
      registry.lookup(kind, name)
    out[f"{os.path.basename(path)}:{variant}"] = {"unset": unset, "method": c.method}
print(json.dumps(out))
'''


def test_every_config_and_variant_validates_after_import_grpo_jax():
  configs = sorted(os.path.join(ROOT, "configs", f)
                   for f in os.listdir(os.path.join(ROOT, "configs"))
                   if f.endswith(".py") and not f.startswith("_"))
  proc = subprocess.run([sys.executable, "-c", _CHECK_CONFIGS, *configs],
                        capture_output=True, text=True, timeout=300, cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT,
                                 JAX_PLATFORMS="cpu"), check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  checked = json.loads(proc.stdout.splitlines()[-1])
  files = {name.split(":")[0] for name in checked}
  assert files == {os.path.basename(p) for p in configs}
  assert checked["star_commonsenseqa.py:commonsenseqa"] == {
      "unset": ["data.kwargs.path", "data.eval_kwargs.path"], "method": "star"}
  for variant in ("deepseekmath", "gemma3_1b"):
    assert checked[f"grpo_gsm8k.py:{variant}"]["unset"] == [
        "data.kwargs.path", "data.eval_kwargs.path", "model.source"]


@pytest.mark.parametrize("kind", ["layout", "method", "final_answer"])
def test_names_exist_after_a_bare_import(kind):
  proc = subprocess.run(
      [sys.executable, "-c", "import grpo_jax, json; from grpo_jax import "
       f"registry; print(json.dumps(registry.names({kind!r})))"],
      capture_output=True, text=True, timeout=120, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  names = json.loads(proc.stdout)
  assert {"layout": "commonsenseqa", "method": "star",
          "final_answer": "multiple_choice"}[kind] in names


# ----------------------------------------------------------------------------
# One shape vocabulary: the table in grpo_jax/__init__.py's docstring.
# ----------------------------------------------------------------------------

VOWELS = set("aeiouy")
# Suffixes that pass for shapes by the rule below but are words: backward,
# forward, the MLP, TensorFlow Datasets.
NOT_SHAPES = {"bwd", "cdf", "cfg", "fwd", "mlp", "tfds"}


def shape_letters(doc: str) -> set[str]:
  """The letters the docstring's table defines: each entry is a lone lower-
  case letter, two spaces, then its meaning."""
  table = doc[doc.index("Shape letters"):].split("\n\n")[1]
  return set(re.findall(r"(?<!\S)([a-z])  (?=\S)", table))


def never_after_b(doc: str) -> set[str]:
  """The letters the docstring says never directly follow `b`."""
  rule = re.search(r"never `b` followed by ([^(]*)\(", doc)
  return set(re.findall(r"`([a-z])`", rule[1]))


def shape_fault(name: str, letters: set[str], after_b: set[str]):
  """Why `name`'s shape suffix breaks the table, or None.

  The suffix is the part after the last `_`, less a trailing 1 (a kept axis
  of size one); only suffixes of at least two lower-case letters count, so a
  lone letter (`r_g`, `M_n`) and words with digits pass. A suffix made only
  of table letters is a shape: it must not put `t`, `s` or `q` (per the
  docstring) right after `b`, the model code's old "b = any batch" meaning
  (`h_btd`, `positions_bt`). A suffix with a letter outside the table is a
  shape with an unknown axis (`x_nbc`) when it has no vowel, at least two
  table letters and is not in NOT_SHAPES; otherwise it is a word (`_id`,
  `_ok`, `_fn`, `_mb`, `_hf`, `_dir`), and words made of table letters
  (`_step`, `_end`, `_db`) pass as long as they keep the `b` rule.
  """
  parts = name.strip("_").rsplit("_", 1)
  if len(parts) < 2:
    return None
  suffix = parts[1].removesuffix("1")
  if len(suffix) < 2 or not (suffix.isalpha() and suffix.islower()):
    return None
  outside = set(suffix) - letters
  if not outside:
    bad = [f"b{c}" for c in after_b if f"b{c}" in suffix]
    return f"`{bad[0]}`: b is prompts" if bad else None
  known = sum(c in letters for c in suffix)
  if set(suffix) & VOWELS or known < 2 or suffix in NOT_SHAPES:
    return None
  return f"letters {sorted(outside)} are not in the table"


def bound_names(tree: ast.AST):
  """(line, identifier) of every name the source binds: definitions,
  arguments, assignment targets (names and attributes), `except ... as`."""
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      yield node.lineno, node.name
    elif isinstance(node, ast.arg):
      yield node.lineno, node.arg
    elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(
        node.ctx, ast.Store):
      yield node.lineno, getattr(node, "id", None) or node.attr
    elif isinstance(node, ast.ExceptHandler) and node.name:
      yield node.lineno, node.name


def test_shape_table_is_read_from_the_package_docstring():
  letters = shape_letters(grpo_jax.__doc__)
  assert set("bgntpsvld") <= letters
  assert never_after_b(grpo_jax.__doc__) == set("tsq")
  assert not letters & (VOWELS - {"e"})   # else the unknown-letter rule misses


@pytest.mark.parametrize("name,fault", [
    # The model code's old vocabulary (b = any rows, t = their length).
    ("positions_bt", "bt"), ("h_btd", "bt"), ("logits_btv", "bt"),
    ("valid_bs", "bs"), ("q_bthd", "bt"), ("mask_bts", "bt"),
    ("x_nbf", "not in the table"), ("logits_nfv", "not in the table"),
    # Shapes of the table, and words that are not shapes.
    ("tokens_ns", None), ("reward_bg", None), ("mask_bgt", None),
    ("adv_n1", None), ("q_nqhe", None), ("k_lbkpe", None), ("h_last_bd", None),
    ("memory_mb", None), ("grad_fn", None), ("step_end", None),
    ("pad_id", None), ("exist_ok", None), ("x_db", None), ("x_tb", None),
    ("_attend_bwd", None), ("r_g", None), ("format_r1", None)])
def test_shape_fault_flags_the_old_and_unknown_letters(name, fault):
  letters = shape_letters(grpo_jax.__doc__)
  got = shape_fault(name, letters, never_after_b(grpo_jax.__doc__))
  if fault is None:
    assert got is None, got
  else:
    assert got is not None and fault in got


def test_every_shape_suffix_in_grpo_jax_uses_the_table():
  letters = shape_letters(grpo_jax.__doc__)
  after_b = never_after_b(grpo_jax.__doc__)
  faults = []
  for dirpath, _, files in os.walk(os.path.join(ROOT, "grpo_jax")):
    for file in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(dirpath, file)
      with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
      for line, name in sorted(set(bound_names(tree))):
        fault = shape_fault(name, letters, after_b)
        if fault:
          faults.append(f"{os.path.relpath(path, ROOT)}:{line} {name}: {fault}")
  assert not faults, ("shape suffixes outside grpo_jax/__init__.py's table "
                      "(rename, or add a word to NOT_SHAPES):\n"
                      + "\n".join(faults))
