"""Quiet, useful logs (issue 25 item 5): no library INFO below --verbosity=1,
the resolved config in <workdir>/config.yaml instead of the log, one line
per step, a progress bar only on a terminal and never run into a log line."""
import io
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from absl import logging as absl_logging

from configs import tiny
from grpo_jax.harness import cli, experiment, metrics

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
# absl's line prefix: I1201 09:11:43.097560 140126472407936 run.py:61] ...
ABSL_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ ([^:\]]+):\d+\] ")


# ----------------------------------------------------------------------------
# No library INFO below --verbosity=1.
# ----------------------------------------------------------------------------

def _record(pathname, level=logging.INFO):
  return logging.LogRecord("absl", level, pathname, 1, "message", (), None)


ORBAX = "/usr/lib/python3/site-packages/orbax/checkpoint/checkpoint_manager.py"


@pytest.mark.parametrize("verbosity", [0, 1])
def test_library_info_is_dropped_below_verbosity_1(verbosity):
  previous = absl_logging.get_verbosity()
  absl_logging.set_verbosity(verbosity)
  try:
    keep = cli._NoLibraryInfo().filter   # pylint: disable=protected-access
    assert keep(_record(ORBAX)) == (verbosity >= 1)
    assert keep(_record(ORBAX, logging.DEBUG)) == (verbosity >= 1)
    assert keep(_record(ORBAX, logging.WARNING))   # warnings always stay
    assert keep(_record(str(REPO / "grpo_jax" / "generate" / "sampling.py")))
    assert keep(_record(str(REPO / "experiments" / "run.py")))
    # a virtualenv inside the checkout is still a library
    assert keep(_record(str(REPO / ".venv/lib/python3.11/site-packages/orbax/x.py"))) == (
        verbosity >= 1)
  finally:
    absl_logging.set_verbosity(previous)


_ORBAX_APP = """
import sys
from absl import app
import orbax.checkpoint as ocp
from grpo_jax.harness import cli

def main(argv):
  with cli.user_errors():
    ocp.CheckpointManager(argv[1]).close()

app.run(main)
"""


def test_verbosity_1_brings_orbax_info_back(tmp_path):
  def run(*flags):
    proc = subprocess.run([sys.executable, "-c", _ORBAX_APP, *flags, str(tmp_path / "c")],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr
  assert "checkpoint_manager.py" not in run()
  assert "checkpoint_manager.py" in run("--verbosity=1")


# ----------------------------------------------------------------------------
# The resolved config: <workdir>/config.yaml.
# ----------------------------------------------------------------------------

def _listify(value):
  if isinstance(value, dict):
    return {k: _listify(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return [_listify(v) for v in value]
  return value


def test_write_config_round_trips_as_plain_yaml(tmp_path):
  config = tiny.get_config()
  config.rl.num_generations = 6   # an override is what is written
  path = experiment.write_config(config, str(tmp_path))
  assert path == str(tmp_path / "config.yaml")
  loaded = yaml.safe_load(Path(path).read_text())
  assert loaded == _listify(config.to_dict())
  assert loaded["rl"]["num_generations"] == 6
  assert loaded["mesh"]["shape"] == [-1, 1, 1]
  assert loaded["mesh"]["rules"][0] == ["batch", ["data", "fsdp"]]
  assert os.listdir(tmp_path) == ["config.yaml"]


def test_a_failed_config_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
  config = tiny.get_config()
  experiment.write_config(config, str(tmp_path))
  before = (tmp_path / "config.yaml").read_text()
  def killed(*args):
    raise KeyboardInterrupt
  monkeypatch.setattr(os, "replace", killed)
  config.rl.num_generations = 6
  with pytest.raises(KeyboardInterrupt):
    experiment.write_config(config, str(tmp_path))
  assert (tmp_path / "config.yaml").read_text() == before
  assert os.listdir(tmp_path) == ["config.yaml"]
