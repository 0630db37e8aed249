"""Exact resume of the real trainer after SIGKILL at a random point."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from grpo_jax import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6   # a tiny step takes ~80 ms on CPU; leave >= 3 steps after the kill point
ASYNC_STEPS = 12   # 10 after the kill point (_steps)
_VOLATILE = ("time/", "tokens_per_second")  # and every "*seconds": timings


# Asynchronous rollouts one version stale (rl/async_rollouts.py): the
# checkpoint keeps the finished rows of the old version, later rows are
# regenerated from the saved parameters.
ASYNC = ("--config.rollout.max_staleness=1", "--config.rl.old_logp=recompute",
         "--config.rl.rollout_correction.is_level=token")


# Partial rollouts (rl/partial_rollouts.py): the checkpoint keeps the stream
# at the switch into its version, rows in flight included.
PARTIAL = ASYNC + ("--config.rollout.partial=True",
                   "--config.sampling.continuous_batching=True",
                   "--config.sampling.kv_cache=paged",
                   "--config.sampling.slots=4",
                   "--config.sampling.max_new_tokens=16")


# Multi-turn episodes (generate/agent.py): a random tiny model stops a
# 24-token turn now and then, and the scripted env answers it once.
ENV = ("--config.env.name=scripted", "--config.env.max_turns=2",
       "--config.env.max_observation_tokens=32",
       "--config.sampling.max_new_tokens=24")
# The same on the parked engine (generate/parked.py): rows that wait.
ENV_PARKED = ENV + ("--config.env.engine=parked",
                    "--config.sampling.continuous_batching=True",
                    "--config.sampling.kv_cache=paged")
# Counters of how the engine's calls fell (tools' timing), not results.
_ENGINE_TIMING = ("env/engine_decode_calls", "env/engine_decode_steps",
                  "env/engine_peak_pages")


def _steps(extra) -> int:
  # The steps after the kill point are the margin for a poll that comes
  # late on a loaded machine (the kill must land before the last
  # checkpoint). The asynchronous run's steps overlap sampling with the
  # update, so it gets 10 of them, not 4 (~0.3 s each on a quiet core).
  return ASYNC_STEPS if extra in (ASYNC, PARTIAL) else STEPS


def _command(workdir, extra=()):
  steps = _steps(extra)
  # keep_checkpoints=steps: the kill point stays on disk until the run ends
  # (the default keeps 2: a poll that came 2 steps late never saw it).
  return [sys.executable, os.path.join(ROOT, "experiments", "run.py"),
          f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}",
          f"--workdir={workdir}", f"--config.train.steps={steps}",
          "--config.train.checkpoint_every=1",
          f"--config.train.keep_checkpoints={steps}",
          "--config.train.eval_at_start=false", *extra]


def _run(workdir, extra=(), timeout=600):
  subprocess.run(_command(workdir, extra), check=True, timeout=timeout,
                 cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _metrics(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return [{k: v for k, v in r.items()
           if not k.startswith(_VOLATILE) and not k.endswith("seconds")}
          for r in rows]


@pytest.mark.parametrize("extra", [
    (), pytest.param(ASYNC, marks=pytest.mark.slow, id="async_k1"),
    pytest.param(PARTIAL, marks=pytest.mark.slow, id="partial_k1"),
    pytest.param(ENV, marks=pytest.mark.slow, id="env"),
    pytest.param(ENV_PARKED, marks=pytest.mark.slow, id="env_parked")])
def test_sigkill_and_restart_equals_uninterrupted_run(tmp_path, extra):
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  _run(straight, extra)
  # Start, wait until a random checkpoint is finalised, then SIGKILL.
  # The kill lands at most ~70 ms after `kill_after` is finalised, mid-step or
  # mid-write, and always before the last step is finalised (a fast CI machine
  # once finished 2 steps inside a 1 s random sleep). Every checkpoint is
  # kept, so the poll sees `kill_after` however late it comes; the steps
  # after it are the margin (_steps).
  steps = _steps(extra)
  kill_after = random.Random(0).randint(1, STEPS - 3)
  proc = subprocess.Popen(_command(killed, extra), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
  try:
    deadline = time.time() + 600
    ckpt_dir = checkpoint.checkpoint_dir(killed)
    while time.time() < deadline and proc.poll() is None:
      if os.path.isdir(ckpt_dir) and kill_after in checkpoint.finalized_steps(
          ckpt_dir):
        time.sleep(random.Random(1).uniform(0.0, 0.05))
        break
      time.sleep(0.02)
    assert proc.poll() is None, (
        f"the run ended (exit {proc.returncode}) before checkpoint "
        f"{kill_after} was seen; finalised: "
        f"{checkpoint.finalized_steps(ckpt_dir)}")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  resumed_from = max(checkpoint.finalized_steps(ckpt_dir))
  assert kill_after <= resumed_from < steps, "the kill did not land mid-run"
  _run(killed, extra)   # resumes from the latest finalised checkpoint
  a = checkpoint.load_params(straight)
  b = checkpoint.load_params(killed)
  for x, y in zip(_leaves(a), _leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)   # bitwise on CPU
  if extra in (ENV, ENV_PARKED):   # later turns' prompt shapes: a fresh
    # process compiles those it has not seen, so its count differs (a
    # counter, not a result)
    drop = lambda rows: [{k: v for k, v in r.items()
                          if k not in ("sampler/compilations", *_ENGINE_TIMING)}
                         for r in rows]
    assert drop(_metrics(straight)) == drop(_metrics(killed))
  else:
    assert _metrics(straight) == _metrics(killed)
  if extra in (ENV, ENV_PARKED):   # episodes with observations were trained on
    assert sum(r.get("env/tool_calls_mean", 0) for r in _metrics(straight)) > 0
  if extra == ASYNC:   # the rows in flight were in the checkpoint it resumed from
    assert checkpoint.load_host_state(killed, resumed_from)["rollouts"]
  # TensorBoard too: the steps the kill discarded are not kept beside the
  # recomputed ones (each (step, tag) once, as in the uninterrupted run).
  assert _tensorboard(killed) == _tensorboard(straight)


def _tensorboard(workdir):
  from grpo_jax.harness import metrics  # pylint: disable=import-outside-toplevel
  return sorted((step, tag) for step, tag, _ in
                metrics.read_tensorboard(os.path.join(workdir, "tensorboard")))


def _leaves(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return [np.asarray(x) for x in jax.tree.leaves(tree)]
