"""Distilling the DAPO quickstart's SmolLM2 into a fresh SmolLM2-135M-Instruct, and the R1 recipe.

The teacher is the quickstart's run (`python experiments/run.py --config=configs/dapo_aime.py:local
--workdir=workdirs/dapo_local`, 0.37 -> 0.95); every student variant starts from the fresh model
and makes 4 optimizer updates (the quickstart's 4 steps of 64 rows, or 4 SFT steps of 64 rows):
  :rl          RL alone (the quickstart itself, another workdir)
  :on_policy   the student samples, the teacher grades each token (rl.distill)
  :off_policy  the teacher samples 256 problems, verified answers kept, the student fine-tuned
  :r1          the R1 recipe as one pipeline: cold start on 16 worked examples (16 steps:
               4 taught the equation but not the <think> tags), the quickstart's RL plus the
               <think> format and language rewards (0.1 each), rejection-sampling SFT
               (docs/recipes.md)
  :r1_cold_start  its cold start alone
"""
import os

from configs import dapo_aime
from grpo_jax.config import base_config, pick_variant

TEACHER = "workdirs/dapo_local"
COLD_START = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                          "r1_cold_start_tiny.jsonl")


def rl(c):
  c = dapo_aime.local(c)
  c.name = "distill_local_rl"
  return c


def on_policy(c):
  c = dapo_aime.local(c)
  c.name = "distill_local_on_policy"
  c.rl.distill.mode, c.rl.distill.teacher = "on_policy", TEACHER
  c.rl.dynamic_sampling = False   # every group teaches
  return c


def off_policy(c):
  c = dapo_aime.local(c)
  c.name = "distill_local_off_policy"
  c.method = "star"
  c.star.teacher, c.star.iterations, c.star.rationalize = TEACHER, 1, False
  c.star.problems_per_iteration, c.star.sample_batch = 256, 64
  c.star.sft_steps, c.star.sft_growth, c.star.batch_size = 4, 1.0, 64
  c.star.micro_batch_size = 16
  return c


def r1(c):
  c = dapo_aime.local(c)
  c.name = "r1_local"
  c.method = "pipeline"
  c.train.eval_at_start = False
  c.star.batch_size, c.star.micro_batch_size = 16, 16
  c.stages = (
      {"kind": "sft", "name": "cold_start", "overrides": {
          "data.source": "jsonl", "data.kwargs": {"path": COLD_START, "layout": "math"},
          "data.eval_source": "arithmetic", "star.sft_steps": 16}},
      {"kind": "rl", "name": "reasoning_rl", "overrides": {
          "rewards": {**c.rewards, "format_think": 0.1, "language_consistency": 0.1},
          "reward_kwargs": {**c.reward_kwargs, "format_think": {"answer": "boxed"}}}},
      {"kind": "rejection_sft", "name": "rejection_sft", "overrides": {
          "star.problems_per_iteration": 256, "star.sample_batch": 64,
          "star.sft_steps": 4}},
  )
  return c


def r1_cold_start(c):
  """The R1 recipe's cold start alone."""
  c = r1(c)
  c.name = "r1_local_cold_start"
  c.stages = c.stages[:1]
  return c


VARIANTS = {"rl": rl, "on_policy": on_policy, "off_policy": off_policy, "r1": r1,
            "r1_cold_start": r1_cold_start}


def get_config(arg=None):
  c = dapo_aime.dapo_common(base_config())
  c.description = __doc__.splitlines()[0]
  return pick_variant(VARIANTS, arg, "on_policy", "configs/distill_local.py")(c)
