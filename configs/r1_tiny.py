"""The R1 recipe as one pipeline on the tiny model: cold start, RL, rejection SFT.

Stages (grpo_jax/harness/pipeline.py), each starting from the previous one's policy:
  cold_start     SFT on a file of worked examples (configs/data/r1_cold_start_tiny.jsonl)
  reasoning_rl   GRPO with the accuracy, <think> format and language-consistency rewards
  rejection_sft  sample with the RL policy, keep the verified answers, fine-tune on them
For SmolLM2 set model.source and the stages' steps (docs/recipes.md).
"""
import os

from configs import tiny
from grpo_jax.config import no_variants

VARIANTS = ("",)
COLD_START = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                          "r1_cold_start_tiny.jsonl")


def get_config(arg=None):
  no_variants(arg, "configs/r1_tiny.py")
  c = tiny.get_config()
  c.name = "r1_tiny"
  c.description = __doc__.splitlines()[0]
  c.method = "pipeline"
  c.train.eval_at_start = False   # each stage evaluates at its end
  c.star.batch_size = 4
  c.stages = (
      {"kind": "sft", "name": "cold_start", "overrides": {
          "data.source": "jsonl", "data.kwargs": {"path": COLD_START, "layout": "math"},
          "data.eval_source": "arithmetic", "star.sft_steps": 4}},
      {"kind": "rl", "name": "reasoning_rl", "overrides": {
          "train.steps": 2, "rl.kl_beta": 0.01,
          "rewards": {"last_number": 1.0, "format_think": 0.1,
                      "language_consistency": 0.1}}},
      {"kind": "rejection_sft", "name": "rejection_sft", "overrides": {
          "star.problems_per_iteration": 8, "star.sample_batch": 8,
          "star.sft_steps": 2}},
  )
  return c
