"""Tests for the run store (grpo_jax.harness.runs), named experiments, sweeps
(grpo_jax.harness.sweeps) and the experiments/runs.py and sweep.py commands."""
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from grpo_jax.harness import runs, sweeps

REPO = Path(__file__).resolve().parents[1]


def base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict({
      "name": "toy", "description": "a toy", "seed": 0,
      "rl": {"eps_high": 0.2, "num_generations": 8, "loss_agg": "token-mean"},
      "optimizer": {"learning_rate": 1e-6}})
  config.lock()
  return config


def command(script: str, *args: str, env=None, **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, f"experiments/{script}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})), **kwargs)


def table_rows(text: str) -> dict[str, list[str]]:
  """First cell -> the other cells, for every line of a format_table table."""
  return {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.strip()}


# ----------------------------------------------------------------------------
# The store.
# ----------------------------------------------------------------------------

def test_store_records_a_run_from_start_to_finish(tmp_path):
  store = runs.RunStore(tmp_path)
  run_id = store.start("toy", base_config(), tmp_path / "wd", sweep="s")
  run = store.get(run_id)
  assert (run.name, run.status, run.sweep) == ("toy", "running", "s")
  assert run.config["rl"]["eps_high"] == 0.2 and run.workdir == str(tmp_path / "wd")
  head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                        capture_output=True, text=True).stdout.strip()
  assert run.git_commit.startswith(head) and run.end_time is None
  summary = {"accuracy": np.float32(0.75), "steps": 3, "loss": np.array([0.25]),
             "plot": tmp_path / "curve.png", "curve": np.array([0.5, 1.0]),
             "state": {"params": np.zeros((4, 4))}}   # what train.run returns
  store.finish(run_id, "finished", summary, tmp_path / "wd/ck/3")
  again = runs.RunStore(tmp_path).get(run_id)     # persisted, seen by a new store
  assert (again.status, again.checkpoint) == ("finished", str(tmp_path / "wd/ck/3"))
  assert again.metrics == {"accuracy": 0.75, "steps": 3, "loss": 0.25,
                           "plot": str(tmp_path / "curve.png")}
  assert again.end_time >= again.start_time
  with pytest.raises(ValueError, match="allowed"):
    store.finish(run_id, "done")
  with pytest.raises(KeyError, match="no run 99"):
    store.get(99)


def test_store_root_comes_from_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv("GRPO_JAX_RUNS", str(tmp_path / "store"))
  assert runs.RunStore().path == tmp_path / "store" / "runs.sqlite"
  monkeypatch.delenv("GRPO_JAX_RUNS")
  assert runs.default_root() == Path("runs")


def test_record_sets_the_status_from_how_the_run_ended(tmp_path):
  store = runs.RunStore(tmp_path)
  with store.record("ok", {}, None) as record:
    record.metrics = {"reward": 1.5}
  with pytest.raises(RuntimeError):
    with store.record("crash", {}, None):
      raise RuntimeError("diverged")
  with pytest.raises(KeyboardInterrupt):
    with store.record("ctrl-c", {}, None):
      raise KeyboardInterrupt
  with store.record("preempted", {}, None) as record:
    record.status = "killed"
  statuses = {r.name: (r.status, r.metrics) for r in store.list()}
  assert statuses == {"ok": ("finished", {"reward": 1.5}), "crash": ("failed", {}),
                      "ctrl-c": ("killed", {}), "preempted": ("killed", {})}
  assert [r.name for r in store.list(status="killed")] == ["ctrl-c", "preempted"]


def _two_finished_runs(store: runs.RunStore) -> tuple[int, int]:
  ids = []
  for eps, accuracy in ((0.2, 0.5), (0.28, 0.625)):
    config = sweeps.apply_overrides(base_config(), {"rl.eps_high": eps})
    ids.append(store.start(f"toy[eps={eps}]", config, f"/wd/{eps}", sweep="clip"))
    store.finish(ids[-1], "finished", {"accuracy": accuracy, "entropy": 0.123456})
  return tuple(ids)


def test_compare_puts_differing_config_and_metrics_side_by_side(tmp_path):
  store = runs.RunStore(tmp_path)
  a, b = _two_finished_runs(store)
  table = runs.compare_runs([store.get(a), store.get(b)])
  rows = table_rows(table)
  assert rows["run"] == [str(a), str(b)]
  assert rows["config.rl.eps_high"] == ["0.2", "0.28"]
  assert rows["accuracy"] == ["0.5", "0.625"] and rows["entropy"] == ["0.1235", "0.1235"]
  assert rows["status"] == ["finished", "finished"]
  assert "config.seed" not in rows and "config.rl.num_generations" not in rows
  listing = table_rows(runs.format_runs(store.list(sweep="clip")))
  assert listing[str(a)][:2] == ["toy[eps=0.2]", "finished"]


def test_runs_command_lists_shows_and_compares(tmp_path):
  store = runs.RunStore(tmp_path)
  a, b = _two_finished_runs(store)
  root = f"--root={tmp_path}"
  listed = command("runs.py", "list", root)
  assert listed.returncode == 0, listed.stderr
  assert table_rows(listed.stdout)[str(b)][0] == "toy[eps=0.28]"
  shown = command("runs.py", "show", str(a), root)
  assert shown.returncode == 0 and '"accuracy": 0.5' in shown.stdout
  assert '"eps_high": 0.2' in shown.stdout
  compared = command("runs.py", "compare", "--sweep=clip", root)
  assert compared.stdout == runs.compare_runs([store.get(a), store.get(b)]) + "\n"
  bad = command("runs.py", "compare", "x", root)
  assert bad.returncode != 0 and "run ids are integers" in bad.stderr


# ----------------------------------------------------------------------------
# Named experiments.
# ----------------------------------------------------------------------------

def test_list_experiments_reads_docstrings_or_descriptions(tmp_path):
  (tmp_path / "b_grpo.py").write_text(textwrap.dedent('''\
      """GRPO on GSM8K, DeepSeekMath style.

      Longer text that is not shown.
      """
      raise RuntimeError("a docstring is read without importing the file")
      '''))
  (tmp_path / "a_dapo.py").write_text(textwrap.dedent('''\
      import ml_collections
      def get_config(arg=None):
        return ml_collections.ConfigDict({"name": "a", "description": "DAPO, local"})
      '''))
  (tmp_path / "_common.py").write_text('"""Shared helpers, not an experiment."""')
  (tmp_path / "sweeps").mkdir()
  (tmp_path / "sweeps" / "s.py").write_text('"""A sweep."""')
  assert runs.list_experiments(tmp_path) == [
      ("a_dapo", "DAPO, local"), ("b_grpo", "GRPO on GSM8K, DeepSeekMath style.")]


# ----------------------------------------------------------------------------
# Sweeps.
# ----------------------------------------------------------------------------

def test_apply_overrides_sets_dotted_fields_on_a_copy():
  config = base_config()
  new = sweeps.apply_overrides(config, {"rl.eps_high": 0.28, "seed": 3,
                                        "optimizer.learning_rate": 2e-6})
  assert (new.rl.eps_high, new.seed, new.optimizer.learning_rate) == (0.28, 3, 2e-6)
  assert (config.rl.eps_high, config.seed) == (0.2, 0)


@pytest.mark.parametrize("overrides, error, message", [
    ({"rl.eps_hi": 0.3}, KeyError, "no field 'eps_hi' at rl; fields there: "
                                   "['eps_high', 'loss_agg', 'num_generations']"),
    ({"optim.learning_rate": 1.0}, KeyError, "no field 'optim' at the top level"),
    ({"seed.value": 1}, KeyError, "seed is a value, not a group"),
    ({"rl.num_generations": "many"}, ValueError, "rl.num_generations='many'"),
])
def test_apply_overrides_names_a_bad_field(overrides, error, message):
  with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
    sweeps.apply_overrides(base_config(), overrides)


def test_shipped_sweep_and_malformed_sweep_files(tmp_path):
  assert sweeps.load_sweep(REPO / "configs/sweeps/clip_higher.py") == [
      {"rl.eps_high": 0.2}, {"rl.eps_high": 0.28}]
  bad = tmp_path / "bad.py"
  bad.write_text("def get_sweep():\n  return {'rl.eps_high': 0.2}\n")
  with pytest.raises(ValueError, match="must return a non-empty list of dicts"):
    sweeps.load_sweep(bad)


def test_run_sweep_records_every_point_and_survives_a_failing_one(tmp_path):
  calls = []

  def fake_run(config, workdir):
    calls.append((config.rl.eps_high, workdir))
    if config.rl.eps_high > 1:
      raise FloatingPointError("loss is NaN")
    Path(workdir).mkdir(parents=True)
    return {"accuracy": config.rl.eps_high * 2}

  store = runs.RunStore(tmp_path / "store")
  points = [{"rl.eps_high": 0.2}, {"rl.eps_high": 0.28}, {"rl.eps_high": 5.0}]
  log = []
  ids = sweeps.run_sweep(base_config(), points, fake_run,
                         sweeps.Destination(store, "toy", "clip", tmp_path / "sweep"),
                         log=log.append)
  assert calls == [(0.2, str(tmp_path / "sweep/00_rl.eps_high=0.2")),
                   (0.28, str(tmp_path / "sweep/01_rl.eps_high=0.28")),
                   (5.0, str(tmp_path / "sweep/02_rl.eps_high=5.0"))]
  recorded = [store.get(i) for i in ids]
  assert [(r.name, r.status, r.sweep) for r in recorded] == [
      ("toy[rl.eps_high=0.2]", "finished", "clip"),
      ("toy[rl.eps_high=0.28]", "finished", "clip"),
      ("toy[rl.eps_high=5.0]", "failed", "clip")]
  assert [r.config["rl"]["eps_high"] for r in recorded] == [0.2, 0.28, 5.0]
  assert recorded[1].metrics == {"accuracy": 0.56}
  assert any("failed: FloatingPointError: loss is NaN" in line for line in log)
  assert table_rows(runs.compare_runs(recorded))["accuracy"] == ["0.4", "0.56", "-"]


def test_run_sweep_checks_every_point_before_running_any(tmp_path):
  calls = []
  with pytest.raises(KeyError, match="eps_hgh"):
    sweeps.run_sweep(base_config(), [{"rl.eps_high": 0.2}, {"rl.eps_hgh": 0.3}],
                     lambda c, w: calls.append(w),
                     sweeps.Destination(runs.RunStore(tmp_path), "toy", "s", tmp_path))
  assert calls == [] and runs.RunStore(tmp_path).list() == []


# A real config (the sweep validates every point): the variant goes to description.
_CONFIG_FILE = '''\
"""A toy experiment."""
from grpo_jax.config import base_config
def get_config(arg="base"):
  c = base_config()
  c.name, c.description, c.rl.eps_high = "toy", arg, 0.1
  return c
'''


def test_sweep_command_dry_run_prints_one_run_command_per_point(tmp_path):
  (tmp_path / "toy.py").write_text(_CONFIG_FILE)
  out = command("sweep.py", f"--config={tmp_path}/toy.py:small", "--config.seed=3",
                "--sweep=configs/sweeps/clip_higher.py", f"--workdir={tmp_path}/sw",
                "--dry_run")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert [shlex.split(line) for line in lines] == [
      ["python", "experiments/run.py", f"--config={tmp_path}/toy.py:small",
       "--config.seed=3", f"--config.rl.eps_high={eps}",
       f"--workdir={tmp_path}/sw/{i:02d}_rl.eps_high={eps}"]
      for i, eps in enumerate((0.2, 0.28))]
  bad = tmp_path / "bad_sweep.py"
  bad.write_text("def get_sweep():\n  return [{'rl.eps': 0.2}]\n")
  out = command("sweep.py", f"--config={tmp_path}/toy.py", f"--sweep={bad}", "--dry_run")
  assert out.returncode != 0 and "no field 'eps' at rl" in out.stderr


_FAKE_TRAINER = '''\
import runpy, sys
from grpo_jax import registry
def run(config, workdir):
  print(f"training {config.description} eps_high={config.rl.eps_high} in {workdir}")
  return {"accuracy": 10 * config.rl.eps_high}
registry._REGISTRY["method"]["rl"] = run   # the "rl" method: train.run
sys.argv = ["experiments/sweep.py"] + sys.argv[1:]
runpy.run_path("experiments/sweep.py", run_name="__main__")
'''


def test_sweep_command_runs_points_records_them_and_prints_the_table(tmp_path):
  (tmp_path / "toy.py").write_text(_CONFIG_FILE)
  out = subprocess.run(
      [sys.executable, "-c", _FAKE_TRAINER, f"--config={tmp_path}/toy.py:small",
       "--sweep=configs/sweeps/clip_higher.py", f"--runs_root={tmp_path}/store"],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  workdir = tmp_path / "store/sweeps/toy_small-clip_higher"
  assert f"training small eps_high=0.28 in {workdir}/01_rl.eps_high=0.28" in out.stdout
  recorded = runs.RunStore(tmp_path / "store").list(sweep="clip_higher")
  assert [(r.name, r.status, r.metrics) for r in recorded] == [
      ("toy:small[rl.eps_high=0.2]", "finished", {"accuracy": 2.0}),
      ("toy:small[rl.eps_high=0.28]", "finished", {"accuracy": 2.8000000000000003})]
  assert out.stdout.endswith(runs.compare_runs(recorded) + "\n")


def test_sweep_points_run_their_configs_method(monkeypatch):
  """A STaR config's sweep point runs the STaR loop, an RL one the trainer
  (experiments/sweep.py runs every point through sweeps.run_method)."""
  from grpo_jax import registry  # pylint: disable=g-import-not-at-top
  calls = []
  for method in ("rl", "star"):
    monkeypatch.setitem(registry._REGISTRY["method"], method,  # pylint: disable=protected-access
                        lambda c, w, m=method: calls.append((m, c.method, w)) or {})
  for method in ("star", "rl"):
    sweeps.run_method(ml_collections.ConfigDict({"method": method}), f"/wd/{method}")
  assert calls == [("star", "star", "/wd/star"), ("rl", "rl", "/wd/rl")]
  with pytest.raises(KeyError, match="unknown method 'ppo'"):
    sweeps.run_method(ml_collections.ConfigDict({"method": "ppo"}), "/wd")
