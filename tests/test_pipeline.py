"""The method "pipeline": stage configs, stage directories, and a restart
that skips finished stages and resumes the stopped one at its step."""
import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from configs import r1_tiny, tiny
from grpo_jax import checkpoint, errors
from grpo_jax.harness import interrupts, pipeline
from grpo_jax.rl import train
from grpo_jax.star import loop as star_loop


def _two_stages():
  c = r1_tiny.get_config()
  c.stages = (c.stages[0], {"kind": "rl", "name": "rl", "overrides": {
      "train.steps": 2, "train.checkpoint_every": 1, "rl.kl_beta": 0.01,
      "train.eval_at_end": False}})
  c.star.sft_steps = 2
  c.train.eval_examples = 0   # no held-out evaluation: a cheaper test
  return c


def _sigterm_in_call(monkeypatch, owner, name: str, n: int) -> list:
  """Replaces owner.<name> by a wrapper that counts its calls (the list
  returned) and sends this process a SIGTERM during the n-th, which the run
  handles by saving at that step's end."""
  wrapped, calls = getattr(owner, name), []

  def counted(*args, **kwargs):
    calls.append(1)
    if len(calls) == n:
      os.kill(os.getpid(), signal.SIGTERM)
    return wrapped(*args, **kwargs)

  monkeypatch.setattr(owner, name, counted)
  return calls


def test_stage_configs(tmp_path):
  c = r1_tiny.get_config()
  configs = pipeline.stage_configs(c, str(tmp_path))
  assert [s.method for s in configs] == ["sft", "rl", "star"]
  assert configs[0].init_from == ""
  assert configs[1].init_from == str(tmp_path / "stage0_cold_start")
  assert configs[2].init_from == str(tmp_path / "stage1_reasoning_rl")
  assert configs[1].rl.kl_reference == "start" and configs[1].train.steps == 2
  assert (configs[2].star.iterations, configs[2].star.rationalize) == (1, False)
  assert configs[0].data.source == "jsonl" and configs[1].data.source == "arithmetic"
  assert all(s.stages == () for s in configs)


@pytest.mark.parametrize("stage,match", [
    ({"kind": "ppo"}, r"stages\[0\].*needs 'kind'"),
    ({"kind": "rl", "overrides": {"rl.eps_hihg": 0.3}}, r"stages\[0\].overrides.rl.eps_hihg"),
    ({"kind": "rl", "steps": 3}, r"unknown keys \['steps'\]"),
    ({"kind": "distill"}, r"stages\[0\] \(distill\).*rl.distill.teacher"),
])
def test_bad_stages_are_refused_naming_the_stage(stage, match, tmp_path):
  c = tiny.get_config()
  c.method, c.stages = "pipeline", (stage,)
  with pytest.raises(errors.ConfigError, match=match):
    pipeline.stage_configs(c, str(tmp_path))


def test_restart_skips_finished_stages_and_resumes_the_stopped_one(tmp_path, monkeypatch):
  """A SIGTERM in the RL stage's first step: the stage saves step 1 and the
  pipeline stops; the restart skips the cold start and runs RL step 2 only,
  ending with the parameters of a run that never stopped."""
  config = _two_stages()
  calls = _sigterm_in_call(monkeypatch, train, "learn", 1)
  stopped = str(tmp_path / "stopped")
  with pytest.raises(interrupts.Preempted):
    pipeline.run(config, stopped)
  rl_dir = os.path.join(stopped, "stage1_rl")
  assert checkpoint.latest_step(checkpoint.checkpoint_dir(rl_dir)) == 1
  # An uninterrupted RL stage from the same cold start, for comparison.
  whole = str(tmp_path / "whole")
  shutil.copytree(os.path.join(stopped, "stage0_cold_start"),
                  os.path.join(whole, "stage0_cold_start"))
  summary = pipeline.run(config, stopped)
  assert len(calls) == 2   # only RL step 2 ran after the restart
  assert summary["stopped_at"] == "" and "stage0_cold_start/sft/loss_last" in summary
  assert summary["stages"] == "stage0_cold_start,stage1_rl"
  assert summary["checkpoint"] == os.path.join(rl_dir, "checkpoints", "2")
  rows = [json.loads(l) for l in open(os.path.join(rl_dir, "metrics.jsonl"))]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2]
  # Issue 46: π_ref is the policy the RL stage starts from (the real SFT
  # cold start's), so before its first update the KL is 0.
  assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7)
  pipeline.run(config, whole)
  assert len(calls) == 4   # no cold start again: copied with its results
  got = checkpoint.load_params(os.path.join(rl_dir, "checkpoints", "2"))
  want = checkpoint.load_params(os.path.join(whole, "stage1_rl", "checkpoints", "2"))
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("rank", [0, pytest.param(4, marks=pytest.mark.slow)])
def test_a_stopped_sft_stage_resumes_at_its_step(rank, tmp_path, monkeypatch):
  """A SIGTERM in the cold start's second SFT step: the stage saves step 2
  (the TrainState and the data position) and stops; the restart runs step 3
  only and ends with the parameters and metrics of a stage that never
  stopped, bit for bit. With LoRA (rank 4) the restart trains the saved
  adapters on the base a fresh start loads."""
  config = r1_tiny.get_config()
  config.model.lora.rank = rank
  cold = config.stages[0]
  config.stages = ({**cold, "overrides": {**cold["overrides"], "star.sft_steps": 3}},)
  config.train.eval_examples = 0
  calls = _sigterm_in_call(monkeypatch, star_loop, "tune_steps", 2)
  stopped = str(tmp_path / "stopped")
  with pytest.raises(interrupts.Preempted):
    pipeline.run(config, stopped)
  sft_dir = os.path.join(stopped, "stage0_cold_start")
  assert checkpoint.latest_step(checkpoint.checkpoint_dir(sft_dir)) == 2
  assert checkpoint.load_host_state(sft_dir)["sft_batches_drawn"] == 2
  resumed = pipeline.run(config, stopped)
  assert len(calls) == 3   # only step 3 ran after the restart
  whole = pipeline.run(config, str(tmp_path / "whole"))
  assert len(calls) == 6
  for key in ("sft/loss_first", "sft/loss_last", "sft/steps", "sft/skipped"):
    assert resumed[f"stage0_cold_start/{key}"] == whole[f"stage0_cold_start/{key}"], key
  losses = [checkpoint.load_host_state(d)["sft_metrics"]
            for d in (sft_dir, tmp_path / "whole" / "stage0_cold_start")]
  assert losses[0] == losses[1] and len(losses[0]) == 3
  got = checkpoint.load_params(os.path.join(sft_dir, "checkpoints", "3"))
  want = checkpoint.load_params(tmp_path / "whole" / "stage0_cold_start" / "checkpoints" / "3")
  jax.tree.map(np.testing.assert_array_equal, got, want)
