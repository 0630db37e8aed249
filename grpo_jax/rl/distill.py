"""The teacher of on-policy distillation (rl.distill; the signal:
algorithms/distillation.py).

`rl.distill.mode = "on_policy"` makes the RL loop a distillation loop: the
student samples as usual, the scoring pass (step.score_step) also runs the
teacher on the sampled tokens, and each token's advantage is the negative
reverse-KL estimate log π_T - log π_S; no second sampler runs.

`rl.distill.teacher` is any model the codebase loads: a preset name, a
Hugging Face directory or `.gguf` file, or a grpo_jax run (its workdir,
checkpoints directory or one step directory; LoRA adapters are merged onto
the base they were trained on). Teacher and student must share one
tokenizer (the same vocabulary, token for token): log-probs of one token id
are compared, so a mismatch is refused before anything trains.
"""
from __future__ import annotations

import copy
import os
from typing import Any, NamedTuple

from ml_collections import ConfigDict

from grpo_jax import checkpoint
from grpo_jax.errors import CheckpointError, ConfigError
from grpo_jax.harness import experiment
from grpo_jax.models import cast
from grpo_jax.models.config import ModelConfig

MODES = ("off", "on_policy")


class Teacher(NamedTuple):
  """The teacher a distillation run scores with (never trained)."""
  model_config: ModelConfig
  params: Any
  source: str


def is_run(source: str) -> bool:
  """Whether `source` is a grpo_jax run (a complete checkpoint there)."""
  if not os.path.isdir(source):
    return False
  try:
    checkpoint.find_step(source)
  except CheckpointError:
    return False
  return True


def teacher_config(config, source: str, field: str = "rl.distill.teacher") -> ConfigDict:
  """The config whose model is the teacher: a run's own saved config, or
  this run's with model.source = `source` (no tokenizer override, no LoRA)."""
  if is_run(source):
    saved = checkpoint.load_config(source)
    if not saved:
      raise ConfigError(f"config field {field!r} = {source!r}: the run "
                        "saved no config, so its tokenizer is unknown")
    return ConfigDict(saved)
  out = copy.deepcopy(config)
  out.model.source, out.model.tokenizer, out.model.lora.rank = source, "", 0
  return out


def check_tokenizers(student, teacher, source: str,
                     field: str = "rl.distill.teacher") -> None:
  """Refuses a teacher whose vocabulary differs from the student's."""
  vocab_s = student.backend.get_vocab(with_added_tokens=True)
  vocab_t = teacher.backend.get_vocab(with_added_tokens=True)
  if vocab_s == vocab_t:
    return
  differ = sorted(set(vocab_s.items()) ^ set(vocab_t.items()))[:3]
  raise ConfigError(
      f"config field {field!r} = {source!r}: its tokenizer differs from "
      f"the student's ({len(vocab_t)} vs {len(vocab_s)} tokens; e.g. {differ}); "
      "distillation compares log-probs of the same token ids, so both need one tokenizer")


def load_teacher(config, student_tokenizer, layout=None) -> Teacher | None:
  """The teacher of config.rl.distill (None when off), its tokenizer checked
  against the student's before its weights load, its params in the
  student's compute dtype, placed on `layout`."""
  if config.rl.distill.mode == "off":
    return None
  return load_model_as_teacher(config, config.rl.distill.teacher,
                               student_tokenizer, layout)


def load_model_as_teacher(config, source: str, student_tokenizer, layout=None,
                          field: str = "rl.distill.teacher") -> Teacher:
  """The model `source` names (config field `field`) as a Teacher: its
  tokenizer checked against the student's first, then its weights."""
  tconf = teacher_config(config, source, field)
  check_tokenizers(student_tokenizer, experiment.load_tokenizer(tconf), source, field)
  if is_run(source):
    model_config, params, _, _ = experiment.load_policy(tconf, source)
  else:
    model_config, params = experiment.load_model(tconf)
  params = cast(params, config.model.compute_dtype)
  if layout is not None:
    params = layout.shard_params(model_config, params)
  return Teacher(model_config, params, source)
