"""The config's fields across its groups: every field's name and kind,
the allowed values, registry names, ranges and the fields that must agree;
`validate` also runs each group's own checks (`groups`).
"""
from __future__ import annotations

import difflib
import inspect
import math
import numbers
from typing import Any, Mapping

import ml_collections

from grpo_jax import registry
from grpo_jax.algorithms import dynamic_sampling
from grpo_jax.config import base_config
from grpo_jax.errors import ConfigError
from grpo_jax.models import attention, int8_pages, paged, quant, transformer
from grpo_jax.validation import groups

ConfigDict = ml_collections.ConfigDict


# The allowed values of the fields whose values are fixed strings (the
# registry lists the open sets: losses, rewards, data sets, ...).
DTYPES = ("float32", "bfloat16")

_CHOICES = {
    "model.param_dtype": DTYPES,
    "model.compute_dtype": DTYPES,
    "model.remat": tuple(transformer.REMAT_POLICIES),
    "model.moe.routing_replay": ("off", "rollout"),
    "model.moe.dispatch": ("auto", "ragged", "all_to_all"),
    "sampling.compute_dtype": ("",) + DTYPES,   # "": the model's
    "sampling.weights_dtype": quant.WEIGHTS_DTYPES,  # "": compute_dtype
    "sampling.kv_cache": ("dense", "paged"),    # decoding.KV_CACHES
    "sampling.paged_kernel": paged.KERNELS,     # the paged decode attention
    "sampling.kv_dtype": int8_pages.KV_DTYPES,       # "": compute_dtype | int8 pages
    "rl.old_logp": ("sampler", "recompute"),    # where π_old comes from
    "rl.on_cap": dynamic_sampling.ON_CAP,
    "rl.packing": ("auto", "on", "off"),
    "rl.kl_reference": ("start", "model"),      # π_ref: the run's start | model.source
    "rl.distill.mode": ("off", "on_policy"),    # rl/distill.py MODES
    "optim.schedule": ("constant", "cosine"),
    "model.attention": attention.ATTENTION,
    "train.on_non_finite": ("stop", "skip"),
}
# rl.num_generations may be 1: no group baseline (a batch baseline or none).
_NO_GROUP_ADVANTAGES = ("dr_grpo", "reinforce_pp")
# Advantages that divide by the std of a group's G rewards (G > ddof).
_STD_ADVANTAGES = ("grpo",)
# Advantages that divide by a std + rl.adv_eps (a group's, a batch's tokens',
# a group's steps'): a std of 0 (equal rewards) needs eps > 0.
_EPS_ADVANTAGES = ("grpo", "reinforce_pp", "reinforce_pp_baseline",
                   "grpo_process")
# Policy losses whose ratio is PPO-clipped to [1 - eps_low, 1 + eps_high].
# Registry fields that may be "" (none).
_OPTIONAL_REGISTRY_FIELDS = ("rl.process_reward",)
_REGISTRY_FIELDS = {
    "method": "method",
    "data.source": "dataset",
    "data.template": "template",
    "rl.advantage": "advantage",
    "rl.loss_agg": "loss_agg",
    "rl.policy_loss": "policy_loss",
    "rl.process_reward": "process_reward",
    "rl.kl_estimator": "kl_estimator",
}


def _check_fields(config: ConfigDict, base: ConfigDict, prefix: str,
                  open_fields: tuple[str, ...]) -> None:
  for key, value in config.items():
    path = f"{prefix}{key}"
    if key not in base:
      raise ConfigError(unknown_field(path, sorted(base.keys())))
    ref = base[key]
    if isinstance(ref, ConfigDict):
      if path in open_fields:
        continue
      if not isinstance(value, ConfigDict):
        raise ConfigError(f"config field {path!r} must be a group")
      missing = [k for k in ref.keys() if k not in value]
      if missing:   # e.g. --config.model.lora="{'rank': 4}" replaced the group
        given = ", ".join(f"{k}={value[k]!r}" for k in value.keys())
        raise ConfigError(
            f"config field {path!r} lacks {missing}: a group given whole needs "
            f"every field; set the ones you change one by one instead"
            + (f" ({' '.join(f'--config.{path}.{k}={value[k]!r}' for k in value.keys())})"
               if given else ""))
      _check_fields(value, ref, path + ".", open_fields)
    elif ref is not None and value is not None and not _same_kind(ref, value):
      raise ConfigError(f"config field {path!r} = {value!r} should be a "
                        f"{type(ref).__name__}")


def unknown_field(path: str, names: list[str]) -> str:
  """"unknown config field 'rl.eps_hihg': did you mean 'rl.eps_high'?" (the
  nearest names in spelling, else every name there)."""
  prefix, _, key = path.rpartition(".")
  close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
  if close:
    return (f"unknown config field {path!r}: did you mean "
            f"{' or '.join(repr(f'{prefix}.{c}' if prefix else c) for c in close)}?")
  return (f"unknown config field {path!r}; fields "
          f"{'of ' + repr(prefix) if prefix else 'at the top level'}: {names}")


def _check_finite(value: Any, path: str) -> None:
  """Every number anywhere in the config (all groups, the free-form ones,
  tuples) is finite: `x < 0` is False for NaN, so a NaN passes every range
  check below and would train a model of NaNs."""
  if isinstance(value, Mapping) or hasattr(value, "items"):
    for key, item in value.items():
      _check_finite(item, f"{path}.{key}" if path else str(key))
  elif isinstance(value, (tuple, list)):
    for i, item in enumerate(value):
      _check_finite(item, f"{path}[{i}]")
  elif (isinstance(value, numbers.Real) and not isinstance(value, bool)
        and not math.isfinite(value)):
    raise ConfigError(f"config field {path!r} = {value!r} is not a finite "
                      f"number")


def _same_kind(ref: Any, value: Any) -> bool:
  if isinstance(ref, bool) or isinstance(value, bool):
    return isinstance(ref, bool) and isinstance(value, bool)
  if isinstance(ref, (int, float)):
    return isinstance(value, (int, float))
  if isinstance(ref, (tuple, list)):
    return isinstance(value, (tuple, list))
  return isinstance(value, type(ref))


def _get(config: ConfigDict, path: str) -> Any:
  for part in path.split("."):
    config = config[part]
  return config


def validate(config: ConfigDict, data_files: bool = True) -> ConfigDict:
  """Checks names, types, choices and ranges; returns the config unchanged.
  data_files=False: the data sets' files may be unset (experiments/aot.py
  compiles without reading them)."""
  _check_fields(config, base_config(), "",
                ("rewards", "reward_kwargs", "data.kwargs", "data.eval_kwargs",
                 "env.kwargs"))
  _check_finite(config, "")
  for path, allowed in _CHOICES.items():
    if _get(config, path) not in allowed:
      raise ConfigError(f"config field {path!r} = {_get(config, path)!r}; "
                        f"allowed: {allowed}")
  for path, kind in _REGISTRY_FIELDS.items():
    if path in _OPTIONAL_REGISTRY_FIELDS and not _get(config, path):
      continue
    if _get(config, path) not in registry.names(kind):
      raise ConfigError(f"config field {path!r} = {_get(config, path)!r}; "
                        f"allowed: {registry.names(kind)}")
  for name in list(config.rewards.keys()) + list(config.reward_kwargs.keys()):
    if name not in registry.names("reward"):
      raise ConfigError(f"config field 'rewards.{name}': unknown reward; "
                        f"allowed: {registry.names('reward')}")
  if config.accuracy_reward not in config.rewards:
    raise ConfigError(f"config field 'accuracy_reward' = "
                      f"{config.accuracy_reward!r} must be one of the rewards "
                      f"{list(config.rewards.keys())}")
  _check_ranges(config)
  groups.check_final_answer(config)
  groups.check_eval(config.eval)
  if data_files:
    groups.check_data_paths(config.data)
  groups.check_layouts(config.data)
  check_data_kwargs(config.data)
  if not config.model.source:
    raise ConfigError("config field 'model.source' is unset: give a preset "
                      "name (e.g. smollm2-135m-instruct), a Hugging Face model "
                      "directory or a .gguf file, e.g. "
                      "--config.model.source=/ckpt/Qwen2.5-32B")
  if config.method == "star":
    groups.check_star(config.star)
  groups.check_lora(config.model.lora)
  groups.check_rollout(config)
  groups.check_env(config)
  groups.check_sizes(config)
  return config


# Fields that must be >= 1: counts, sizes, and the divisors of the loops
# (a step is logged when step % train.log_every == 0), with why where it is
# not plain.
_AT_LEAST_1 = {
    "rl.prompts_per_step": "", "rl.num_generations": "",
    "rl.num_updates": "", "rl.max_gen_batches": "", "train.steps": "",
    "train.log_every": " (metrics are written every train.log_every steps)",
    "train.keep_checkpoints": " (the run resumes from the newest checkpoint "
                              "it keeps)",
    "sampling.max_new_tokens": "", "model.logprob_chunk": "",
    "sampling.page_size": " (columns per page of the paged KV cache)",
    "sampling.stop_check_every": " (decode steps per check of whether any "
                                 "row is still live)",
    "mesh.init_timeout_s": ""}
# Fields that must be >= 0; 0 means "off" or "all" for the *_every and
# *_batch_size fields (the loops test them before dividing).
_AT_LEAST_0 = (
    "seed", "optim.learning_rate", "optim.weight_decay", "optim.warmup_steps",
    "rl.kl_beta", "rl.kl_start_step", "rl.kl_ramp_steps", "rl.adv_ddof",
    "rl.adv_eps", "rl.max_len_norm", "rl.mini_batch_size",
    "rl.micro_batch_size", "train.checkpoint_every", "train.eval_every",
    "train.eval_examples", "sampling.temperature", "sampling.top_k")


def _check_ranges(config: ConfigDict) -> None:
  rl = config.rl
  for path, why in _AT_LEAST_1.items():
    if _get(config, path) < 1:
      raise ConfigError(f"config field {path!r} = {_get(config, path)} must "
                        f"be >= 1{why}")
  for path in _AT_LEAST_0:
    if _get(config, path) < 0:
      raise ConfigError(f"config field {path!r} = {_get(config, path)} must "
                        "be >= 0")
  for path in ("sampling.chunk_rows", "sampling.slots", "sampling.pages"):
    if _get(config, path) < 0:
      raise ConfigError(f"config field {path!r} = {_get(config, path)} must "
                        f"be >= 0 (0: automatic)")
  if (config.sampling.kv_cache == "paged"
      and not config.sampling.continuous_batching):
    raise ConfigError("config field 'sampling.kv_cache' = 'paged' is the "
                      "continuous-batching sampler's cache: set "
                      "sampling.continuous_batching = True (or kv_cache = "
                      "'dense')")
  if config.sampling.kv_dtype and config.sampling.kv_cache != "paged":
    raise ConfigError(f"config field 'sampling.kv_dtype' = "
                      f"{config.sampling.kv_dtype!r} is the paged pool's: set "
                      "sampling.kv_cache = 'paged' (or kv_dtype = '')")
  if not 0 < config.sampling.top_p <= 1:
    raise ConfigError(f"config field 'sampling.top_p' = "
                      f"{config.sampling.top_p} must be in (0, 1]")
  if config.method == "rl" and config.sampling.temperature == 0:
    raise ConfigError(
        "config field 'sampling.temperature' = 0: RL compares the "
        f"{rl.num_generations} completions of a group, which at temperature 0 "
        "are identical, so every advantage is 0 and nothing is learnt; use a "
        "temperature > 0 (e.g. 1.0)")
  if rl.advantage in _EPS_ADVANTAGES and rl.adv_eps <= 0:
    raise ConfigError(f"config field 'rl.adv_eps' = {rl.adv_eps} must be > 0: "
                      f"rl.advantage = {rl.advantage!r} divides by a reward "
                      f"std + rl.adv_eps, and a group whose completions all "
                      f"score the same has std 0 (0/0 is NaN); verl uses "
                      f"1e-6, TRL 1e-4")
  groups.check_optim(config.optim)
  if rl.advantage in _STD_ADVANTAGES and rl.num_generations <= rl.adv_ddof:
    raise ConfigError(f"config field 'rl.adv_ddof' = {rl.adv_ddof} must be "
                      f"below rl.num_generations = {rl.num_generations}: "
                      f"rl.advantage = {rl.advantage!r} divides by the "
                      f"group's std with G - ddof degrees of freedom")
  if rl.num_generations < 2 and rl.advantage not in _NO_GROUP_ADVANTAGES:
    raise ConfigError(f"config field 'rl.num_generations' must be >= 2 for "
                      f"group-relative advantages (rl.advantage = "
                      f"{rl.advantage!r}; G = 1 works with "
                      f"{list(_NO_GROUP_ADVANTAGES)})")
  groups.check_policy_loss(rl)
  groups.check_advantage(rl)
  groups.check_distill(rl)
  if (config.method == "rl" and rl.kl_beta > 0 and rl.kl_reference == "start"
      and config.init_from and config.model.lora.rank > 0):
    raise ConfigError(
        "config field 'rl.kl_reference' = 'start' with init_from and LoRA "
        "(model.lora.rank > 0): LoRA's reference is the base with the "
        "adapters off, not init_from's adapters; set "
        "--config.rl.kl_reference=model to use the base on purpose")
  if rl.micro_batch_tokens < 0:
    raise ConfigError(f"config field 'rl.micro_batch_tokens' = "
                      f"{rl.micro_batch_tokens} must be >= 0 (0: off)")
  rows = rl.prompts_per_step * rl.num_generations
  for path in ("rl.mini_batch_size", "rl.micro_batch_size"):
    size = _get(config, path)
    if size and rows % size:
      raise ConfigError(f"config field {path!r} = {size} must divide the "
                        f"{rows} completions of a step")
  mini = rl.mini_batch_size or rows
  if rl.micro_batch_size and mini % rl.micro_batch_size:
    raise ConfigError(f"config field 'rl.micro_batch_size' = "
                      f"{rl.micro_batch_size} must divide rl.mini_batch_size "
                      f"= {mini}")



def check_data_kwargs(data: ConfigDict) -> None:
  """data.kwargs and data.eval_kwargs name parameters of their reader (the
  "dataset" registry's function): a misspelt keyword is refused at start,
  naming the nearest parameters, instead of a TypeError once data loads."""
  for field, source in (("data.kwargs", data.source),
                        ("data.eval_kwargs", data.eval_source or data.source)):
    if source not in registry.names("dataset"):
      continue
    params = inspect.signature(registry.lookup("dataset", source)).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
      continue
    for key in data[field.split(".")[1]].keys():
      if key not in params:
        raise ConfigError(f"{unknown_field(f'{field}.{key}', sorted(params))} "
                          f"(the keywords of the reader of data source {source!r})")
