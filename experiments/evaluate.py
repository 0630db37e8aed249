r"""Evaluates a policy on the held-out set: greedy accuracy, avg@n, pass@k, maj@k.

  python experiments/evaluate.py --config=configs/dapo_aime.py:local
  python experiments/evaluate.py --config=configs/dapo_aime.py:local \
      --checkpoint=workdirs/dapo_local --step=20 \
      --config.eval.n=32 --config.eval.ks='(1,8,32)' --config.eval.top_p=0.7

Without --checkpoint the model of `config.model` is evaluated (pretrained;
an exported Hugging Face directory works too: --config.model.source=DIR).
`--checkpoint` is a run's workdir, its checkpoints directory or one step
directory (default step: the latest). The problems are the first
`train.eval_examples` of `data.eval_source`; sampling settings come from
`config.eval`. A checkpoint is evaluated with the tokenizer and prompt
format (data.template, data.system_prompt) it was trained with: another is
refused (--allow_prompt_change allows another prompt format). Prints a
table and writes every completion with its answer and verdict to
<workdir>/eval/<step_N|pretrained>.json.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags

from grpo_jax.harness import cli, interrupts

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "Run workdir, checkpoints "
                                  "dir or step dir; empty: config.model.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_ALLOW_PROMPT_CHANGE = flags.DEFINE_bool(
    "allow_prompt_change", False, "Evaluate a checkpoint under another "
    "data.template / data.system_prompt than it was trained with (refused "
    "otherwise).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where eval/*.json goes "
                               "(default: the checkpoint's run workdir, else "
                               "workdirs/<config name>).")


def default_workdir(config, checkpoint: str) -> str:
  """The run workdir that holds `checkpoint`, else workdirs/<config name>."""
  if not checkpoint:
    return os.path.join("workdirs", config.name)
  from grpo_jax import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  directory = ckpt_lib.locate(checkpoint)[0]
  is_run = directory.name == ckpt_lib.CHECKPOINT_SUBDIR
  return os.fspath(directory.parent if is_run else directory)


def write_results(path: str, record: dict) -> None:
  """`record` as JSON at `path`, written beside it and renamed: a killed or
  failed evaluation leaves the old results whole, never half a file."""
  tmp = f"{path}.tmp.{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(record, f, indent=1)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required")
  # SIGTERM / Ctrl-C stop at once (nothing half-written: the results file
  # is replaced whole), in one line, with status 143 / 130.
  with cli.user_errors(exit_hard=True), interrupts.handle_signals():
    _evaluate(_CONFIG.value)


def _evaluate(config):
  # pylint: disable=import-outside-toplevel
  from grpo_jax import checkpoint as ckpt_lib
  from grpo_jax import evaluation, validation
  from grpo_jax.harness import experiment, outdir, preflight
  from grpo_jax.rl.spec import RunSpec
  config = validation.validate(config)
  if _CHECKPOINT.value:   # the run's own config must fit this one
    preflight.check_eval_config(
        config, ckpt_lib.load_config(_CHECKPOINT.value, _STEP.value),
        _CHECKPOINT.value, allow_prompt_change=_ALLOW_PROMPT_CHANGE.value)
  workdir = _WORKDIR.value or default_workdir(config, _CHECKPOINT.value)
  # Before any work: evaluating everything and then failing to write loses it.
  outdir.check_writable(os.path.join(workdir, "eval"), "the eval directory (--workdir)")
  examples = experiment.load_examples(config)[1][:config.train.eval_examples]
  if not examples:
    from grpo_jax.errors import ConfigError
    raise ConfigError(
        f"nothing to evaluate: config field 'train.eval_examples' = "
        f"{config.train.eval_examples} (of data.eval_source's examples); set it "
        "to how many held-out problems to evaluate, e.g. --config.train.eval_examples=200")
  tokenizer = experiment.load_tokenizer(config)
  preflight.check_model(   # before the weights load
      config, experiment.policy_model_config(config, _CHECKPOINT.value,
                                             _STEP.value),
      tokenizer, preflight.data_prompts(config, tokenizer, [], examples),
      where=_CHECKPOINT.value or "config.model")
  model_config, params, tokenizer, step = experiment.load_policy(
      config, _CHECKPOINT.value, _STEP.value)
  settings = RunSpec.from_config(config, tokenizer).eval
  result = evaluation.evaluate_policy(settings, model_config, params,
                                      tokenizer, examples)
  path = os.path.join(workdir, "eval",
                      "pretrained.json" if step is None else f"step_{step}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  record = {"config": config.name, "checkpoint": _CHECKPOINT.value,
            "step": step, "eval": config.eval.to_dict(),
            **result.to_json()}
  write_results(path, record)
  width = max(map(len, result.metrics))
  for name, value in result.metrics.items():
    print(f"{name:{width}s}  {value:.4f}")
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
