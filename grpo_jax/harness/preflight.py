"""Checks that need more than the config (validation.validate has the rest),
made before the work they protect, each naming the field and what to do.

  check_model       the tokenizer's vocabulary fits the model's; the
                    longest prompt of the data (data_prompts) plus
                    sampling.max_new_tokens fits the model's context
  check_eval_config an evaluation's config against the one a checkpoint
                    was trained with (tokenizer, prompt template, system
                    prompt)
  check_resume_step train.steps against the step a run resumes from
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import jax
import numpy as np

from grpo_jax import validation
from grpo_jax.data import templates
from grpo_jax.envs import base as envs
from grpo_jax.errors import ConfigError
from grpo_jax.generate import agent, agent_parked


def tokenizer_source(config) -> str:
  return config.model.tokenizer or config.model.source


def check_model(config, model_config, tokenizer,
                prompts: Mapping[str, Iterable[str]] | None = None,
                where: str = "config.model") -> None:
  """Raises ConfigError if the tokenizer can produce ids the model has no
  embedding for, or if a prompt of `prompts` (what gave them -> the rendered
  prompt texts, `data_prompts`) plus sampling.max_new_tokens does not fit
  the model's context. Needs the ModelConfig only: call it before the
  weights load."""
  if tokenizer.vocab_size > model_config.vocab_size:
    raise ConfigError(
        f"the tokenizer {tokenizer_source(config)!r} (config field "
        f"'model.tokenizer' / 'model.source') has {tokenizer.vocab_size} tokens "
        f"but the model of {where} has a vocabulary of {model_config.vocab_size}: "
        "its ids would index past the embedding. Use the model's own tokenizer "
        "(--config.model.tokenizer= empty, or the config the model was trained "
        "with).")
  check_model_sizes(config, model_config, where)
  if config.model.moe.routing_replay != "off" and model_config.moe is None:
    raise ConfigError(
        f"config field 'model.moe.routing_replay' = "
        f"{config.model.moe.routing_replay!r}: the model of {where} has no "
        "experts (a dense model routes nothing); set it to 'off'")
  check_backend(config)
  check_env(config, tokenizer)
  _check_context(config, model_config.max_seq_len, tokenizer, prompts or {},
                 where)


def check_backend(config, backend: str = "") -> None:
  """sampling.paged_kernel = 'pallas' is the TPU kernel: on another backend
  (`backend`, default this process's) it fails in its lowering. Tests run
  it interpreted on a CPU by calling the sampler directly. On a TPU, int8
  pages of fewer than 128 columns run but are warned of: a page's float32
  scales fill 128 lanes only at 128 (at 16 they are padded 8x, 8.7 GiB a
  chip at the paper config, docs/pod.md)."""
  s = config.sampling
  backend = backend or jax.default_backend()
  if s.kv_cache == "paged" and s.paged_kernel == "pallas" and backend != "tpu":
    raise ConfigError(
        f"config field 'sampling.paged_kernel' = 'pallas' is the TPU kernel; this "
        f"run's devices are {backend}: use 'auto' (the TPU kernel on a TPU) or "
        "'reference'")
  if backend == "tpu" and s.kv_dtype == "int8" and s.page_size % 128:
    logging.warning(
        "config field 'sampling.page_size' = %d with sampling.kv_dtype = 'int8' "
        "on a TPU: a page's scales fill the chip's 128 lanes only at a multiple "
        "of 128 (padded %dx here, in memory and in what each read moves); "
        "--config.sampling.page_size=128 is the size the pod figures use",
        s.page_size, -(-128 // s.page_size))


def check_model_sizes(config, model_config, where: str = "config.model") -> None:
  """The sizes whose upper bound is the model's: a LoRA rank above the
  hidden size adds nothing a full matrix would not (and costs its memory);
  more pages per row shard than every row of the largest sampler call and
  its prompt can take at the model's whole context are never used."""
  rank, dim = config.model.lora.rank, model_config.dim
  if rank > dim:
    raise ConfigError(
        f"config field 'model.lora.rank' = {rank} is above the hidden size {dim} "
        f"of the model of {where}: use at most {dim} (or 0: full fine-tuning)")
  s = config.sampling
  if s.kv_cache == "paged" and s.pages:
    rows = validation.sampler_rows(config)
    most = 2 * rows * -(-model_config.max_seq_len // s.page_size)
    if s.pages > most:
      raise ConfigError(
          f"config field 'sampling.pages' = {s.pages} is more than this run can "
          f"use: {rows} rows (and their prompts) at the model's whole context of "
          f"{model_config.max_seq_len} tokens take at most {most} pages of "
          f"{s.page_size}; use at most {most} (or 0: automatic)")


def check_env(config, tokenizer) -> None:
  """With an env: the chat template renders a tool turn and its markers
  leave room for an observation in env.max_observation_tokens (else the
  first observation of the run would fail, not its start)."""
  env = envs.EnvSpec.from_config(config)
  if env is not None:
    agent.ToolTurns.of(tokenizer, tokenizer.stop_ids).wrap(tokenizer, "",
                                             env.max_observation_tokens)


def check_engine(config) -> None:
  """env.engine = 'parked' and rollout.partial drive an engine per row
  shard from this host (generate/agent_parked.py, generate/partial.py):
  where the hosts cannot serve them the first rollout would stop the run;
  this stops it before the weights load."""
  env = envs.EnvSpec.from_config(config)
  if env is not None and env.engine == "parked":
    agent_parked.check_hosts()
  if config.method == "rl" and config.rollout.partial:
    agent_parked.check_hosts("'rollout.partial' = True",
                             "sample on one host (rollout.sampler_devices)")


def _check_context(config, context: int, tokenizer,
                   prompts: Mapping[str, Iterable[str]], where: str) -> None:
  """Prompt + completion positions within the model's context: the longest
  prompt of each set plus sampling.max_new_tokens (max position P + T - 1)."""
  T = config.sampling.max_new_tokens
  env = envs.EnvSpec.from_config(config)
  if env is not None:    # an episode's turns and observations after its prompt
    T = env.trajectory_tokens(T)
  if T >= context:
    raise ConfigError(
        f"config field 'sampling.max_new_tokens' = {T} leaves no room for a "
        f"prompt in the model's context of {context} tokens (ModelConfig."
        f"max_seq_len of {where}): lower it below {context}.")
  for source, texts in prompts.items():
    longest = longest_prompt(tokenizer, texts)
    if longest is None:
      continue
    i, P = longest
    if P + T > context:
      keep = f"only prompts of at most {context - T} tokens in the data"
      fix = (f"Lower sampling.max_new_tokens to {context - P} or less, or "
             f"keep {keep}" if P < context else f"Keep {keep}")
      raise ConfigError(
          f"prompt {i} of {source} has {P} tokens (through data.template = "
          f"{config.data.template!r}"
          f"{' and data.system_prompt' if config.data.system_prompt else ''}"
          f"); with sampling.max_new_tokens = {T} it needs {P + T} "
          f"positions, beyond the model's context of {context} tokens "
          f"(ModelConfig.max_seq_len of {where}). {fix}.")


# Prompts rendered and tokenised at a time: preflight's memory is one
# chunk's ids, whatever the data set's size.
CHUNK = 1024


def longest_prompt(tokenizer, texts: Iterable[str]) -> tuple[int, int] | None:
  """(index, tokens) of the first longest of `texts`, tokenised CHUNK at a
  time and kept as lengths only; None when there are none."""
  best, it = None, iter(texts)
  for start in itertools.count(0, CHUNK):
    chunk = list(itertools.islice(it, CHUNK))
    if not chunk:
      return best
    lengths = [len(ids) for ids in tokenizer.encode_batch(chunk)]
    i = int(np.argmax(lengths))
    if best is None or lengths[i] > best[1]:
      best = (start + i, lengths[i])


class RenderedPrompts:
  """The prompt texts of `examples`, rendered CHUNK at a time as they are
  iterated (never all held)."""

  def __init__(self, render: Callable[[Sequence[Any]], list[str]],
               examples: Sequence[Any]):
    self.render, self.examples = render, examples

  def __len__(self) -> int:
    return len(self.examples)

  def __iter__(self) -> Iterator[str]:
    for start in range(0, len(self.examples), CHUNK):
      yield from self.render(self.examples[start:start + CHUNK])


def data_prompts(config, tokenizer, train: Sequence[Any],
                 held_out: Sequence[Any]) -> dict[str, RenderedPrompts]:
  """The prompts an RL run or an evaluation samples from (for
  `check_model`): every training and held-out example through data.template,
  data.system_prompt and the chat template, by the config fields that gave
  them, rendered as they are checked."""
  d = config.data
  render = lambda examples: templates.render_prompts(
      tokenizer, d.template, [e.question for e in examples], d.system_prompt)
  return {f"the training data (data.source = {d.source!r}, data.kwargs)":
              RenderedPrompts(render, train),
          f"the held-out data (data.eval_source = "
          f"{d.eval_source or d.source!r}, data.eval_kwargs)":
              RenderedPrompts(render, held_out)}


# Fields of a run's config that an evaluation of its checkpoint must keep:
# the tokenizer (a different one feeds the model ids it was not trained on)
# and the prompt format.
_EVAL_MUST_MATCH = ("model.tokenizer_source",)
_EVAL_SHOULD_MATCH = ("data.template", "data.system_prompt")


def _effective(config: Mapping[str, Any]) -> dict[str, Any]:
  model = config.get("model", {})
  data = config.get("data", {})
  return {"model.tokenizer_source": model.get("tokenizer") or model.get("source"),
          "data.template": data.get("template"),
          "data.system_prompt": data.get("system_prompt")}


def _resolvable(source: str) -> bool:
  """A preset name (no path separator) or a path that exists: a tokenizer
  source an evaluation could still load."""
  return os.sep not in source or os.path.exists(source)


def check_eval_config(config, stored: Optional[Mapping[str, Any]],
                      checkpoint: str, allow_prompt_change: bool = False
                      ) -> None:
  """Compares an evaluation's config with the config stored in the
  checkpoint: a different tokenizer raises ConfigError listing both; so
  does a different prompt format (template, system prompt) unless
  `allow_prompt_change` (evaluating under another prompt on purpose)."""
  if not stored:
    return
  now, then = _effective(config.to_dict()), _effective(stored)
  wrong = [k for k in _EVAL_MUST_MATCH if now[k] != then[k]]
  if wrong and not _resolvable(then["model.tokenizer_source"]):
    logging.warning("the checkpoint %s was trained with the tokenizer %r, which "
                    "is no longer there; evaluating with %r", checkpoint,
                    then["model.tokenizer_source"], now["model.tokenizer_source"])
  elif wrong:
    raise ConfigError(
        f"the checkpoint {checkpoint} was trained with the tokenizer "
        f"{then['model.tokenizer_source']!r} (model.tokenizer / model.source of "
        f"its config {stored.get('name')!r}); this config "
        f"({config.name!r}) uses {now['model.tokenizer_source']!r}. Evaluate "
        f"with the run's config (--config=configs/{stored.get('name', '?')}.py...) "
        f"or --config.model.tokenizer={then['model.tokenizer_source']}.")
  changed = [k for k in _EVAL_SHOULD_MATCH if now[k] != then[k]]
  if not changed:
    return
  fields = "; ".join(f"{k} is {now[k]!r} here but {then[k]!r} in training"
                     for k in changed)
  if allow_prompt_change:
    logging.warning("%s (checkpoint %s): evaluating with other prompts than "
                    "training, as --allow_prompt_change asks", fields,
                    checkpoint)
    return
  flags = " ".join(f"--config.{k}={then[k]!r}" for k in changed)
  raise ConfigError(
      f"the checkpoint {checkpoint} (config {stored.get('name')!r}) was "
      f"trained with other prompts: {fields}. Evaluate with its prompts "
      f"({flags}), or pass --allow_prompt_change to evaluate under this "
      "config's prompts on purpose.")


def check_resume_step(resumed_step: int, config, where: str) -> None:
  """Raises ConfigError if train.steps is below the step a run resumes from
  (nothing would be trained, and the run would read as finished)."""
  if resumed_step > config.train.steps:
    raise ConfigError(
        f"config field 'train.steps' = {config.train.steps} is below the step "
        f"{resumed_step} that {where} resumes from: raise train.steps to continue "
        "training, or use a fresh --workdir (with --config.init_from=<that "
        "checkpoint> to start from its weights).")
