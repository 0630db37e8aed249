r"""Lists, shows and compares recorded runs.

  python experiments/runs.py list [--sweep=clip_higher] [--name=...] [--status=failed]
  python experiments/runs.py show 12
  python experiments/runs.py compare 12 13 [14 ...]
  python experiments/runs.py compare --sweep=clip_higher

The store is $GRPO_JAX_RUNS/runs.sqlite (default ./runs/runs.sqlite);
--root overrides the directory.
"""
import os
import sqlite3
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import (
  app,  # pylint: disable=g-import-not-at-top
  flags,
)

from grpo_jax import errors
from grpo_jax.harness import cli, runs

_ROOT = flags.DEFINE_string("root", None, "Run store directory "
                            "(default $GRPO_JAX_RUNS, else ./runs).")
_SWEEP = flags.DEFINE_string("sweep", None, "Only the runs of this sweep.")
_NAME = flags.DEFINE_string("name", None, "Only the runs with this name.")
_STATUS = flags.DEFINE_enum("status", None, runs.SHOWN_STATUSES, "Only runs with this "
                            "status (died: recorded running, its process is gone).")
_USAGE = "usage: runs.py list | show ID | compare ID ID... (or compare --sweep=NAME)"


def _ids(args: list[str]) -> list[int]:
  try:
    return [int(a) for a in args]
  except ValueError:
    raise app.UsageError(f"run ids are integers, got {args}; {_USAGE}") from None


def main(argv):
  command, args = (argv[1], argv[2:]) if len(argv) > 1 else ("list", [])
  with cli.user_errors():
    store = runs.RunStore(_ROOT.value, create=False)   # reading: never make one
    # As they stand: a run whose process died shows "died".
    try:
      every = runs.observed(store.list())
    except sqlite3.Error as e:   # locked (told apart) or damaged: one line
      raise runs.store_error(store.path, e) from None
    wanted = {"name": _NAME.value, "sweep": _SWEEP.value, "status": _STATUS.value}
    selected = lambda: [r for r in every if all(
        v is None or getattr(r, k) == v for k, v in wanted.items())]
    by_id = {r.id: r for r in every}

    def get(run_id: int) -> runs.Run:
      if run_id not in by_id:
        raise errors.RunStoreError(f"no run {run_id} in {store.path}; `python "
                                   "experiments/runs.py list` shows the runs")
      return by_id[run_id]
    if command == "list" and not args:
      print(runs.format_runs(selected()))
    elif command == "show" and len(args) == 1:
      print(runs.format_run(get(_ids(args)[0])))
    elif command == "compare" and (args or _SWEEP.value or _NAME.value):
      print(runs.compare_runs([get(i) for i in _ids(args)] if args else selected()))
    else:
      raise app.UsageError(_USAGE)


if __name__ == "__main__":
  app.run(main)
