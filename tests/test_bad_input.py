"""Bad input gets a clear error and loses nothing (issue 19).

Each test reproduces one case a new user hit: nothing destructive without
being asked (export, a second run on one workdir), mismatches refused before
any work, signals that save and say so, and messages that name the field,
file or process. The tiny config and files the tests write stand in for
real models and data.
"""
import glob
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs import tiny
from grpo_jax import checkpoint, errors, validation
from grpo_jax.harness import cli, interrupts, metrics, outdir, runs, sweeps, workdir_lock
from grpo_jax.rl import train

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.py")


def command(script, *args, env=None, timeout=300):
  return subprocess.run([sys.executable, f"experiments/{script}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout,
                        env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
                                 **(env or {})))


def quiet_tiny(**train_fields):
  config = tiny.get_config()
  config.train.update(train_fields)
  return config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A finished 3-step tiny run (checkpoint at step 3); copy before changing."""
  workdir = tmp_path_factory.mktemp("finished") / "run"
  train.run(quiet_tiny(), str(workdir))
  return workdir


def copy_run(source, tmp_path):
  target = tmp_path / "run"
  shutil.copytree(source, target)
  return target


def metric_rows(workdir):
  return [json.loads(l) for l in open(Path(workdir) / "metrics.jsonl")]


def row_keys(rows):
  """(step, 'eval' or 'train') of each row: a duplicate shows twice."""
  return [(r["step"], "eval" if metrics.is_eval_row(r) else "train") for r in rows]


# ----------------------------------------------------------------------------
# Nothing destructive without being asked.
# ----------------------------------------------------------------------------

def test_export_refuses_a_non_empty_out_and_overwrite_replaces_it(finished_run, tmp_path):
  out = tmp_path / "hf_model"
  out.mkdir()
  for name, text in (("config.json", '{"mine": 1}'), ("model-00001-of-00002.safetensors", "w1"),
                     ("model.safetensors.index.json", "{}")):
    (out / name).write_text(text)
  before = {p.name: p.read_text() for p in out.iterdir()}
  refused = command("export.py", f"--workdir={finished_run}", f"--out={out}")
  assert refused.returncode != 0
  assert "is not empty" in refused.stderr and "--overwrite" in refused.stderr
  assert "Traceback" not in refused.stderr
  assert {p.name: p.read_text() for p in out.iterdir()} == before   # untouched
  done = command("export.py", f"--workdir={finished_run}", f"--out={out}", "--overwrite")
  assert done.returncode == 0, done.stderr[-2000:]
  names = sorted(p.name for p in out.iterdir())
  assert "model-00001-of-00002.safetensors" not in names   # replaced whole
  assert json.loads((out / "config.json").read_text())["vocab_size"] == 256
  assert [p.name for p in tmp_path.iterdir()] == ["hf_model"]   # no staging left
  # A new directory needs no flag.
  fresh = command("export.py", f"--workdir={finished_run}", f"--out={tmp_path / 'new'}")
  assert fresh.returncode == 0 and (tmp_path / "new" / "config.json").is_file()


def test_staged_output_leaves_the_old_directory_when_writing_fails(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("old")
  with pytest.raises(RuntimeError):
    with outdir.staged(out) as staging:
      (staging / "half.bin").write_text("x")
      raise RuntimeError("export failed")
  assert [p.name for p in tmp_path.iterdir()] == ["out"]
  assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_a_second_run_on_a_workdir_in_use_is_refused_naming_the_first(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from grpo_jax.harness import workdir_lock\n"
       "with workdir_lock.hold(sys.argv[1]):\n  print('held', flush=True); time.sleep(600)",
       str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=str(REPO)))
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(errors.WorkdirLockedError) as error:
      train.run(quiet_tiny(), str(tmp_path))
    message = str(error.value)
    assert f"pid {holder.pid}" in message and "host" in message and "--workdir" in message
    assert not (tmp_path / "metrics.jsonl").exists()
  finally:
    holder.kill()
    holder.wait()
  # The holder died (SIGKILL): its lock died with it.
  with workdir_lock.hold(str(tmp_path)):
    pass


# ----------------------------------------------------------------------------
# Mismatches refused before any work.
# ----------------------------------------------------------------------------

def _tokenizer_with(tmp_path, extra_tokens: int) -> str:
  """A byte tokenizer with `extra_tokens` more entries, saved as a directory."""
  from grpo_jax.models.byte_tokenizer import byte_tokenizer
  tok = byte_tokenizer()
  tok.backend.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
  directory = tmp_path / f"tokenizer_{tok.vocab_size}"
  tok.save_pretrained(directory)
  return str(directory)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
  config = quiet_tiny()
  config.model.tokenizer = _tokenizer_with(tmp_path, 44)   # 300 ids, model: 256
  with pytest.raises(errors.ConfigError, match=r"300 tokens.*vocabulary of 256"):
    train.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_evaluate_refuses_a_config_whose_tokenizer_differs_from_the_checkpoints(
    finished_run, tmp_path):
  other = _tokenizer_with(tmp_path, 44)
  out = command("evaluate.py", f"--config={TINY}", f"--config.model.tokenizer={other}",
                f"--checkpoint={finished_run}", f"--workdir={tmp_path / 'eval'}")
  assert out.returncode != 0
  assert "was trained with the tokenizer 'tiny'" in out.stderr and other in out.stderr
  assert "Traceback" not in out.stderr and not (tmp_path / "eval").exists()


def test_evaluate_refuses_the_dapo_config_on_a_tiny_checkpoint(finished_run, tmp_path):
  """The issue's case: a 49,152-token tokenizer on a 256-token model gave
  accuracy 0.0 labelled dapo_local, exit 0."""
  out = command("evaluate.py", f"--config={REPO / 'configs' / 'dapo_aime.py'}:local",
                f"--checkpoint={finished_run}", f"--workdir={tmp_path / 'eval'}")
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert ("was trained with the tokenizer 'tiny'" in out.stderr
          and "uses 'smollm2-135m-instruct'" in out.stderr)
  assert not (tmp_path / "eval").exists()


def test_evaluate_refuses_other_prompts_than_the_checkpoint_was_trained_with(
    finished_run, tmp_path):
  args = (f"--config={TINY}", f"--checkpoint={finished_run}", "--config.data.template=boxed",
          "--config.data.system_prompt=Think.", f"--workdir={tmp_path / 'eval'}")
  out = command("evaluate.py", *args)
  assert out.returncode != 0 and not (tmp_path / "eval").exists()
  message = out.stderr.strip().splitlines()[-1]
  assert "data.template is 'boxed' here but 'last_number' in training" in message
  assert "data.system_prompt is 'Think.' here but '' in training" in message
  assert "--config.data.template='last_number'" in message
  assert "--allow_prompt_change" in message and "Traceback" not in out.stderr
  on_purpose = command("evaluate.py", *args, "--allow_prompt_change")
  assert on_purpose.returncode == 0, on_purpose.stderr[-2000:]
  assert "evaluating with other prompts than training" in on_purpose.stderr
  assert (tmp_path / "eval" / "eval" / "step_3.json").is_file()


def test_resume_with_changed_data_arguments_lists_the_fields(finished_run, tmp_path):
  workdir = copy_run(finished_run, tmp_path)
  config = quiet_tiny(steps=5)
  config.data.kwargs = dict(num_examples=64, levels=3, seed=7)   # same count
  with pytest.raises(errors.UnsafeResumeError) as error:
    train.run(config, str(workdir))
  assert "data.kwargs.levels: 1 in the checkpoint, 3 now" in str(error.value)
  assert "data.kwargs.seed: 0 in the checkpoint, 7 now" in str(error.value)


def test_train_steps_below_the_checkpoint_step_is_refused(finished_run, tmp_path):
  workdir = copy_run(finished_run, tmp_path)
  with pytest.raises(errors.ConfigError, match=r"'train.steps' = 2 is below the step 3"):
    train.run(quiet_tiny(steps=2), str(workdir))


def test_rerunning_a_finished_run_writes_no_duplicate_rows(finished_run, tmp_path):
  workdir = copy_run(finished_run, tmp_path)
  before = metric_rows(workdir)
  train.run(quiet_tiny(), str(workdir))
  after = metric_rows(workdir)
  assert row_keys(after) == row_keys(before) == [
      (0, "eval"), (1, "train"), (2, "train"), (3, "train"), (3, "eval")]
  timeless = lambda row: {k: v for k, v in row.items() if not k.endswith("seconds")}
  assert timeless(after[-1]) == timeless(before[-1])   # recomputed: the same


def test_max_new_tokens_beyond_the_models_context_is_refused(tmp_path):
  config = quiet_tiny()
  config.sampling.max_new_tokens = 600   # the tiny model's context: 512
  with pytest.raises(errors.ConfigError, match=r"'sampling.max_new_tokens' = 600.*512"):
    train.run(config, str(tmp_path))


def _no_weights(monkeypatch):
  """Makes loading any model's weights fail: a check that passes must have
  run before them."""
  from grpo_jax.harness import experiment

  def load_model(config):
    raise AssertionError("the weights were loaded before the check")
  monkeypatch.setattr(experiment, "load_model", load_model)


def _jsonl(path, questions):
  path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n"
                          for q in questions))
  return str(path)


@pytest.mark.parametrize("which", ["train", "eval"])
def test_a_prompt_plus_completion_beyond_the_context_is_refused_before_the_weights(
    tmp_path, monkeypatch, which):
  _no_weights(monkeypatch)
  # The tiny model: byte tokenizer, context 512. max_new_tokens = 64 fits
  # alone; one prompt of ~470 bytes (with the template's) plus 64 new tokens
  # does not.
  config = quiet_tiny()
  config.sampling.max_new_tokens = 64
  long = _jsonl(tmp_path / "long.jsonl", ["1 + 1 = ?", "x" * 360 + " 1 + 0 = ?"])
  if which == "train":
    config.data.source, config.data.kwargs = "jsonl", dict(path=long, layout="gsm8k")
    config.data.eval_source = "arithmetic"
    source = r"the training data \(data.source = 'jsonl', data.kwargs\)"
  else:
    config.data.eval_source, config.data.eval_kwargs = "jsonl", dict(path=long,
                                                                     layout="gsm8k")
    source = r"the held-out data \(data.eval_source = 'jsonl', data.eval_kwargs\)"
  with pytest.raises(errors.ConfigError,
                     match=rf"prompt 1 of {source} has 47\d tokens \(through data.template = "
                           r"'last_number'\); with sampling.max_new_tokens = 64 it needs 5\d\d "
                           r"positions, beyond the model's context of 512 tokens.*Lower "
                           r"sampling.max_new_tokens to 3\d or less, or keep only prompts of "
                           r"at most 448 tokens"):
    train.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_star_checks_its_few_shot_prompts_against_the_context(tmp_path, monkeypatch):
  from configs import star_tiny
  _no_weights(monkeypatch)
  config = star_tiny.get_config()
  config.star.few_shot = 4   # four worked exemplars before each question
  config.sampling.max_new_tokens = 250   # the held-out prompts (no exemplars) fit
  with pytest.raises(errors.ConfigError, match=r"prompt \d+ of the training data .*"
                                                   r"star.few_shot exemplars"):
    train_star = __import__("grpo_jax.star.loop", fromlist=["run"]).run
    train_star(config, str(tmp_path / "run"))
  config.sampling.max_new_tokens, config.star.few_shot = 8, 0   # fits: loads the weights
  with pytest.raises(AssertionError, match="weights were loaded"):
    train_star(config, str(tmp_path / "run"))


def test_evaluate_checks_the_held_out_prompts_against_the_checkpoints_context(
    finished_run, tmp_path):
  long = _jsonl(tmp_path / "long.jsonl", ["x" * 520])
  out = command("evaluate.py", f"--config={TINY}", f"--checkpoint={finished_run}",
                "--config.data.eval_source=jsonl",
                f"--config.data.eval_kwargs={json.dumps(dict(path=long, layout='gsm8k'))}",
                f"--workdir={tmp_path / 'eval'}")
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "prompt 0 of the held-out data (data.eval_source = 'jsonl'" in out.stderr
  assert f"context of 512 tokens (ModelConfig.max_seq_len of {finished_run}). Keep only " \
      "prompts of at most 504 tokens" in out.stderr


@pytest.mark.parametrize("field, value, message", [
    ("optim.learning_rate", -1e-3, "'optim.learning_rate' = -0.001 must be >= 0"),
    ("rl.kl_beta", -0.1, "'rl.kl_beta' = -0.1 must be >= 0"),
    ("optim.weight_decay", -0.01, "'optim.weight_decay' = -0.01 must be >= 0"),
    ("train.keep_checkpoints", 0, "'train.keep_checkpoints' = 0 must be >= 1"),
    ("sampling.temperature", 0.0, "every advantage is 0"),
    # Divisors of the loops: 0 was a ZeroDivisionError (log_every) or a
    # crash mid-run; a negative size passed `rows % size`.
    ("train.log_every", 0, "'train.log_every' = 0 must be >= 1"),
    ("rl.mini_batch_size", -4, "'rl.mini_batch_size' = -4 must be >= 0"),
    ("rl.micro_batch_size", -4, "'rl.micro_batch_size' = -4 must be >= 0"),
    ("rl.adv_ddof", 4, "'rl.adv_ddof' = 4 must be below rl.num_generations = 4"),
    ("model.logprob_chunk", 0, "'model.logprob_chunk' = 0 must be >= 1"),
    ("train.eval_every", -1, "'train.eval_every' = -1 must be >= 0"),
    ("train.checkpoint_every", -2, "'train.checkpoint_every' = -2 must be >= 0"),
    ("sampling.top_p", 0.0, r"'sampling.top_p' = 0.0 must be in \(0, 1\]"),
    ("sampling.top_k", -1, "'sampling.top_k' = -1 must be >= 0"),
])
def test_impossible_values_are_refused_naming_the_field(field, value, message):
  config = sweeps.apply_overrides(tiny.get_config(), {field: value})
  with pytest.raises(errors.ConfigError, match=message):
    validation.validate(config)


@pytest.mark.parametrize("field", ["train.eval_every", "train.checkpoint_every",
                                   "rl.mini_batch_size", "rl.micro_batch_size"])
def test_zero_means_off_or_all_for_the_other_divisors(field):
  """The loops test these before dividing: 0 is 'never' or 'the whole batch'."""
  validation.validate(sweeps.apply_overrides(tiny.get_config(), {field: 0}))


def test_a_run_with_log_every_0_stops_before_the_model_loads(tmp_path):
  config = quiet_tiny(log_every=0)
  config.model.source = str(tmp_path / "no_such_model.gguf")   # never reached
  with pytest.raises(errors.ConfigError, match="'train.log_every' = 0"):
    train.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_stray_argument_and_variant_of_a_config_without_variants_are_refused(tmp_path):
  stray = command("run.py", f"--config={TINY}", f"--workdir={tmp_path / 'a'}",
                  "config.train.steps=1")   # a forgotten --
  assert stray.returncode != 0 and "unexpected arguments" in stray.stderr
  assert not (tmp_path / "a").exists()
  variant = command("run.py", f"--config={TINY}:paper", f"--workdir={tmp_path / 'b'}")
  assert variant.returncode != 0
  assert "configs/tiny.py has no variants, got ':paper'" in variant.stderr
  assert "Traceback" not in variant.stderr and len(variant.stderr.splitlines()) <= 2 and not (tmp_path / "b").exists()


def test_an_empty_eval_file_is_refused_before_the_model_loads(tmp_path):
  empty = tmp_path / "eval.jsonl"
  empty.write_text("")
  config = quiet_tiny()
  config.model.source = str(tmp_path / "no_such_model.gguf")   # never reached
  config.data.eval_source = "jsonl"
  config.data.eval_kwargs = dict(path=str(empty), layout="gsm8k")
  with pytest.raises(errors.ConfigError, match=r"data.eval_kwargs.*gave no examples"):
    train.run(config, str(tmp_path / "run"))


def test_a_bad_data_file_is_one_line_naming_it(tmp_path):
  bad = tmp_path / "eval.jsonl"
  bad.write_text('{"question": "1 + 1 = ?", "answer": "#### 2"}\n{"question": \n')
  out = command("run.py", f"--config={TINY}", f"--workdir={tmp_path / 'run'}",
                "--config.data.eval_source=jsonl",
                f"--config.data.eval_kwargs={json.dumps(dict(path=str(bad), layout='gsm8k'))}")
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == f"error: {bad} line 2: not valid JSON (Expecting value)"


def test_a_data_path_typo_is_reported_before_the_model_loads(tmp_path):
  config = quiet_tiny()
  config.model.source = str(tmp_path / "no_such_model.gguf")
  config.data.source = "jsonl"
  config.data.kwargs = dict(path=str(tmp_path / "trian.jsonl"), layout="gsm8k")
  config.data.eval_source = "arithmetic"
  with pytest.raises(ValueError, match="trian.jsonl"):
    train.run(config, str(tmp_path / "run"))


def test_a_sweep_validates_every_point_before_running_the_first(tmp_path):
  calls = []
  points = [{"rl.eps_high": 0.2}, {"optim.learning_rate": -1.0}]
  with pytest.raises(errors.ConfigError, match=r"sweep point 1 \(optim.learning_rate=-1.0\)"):
    sweeps.run_sweep(tiny.get_config(), points, lambda c, w: calls.append(w),
                     sweeps.Destination(runs.RunStore(tmp_path), "tiny", "s", tmp_path),
                     validate=validation.validate)
  assert calls == [] and runs.RunStore(tmp_path).list() == []
  sweep_file = tmp_path / "bad_sweep.py"
  sweep_file.write_text("def get_sweep():\n  return [{'rl.eps_high': 0.2}, "
                        "{'optim.learning_rate': -1.0}]\n")
  out = command("sweep.py", f"--config={TINY}", f"--sweep={sweep_file}", "--dry_run")
  assert out.returncode != 0 and "'optim.learning_rate' = -1.0 must be >= 0" in out.stderr
  assert out.stdout == ""   # not even the first point's command


# ----------------------------------------------------------------------------
# Signals.
# ----------------------------------------------------------------------------

def _signal_at_step(monkeypatch, step_to_signal: int, signals: int = 1,
                    signum=signal.SIGINT):
  """Sends `signals` x `signum` to this process inside step `step_to_signal`
  (while its advantages are computed, mid-step)."""
  calls = []
  advantages = train.advantages

  def signalling(config, reward_bg, *args, **kwargs):
    calls.append(1)
    if len(calls) == step_to_signal:
      for _ in range(signals):
        os.kill(os.getpid(), signum)
        time.sleep(0.05)   # Python runs the handler between bytecodes
    return advantages(config, reward_bg, *args, **kwargs)
  monkeypatch.setattr(train, "advantages", signalling)


def test_ctrl_c_saves_at_the_step_boundary_and_the_restart_resumes(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  _signal_at_step(monkeypatch, 2)   # checkpoint_every=0: only the signal saves
  # What the run must give back: Python's default handler, or SIG_IGN when
  # pytest itself was started in the background by a non-interactive shell.
  before = signal.getsignal(signal.SIGINT)
  with pytest.raises(interrupts.Preempted) as stopped:
    train.run(quiet_tiny(steps=4), workdir)
  assert stopped.value.exit_code == 130 and stopped.value.step == 2
  assert "stopped by SIGINT at step 2" in str(stopped.value)
  assert checkpoint.finalized_steps(checkpoint.checkpoint_dir(workdir)) == [2]
  assert signal.getsignal(signal.SIGINT) is before   # given back
  monkeypatch.undo()
  train.run(quiet_tiny(steps=4), workdir)
  assert row_keys(metric_rows(workdir)) == [
      (0, "eval"), (1, "train"), (2, "train"), (3, "train"), (4, "train"), (4, "eval")]


def test_a_start_up_signal_inside_a_gc_callback_is_quiet_and_stops_at_start_up_end(capfd):
  # The signal handler raises `Preempted`; inside a garbage-collector callback
  # (JAX registers one) Python cannot propagate it and prints "Exception
  # ignored" with a traceback. The stop is still recorded: quiet, and the run
  # stops where start-up ends.
  import gc
  with pytest.raises(interrupts.Preempted) as stopped:
    with interrupts.handle_signals() as stop:
      def in_gc(phase, info):
        del info
        if phase == "start" and stop.reason is None:
          stop._on_signal(signal.SIGTERM, None)
      gc.callbacks.append(in_gc)
      try:
        gc.collect()
      finally:
        gc.callbacks.remove(in_gc)
      assert interrupts.stop_requested()
      interrupts.defer_to_step_boundary()
      raise AssertionError("start-up went on past a recorded SIGTERM")
  assert "during start-up" in str(stopped.value) and stopped.value.exit_code == 143
  err = capfd.readouterr().err
  assert "Exception ignored" not in err and "Traceback" not in err, err


def test_a_second_ctrl_c_aborts_without_saving(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  _signal_at_step(monkeypatch, 2, signals=2)
  with pytest.raises(KeyboardInterrupt, match="aborted without saving"):
    train.run(quiet_tiny(steps=4), workdir)
  assert checkpoint.finalized_steps(checkpoint.checkpoint_dir(workdir)) == []


def _running_tiny(workdir, store, *extra):
  return subprocess.Popen(
      [sys.executable, "experiments/run.py", f"--config={TINY}", f"--workdir={workdir}",
       "--config.train.steps=100000", "--config.train.eval_at_start=false", *extra],
      cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               GRPO_JAX_RUNS=str(store)))


def _wait_for(predicate, proc, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if predicate():
      return True
    time.sleep(0.05)
  return False


def _statuses(store):
  path = Path(store) / "runs.sqlite"
  if not path.exists():
    return []
  try:
    with sqlite3.connect(path, timeout=5) as db:
      return [row[0] for row in db.execute("SELECT status FROM runs ORDER BY id")]
  except sqlite3.OperationalError:   # the table is being created
    return []


def test_sigterm_mid_run_saves_exits_non_zero_and_records_preempted(tmp_path):
  workdir, store = tmp_path / "run", tmp_path / "store"
  proc = _running_tiny(workdir, store)
  try:
    assert _wait_for(lambda: (workdir / "metrics.jsonl").exists()
                     and (workdir / "metrics.jsonl").read_text().count("\n") >= 2, proc)
    # The same command again, while the first runs: refused, naming it.
    second = command("run.py", f"--config={TINY}", f"--workdir={workdir}",
                     "--config.train.steps=100000", "--config.train.eval_at_start=false",
                     env={"GRPO_JAX_RUNS": str(store)})
    assert proc.poll() is None, "the first run ended before the second started"
    assert second.returncode == 1 and "Traceback" not in second.stderr
    assert second.stderr.strip().splitlines()[-1].startswith(
        f"error: workdir {workdir} is in use by pid {proc.pid} on host ")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
  assert "stopped by SIGTERM at step" in stderr and "Traceback" not in stderr
  saved = checkpoint.finalized_steps(checkpoint.checkpoint_dir(workdir))
  assert len(saved) == 1 and 2 <= saved[0] < 100000
  assert _statuses(store) == ["preempted", "failed"]   # the refused second run


def test_sigterm_during_start_up_leaves_no_row_running(tmp_path):
  workdir, store = tmp_path / "run", tmp_path / "store"
  # The evaluation before training widens start-up by its compile.
  proc = _running_tiny(workdir, store, "--config.train.eval_at_start=true")
  try:
    assert _wait_for(lambda: _statuses(store) == ["running"], proc)
    proc.send_signal(signal.SIGTERM)   # the model is loading or compiling
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
  assert "during start-up" in stderr
  assert _statuses(store) == ["preempted"]


def test_a_second_ctrl_c_exits_130_naming_the_last_checkpoint_without_a_traceback(
    finished_run, capsys):
  with pytest.raises(SystemExit) as exited:
    with cli.user_errors(str(finished_run)):
      raise interrupts.Aborted(signal.SIGINT)
  assert exited.value.code == 130
  assert capsys.readouterr().err == (
      "stopped by SIGINT again: aborted without saving; the last good checkpoint is "
      f"{finished_run / 'checkpoints' / '3'}: run the same command again to resume from it.\n")


def test_a_sweep_stops_at_a_preempted_point(tmp_path):
  calls = []

  def preempted_run(config, workdir):
    calls.append(workdir)
    raise interrupts.Preempted("SIGTERM", step=1, signum=signal.SIGTERM)
  store = runs.RunStore(tmp_path / "store")
  with pytest.raises(interrupts.Preempted):
    sweeps.run_sweep(tiny.get_config(), [{"rl.eps_high": 0.2}, {"rl.eps_high": 0.28}],
                     preempted_run, sweeps.Destination(store, "tiny", "s", tmp_path / "sweep"),
                     log=lambda _: None)
  assert len(calls) == 1
  assert [(r.name, r.status) for r in store.list()] == [("tiny[rl.eps_high=0.2]", "preempted")]


# ----------------------------------------------------------------------------
# Messages that name the field, file or process.
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("flag, expected", [
    ("--config.rl.eps_hihg=0.3", "unknown config field 'rl.eps_hihg': did you mean 'rl.eps_high'"),
    ("--config.sed=3", "unknown config field 'sed': did you mean 'seed'?"),
    ("--config.data.eval_kwargs.path=/x.jsonl",
     "--config.data.eval_kwargs='{\"path\": ...}'"),
])
def test_unknown_config_fields_get_one_line_with_the_nearest_names(tmp_path, flag, expected):
  out = command("run.py", f"--config={TINY}", flag, f"--workdir={tmp_path}/wd")
  assert out.returncode != 0
  assert expected in out.stderr
  assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_the_fix_a_missing_data_path_error_suggests_works(tmp_path):
  """tiny's data.eval_kwargs has no `path`: the suggestion must be a flag
  that parses (--config.data.eval_kwargs.path=... failed with AttributeError)."""
  base = ("run.py", f"--config={TINY}", f"--workdir={tmp_path / 'run'}",
          "--config.data.eval_source=jsonl")
  out = command(*base)
  assert out.returncode == 1 and "Traceback" not in out.stderr
  suggestion = "--config.data.eval_kwargs='{\"path\": \"...\"}'"
  assert suggestion in out.stderr.strip().splitlines()[-1]
  missing = tmp_path / "eval.jsonl"
  followed = command(*base, suggestion.replace("'", "").replace("...", str(missing)))
  assert followed.returncode == 1 and "Traceback" not in followed.stderr
  assert followed.stderr.strip().splitlines()[-1] == f"error: {missing}: no such file"


def test_validate_names_the_nearest_field_for_a_misspelt_nested_one():
  config = tiny.get_config()
  config.optim.weight_decy = 0.1
  with pytest.raises(errors.ConfigError,
                     match=r"^unknown config field 'optim.weight_decy': did you mean "
                           r"'optim.weight_decay'\?$"):
    validation.validate(config)


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
  assert metrics.read_jsonl(str(path)) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]
  assert "torn last line 3" in caplog.text and str(path) in caplog.text
  path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
  with pytest.raises(ValueError, match=f"{path} line 2 is not JSON"):
    metrics.read_jsonl(str(path))


def test_resume_after_a_torn_metrics_line(finished_run, tmp_path):
  workdir = copy_run(finished_run, tmp_path)
  with open(workdir / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "loss"')   # killed while writing a row
  train.run(quiet_tiny(), str(workdir))
  assert row_keys(metric_rows(workdir))[-1] == (3, "eval")


def test_tensorboard_keeps_each_step_once_after_a_resume(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), enabled=True)
  for step in range(6):   # a run killed after step 5, checkpoint at 3
    writer.write(step, {"loss": float(step)})
  writer.close()
  metrics.truncate(str(tmp_path), 3)
  writer = metrics.MetricWriter(str(tmp_path), enabled=True)
  for step in range(4, 6):   # recomputed after the resume
    writer.write(step, {"loss": 10.0 + step})
  writer.close()
  seen = [(step, value) for step, _, value in
          metrics.read_tensorboard(str(tmp_path / "tensorboard"))]
  assert sorted(seen) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)]


def test_tensorboard_has_every_scalar_of_a_step_on_disk_when_write_returns(
    tmp_path):
  # A run SIGKILLed after the step's checkpoint does not write it again.
  # (tensorboardX's SummaryWriter.flush left ~9 of these 50 queued.)
  writer = metrics.MetricWriter(str(tmp_path), enabled=True)
  writer.write(1, {f"m{i:02d}": float(i) for i in range(50)})
  writer.write(2, {"loss": 2.0, "kl": float("nan")})
  logdir = str(tmp_path / "tensorboard")
  assert sorted(metrics.read_tensorboard(logdir)) == sorted(
      [(1, f"m{i:02d}", float(i)) for i in range(50)]
      + [(2, "loss", 2.0), (2, "nonfinite/kl", 1.0)])
  writer.close()
  # killed mid-write: the torn record (step 2's) is dropped whole
  (path,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
  os.truncate(path, os.path.getsize(path) - 3)
  assert {step for step, _, _ in metrics.read_tensorboard(logdir)} == {1}


@pytest.mark.slow
def test_a_corrupt_run_store_is_named_and_does_not_block_training(tmp_path):
  store = tmp_path / "store"
  store.mkdir()
  (store / "runs.sqlite").write_text("this is not a database\n" * 100)
  with pytest.raises(errors.RunStoreError, match=str(store / "runs.sqlite")):
    runs.RunStore(store)
  out = command("run.py", f"--config={TINY}", f"--workdir={tmp_path / 'run'}",
                "--config.train.steps=1", env={"GRPO_JAX_RUNS": str(store)})
  assert out.returncode == 0, out.stderr[-2000:]
  assert f"the run store {store / 'runs.sqlite'} is unreadable" in out.stderr
  assert checkpoint.finalized_steps(checkpoint.checkpoint_dir(tmp_path / "run")) == [1]


def test_runs_list_with_a_missing_root_is_an_error_not_a_new_store(tmp_path):
  out = command("runs.py", "list", f"--root={tmp_path / 'typo'}")
  assert out.returncode != 0 and f"no run store at {tmp_path / 'typo'}" in out.stderr
  assert not (tmp_path / "typo").exists()


def test_a_data_file_that_changed_since_the_checkpoint_names_the_data_fields(tmp_path):
  data = tmp_path / "train.jsonl"
  lines = [json.dumps({"question": f"{i} + 1 = ?", "answer": f"#### {i + 1}"})
           for i in range(8)]
  data.write_text("\n".join(lines) + "\n")
  config = quiet_tiny(steps=1, eval_at_start=False, eval_at_end=False)
  config.data.source = "jsonl"
  config.data.kwargs = dict(path=str(data), layout="gsm8k")
  config.data.eval_source = "arithmetic"
  train.run(config, str(tmp_path / "run"))
  with open(data, "a") as f:   # the same config, a file with one more problem
    f.write(json.dumps({"question": "8 + 1 = ?", "answer": "#### 9"}) + "\n")
  config.train.steps = 2
  with pytest.raises(ValueError, match=r"ran over 8 examples, the training data now has 9.*"
                                       r"data.source / data.kwargs \(or the data file\)"):
    train.run(config, str(tmp_path / "run"))


def test_disk_full_names_the_last_good_checkpoint(tmp_path):
  mount = tmp_path / "small_disk"
  mount.mkdir()
  made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                        capture_output=True, text=True)
  if made.returncode != 0:
    pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
  try:
    out = command("run.py", f"--config={TINY}", f"--workdir={mount / 'run'}",
                  "--config.train.steps=20", "--config.train.checkpoint_every=1",
                  "--config.train.keep_checkpoints=20", "--config.train.eval_at_start=false",
                  env={"GRPO_JAX_RUNS": str(tmp_path / "store")})
    assert out.returncode == 1, out.stderr[-3000:]
    # The message closes the run; orbax's background save thread may still log
    # one line of its own failure after it (a race), so look at the last few.
    tail = out.stderr.strip().splitlines()[-3:]
    last = next((line for line in tail
                 if line.startswith("error: disk full (No space left on device)")), "")
    saved = checkpoint.finalized_steps(checkpoint.checkpoint_dir(mount / "run"))
    assert saved and last, (saved, out.stderr[-3000:])
    assert f"the last good checkpoint is {mount / 'run' / 'checkpoints' / str(saved[-1])}" in last
    assert "site-packages/orbax" not in out.stderr   # its ~600 lines of tracebacks
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr
  finally:
    subprocess.run(["umount", str(mount)], check=False)


_CLOSED_LOOP = """
import asyncio, threading, tensorstore
from grpo_jax.harness import cli
cli.hide_library_tracebacks()
# What a failed orbax save leaves: a tensorstore write awaited in an event
# loop that orbax closed after a sibling write failed; the write completes
# later, on another thread.
promise, write = tensorstore.Promise.new()
async def save():
  async def one_write():
    await write
  asyncio.ensure_future(one_write())
  await asyncio.sleep(0.01)
  raise OSError(28, "No space left on device")
loop = asyncio.new_event_loop()
try:
  loop.run_until_complete(save())
except OSError:
  pass
loop.close()
done = threading.Thread(target=lambda: promise.set_result(1))
done.start()
done.join()
class Other:
  def __del__(self):
    raise ValueError("another unraisable error is still shown")
Other()
print("end")
"""


def test_a_failed_async_save_prints_no_closed_event_loop_traceback():
  out = subprocess.run([sys.executable, "-c", _CLOSED_LOOP], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
  assert out.returncode == 0 and out.stdout == "end\n", out.stderr
  assert "Event loop is closed" not in out.stderr
  assert "another unraisable error is still shown" in out.stderr


def test_config_json_missing_a_key_names_it(tmp_path):
  from grpo_jax import models
  hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(Exception, match=r"config.json.*num_attention_heads"):
    models.load_pretrained(str(tmp_path))


def test_describe_finds_disk_full_inside_wrapped_errors(tmp_path):
  try:
    try:
      raise OSError(28, "No space left on device")
    except OSError as e:
      raise RuntimeError("async save failed") from e
  except RuntimeError as e:
    message = cli.describe(e, str(tmp_path))
  assert message.startswith("disk full") and "no complete checkpoint yet" in message
  assert cli.describe(RuntimeError("a bug"), str(tmp_path)) is None


_JOIN = """
import sys
from configs import tiny
from grpo_jax.harness import distributed
config = tiny.get_config()
config.mesh.update(eval(sys.argv[1]))
distributed.initialize_distributed(config)
print("joined")
"""


def _join(mesh_fields, timeout=120):
  return subprocess.run([sys.executable, "-c", _JOIN, repr(mesh_fields)], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout,
                        env={k: v for k, v in dict(os.environ, PYTHONPATH=str(REPO),
                                                    JAX_PLATFORMS="cpu").items()
                             if not k.startswith("JAX_COORDINATOR")})


def test_distributed_without_an_address_names_the_fields_and_variables():
  out = _join({"distributed": True})
  assert out.returncode != 0 and "joined" not in out.stdout
  last = out.stderr.strip().splitlines()[-1]
  assert "mesh.distributed" in last and "mesh.coordinator_address" in last
  assert "JAX_COORDINATOR_ADDRESS" in last


def test_distributed_start_up_says_what_it_waits_for_and_gives_up_in_time():
  import socket
  with socket.socket() as s:   # a free port
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  out = _join({"coordinator_address": f"localhost:{port}", "num_processes": 2,
               "process_id": 0, "init_timeout_s": 3})   # process 1 never starts
  assert out.returncode == 1 and "joined" not in out.stdout
  assert (f"process 0 of 2 connecting to the coordinator at localhost:{port}; waiting up "
          "to 3 s (mesh.init_timeout_s)") in out.stderr
  assert out.stderr.strip().splitlines()[-1].startswith(
      "error: gave up after 3 s (config field mesh.init_timeout_s)")
