"""Stages as one experiment: the method "pipeline" (the R1 recipe).

`config.stages` is an ordered tuple of dicts

    {"kind": "sft" | "rl" | "distill" | "rejection_sft" | "distill_sft",
     "name": "cold_start",                       # optional; default: the kind
     "overrides": {"train.steps": 20, ...}}      # dotted fields of this config

Each stage's config is the pipeline's config with the kind's fixed fields,
then the stage's overrides, applied; every stage config is validated before
the first stage runs. Kinds and the method each runs:

| kind | method | what it does |
| --- | --- | --- |
| sft | sft | fine-tune on the data's worked solutions (a file) |
| rl | rl | the RL loop |
| distill | rl | on-policy distillation (rl.distill.mode = on_policy) |
| rejection_sft | star | sample with the current policy, keep verified answers, |
|               |      | fine-tune it (one STaR iteration, no rationalisation) |
| distill_sft | star | the same with a teacher sampling (star.teacher): off-policy distillation |

Stage i runs in `<workdir>/stage_<i>_<name>` and starts from stage i-1's
last checkpoint (init_from; π_ref is that start, rl.kl_reference =
"start"); stage 0 from config.init_from or the pretrained model. A stage is
finished when its checkpoint holds its last step; a restart skips finished
stages and the next one resumes exactly as its method resumes (rl, sft: at
the step where it stopped). The summary holds each stage's results as
`stage<i>_<name>/<metric>`, so the run store (`experiments/runs.py show`)
lists them.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

from ml_collections import ConfigDict

from grpo_jax import checkpoint, registry, validation
from grpo_jax.errors import ConfigError
from grpo_jax.harness import experiment, interrupts

# kind -> (method, fixed fields, the field holding its last step)
KINDS: dict[str, tuple[str, dict[str, Any], str]] = {
    "sft": ("sft", {}, "star.sft_steps"),
    "rl": ("rl", {"rl.kl_reference": "start"}, "train.steps"),
    "distill": ("rl", {"rl.distill.mode": "on_policy", "rl.dynamic_sampling": False,
                       "rl.kl_reference": "start"}, "train.steps"),
    "rejection_sft": ("star", {"star.iterations": 1, "star.rationalize": False},
                      "star.iterations"),
    "distill_sft": ("star", {"star.iterations": 1, "star.rationalize": False},
                    "star.iterations"),
}
DONE_FILE = "stage_done.json"


def _set(config: ConfigDict, path: str, value: Any, where: str) -> None:
  *head, last = path.split(".")
  group = config
  for part in head:
    if part not in group or not hasattr(group[part], "keys"):
      raise ConfigError(f"config field {where!r}: no config group {part!r} in {path!r}")
    group = group[part]
  if last not in group:
    raise ConfigError(f"config field {where!r}: unknown field {path!r}")
  group[last] = value


def stage_name(i: int, stage) -> str:
  """The stage's directory name under the pipeline's workdir."""
  return f"stage{i}_{stage.get('name') or stage.get('kind')}"


def stage_configs(config, workdir: str) -> list[ConfigDict]:
  """Each stage's config, validated; a stage after the first starts from
  the previous stage's directory (init_from)."""
  if not config.stages:
    raise ConfigError("config field 'stages' is empty: method 'pipeline' needs "
                      "at least one stage {'kind': ..., 'overrides': {...}}")
  out = []
  for i, stage in enumerate(config.stages):
    where = f"stages[{i}]"
    if not hasattr(stage, "get") or stage.get("kind") not in KINDS:
      raise ConfigError(f"config field {where!r} = {stage!r}: needs 'kind' in "
                        f"{sorted(KINDS)}")
    extra = set(stage) - {"kind", "name", "overrides"}
    if extra:
      raise ConfigError(f"config field {where!r}: unknown keys {sorted(extra)}; "
                        "allowed: kind, name, overrides")
    method, fixed, _ = KINDS[stage["kind"]]
    c = copy.deepcopy(config)
    c.method, c.stages = method, ()
    c.name = f"{config.name}/{stage_name(i, stage)}"
    for path, value in {**fixed, **dict(stage.get("overrides") or {})}.items():
      _set(c, path, value, f"{where}.overrides.{path}")
    if i:
      c.init_from = os.path.join(workdir, stage_name(i - 1, config.stages[i - 1]))
    try:
      validation.validate(c)
    except ConfigError as e:
      raise ConfigError(f"{where} ({stage['kind']}): {e}") from None
    out.append(c)
  return out


def last_step(config, kind: str) -> int:
  """The step of a stage's final checkpoint."""
  group, key = KINDS[kind][2].split(".")
  return int(config[group][key])


def finished(workdir: str, config, kind: str) -> bool:
  """Whether the stage in `workdir` holds its last step's checkpoint."""
  step = checkpoint.latest_step(checkpoint.checkpoint_dir(workdir))
  return step is not None and step >= last_step(config, kind)


def _scalars(summary: dict) -> dict:
  return {k: v for k, v in summary.items()
          if isinstance(v, (bool, int, float, str)) and k != "plot"}


@registry.register("method", "pipeline")
@experiment.guarded
def run(config, workdir: str) -> dict:
  """Runs the stages in order (module docstring); returns each stage's
  scalar results as `stage<i>_<name>/<key>`, `stages` (their names), the
  first stage's `eval_before` and the last's `eval_after` and `checkpoint`,
  and `stopped_at` (the stage a pre-emption stopped, "" when all finished)."""
  configs = stage_configs(config, workdir)   # all validated before any work
  experiment.record_config(config, workdir)
  names = [stage_name(i, s) for i, s in enumerate(config.stages)]
  summary: dict[str, Any] = {"stages": ",".join(names), "stopped_at": ""}
  for name, stage, c in zip(names, config.stages, configs):
    result, complete = run_stage(os.path.join(workdir, name), stage["kind"], c)
    summary.update({f"{name}/{k}": v for k, v in result.items()})
    if not complete or interrupts.stop_requested():
      summary["stopped_at"] = name if not complete else ""
      return summary
  for key, name in (("eval_before", names[0]), ("eval_after", names[-1])):
    if f"{name}/{key}" in summary:
      summary[key] = summary[f"{name}/{key}"]
  summary["checkpoint"] = checkpoint.latest_checkpoint(os.path.join(workdir, names[-1]))
  return summary


def run_stage(stage_dir: str, kind: str, config) -> tuple[dict, bool]:
  """(the stage's scalar results, whether it finished): a finished stage's
  saved results, else what its method returns when run (or resumed)."""
  done_path = os.path.join(stage_dir, DONE_FILE)
  if finished(stage_dir, config, kind) and os.path.exists(done_path):
    logging.info("pipeline: %s finished before; skipped", stage_dir)
    with open(done_path, encoding="utf-8") as f:
      return json.load(f), True
  logging.info("pipeline: %s (%s)", stage_dir, kind)
  result = _scalars(registry.lookup("method", config.method)(config, stage_dir))
  if not finished(stage_dir, config, kind):   # stopped: a signal, a pre-emption
    return result, False
  with open(done_path, "w", encoding="utf-8") as f:
    json.dump(result, f)
  return result, True
