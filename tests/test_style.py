"""The code's shape, held by numbers: imports sorted and lines formatted as
pyproject.toml's [tool.ruff] says, few functions with long signatures (small
frozen values carry settings instead), and no module over 420 lines."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "grpo_jax")

# Functions with this many parameters or more (self / cls not counted,
# *args / **kwargs one each): at most MAX_WIDE of them in grpo_jax/.
WIDE = 8
MAX_WIDE = 20
MAX_MODULE_LINES = 420
# The sandbox's runner is one file by design: it runs in the sandboxed child,
# which imports nothing of grpo_jax (rewards/sandbox.py).
LONG_MODULES_ALLOWED = {"grpo_jax/rewards/_sandbox_runner.py"}


def _modules() -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), ROOT)
                for d, _, files in os.walk(PACKAGE) for f in files
                if f.endswith(".py"))


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  a = node.args
  names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs
           if x.arg not in ("self", "cls")]
  return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def wide_functions(text: str) -> list[tuple[str, int]]:
  """(name, parameter count) of each function with >= WIDE parameters."""
  return [(node.name, parameter_count(node))
          for node in ast.walk(ast.parse(text))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and parameter_count(node) >= WIDE]


def test_wide_functions_counts_parameters_as_documented():
  text = ("def f(a, b, c, d, e, f, g, *, h): pass\n"
          "def g(a, b, c, d, e, f, *args, **kwargs): pass\n"
          "class C:\n  def m(self, a, b, c, d, e, f, g): pass\n")
  assert wide_functions(text) == [("f", 8), ("g", 8)]


def test_few_functions_take_eight_or_more_parameters():
  wide = []
  for path in _modules():
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      wide += [f"{path}:{name} ({n})" for name, n in wide_functions(f.read())]
  assert len(wide) <= MAX_WIDE, (
      f"{len(wide)} functions with >= {WIDE} parameters (at most {MAX_WIDE}): "
      "pass the settings that travel together as one frozen value\n"
      + "\n".join(sorted(wide)))


def test_no_module_is_over_420_lines():
  long = {}
  for path in _modules():
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      lines = len(f.read().splitlines())
    if lines > MAX_MODULE_LINES and path not in LONG_MODULES_ALLOWED:
      long[path] = lines
  assert not long, f"modules over {MAX_MODULE_LINES} lines (split by idea): {long}"


def test_ruff_finds_nothing():
  """Import order and formatting rules: pyproject.toml's [tool.ruff]."""
  proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."],
                        cwd=ROOT, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
