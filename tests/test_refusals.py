"""Bad records and bad places to write are refused while reading and before
any work (issue 31, items 2-4).

Each test is one case a new user hit: an empty gold answer that trained
without a word, a 100 MB record that cost ~190 bytes of memory per byte
before it was refused, a non-UTF-8 byte with no file or line, an entry point
that evaluated everything before finding it could not write, a SIGKILLed run
`running` forever, a killed export's staging directory left behind, and
tracebacks where one line belongs. Subprocesses only where the point is the
one line without a traceback.
"""
import json
import logging
import os
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from configs import tiny
from grpo_jax import data, errors, sharding, validation
from grpo_jax.data import files, tfds_source
from grpo_jax.harness import experiment, outdir, runs, sweeps, workdir_lock
from grpo_jax.registry import lookup
from grpo_jax.rl import train

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.py")


def command(script, *args, env=None):
  return subprocess.run([sys.executable, f"experiments/{script}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
                                 **(env or {})))


def one_line_error(out) -> str:
  """The last stderr line of a refused command, checked to be the only error."""
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ")
  return last


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def write_parquet(path, records):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(records), path)
  return str(path)


# ----------------------------------------------------------------------------
# Empty gold answers.
# ----------------------------------------------------------------------------

_GOOD = {"math": {"problem": "1 + 1?", "solution": "so $\\boxed{2}$", "answer": None},
         "question_answer": {"question": "1 + 1?", "answer": "2"},
         "dapo_math": {"prompt": [{"role": "user", "content": "1 + 1?"}],
                       "reward_model": {"ground_truth": "2"}}}
_EMPTY = [
    ("math", {"problem": "p", "solution": "the answer is $\\boxed{}$"},
     "field 'answer', else the last \\boxed{} of field 'solution', math layout"),
    ("math", {"problem": "p", "solution": "$\\boxed{3}$", "answer": ""},
     "field 'answer', else the last \\boxed{} of field 'solution', math layout"),
    ("question_answer", {"question": "q", "answer": "  "},
     "field 'answer', question_answer layout"),
    ("dapo_math", {"prompt": [{"role": "user", "content": "q"}],
                   "reward_model": {"ground_truth": ""}},
     "field 'reward_model.ground_truth', dapo_math layout"),
]


@pytest.mark.parametrize("layout, record, source", _EMPTY)
@pytest.mark.parametrize("reader", ["jsonl", "parquet"])
def test_an_empty_gold_answer_is_refused_naming_the_record(tmp_path, reader, layout,
                                                           record, source):
  write = write_jsonl if reader == "jsonl" else write_parquet
  path = write(tmp_path / f"d.{reader}", [_GOOD[layout], record])
  where = "line 2" if reader == "jsonl" else "row 1"
  with pytest.raises(errors.DataError) as refused:
    lookup("dataset", reader)(path=path, layout=layout)
  assert str(refused.value) == (
      f"{path} {where}: the gold answer is empty ({source}), so no completion can be "
      "scored against it: fix or remove the record, or pass on_empty_answer='drop' in "
      "the data kwargs to skip such records")


@pytest.mark.parametrize("reader", ["jsonl", "parquet"])
def test_on_empty_answer_drop_skips_them_with_one_warning(tmp_path, caplog, reader):
  write = write_jsonl if reader == "jsonl" else write_parquet
  rows = [_GOOD["math"], _EMPTY[0][1], _GOOD["math"], _EMPTY[0][1], _GOOD["math"]]
  path = write(tmp_path / f"d.{reader}", rows)
  with caplog.at_level(logging.WARNING):
    kept = lookup("dataset", reader)(path=path, layout="math", on_empty_answer="drop")
  assert [e.answer for e in kept] == ["2", "2", "2"]
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  where = "line 2, line 4" if reader == "jsonl" else "row 1, row 3"
  assert warnings == [f"{path}: dropped 2 record(s) whose gold answer is empty "
                      f"(on_empty_answer='drop'): {where}"]


def test_tfds_records_are_sized_and_their_answers_checked():
  qa = lambda q, a: {"question": q.encode(), "answer": a.encode()}
  source = [qa("1 + 1?", "2"), qa("2 + 2?", " "), qa("x" * 300, "5"), qa("3 + 3?", "6")]
  examples = tfds_source.TfdsExamples(source, lookup("layout", "question_answer"),
                                      "tfds math:train", 4, {}, "question_answer",
                                      max_record_bytes=100)
  assert examples[0].answer == "2"
  with pytest.raises(errors.DataError, match=r"^tfds math:train record 1: the gold answer "
                                             r"is empty \(field 'answer'"):
    examples[1]
  with pytest.raises(errors.DataError, match=r"^tfds math:train record 2: a record of "
                                             r"301 bytes .* over the bound of 100 bytes"):
    examples[2]
  kept = tfds_source.TfdsExamples(source[:2] + source[3:], examples._parse, "tfds m:t", 3,
                                  {}, "question_answer").keep_answered(limit=None)
  assert [e.answer for e in kept] == ["2", "6"]


def test_no_example_with_an_empty_answer_reaches_training(monkeypatch):
  """Any data set (a registered generator, a notebook's): load_examples refuses it."""
  real = experiment.registry.lookup
  blank = lambda **kwargs: [data.Example("1 + 1?", "2"), data.Example("2 + 2?", "")]
  monkeypatch.setattr(experiment.registry, "lookup",
                      lambda kind, name: blank if kind == "dataset" else real(kind, name))
  with pytest.raises(errors.DataError, match=r"^example 1 of data.source = 'arithmetic' "
                                             r"has an empty gold answer"):
    experiment.load_examples(tiny.get_config())


# ----------------------------------------------------------------------------
# Bounded reading; bytes that are not UTF-8.
# ----------------------------------------------------------------------------

def test_an_over_long_jsonl_record_is_refused_holding_at_most_the_bound(tmp_path):
  path = tmp_path / "long.jsonl"
  with open(path, "w") as f:
    f.write(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    f.write(json.dumps({"question": "x" * (16 << 20), "answer": "#### 2"}) + "\n")
  size = len(path.read_bytes().splitlines()[1])
  tracemalloc.start()
  try:
    with pytest.raises(errors.DataError) as refused:
      data.read_jsonl(str(path), layout="gsm8k")
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert str(refused.value) == (
      f"{path} line 2: a record of {size} bytes (16.0 MiB) is over the bound of 1048576 "
      "bytes per record; shorten or remove it, or raise max_record_bytes in the data kwargs")
  assert peak < 3 * files.MAX_RECORD_BYTES   # the 16 MiB line was never held whole
  assert len(data.read_jsonl(str(path), layout="gsm8k", max_record_bytes=32 << 20)) == 2


def test_an_over_long_parquet_row_is_refused_before_it_becomes_python(tmp_path):
  nested = {"prompt": [{"role": "user", "content": "y" * 5000}],
            "reward_model": {"ground_truth": "7"}}
  path = write_parquet(tmp_path / "d.parquet", [_GOOD["dapo_math"], nested])
  with pytest.raises(errors.DataError,
                     match=r"d\.parquet row 1: a record of 50\d\d bytes \(0\.0 MiB\) is over "
                           r"the bound of 4096 bytes per record"):
    data.read_parquet(path, max_record_bytes=4096)
  assert len(data.read_parquet(path, max_record_bytes=8192)) == 2


def test_a_non_utf8_byte_is_one_line_naming_the_file_and_line(tmp_path):
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(b'{"question": "1 + 1?", "answer": "#### 2"}\n'
                   b'{"question": "caf\xe9?", "answer": "#### 2"}\n')
  with pytest.raises(errors.DataError) as refused:
    data.read_jsonl(str(path), layout="gsm8k")
  assert str(refused.value) == (f"{path} line 2: not UTF-8 text (byte 0xe9 at byte 18 of "
                                "the line); save the file as UTF-8")


@pytest.mark.parametrize("overrides, message", [
    ({"data.kwargs": {"on_empty_answer": "dorp"}},
     "config field 'data.kwargs': data kwarg on_empty_answer = 'dorp'; allowed: "
     "('error', 'drop')"),
    ({"data.eval_kwargs": {"max_record_bytes": 0}},
     "config field 'data.eval_kwargs': data kwarg max_record_bytes = 0 must be an "
     "integer >= 1"),
    ({"seed": -1}, "config field 'seed' = -1 must be >= 0"),
])
def test_reading_options_and_the_seed_are_validated_at_start(overrides, message):
  config = sweeps.apply_overrides(tiny.get_config(), overrides)
  with pytest.raises(errors.ConfigError) as refused:
    validation.validate(config)
  assert str(refused.value).startswith(message)


# ----------------------------------------------------------------------------
# What the entry points write, checked before they work.
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("under", [False, True])
def test_a_workdir_that_is_a_file_or_under_one_is_refused_at_once(tmp_path, under):
  afile = tmp_path / "afile"
  afile.write_text("mine")
  workdir = afile / "run" if under else afile
  config = tiny.get_config()
  config.model.source = str(tmp_path / "never_loaded.gguf")
  with pytest.raises(errors.UnwritableDirectoryError) as refused:
    train.run(config, str(workdir))
  where = f"is under {afile}, which is a file" if under else "is a file"
  assert str(refused.value) == (f"--workdir {workdir} {where}, not a directory: choose "
                                "another; nothing was written")
  assert afile.read_text() == "mine"


def test_evaluate_checks_its_output_before_evaluating(tmp_path):
  (tmp_path / "afile").write_text("")
  out = command("evaluate.py", f"--config={TINY}", f"--workdir={tmp_path / 'afile' / 'e'}")
  assert one_line_error(out) == (
      f"error: the eval directory (--workdir) {tmp_path / 'afile' / 'e' / 'eval'} is under "
      f"{tmp_path / 'afile'}, which is a file, not a directory: choose another; nothing "
      "was written")


def test_a_run_store_root_that_is_a_file_is_a_run_store_error(tmp_path):
  (tmp_path / "afile").write_text("")
  with pytest.raises(errors.RunStoreError, match=r"the run store root .*afile is a file, "
                                                 r"not a directory: point \$GRPO_JAX_RUNS"):
    runs.RunStore(tmp_path / "afile")


def test_export_checks_out_and_removes_a_killed_exports_staging(tmp_path):
  (tmp_path / "afile").write_text("")
  with pytest.raises(errors.UnwritableDirectoryError, match="--out .* is under"):
    outdir.check_empty(tmp_path / "afile" / "hf", overwrite=False)
  dead = subprocess.Popen(["true"])
  dead.wait()
  host = socket.gethostname()
  killed = tmp_path / f".hf.new-{host}-{dead.pid}-abc123"          # a killed export
  older = tmp_path / ".hf.new-x1y2z3"                              # before pids in names
  live = tmp_path / f".hf.new-{host}-{os.getpid()}-def456"         # an export running now
  elsewhere = tmp_path / f".hf.old-other-host-{dead.pid}-ghi789"   # another host's
  for staging in (killed, older, live, elsewhere):
    (staging / "weights").mkdir(parents=True)
  with outdir.staged(tmp_path / "hf") as staging:
    (staging / "config.json").write_text("{}")
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      ["afile", "hf", live.name, elsewhere.name])


def _dead_pid() -> int:
  proc = subprocess.Popen(["true"])
  proc.wait()
  return proc.pid


def _lock_file(workdir: Path, pid: int) -> None:
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / workdir_lock.LOCK_NAME).write_text(json.dumps(
      {"pid": pid, "host": socket.gethostname(), "command": "run.py", "started": "-",
       "since": time.time()}))


def test_runs_whose_process_died_are_shown_died(tmp_path):
  store = runs.RunStore(tmp_path / "store")
  killed, gone, live = tmp_path / "killed", tmp_path / "gone", tmp_path / "live"
  _lock_file(killed, _dead_pid())
  _lock_file(live, os.getpid())
  ids = [store.start("killed", {}, killed), store.start("no lock", {}, gone),
         store.start("before", {}, live), store.start("holder", {}, live),
         store.start("remote", {}, "gs://bucket/run")]
  store.finish(store.start("done", {}, killed), "finished")
  assert [(r.name, r.status) for r in runs.observed(store.list())] == [
      ("killed", "died"), ("no lock", "died"), ("before", "died"), ("holder", "running"),
      ("remote", "running"), ("done", "finished")]
  assert [r.status for r in store.list()][:5] == ["running"] * 5   # the store as recorded
  listed = command("runs.py", "list", "--status=died", f"--root={tmp_path / 'store'}")
  assert listed.returncode == 0, listed.stderr[-2000:]
  assert [line.split()[:3] for line in listed.stdout.splitlines()[2:]] == [
      [str(ids[0]), "killed", "died"], [str(ids[1]), "no", "lock"],
      [str(ids[2]), "before", "died"]]


def test_a_mesh_whose_fixed_axes_do_not_divide_the_devices_says_so():
  with pytest.raises(errors.ConfigError) as refused:
    sharding.mesh_shape((-1, 3, 1), 2)
  assert str(refused.value) == ("config field 'mesh.shape' = (-1, 3, 1): its fixed axes "
                                "need a multiple of 3 devices; there are 2")


def test_plot_runs_names_a_misspelt_key_and_the_keys_that_exist(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5, "loss": 1.0}\n')
  out = command("plot_runs.py", "--keys=reward/maen", f"a={tmp_path}")
  assert one_line_error(out) == ("error: --keys: no run logged 'reward/maen'; did you mean "
                                 "'reward/mean'? the keys logged: loss, reward/mean")
  assert out.stdout == ""   # not an empty table


def test_aot_reports_a_bad_topology_as_one_line():
  out = command("aot.py", f"--config={TINY}", "--topology=v9:2x2")
  assert one_line_error(out).startswith("error: --topology='v9:2x2': JAX cannot describe it")


def test_sweep_reports_a_bad_point_and_an_unwritable_workdir_as_one_line(tmp_path):
  sweep = tmp_path / "sweep.py"
  sweep.write_text("def get_sweep():\n  return [{'rl.eps_hihg': 0.3}]\n")
  out = command("sweep.py", f"--config={TINY}", f"--sweep={sweep}", "--dry_run")
  assert one_line_error(out).startswith(
      f"error: --sweep={sweep}: override 'rl.eps_hihg': the config has no field 'eps_hihg'")
  assert out.stdout == ""
  sweep.write_text("def get_sweep():\n  return [{'rl.eps_high': 0.3}]\n")
  (tmp_path / "afile").write_text("")
  out = command("sweep.py", f"--config={TINY}", f"--sweep={sweep}",
                f"--workdir={tmp_path / 'afile' / 'sw'}", f"--runs_root={tmp_path / 'store'}")
  assert one_line_error(out) == (
      f"error: the sweep's --workdir {tmp_path / 'afile' / 'sw'} is under "
      f"{tmp_path / 'afile'}, which is a file, not a directory: choose another; nothing "
      "was written")
  assert not (tmp_path / "store").exists()   # nothing recorded
