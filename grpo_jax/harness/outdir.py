"""Output directories that are never overwritten by accident.

`export.py --out=DIR` into a folder that already holds a model would mix the
two (stale weight shards beside a new config.json). `check_empty` refuses a
non-empty directory unless told to overwrite; `staged` writes the new
content into a temporary directory beside the target and swaps it in only
once complete, so a failed export leaves the old directory as it was.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from grpo_jax.errors import OutputExistsError


def check_empty(out: os.PathLike, overwrite: bool, flag: str = "--overwrite") -> None:
  """Raises OutputExistsError if `out` is a file, or a non-empty directory
  and not `overwrite`."""
  out = Path(out)
  if out.exists() and not out.is_dir():
    raise OutputExistsError(f"{out} is a file, not a directory: choose another output "
                            "directory; nothing was written")
  entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
  if entries and not overwrite:
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
    raise OutputExistsError(
        f"{out} is not empty ({shown}); nothing was written. Choose an empty or new "
        f"directory, or pass {flag} to replace its whole content (the new one is "
        "written beside it and swapped in once complete).")


@contextlib.contextmanager
def staged(out: os.PathLike) -> Iterator[Path]:
  """A fresh directory beside `out` to write into; on success it replaces
  `out` (the old content is deleted after the swap), on failure it is
  removed and `out` is untouched."""
  out = Path(out).absolute()
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
  try:
    yield tmp
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  old = None
  if out.exists():
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / out.name)
  os.replace(tmp, out)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)
