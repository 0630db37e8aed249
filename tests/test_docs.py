"""The docs against the tree: docs/modules.md names every module of grpo_jax/
and nothing that is not there; every relative link resolves; commit hashes
live only in docs/history.md; the README stays a front door (at most 250
lines of at most 160 characters). The README's layout against the import
graph is tests/test_architecture.py's."""
import os
import re

import pytest

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


# ----------------------------------------------------------------------------
# Every relative link resolves.
# ----------------------------------------------------------------------------

def _relative_links(path: str) -> list[str]:
  """The targets of markdown links and images in `path`, outside code, with
  web links and pure anchors left out and any #anchor cut off."""
  text = _read(path)
  text = re.sub(r"```.*?```", "", text, flags=re.S)   # code blocks
  text = re.sub(r"`[^`\n]*`", "", text)               # inline code
  targets = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
  return [t.split("#")[0] for t in targets
          if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_relative_link_in_the_docs_resolves():
  missing = set()
  for page in ["README.md"] + _doc_pages():
    for target in _relative_links(page):
      resolved = os.path.relpath(
          os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target)), ROOT)
      if not os.path.exists(os.path.join(ROOT, resolved)):
        missing.add((page, target, resolved))
  assert not missing, f"links to nothing: {sorted(missing)}"


# ----------------------------------------------------------------------------
# Commit hashes only in docs/history.md.
# ----------------------------------------------------------------------------

# A commit hash as the docs write one: 7 to 40 lower-case hex characters with
# at least one digit and one letter, as a word of its own. Hex in code
# (`0x85EBCA6B`), colours (`#1f77b4`) and words (`decade`, `1e-5`) fail one of
# the conditions; an all-digit hash cannot be told from a number.
HASH = re.compile(r"(?<![\w#.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")


def hashes(text: str) -> list[str]:
  return HASH.findall(text)


@pytest.mark.parametrize("text,found", [
    ("on 998e26b (2026-12-02)", ["998e26b"]), ("`2856994`", []),
    ("(c831303: each shard", ["c831303"]), ("a worktree of `ce314ec`", ["ce314ec"]),
    ("0x85EBCA6B", []), ("color #1f77b4", []), ("a decade", []), ("atol 2e-2", []),
    ("sha 0123456789abcdef0123456789abcdef01234567", ["0123456789abcdef0123456789abcdef01234567"]),
    ("1e+5 and 5.83e-03", []), ("abc1234x", []), ("ab12", [])])
def test_hashes_finds_commit_hashes_and_nothing_else(text, found):
  assert hashes(text) == found


def test_commit_hashes_appear_only_in_history_md():
  found = {page: hashes(_read(page)) for page in ["README.md"] + _doc_pages()
           if page != os.path.join("docs", "history.md")}
  found = {page: h for page, h in found.items() if h}
  assert not found, ("commit hashes outside docs/history.md (move the run's "
                     f"story there, keep the figure and its command): {found}")


# ----------------------------------------------------------------------------
# The README: a front door.
# ----------------------------------------------------------------------------

# CI (`.ci/run`) reads the test command from the README verbatim, and the
# README's two set-up commands are copied whole: they stay one line each.
LONG_LINES_ALLOWED = ("pip install -r requirements.txt && ",
                      "pip install -r requirements-test.txt && ")


def test_readme_is_at_most_250_lines():
  assert len(_read("README.md").splitlines()) <= 250


def test_readme_lines_are_at_most_160_characters():
  long = [(i, len(line)) for i, line in enumerate(_read("README.md").splitlines(), 1)
          if len(line) > 160 and not line.startswith(LONG_LINES_ALLOWED)]
  assert not long, f"README.md lines (number, length) over 160 characters: {long}"


def test_the_two_set_up_commands_are_single_lines_of_the_readme():
  lines = _read("README.md").splitlines()
  for prefix in LONG_LINES_ALLOWED:
    assert sum(line.startswith(prefix) for line in lines) == 1, prefix
