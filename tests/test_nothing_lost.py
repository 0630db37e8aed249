"""Nothing lost, nothing silently wrong (issue 46).

One test per class of fault: an export never replaces a run; a resume
refuses every change it cannot honour (one list, by class) and writes
config.yaml only once its checks pass; π_ref is the policy the run starts
from (init_from included); the run store's locks and damage are warnings
that keep the run's result; sizes past what a run can use, and the user
errors of this round's features, are one line naming the field.
"""
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from configs import tiny
from grpo_jax import checkpoint, errors, validation
from grpo_jax.checkpoint import integrity
from grpo_jax.config import base_config
from grpo_jax.harness import cli, experiment, outdir, runs
from grpo_jax.rl import train

REPO = Path(__file__).resolve().parents[1]


def quiet_tiny(**train_fields):
  config = tiny.get_config()
  config.train.update(dict(eval_at_start=False, eval_at_end=False, **train_fields))
  return config


def _script(name: str):
  """experiments/<name>.py as a module of its own name (never a library's)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(f"_nothing_lost_{name}",
                                                REPO / "experiments" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def rows_of(workdir):
  return [json.loads(line) for line in open(Path(workdir) / "metrics.jsonl")]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """What a finished 2-step tiny run leaves (checkpoints at steps 1 and 2
  with its config, metrics.jsonl, config.yaml, the lock file), written
  without training: what these tests read is the files."""
  from grpo_jax.harness import workdir_lock
  from grpo_jax.models import get_preset
  workdir = tmp_path_factory.mktemp("nothing_lost") / "run"
  config = quiet_tiny(steps=2, checkpoint_every=1)
  with workdir_lock.hold(str(workdir)):
    experiment.write_config(config, str(workdir))
    ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_dir(workdir), save_every=1,
                                   config=config, model_config=get_preset("tiny"),
                                   handle_sigterm=False)
    for step in (1, 2):
      ckpt.save(step, {"w": np.full(3, step, np.float32)}, {}, force=True)
    ckpt.close()
    (workdir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": 0.5}) + "\n" for step in (1, 2)))
  return workdir


# ----------------------------------------------------------------------------
# 1. An export never replaces what holds a run; evaluation writes atomically.
# ----------------------------------------------------------------------------

def test_export_never_replaces_a_run_whatever_overwrite_says(finished_run, tmp_path):
  store_root = tmp_path / "store"
  runs.RunStore(store_root)
  step = finished_run / "checkpoints" / "2"
  assert (step / "_CHECKPOINT_METADATA").exists()   # what orbax writes per step
  for out in (finished_run, finished_run / "checkpoints", step, step / "hf",
              finished_run.parent, store_root):
    before = sorted(p.name for p in finished_run.rglob("*"))
    with pytest.raises(errors.OutputExistsError, match="holds a run's work"):
      outdir.check_empty(out, overwrite=True)
    with pytest.raises(errors.OutputExistsError):
      with outdir.staged(out) as staging:
        (staging / "config.json").write_text("{}")
    assert sorted(p.name for p in finished_run.rglob("*")) == before
  # An ordinary export directory (or a new one inside the run's workdir) is fine.
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text("{}")
  outdir.check_empty(tmp_path / "hf", overwrite=True)
  outdir.check_empty(finished_run / "export", overwrite=False)


def test_export_command_refuses_the_workdir_in_one_line(finished_run):
  before = sorted(p.name for p in finished_run.rglob("*"))
  out = subprocess.run(
      [sys.executable, "experiments/export.py", f"--workdir={finished_run}",
       f"--out={finished_run}", "--overwrite"], cwd=REPO, capture_output=True,
      text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1].startswith("error: --out")
  assert "Traceback" not in out.stderr
  assert sorted(p.name for p in finished_run.rglob("*")) == before


# ----------------------------------------------------------------------------
# 2. Resume: one list of what may not change, by class; config.yaml after.
# ----------------------------------------------------------------------------

# One field of each refused class, and a value that differs from base_config's.
_ONE_PER_CLASS = {
    "the saved state": ("optim.learning_rate", 1e-5),
    "the updates per step": ("rl.num_updates", 2),
    "the training data": ("seed", 7),
    "the rows in flight": ("rollout.max_staleness", 1),
    "the evaluation": ("train.eval_examples", 3),
    "the KL reference": ("init_from", "/elsewhere"),
}


def _set(config, field, value):
  *groups, name = field.split(".")
  node = config
  for g in groups:
    node = node[g]
  node[name] = value


def test_every_refused_class_is_refused_and_named(tmp_path):
  from grpo_jax.models import get_preset
  assert set(_ONE_PER_CLASS) == set(integrity.RESUME_REFUSED)
  ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_dir(tmp_path), save_every=1,
                                 config=base_config(), model_config=get_preset("tiny"),
                                 handle_sigterm=False)
  ckpt.save(1, {"w": np.ones(3, np.float32)}, {}, force=True)
  ckpt.close()
  for name, (field, value) in _ONE_PER_CLASS.items():
    changed = base_config()
    _set(changed, field, value)
    with pytest.raises(errors.UnsafeResumeError, match=f"{field}: .* now \\({name}\\)"):
      checkpoint.Checkpointer(checkpoint.checkpoint_dir(tmp_path), save_every=1,
                              config=changed, handle_sigterm=False)
  may_change = base_config()   # what may change: run length, logging, a loss knob, speed
  may_change.train.steps, may_change.train.log_every, may_change.rl.eps_high = 9, 2, 0.2
  may_change.sampling.stop_check_every, may_change.rollout.timeout_s = 4, 60.0
  checkpoint.Checkpointer(checkpoint.checkpoint_dir(tmp_path), save_every=1,
                          config=may_change, handle_sigterm=False).close()


@pytest.mark.parametrize("field,value", [("rl.num_updates", 2), ("rl.mini_batch_size", 4),
                                         ("rollout.max_staleness", 1)])
def test_a_refused_resume_trains_nothing_and_keeps_config_yaml(finished_run, tmp_path,
                                                                field, value):
  import shutil
  workdir = tmp_path / "run"
  shutil.copytree(finished_run, workdir)
  config_yaml = (workdir / "config.yaml").read_text()
  rows = rows_of(workdir)
  config = quiet_tiny(steps=4, checkpoint_every=1)
  _set(config, field, value)
  if field == "rollout.max_staleness":
    config.rl.old_logp, config.rl.rollout_correction.is_level = "recompute", "token"
  with pytest.raises(errors.UnsafeResumeError, match=field):
    train.run(config, str(workdir))
  assert (workdir / "config.yaml").read_text() == config_yaml
  assert rows_of(workdir) == rows
  assert checkpoint.latest_step(checkpoint.checkpoint_dir(workdir)) == 2


# ----------------------------------------------------------------------------
# 3. π_ref is the policy the run starts from.
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
  """A fine-tuned starting point as STaR / SFT leaves one ({"params"} under
  <workdir>/checkpoints): model.source's weights moved."""
  workdir = tmp_path_factory.mktemp("sft") / "sft"
  config = tiny.get_config()
  model_config, params = experiment.load_model(config)
  keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(params))))
  params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype),
                        params)
  ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_dir(workdir), save_every=0,
                                 config=config, model_config=model_config,
                                 handle_sigterm=False)
  ckpt.save(1, {"params": params}, {"history": []}, force=True)
  ckpt.close()
  return workdir


@pytest.mark.parametrize("reference", ["start", "model"])
def test_kl_is_zero_at_step_1_against_the_policy_the_run_starts_from(
    sft_checkpoint, tmp_path, reference):
  config = quiet_tiny(steps=1)
  config.init_from = str(sft_checkpoint)
  config.rl.kl_beta, config.rl.kl_reference = 0.1, reference
  train.run(config, str(tmp_path / "rl"))
  kl = rows_of(tmp_path / "rl")[0]["kl"]
  assert (tmp_path / "rl" / "config.yaml").read_text().startswith("# Output: the resolved config")
  if reference == "start":   # before any update the policy is π_ref itself
    assert kl == pytest.approx(0.0, abs=1e-7)
  else:                      # model.source's weights, on purpose
    assert kl > 1e-4


@pytest.mark.slow   # two runs, ~20-40 s
def test_a_resumed_run_keeps_its_start_as_the_reference(sft_checkpoint, tmp_path):
  config = quiet_tiny(steps=1, checkpoint_every=1)
  config.init_from = str(sft_checkpoint)
  config.rl.kl_beta, config.optim.learning_rate = 0.1, 0.0   # the policy stays the start
  workdir = tmp_path / "rl"
  train.run(config, str(workdir))
  config.train.steps = 2
  train.run(config, str(workdir))   # resumed: π_ref loaded again from init_from
  assert [r["step"] for r in rows_of(workdir)] == [1, 2]   # from the checkpoint's step
  assert rows_of(workdir)[1]["kl"] == pytest.approx(0.0, abs=1e-7)
  text = (workdir / "config.yaml").read_text()
  assert text.startswith("# Output: the resolved config") and "steps: 2" in text


def test_lora_with_init_from_names_the_reference_field():
  config = tiny.get_config()
  config.init_from, config.rl.kl_beta, config.model.lora.rank = "/x", 0.1, 2
  with pytest.raises(errors.ConfigError, match="rl.kl_reference"):
    from grpo_jax import validation
    validation.validate(config)


# ----------------------------------------------------------------------------
# 4. Bookkeeping never fails a run.
# ----------------------------------------------------------------------------

def _lock(store: runs.RunStore) -> sqlite3.Connection:
  """Another process's write lock on the store (an open write transaction)."""
  db = sqlite3.connect(store.path, isolation_level=None)
  db.execute("BEGIN EXCLUSIVE")
  return db


def test_a_locked_store_is_a_warning_that_keeps_the_result(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(runs.RunStore, "timeout_s", 0.05)
  store = runs.RunStore(tmp_path)
  with store.record("ends-locked", {"a": 1}) as record:
    holder = _lock(store)   # taken while the run trains
    record.metrics = {"accuracy": 0.5}
  holder.rollback()
  assert "is not recorded" in caplog.text and "locked by another process" in caplog.text
  assert "mv " not in caplog.text   # locked is not damaged: nothing to move
  holder = _lock(store)
  with caplog.at_level(logging.WARNING):
    with store.record("starts-locked", {}) as record:
      record.metrics = {"accuracy": 1.0}
  holder.rollback()
  holder.close()
  assert record.id == -1 and "this run is not recorded" in caplog.text
  with pytest.raises(errors.RunStoreError, match="locked by another process"):
    held = _lock(store)
    try:
      runs.RunStore(tmp_path)
    finally:
      held.close()


def test_a_damaged_store_says_move_it_aside(tmp_path):
  (tmp_path / runs.DB_NAME).write_bytes(b"not a database" * 100)
  with pytest.raises(errors.RunStoreError, match="unreadable .* move it aside"):
    runs.RunStore(tmp_path)


def test_a_finished_run_is_never_restatused(tmp_path, caplog):
  store = runs.RunStore(tmp_path)
  run_id = store.start("once", {})
  store.finish(run_id, "finished", {"accuracy": 1.0})
  with caplog.at_level(logging.WARNING):
    store.finish(run_id, "failed", {})
  assert store.get(run_id).status == "finished"
  assert store.get(run_id).metrics == {"accuracy": 1.0}
  assert "already ended as 'finished'" in caplog.text


# ----------------------------------------------------------------------------
# 7. One line per user error.
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("code,text", [(28, "No space left on device"),
                                       (122, "Disk quota exceeded"),
                                       (27, "File too large")])
def test_a_full_disk_is_recognised_however_the_os_says_it(code, text, tmp_path):
  error = RuntimeError("save failed")
  error.__cause__ = OSError(code, os.strerror(code))
  message = cli.describe(error, str(tmp_path))
  assert message.startswith(f"disk full ({text})")
  assert cli.describe(RuntimeError(f"write: [Errno {code}] {text}")).startswith("disk full")


def test_a_tilde_in_a_path_flag_is_the_home_directory(monkeypatch):
  from absl import flags
  values = flags.FlagValues()
  flags.DEFINE_string("workdir", None, "", flag_values=values)
  flags.DEFINE_string("out", None, "", flag_values=values)
  values(["prog", "--workdir=~/runs/x", "--out=rel/~x"])
  cli.expand_user_paths(values)
  assert values.workdir == os.path.expanduser("~/runs/x") and not values.workdir.startswith("~")
  assert values.out == "rel/~x"


@pytest.mark.parametrize("field,value,message", [
    ("model.lora", {"rank": 4}, r"'model.lora' lacks \['alpha'.*--config.model.lora.rank=4"),
    ("data.kwargs", {"num_examples": 64, "levls": 1},
     r"'data.kwargs.levls': did you mean 'data.kwargs.levels'"),
    ("rollout.timeout_s", 1e12, r"'rollout.timeout_s' = 1000000000000.0 .* at most"),
])
def test_this_rounds_config_mistakes_name_the_field(field, value, message):
  from grpo_jax import validation
  config = tiny.get_config()
  _set(config, field, value)
  with pytest.raises(errors.ConfigError, match=message):
    validation.validate(config)


# ----------------------------------------------------------------------------
# 5. Every size has an upper bound; preflight holds one chunk of ids.
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("fields,message", [
    ({"sampling.continuous_batching": True, "sampling.slots": 9},
     r"'sampling.slots' = 9 is more than the 8 rows"),
    ({"sampling.stop_check_every": 10 ** 6}, r"'sampling.stop_check_every' = 1000000 .* at most 8"),
])
def test_sampler_sizes_past_what_the_run_uses_are_refused(fields, message):
  from grpo_jax import validation
  config = tiny.get_config()   # 2 prompts x 4 completions, eval batches of 50 x 1... capped
  config.eval.batch_size = 8
  for field, value in fields.items():
    _set(config, field, value)
  with pytest.raises(errors.ConfigError, match=message):
    validation.validate(config)


def test_a_step_larger_than_the_host_or_the_data_names_the_field(tmp_path):
  """Session 17's round: G = 10^8 ran out of memory in a traceback, and
  more prompts per step than examples was a ValueError from the iterator."""
  config = quiet_tiny()
  config.rl.num_generations = 10**8
  with pytest.raises(errors.ConfigError, match=r"'rl.num_generations' = 100000000 .* GB"):
    validation.validate(config, data_files=False)
  config = quiet_tiny()
  config.rl.prompts_per_step = 1000
  with pytest.raises(errors.ConfigError, match=r"'rl.prompts_per_step' = 1000: .* 64 examples"):
    train.run(config, str(tmp_path / "run"))
  assert not [p for p in (tmp_path / "run").rglob("*") if p.name != ".lock"]


def test_a_missing_config_file_is_one_line(tmp_path):
  out = subprocess.run([sys.executable, "experiments/run.py", "--config=configs/nope.py",
                        f"--workdir={tmp_path / 'run'}"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert out.stderr.strip().splitlines() == [
      "error: flag --config=configs/nope.py: [Errno 2] No such file or directory: "
      "'configs/nope.py'"]


def test_model_sized_bounds_lora_rank_and_pages():
  from grpo_jax.harness import preflight
  from grpo_jax.models import get_preset
  model = get_preset("tiny")
  config = tiny.get_config()
  config.model.lora.rank = model.dim + 1
  with pytest.raises(errors.ConfigError, match="'model.lora.rank'"):
    preflight.check_model_sizes(config, model)
  config.model.lora.rank = model.dim
  config.sampling.update(continuous_batching=True, kv_cache="paged", pages=10 ** 7)
  with pytest.raises(errors.ConfigError, match="'sampling.pages' = 10000000 is more"):
    preflight.check_model_sizes(config, model)
  config.sampling.pages = 64
  preflight.check_model_sizes(config, model)


def test_preflight_tokenises_a_chunk_at_a_time_keeping_lengths():
  from grpo_jax.harness import preflight
  from grpo_jax.models.byte_tokenizer import byte_tokenizer
  tokenizer, calls = byte_tokenizer(), []
  encode = tokenizer.encode_batch

  def counted(texts):
    calls.append(len(texts))
    return encode(texts)
  tokenizer.encode_batch = counted
  n = 2 * preflight.CHUNK + 5
  texts = (("x" * (40 if i == preflight.CHUNK + 3 else 3)) for i in range(n))   # a generator
  index, length = preflight.longest_prompt(tokenizer, texts)
  assert index == preflight.CHUNK + 3 and length == len(encode(["x" * 40])[0])
  assert calls == [preflight.CHUNK, preflight.CHUNK, 5]
  assert preflight.longest_prompt(tokenizer, []) is None


def test_plot_runs_keeps_a_bare_workdir_and_refuses_a_label_twice():
  plot_runs = _script("plot_runs")
  assert plot_runs.parse_runs(["a=W1", "W2"]) == {"a": "W1", "W2": "W2"}
  with pytest.raises(errors.ArgumentError, match="the label 'a' names two runs"):
    plot_runs.parse_runs(["a=W1", "a=W2"])


def test_a_sweep_label_longer_than_a_file_name_stays_one_per_point(tmp_path):
  from grpo_jax.harness import sweeps
  long = {"data.system_prompt": "x" * 400}
  other = {"data.system_prompt": "x" * 399 + "y"}
  a, b = sweeps.sweep_workdir(tmp_path, 0, long), sweeps.sweep_workdir(tmp_path, 0, other)
  assert a != b and len(a.name) <= 3 + sweeps.MAX_LABEL
  a.mkdir()   # a name the file system takes
  short = {"rl.eps_high": 0.28}
  assert sweeps.sweep_workdir(tmp_path, 1, short).name == "01_rl.eps_high=0.28"


def test_aot_model_directory_without_config_json_is_a_config_error(tmp_path):
  from grpo_jax.aot import programs
  with pytest.raises(errors.ConfigError, match="directory without config.json"):
    programs.model_config_from_source(str(tmp_path))


def test_a_list_ground_truth_is_its_one_answer_and_several_are_refused():
  from grpo_jax.data import layouts
  row = {"prompt": [{"role": "user", "content": "1+1?"}],
         "reward_model": {"ground_truth": np.array(["2"])}}
  assert layouts.dapo_math_example(row, "row 1").answer == "2"
  row["reward_model"]["ground_truth"] = ["2", "3"]
  with pytest.raises(errors.DataError, match="row 1: .* list of 2 answers"):
    layouts.dapo_math_example(row, "row 1")


# ----------------------------------------------------------------------------
# 6. A signal at any moment ends cleanly.
# ----------------------------------------------------------------------------

def _catches_sigterm(pid: int) -> bool:
  """Whether the process has a SIGTERM handler installed (Linux /proc)."""
  try:
    status = Path(f"/proc/{pid}/status").read_text()
  except OSError:
    return False
  caught = int(next(l for l in status.splitlines() if l.startswith("SigCgt:")).split()[1], 16)
  return bool(caught >> (signal.SIGTERM - 1) & 1)


def _sigterm_once_handled(argv: list, after_s: float) -> None:
  """Runs `python argv`, sends SIGTERM `after_s` seconds after its handler is
  installed, and checks the end the docs promise: status 143, the last line
  "stopped by SIGTERM", no traceback."""
  proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  try:
    deadline = time.time() + 120
    while not _catches_sigterm(proc.pid) and proc.poll() is None and time.time() < deadline:
      time.sleep(0.005)
    time.sleep(after_s)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
  assert stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM")
  assert "Traceback" not in stderr


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_sigterm_while_evaluate_starts_is_one_line_and_143(tmp_path):
  # 1 s after the handler is in: into the imports, the data, the model and its compile
  _sigterm_once_handled(["experiments/evaluate.py", f"--config={REPO / 'configs' / 'tiny.py'}",
                         f"--workdir={tmp_path}"], after_s=1.0)
  assert not list(tmp_path.rglob("*.json"))   # nothing half-written


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_sigterm_during_an_export_leaves_out_as_it_was(sft_checkpoint, tmp_path):
  out = tmp_path / "hf"
  out.mkdir()
  (out / "config.json").write_text('{"old": true}')   # a previous export, replaced only whole
  # at once when the handler is in: the export has begun
  _sigterm_once_handled(["experiments/export.py", f"--workdir={sft_checkpoint}", f"--out={out}",
                         "--overwrite"], after_s=0.0)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]   # no staging left beside it
  assert [p.name for p in out.iterdir()] == ["config.json"]
  assert json.loads((out / "config.json").read_text()) == {"old": True}


def test_a_lora_base_that_moved_resumes_and_one_that_is_gone_is_one_line(tmp_path):
  saved = {"source": "/old/base", "dtype": "float32", "checksum": "c0ffee"}
  experiment.check_base({"lora_base": saved}, {**saved, "source": "/new/base"}, "ckpt")
  with pytest.raises(errors.UnsafeResumeError, match="trained on the base"):
    experiment.check_base({"lora_base": saved}, {**saved, "checksum": "other"}, "ckpt")
  ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_dir(tmp_path), save_every=0,
                                 handle_sigterm=False)
  ckpt.save(1, {"w": np.ones(2, np.float32)}, {"lora_base": saved}, force=True)
  ckpt.close()
  config = tiny.get_config()
  config.model.source = str(tmp_path / "moved_away")
  with pytest.raises(errors.CheckpointError, match="is gone: give where it is now"):
    experiment.load_lora_base(config, str(tmp_path), 1)


def test_the_samplers_user_error_is_one_line():
  from grpo_jax.rl import async_rollouts
  stopped = async_rollouts.SamplerStopped(
      "the sampler failed on step 1 (ConfigError: config field 'sampling.pages' = 3 ...)")
  assert isinstance(stopped, async_rollouts.SamplerError)
  assert cli.describe(stopped) == str(stopped)
  assert cli.describe(async_rollouts.SamplerError("a bug")) is None   # keeps its traceback


def test_the_tpu_paged_kernel_off_a_tpu_is_refused_at_start():
  from grpo_jax.harness import preflight
  config = tiny.get_config()
  config.sampling.update(continuous_batching=True, kv_cache="paged", paged_kernel="pallas")
  with pytest.raises(errors.ConfigError, match="'sampling.paged_kernel' = 'pallas' .* cpu"):
    preflight.check_backend(config, backend="cpu")
  preflight.check_backend(config, backend="tpu")
  config.sampling.paged_kernel = "auto"
  preflight.check_backend(config, backend="cpu")


def test_int8_pages_smaller_than_the_lanes_are_warned_of_on_a_tpu(caplog):
  from grpo_jax.harness import preflight
  config = tiny.get_config()
  config.sampling.update(continuous_batching=True, kv_cache="paged", kv_dtype="int8",
                         page_size=16)
  with caplog.at_level("WARNING"):
    preflight.check_backend(config, backend="cpu")
    assert not caplog.records                    # a CPU has no lanes to fill
    preflight.check_backend(config, backend="tpu")
  assert "'sampling.page_size' = 16" in caplog.text and "8x" in caplog.text
  caplog.clear()
  config.sampling.page_size = 128
  with caplog.at_level("WARNING"):
    preflight.check_backend(config, backend="tpu")
  assert not caplog.records


def test_evaluation_results_are_replaced_whole(tmp_path, monkeypatch):
  evaluate = _script("evaluate")
  path = tmp_path / "step_3.json"
  evaluate.write_results(str(path), {"accuracy": 0.5})

  def dies(record, f, **kwargs):
    f.write('{"accura')
    raise KeyboardInterrupt
  monkeypatch.setattr(evaluate.json, "dump", dies)
  with pytest.raises(KeyboardInterrupt):
    evaluate.write_results(str(path), {"accuracy": 0.9})
  assert json.loads(path.read_text()) == {"accuracy": 0.5}
  assert os.listdir(tmp_path) == ["step_3.json"]
