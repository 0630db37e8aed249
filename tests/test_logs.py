"""Quiet, useful logs (issue 25 item 5): no library INFO below --verbosity=1,
the resolved config in <workdir>/config.yaml instead of the log, one line
per step, a progress bar only on a terminal and never run into a log line."""
import io
import json
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
# One line per step.
# ----------------------------------------------------------------------------

RL_METRICS = {"reward/mean": 0.125, "accuracy": 0.25, "response_length/mean": 7.75,
              "kl": 0.00123, "entropy": 5.5273, "time/sample": 0.414,
              "time/update": 0.2, "time/reference": 0.03, "time/step": 0.6349,
              "loss": 1.0}


def test_step_line_shows_the_rl_fields_in_order_and_the_seconds_split():
  assert metrics.step_line(2, 3, RL_METRICS) == (
      "step 2/3  reward 0.125  acc 0.250  len 7.8  kl 0.0012  entropy 5.527"
      "  |  sample 0.41s  update 0.20s  total 0.63s")


def test_step_line_leaves_missing_keys_out_and_prints_nan():
  line = metrics.step_line(1, 10, {"reward/mean": math.nan, "accuracy": 1,
                                   "time/update": 2.0})
  assert line == "step 1/10  reward nan  acc 1.000  |  update 2.00s"
  assert metrics.step_line(5, 5, {}) == "step 5/5"


def test_step_line_of_a_star_iteration_and_an_evaluation():
  star = {"eval/greedy_accuracy": 0.5, "star/train_accuracy": 0.375,
          "star/kept_direct": 3, "star/kept_rationalized": 2, "sft/steps": 40,
          "sft/loss_last": 0.71234, "time/sample": 1.0, "time/finetune": 2.5,
          "eval/seconds": 0.25}
  assert metrics.step_line(1, 3, star, metrics.STAR_LINE, metrics.STAR_TIMES,
                           unit="STaR iteration") == (
      "STaR iteration 1/3  eval greedy acc 0.500  train acc 0.375  kept 3"
      "  rationalized 2  sft steps 40  sft loss 0.7123"
      "  |  sample 1.00s  finetune 2.50s  eval 0.25s")
  assert metrics.step_line(0, 3, {"eval/greedy_accuracy": 0.0, "eval/response_length": 8.0,
                                  "eval/seconds": 4.62, "eval/num_examples": 8},
                           metrics.EVAL_LINE, metrics.EVAL_TIMES) == (
      "step 0/3  eval greedy acc 0.000  len 8.0  |  eval 4.62s")


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


# ----------------------------------------------------------------------------
# The progress bar.
# ----------------------------------------------------------------------------

class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_no_bar_without_a_terminal(monkeypatch):
  stream = io.StringIO()
  monkeypatch.setattr(sys, "stderr", stream)
  bar = metrics.progress_bar(3, enabled=True)
  bar.update(1)
  bar.set_postfix(reward="0.5")
  bar.close()
  assert stream.getvalue() == ""
  monkeypatch.setattr(sys, "stderr", _Terminal())
  bar = metrics.progress_bar(3, enabled=False)
  bar.update(1)
  bar.close()
  assert sys.stderr.getvalue() == ""


def test_log_lines_are_printed_above_the_bar_not_into_it(monkeypatch):
  terminal = _Terminal()
  monkeypatch.setattr(sys, "stderr", terminal)
  handler = logging.StreamHandler(terminal)
  root = logging.getLogger()
  root.addHandler(handler)
  level = root.level
  root.setLevel(logging.INFO)
  try:
    bar = metrics.progress_bar(3, enabled=True)
    bar.update(1)
    logging.info("a log line")
    bar.update(1)
    bar.close()
    assert "emit" not in vars(handler)   # the handler is as it was
  finally:
    root.removeHandler(handler)
    root.setLevel(level)
  out = terminal.getvalue()
  assert "1/3" in out and "2/3" in out
  # on a line of its own: not glued to the bar's text
  assert "a log line" in re.split(r"[\r\n]", out), repr(out)


# ----------------------------------------------------------------------------
# The tiny run, end to end.
# ----------------------------------------------------------------------------

# experiments/run.py as `python experiments/run.py ...` runs it, with the
# entry work counted: validation, joining the processes, installing the
# signal handlers (printed as one JSON line on stdout when it exits).
_COUNTED_RUN = r"""
import atexit, json, runpy, sys
from grpo_jax import validation
from grpo_jax.harness import distributed, interrupts
counts = {"validate": 0, "initialize_distributed": 0, "install_signals": 0}
def counted(owner, name, key):
  inner = getattr(owner, name)
  def wrapper(*args, **kwargs):
    counts[key] += 1
    return inner(*args, **kwargs)
  setattr(owner, name, wrapper)
counted(validation, "validate", "validate")
counted(distributed, "initialize_distributed", "initialize_distributed")
counted(interrupts._Stop, "install", "install_signals")
atexit.register(lambda: print("ENTRY " + json.dumps(counts), flush=True))
sys.argv = ["experiments/run.py", *sys.argv[1:]]
runpy.run_path("experiments/run.py", run_name="__main__")
"""


def test_the_tiny_run_prints_a_few_lines_none_from_a_library(tmp_path):
  """Also: the entry work happens once on the path run.py -> method."""
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-c", _COUNTED_RUN, "--config=configs/tiny.py",
       f"--workdir={workdir}"], cwd=REPO, capture_output=True, text=True, timeout=600,
      env=dict(ENV, GRPO_JAX_RUNS=str(tmp_path / "store")))
  assert proc.returncode == 0, proc.stderr[-3000:]
  entry = [l for l in proc.stdout.splitlines() if l.startswith("ENTRY ")]
  assert [json.loads(l[len("ENTRY "):]) for l in entry] == [
      {"validate": 1, "initialize_distributed": 1, "install_signals": 1}]
  lines = [l for l in (proc.stdout + proc.stderr).splitlines()
           if not l.startswith("ENTRY ")]
  assert len(lines) <= 40, "\n".join(lines)
  assert "orbax" not in proc.stdout + proc.stderr
  ours = {p.name for d in ("grpo_jax", "experiments") for p in (REPO / d).rglob("*.py")}
  for line in lines:
    match = ABSL_LINE.match(line)
    assert match is None or match.group(1) in ours, line
  assert f"config: {workdir / 'config.yaml'}" in proc.stderr
  loaded = yaml.safe_load((workdir / "config.yaml").read_text())
  assert loaded == _listify(tiny.get_config().to_dict())
