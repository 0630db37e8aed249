"""What every experiment sets up the same way, whichever loop runs it.

The RL loop (`train.py`), the STaR loop (`star_loop.py`) and the evaluation
entry point (`experiments/evaluate.py`) all start here:

- `load_model_and_tokenizer` / `load_model` / `load_tokenizer`: what
  `config.model` names; `model_config_of` / `policy_model_config`: its
  ModelConfig without the weights, for the checks made before they load;
- `load_examples`: the train and held-out problems of `config.data`;
- `sampling_config`: the sampler settings of `config.sampling`;
- `load_policy`: a checkpoint's (or the pretrained) policy to evaluate;
- `make_checkpointer` and `restore_or_init`: the resume order, written down
  once (`checkpoint.resolve_init`): this run's latest checkpoint, else
  `config.init_from`'s parameters, else the pretrained weights;
- `metric_writer`: metrics.jsonl and TensorBoard continued after a resume
  as if the run had never stopped;
- `guarded`: a loop's `run` holding the workdir lock (workdir_lock.py), with
  SIGTERM / Ctrl-C saving at the next step boundary (interrupts.py), and the
  resolved config written to `<workdir>/config.yaml` (`write_config`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import jax
import numpy as np
import yaml
from ml_collections import ConfigDict

from grpo_jax import checkpoint, errors, models, registry, validation
from grpo_jax.generate import sampling
from grpo_jax.harness import distributed, interrupts, outdir, preflight, workdir_lock
from grpo_jax.harness import metrics as metrics_lib
from grpo_jax.models import cast, lora
from grpo_jax.models import tokenizer as tok_lib
from grpo_jax.models.byte_tokenizer import byte_tokenizer
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.loading import open_checkpoint
from grpo_jax.rewards import code

Params = Any


def load_tokenizer(config):
  """The tokenizer of `config.model` without loading its weights (the
  random presets, "tiny" and "tiny-gemma": the byte tokenizer)."""
  source = config.model.tokenizer or config.model.source
  return (byte_tokenizer() if source in models.RANDOM_PRESETS
          else tok_lib.load_tokenizer(source))


def model_config_of(config) -> ModelConfig:
  """The ModelConfig of `config.model` without loading its weights (the
  preset, a Hugging Face directory's config.json, a GGUF file's header):
  what the checks before the model loads need (preflight.check_model)."""
  if config.model.source in models.RANDOM_PRESETS:
    return models.get_preset(config.model.source)
  ckpt = open_checkpoint(config.model.source)
  try:
    return ckpt.config
  finally:
    ckpt.close()


def load_model(config) -> tuple[ModelConfig, Params]:
  """The model that `config.model` names (the random presets, `tiny` and
  `tiny-gemma`, initialised from config.seed), in model.param_dtype; with LoRA
  (model.lora.rank > 0) the frozen base, in model.compute_dtype."""
  source = config.model.source
  frozen = lora.LoraSpec.from_config(config).enabled
  dtype = config.model.compute_dtype if frozen else config.model.param_dtype
  if source in models.RANDOM_PRESETS:
    model_config = models.get_preset(source)
    params = models.init_params(model_config, jax.random.key(config.seed))
  else:
    model_config, params = models.load_pretrained(source, dtype=dtype)
  return model_config, cast(params, dtype)


# ----------------------------------------------------------------------------
# LoRA: the adapters beside a frozen base (models/lora.py).
# ----------------------------------------------------------------------------

def base_identity(config, base: Params) -> dict:
  """What identifies the frozen base a LoRA checkpoint's adapters belong
  to: model.source, the base's dtype and one checksum of all its arrays
  (checkpoint.tree_checksums, the same on any mesh). Stored in the host
  state as "lora_base"; a resume or an export onto another base fails."""
  sums = json.dumps(checkpoint.tree_checksums(base), sort_keys=True)
  dtype = jax.tree.leaves(base)[0].dtype
  return {"source": config.model.source, "dtype": np.dtype(dtype).name,
          "checksum": hashlib.sha256(sums.encode()).hexdigest()[:16]}


def init_adapters(config, model_config: ModelConfig, layout) -> Params:
  """Fresh adapters (B = 0) in model.param_dtype, placed on `layout` (their
  logical axes are their base weights', `transformer.lora_axes`)."""
  spec = lora.LoraSpec.from_config(config)
  key = jax.random.fold_in(jax.random.key(config.seed), 0x10A)
  adapters = lora.init_adapters(model_config, spec, key,
                                config.model.param_dtype)
  return adapters if layout is None else layout.shard_params(model_config,
                                                             adapters)


def check_base(host: Mapping, identity: dict, where: str) -> None:
  """A resumed LoRA run's base must be the one its adapters were trained on."""
  saved = host.get("lora_base")   # a moved base (another source, same arrays) resumes
  if saved is not None and {**saved, "source": ""} != {**identity, "source": ""}:
    raise errors.UnsafeResumeError(
        f"cannot resume from {where}: its LoRA adapters were trained on the "
        f"base {saved}, but this run's base is {identity}. Use the same "
        f"model.source (and model.compute_dtype), or a fresh --workdir.")


def lora_run_config(source, step) -> ConfigDict | None:
  """The run config of a checkpoint if it trained LoRA adapters, else None."""
  saved = checkpoint.load_config(source, step)
  if not saved or not saved.get("model", {}).get("lora", {}).get("rank"):
    return None
  return ConfigDict(saved)


def load_lora_base(config, source, step, base_source: str = ""):
  """The frozen base the checkpoint's adapters belong to (from model.source,
  or `base_source` where the base has moved), checked against its
  "lora_base" identity."""
  saved = checkpoint.load_host_state(source, step).get("lora_base")
  if saved is None:
    raise errors.CheckpointError(
        f"checkpoint {source} step {step} trained LoRA adapters but does not "
        "record its base (host state 'lora_base')")
  config.model.source = base_source or config.model.source
  if os.sep in config.model.source and not os.path.exists(config.model.source):
    raise errors.CheckpointError(f"the base {config.model.source!r} of the adapters of {source} "
                                 "is gone: give where it is now (export.py --base=DIR)")
  config.model.compute_dtype = saved["dtype"]
  _, base = load_model(config)   # LoRA: in the compute dtype
  identity = base_identity(config, base)
  if identity["checksum"] != saved["checksum"]:
    raise errors.CheckpointError(
        f"the base {config.model.source!r} is not the one the adapters of "
        f"{source} step {step} were trained on: checksum "
        f"{identity['checksum']} != {saved['checksum']} (saved {saved})")
  return base


def policy_params(spec: lora.LoraSpec, params: Params, base: Params | None,
                  dtype: str) -> Params:
  """The policy the sampler and evaluation run, in `dtype`: `params`, or
  with LoRA (a `base`) the adapters `params` merged into a copy of the
  base or attached unmerged (`spec.sampler`)."""
  if base is None:
    return cast(params, dtype)
  return lora.policy_params(base, params, spec, dtype)


def load_model_and_tokenizer(config) -> tuple[ModelConfig, Params, Any]:
  """The model and tokenizer that `config.model` names (the `tiny` preset
  uses the byte tokenizer)."""
  return (*load_model(config), load_tokenizer(config))


def sampling_config(config, tokenizer) -> sampling.SamplingConfig:
  """The sampler settings of training: `config.sampling` and the tokenizer's
  stop and pad ids."""
  group = config.sampling
  return sampling.SamplingConfig(
      max_new_tokens=group.max_new_tokens, temperature=group.temperature,
      top_p=group.top_p, top_k=group.top_k, stop_ids=tuple(tokenizer.stop_ids),
      pad_id=tokenizer.pad_id or 0, chunk_rows=group.chunk_rows,
      continuous_batching=group.continuous_batching, slots=group.slots,
      kv_cache=group.kv_cache, page_size=group.page_size, pages=group.pages,
      stop_check_every=group.stop_check_every, paged_kernel=group.paged_kernel,
      kv_dtype=group.kv_dtype)


def load_examples(config) -> tuple[list, list]:
  """Train and held-out examples from the `dataset` registry."""
  train = list(registry.lookup("dataset", config.data.source)(
      **dict(config.data.kwargs)))
  eval_source = config.data.eval_source or config.data.source
  held_out = list(registry.lookup("dataset", eval_source)(
      **dict(config.data.eval_kwargs)))
  if not train:
    raise errors.ConfigError(
        f"data.source={config.data.source!r} with data.kwargs="
        f"{dict(config.data.kwargs)} gave no examples")
  if not held_out and config.train.eval_examples:
    raise errors.ConfigError(
        f"data.eval_source={eval_source!r} with data.eval_kwargs="
        f"{dict(config.data.eval_kwargs)} gave no examples, so nothing would be "
        "evaluated: fix the eval data, or set --config.train.eval_examples=0 to "
        "train without held-out evaluation")
  _check_answers(train, f"data.source = {config.data.source!r}")
  _check_answers(held_out, f"data.eval_source = {eval_source!r}")
  if "code" in config.rewards:
    _check_code_tests(train, f"data.source = {config.data.source!r}")
    _check_code_tests(held_out, f"data.eval_source = {eval_source!r}")
  return train, held_out


def _check_code_tests(examples: list, source: str) -> None:
  """The code reward's tests are decided by the trusted checker, never where
  the model's program runs (docs/sandbox.md): a test whose expected side it
  cannot evaluate is refused when the data loads, naming the example."""
  for index, example in enumerate(examples):
    try:
      code.check_tests([example.answer])
    except code.UnevaluableTest as e:
      raise errors.DataError(f"example {index} of {source}: {e}") from None


def _check_answers(examples: list, source: str) -> None:
  """No example with an empty gold answer trains or is evaluated: nothing
  could be scored against it (the file readers refuse such records naming
  the line; this catches any other data set)."""
  for index, example in enumerate(examples):
    if not str(example.answer).strip():
      raise errors.DataError(f"example {index} of {source} has an empty gold answer; "
                             "fix the data set (the jsonl, parquet and tfds readers "
                             "take on_empty_answer='drop' to skip such records)")


def policy_model_config(config, source: str = "", step: int | None = None
                        ) -> ModelConfig:
  """The ModelConfig `load_policy` returns, without loading weights."""
  if not source:
    return model_config_of(config)
  return checkpoint.load_model_config(source, step)


def load_policy(config, source: str = "", step: int | None = None
                ) -> tuple[ModelConfig, Params, Any, int | None]:
  """(model_config, params, tokenizer, step) to evaluate.

  Without `source`: the model `config.model` names (step None). With it (a
  run's workdir, its checkpoints directory or one step directory): the
  policy params of that checkpoint's `step` (None: the step directory's, else
  the latest there), its saved ModelConfig, and the tokenizer of the config
  the run started from.
  """
  if not source:
    return (*load_model_and_tokenizer(config), None)
  directory, step = checkpoint.find_step(source, step)
  model_config = checkpoint.load_model_config(source, step)
  params = checkpoint.load_params(source, step=step)
  run_config = lora_run_config(directory, step)
  if run_config is not None and lora.is_adapters(params):
    # adapters: merged onto the base they belong to
    params = lora.merge(load_lora_base(run_config, directory, step), params,
                        lora.LoraSpec.from_config(run_config).scale)
  return model_config, params, load_tokenizer(config), step


# ----------------------------------------------------------------------------
# Checkpoints and the resume order.
# ----------------------------------------------------------------------------

def make_checkpointer(config, workdir: str, model_config: ModelConfig
                      ) -> checkpoint.Checkpointer:
  """The run's Checkpointer under `<workdir>/checkpoints`, saving every
  `train.checkpoint_every` steps and keeping `train.keep_checkpoints`."""
  return checkpoint.Checkpointer(
      checkpoint.checkpoint_dir(workdir),
      save_every=config.train.checkpoint_every,
      keep=config.train.keep_checkpoints, config=config,
      model_config=model_config,
      handle_sigterm=False)   # the loops' interrupts.guarded handles signals


class Start(NamedTuple):
  """Where a run starts: `state` restored or initialised, the host state
  saved with it ({} unless resumed) and the step it was saved at (None
  unless resumed)."""
  state: Any
  host: dict
  step: int | None


def _params(state) -> Params:
  return state["params"] if isinstance(state, Mapping) else state.params


def _with_params(state, params: Params):
  if isinstance(state, Mapping):
    return {**state, "params": params}
  return state._replace(params=params)


def restore_or_init(ckpt: checkpoint.Checkpointer, workdir: str, config,
                    state, check_steps: bool = False) -> Start:
  """The resume order (`checkpoint.resolve_init`) applied to `state`, a
  pytree with a "params" entry (a TrainState, or {"params": ...}) that
  gives the shapes and shardings: this run's latest checkpoint (the whole
  state and its host state), else config.init_from's parameters (host
  state {"init_from": its step directory}), else `state` as it is (the
  pretrained weights). `check_steps`: a resume past train.steps is refused
  (preflight.check_resume_step). The loop calls `record_config` once every
  resume check has passed."""
  how, where = checkpoint.resolve_init(workdir, config.init_from or None,
                                       config.model.source)
  if how == "resume" and check_steps:
    preflight.check_resume_step(where, config, workdir)
  if how == "resume":
    state, host = ckpt.restore(state, step=where)
    logging.info("resumed from checkpoint step %d of %s", where, workdir)
    return Start(state, host, where)
  if how == "init_from":
    logging.info("parameters from %s", where)
    params = checkpoint.load_params(where, _params(state))
    return Start(_with_params(state, params), {"init_from": where}, None)
  return Start(state, {}, None)


def record_config(config, workdir: str) -> None:
  """`<workdir>/config.yaml` on process 0, once every resume check passed
  (a refused resume leaves the config that ran there)."""
  if metrics_lib.is_primary():
    logging.info("config: %s", write_config(config, workdir))


def metric_writer(workdir: str, last_step: int | None, final: bool = False
                  ) -> metrics_lib.MetricWriter:
  """The run's MetricWriter (only process 0 writes). On resume from
  `last_step`, metrics.jsonl and TensorBoard first lose the rows written
  after it (they are recomputed), so the logs read like one uninterrupted
  run; `final`: `last_step` is the run's last, whose closing evaluation
  (written after that checkpoint) is recomputed too. A fresh start
  (`last_step` None) starts empty logs."""
  primary = metrics_lib.is_primary()
  if primary:
    if last_step is None:
      metrics_lib.truncate(workdir, -1)
    else:
      metrics_lib.truncate(workdir, last_step, drop_eval_at_last=final)
  return metrics_lib.MetricWriter(workdir, enabled=primary)


# ----------------------------------------------------------------------------
# One writer per workdir; signals.
# ----------------------------------------------------------------------------

_STARTED: Any = None   # the config of the run being started


@contextlib.contextmanager
def started(config, workdir: str) -> Iterator[None]:
  """A run's start-up, done once: validates the config, checks the workdir
  can be written and joins the processes of a multi-host run. Inside it,
  starting the same config again (experiments/run.py starts a run to record
  it, then calls the method, whose `guarded` starts it too) does nothing."""
  global _STARTED
  if _STARTED is config:
    yield
    return
  validation.validate(config)   # a bad field fails before the processes join
  outdir.check_writable(workdir)   # a workdir that is a file fails before any work
  distributed.initialize_distributed(config)   # before jax.process_index()
  outer, _STARTED = _STARTED, config
  try:
    yield
  finally:
    _STARTED = outer


def guarded(run: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a loop's `run(config, workdir)`: `started`, then the workdir
  locked on process 0 and SIGTERM / Ctrl-C handled as interrupts.py says
  (on one process; several hosts agree on the step through the
  checkpointer's pre-emption notice; experiments/run.py installs the
  handlers earlier, and this shares them)."""
  @functools.wraps(run)
  def wrapper(config, workdir: str, *args, **kwargs):
    with started(config, workdir), \
        workdir_lock.hold(workdir, enabled=metrics_lib.is_primary()), \
        interrupts.handle_signals(install=jax.process_count() == 1):
      return run(config, workdir, *args, **kwargs)   # record_config: under the lock
  return wrapper


def _plain(value: Any) -> Any:
  """`value` as plain YAML data: tuples as lists, anything unusual as text."""
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return [_plain(v) for v in value]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  return str(value)


CONFIG_HEADER = ("# Output: the resolved config this run started with (written by the run;\n"
                 "# editing it changes nothing: pass --config.<field>=... to the command).\n")


def write_config(config, workdir: str) -> str:
  """Writes the resolved config (overrides applied) to `<workdir>/config.yaml`
  and returns its path. Plain YAML (`yaml.safe_load` reads it; tuples are
  lists), written to a temporary file and renamed, so a killed run leaves
  the old file or the new one, never half of one."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.yaml")
  text = CONFIG_HEADER + yaml.safe_dump(_plain(config.to_dict()), sort_keys=False,
                                       default_flow_style=None, width=100)
  tmp = f"{path}.tmp.{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return path
