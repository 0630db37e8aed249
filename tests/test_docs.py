"""The docs against the tree: docs/modules.md names every module of grpo_jax/
and nothing that is not there."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path: str) -> str:
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


def _doc_pages() -> list[str]:
  return sorted(os.path.join("docs", name)
                for name in os.listdir(os.path.join(ROOT, "docs"))
                if name.endswith(".md"))


# ----------------------------------------------------------------------------
# docs/modules.md names every module, and only modules that exist.
# ----------------------------------------------------------------------------

def modules_named(page: str) -> list[str]:
  """The paths the first column of `page`'s table names, in order.

  A row names one or more files of one package: the first in full
  (`grpo_jax/aot/check.py`), the rest by file name (`programs.py`), each
  relative to the folder of the last full path before it."""
  named = []
  for line in page.splitlines():
    if not line.startswith("| `"):
      continue
    folder = ""
    for token in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
      if "/" in token:
        folder = token.rsplit("/", 1)[0]
        named.append(token)
      else:
        named.append(f"{folder}/{token}")
  return named


def package_modules(root: str) -> set[str]:
  """Every .py file under root/grpo_jax but the `__init__.py`s, relative."""
  found = set()
  for dirpath, _, files in os.walk(os.path.join(root, "grpo_jax")):
    found |= {os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
              for f in files if f.endswith(".py") and f != "__init__.py"}
  return found


def test_modules_named_reads_rows_of_several_files():
  page = ("| path | what |\n| --- | --- |\n"
          "| `grpo_jax/aot/check.py`, `programs.py` | compile (`not_a_path.py`) |\n"
          "| `grpo_jax/errors.py` | errors |\n")
  assert modules_named(page) == ["grpo_jax/aot/check.py", "grpo_jax/aot/programs.py",
                                 "grpo_jax/errors.py"]


def test_modules_md_names_every_module_and_only_modules_that_exist():
  named = modules_named(_read("docs/modules.md"))
  modules = package_modules(ROOT)
  twice = sorted({m for m in named if named.count(m) > 1})
  missing = sorted(modules - set(named))
  extra = sorted(set(named) - modules)
  assert not (missing or extra or twice), (
      "docs/modules.md against grpo_jax/: "
      f"no row names {missing}; rows name files that do not exist {extra}; "
      f"named twice {twice}")
