"""Config validation, once at start: every field's name and kind, the
allowed values, registry names, ranges and the fields that must agree.

`validate(config)` fails with an `errors.ConfigError` naming the field and
what is allowed, before any compile or data load.
"""
from __future__ import annotations

import difflib
import inspect
import math
import numbers
from typing import Any, Mapping

import ml_collections

from grpo_jax import registry
from grpo_jax.algorithms import dynamic_sampling, losses, rollout_correction
from grpo_jax.config import base_config
from grpo_jax.data.files import MAX_RECORD_BYTES, check_reading_options
from grpo_jax.errors import ConfigError
from grpo_jax.models import attention, lora, paged, transformer

ConfigDict = ml_collections.ConfigDict


# The allowed values of the fields whose values are fixed strings (the
# registry lists the open sets: losses, rewards, data sets, ...).
DTYPES = ("float32", "bfloat16")

_CHOICES = {
    "model.param_dtype": DTYPES,
    "model.compute_dtype": DTYPES,
    "model.remat": tuple(transformer.REMAT_POLICIES),
    "sampling.compute_dtype": ("",) + DTYPES,   # "": the model's
    "sampling.kv_cache": ("dense", "paged"),    # decoding.KV_CACHES
    "sampling.paged_kernel": paged.KERNELS,     # the paged decode attention
    "rl.old_logp": ("sampler", "recompute"),    # where π_old comes from
    "rl.on_cap": dynamic_sampling.ON_CAP,
    "rl.packing": ("auto", "on", "off"),
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
# Advantages the loop feeds per-step rewards (train.process_advantages).
_PROCESS_ADVANTAGES = ("grpo_process",)
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
                ("rewards", "reward_kwargs", "data.kwargs", "data.eval_kwargs"))
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
  _check_final_answer(config)
  _check_eval(config.eval)
  if data_files:
    _check_data_paths(config.data)
  _check_layouts(config.data)
  if not config.model.source:
    raise ConfigError("config field 'model.source' is unset: give a preset "
                      "name (e.g. smollm2-135m-instruct), a Hugging Face model "
                      "directory or a .gguf file, e.g. "
                      "--config.model.source=/ckpt/Qwen2.5-32B")
  if config.method == "star":
    _check_star(config.star)
  _check_lora(config.model.lora)
  _check_rollout(config)
  return config


def _check_rollout(config: ConfigDict) -> None:
  """config.rollout (rl/async_rollouts.py): counts in range, sync_every
  within the staleness bound, and stale rows only with a rollout
  correction (never π_rollout of an older policy silently taken as π_old).
  The device split is checked against the devices at start-up
  (async_rollouts.split_devices)."""
  r = config.rollout
  for path in ("rollout.sampler_devices", "rollout.max_staleness"):
    if _get(config, path) < 0:
      raise ConfigError(f"config field {path!r} = {_get(config, path)} must "
                        "be >= 0 (0: off)")
  if not 1 <= r.sync_every <= r.max_staleness + 1:
    raise ConfigError(
        f"config field 'rollout.sync_every' = {r.sync_every} must be in "
        f"[1, rollout.max_staleness + 1 = {r.max_staleness + 1}]: between two "
        "syncs the sampler's weights age by sync_every - 1 steps, which the "
        "staleness bound must cover")
  if r.timeout_s <= 0:
    raise ConfigError(f"config field 'rollout.timeout_s' = {r.timeout_s} "
                      "must be > 0 (seconds the trainer waits for a batch)")
  if r.sampler_mesh and len(r.sampler_mesh) != len(config.mesh.axes):
    raise ConfigError(f"config field 'rollout.sampler_mesh' = "
                      f"{tuple(r.sampler_mesh)} needs one size per mesh axis "
                      f"{tuple(config.mesh.axes)}")
  correction = rollout_correction.CorrectionSettings.from_config(
      config.rl.rollout_correction)
  if config.method == "rl" and r.max_staleness > 0 and not correction.active:
    raise ConfigError(
        f"config field 'rollout.max_staleness' = {r.max_staleness}: rows up "
        "to that many policy versions old are off-policy, and no "
        "rl.rollout_correction is on, so the update would weigh them as if "
        "the current policy had sampled them. Use the decoupled objective "
        "(π_old recomputed, truncated IS on π_old / π_rollout): "
        "--config.rl.old_logp=recompute "
        "--config.rl.rollout_correction.is_level=token; or bypass "
        "(--config.rl.old_logp=sampler) with a correction on")


def _check_lora(c: ConfigDict) -> None:
  """model.lora: rank >= 0 (0: off), alpha > 0, targets that name
  projections, dropout 0, a known sampler."""
  if c.rank < 0 or not isinstance(c.rank, int):
    raise ConfigError(f"config field 'model.lora.rank' = {c.rank!r} must be "
                      f"an int >= 0 (0: full fine-tuning)")
  if c.alpha <= 0:
    raise ConfigError(f"config field 'model.lora.alpha' = {c.alpha} must be "
                      f"> 0 (the adapters' scale is alpha / rank)")
  if not c.targets:
    raise ConfigError(f"config field 'model.lora.targets' is empty; allowed "
                      f"names: {list(lora.PROJECTIONS)} (fnmatch patterns)")
  try:
    lora.target_names(c.targets)
  except ValueError as e:
    raise ConfigError(f"config field 'model.lora.targets': {e}") from e
  if c.dropout != 0:
    # Dropout makes the policy random at fixed θ: the PPO ratio at θ = θ_old
    # would not be 1 and the sampler's log-probs would not be the trainer's.
    raise ConfigError(f"config field 'model.lora.dropout' = {c.dropout}: "
                      f"only 0 is supported (RL needs π_θ deterministic "
                      f"for the ratio π_θ / π_old)")
  if c.sampler not in lora.SAMPLERS:
    raise ConfigError(f"config field 'model.lora.sampler' = {c.sampler!r}; "
                      f"allowed: {lora.SAMPLERS}")


# Keywords that locate the data of a file-backed dataset; "path" and
# "data_dir" are also required non-empty wherever a config lists them.
_DATA_LOCATION = {"jsonl": ("path",), "parquet": ("path",), "tfds": ("name",)}


def _check_data_paths(data: ConfigDict) -> None:
  sources = (("data.source", data.source, "data.kwargs", data.kwargs),
             ("data.eval_source", data.eval_source or data.source,
              "data.eval_kwargs", data.eval_kwargs))
  for field, source, group, kwargs in sources:
    listed = tuple(k for k in ("path", "data_dir") if k in kwargs)
    for key in _DATA_LOCATION.get(source, ()) + listed:
      if not kwargs.get(key):
        # A key the dict lacks cannot be set as --config.<group>.<key>.
        fix = (f"--config.{group}.{key}=..." if key in kwargs else
               f"--config.{group}='{{\"{key}\": \"...\"}}' (the whole dict)")
        raise ConfigError(f"config field '{group}.{key}' is unset but "
                          f"{field} = {source!r} needs it: pass {fix}")


def _check_layouts(data: ConfigDict) -> None:
  """A file or TFDS data set's `layout` keyword names a registered layout
  (or "auto"), and its reading options are allowed values, checked here
  rather than when the data loads."""
  for group in ("kwargs", "eval_kwargs"):
    layout = data[group].get("layout")
    if layout not in (None, "auto") and layout not in registry.names("layout"):
      raise ConfigError(f"config field 'data.{group}.layout' = {layout!r}; "
                        f"allowed: 'auto' or {registry.names('layout')}")
    try:   # the file and TFDS readers' reading options, when given
      check_reading_options(data[group].get("on_empty_answer", "error"),
                            data[group].get("max_record_bytes", MAX_RECORD_BYTES))
    except ConfigError as e:
      raise ConfigError(f"config field 'data.{group}': {e}") from None


def _check_star(star: ConfigDict) -> None:
  positive = ("iterations", "samples_per_problem", "sample_batch",
              "sft_steps", "batch_size")
  for name in positive:
    if star[name] < 1:
      raise ConfigError(f"config field 'star.{name}' = {star[name]} must be "
                        f">= 1")
  for name in ("problems_per_iteration", "few_shot", "micro_batch_size",
               "row_length"):
    if star[name] < 0:
      raise ConfigError(f"config field 'star.{name}' = {star[name]} must be "
                        f">= 0")
  if star.sft_growth <= 0:
    raise ConfigError(f"config field 'star.sft_growth' = {star.sft_growth} "
                      f"must be > 0")
  if star.micro_batch_size and star.batch_size % star.micro_batch_size:
    raise ConfigError(f"config field 'star.micro_batch_size' = "
                      f"{star.micro_batch_size} must divide star.batch_size "
                      f"= {star.batch_size}")


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
  _check_optim(config.optim)
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
  _check_policy_loss(rl)
  _check_advantage(rl)
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


def _check_optim(optim: ConfigDict) -> None:
  """The optimizer's divisors (optim.learning_rate and weight_decay are
  checked >= 0 with the other ranges)."""
  if optim.grad_clip <= 0:
    raise ConfigError(f"config field 'optim.grad_clip' = {optim.grad_clip} "
                      f"must be > 0: clipping scales the gradient by "
                      f"grad_clip / its norm, so 0 turns a zero gradient into "
                      f"0/0 = NaN (for no clipping use a large value, e.g. 1e9)")
  if optim.eps <= 0:
    raise ConfigError(f"config field 'optim.eps' = {optim.eps} must be > 0: "
                      f"Adam divides by sqrt(v) + eps, and v is 0 wherever "
                      f"the gradient has been 0 (0/0 is NaN)")
  for name in ("b1", "b2"):
    if not 0 <= optim[name] < 1:
      raise ConfigError(f"config field 'optim.{name}' = {optim[name]} must be "
                        f"in [0, 1): Adam's bias correction divides by "
                        f"1 - {name}^t")


def _check_policy_loss(rl: ConfigDict) -> None:
  """A loss with its own aggregation (GSPO, GMPO, SAPO) must be given it;
  the rollout correction's fields (rollout_correction.validate)."""
  fixed = registry.lookup("policy_loss", rl.policy_loss).fixed_agg
  if fixed is not None and rl.loss_agg != fixed:
    raise ConfigError(f"config field 'rl.loss_agg' = {rl.loss_agg!r}: "
                      f"rl.policy_loss = {rl.policy_loss!r} aggregates "
                      f"{fixed!r} only (as verl); set --config.rl.loss_agg="
                      f"{fixed}")
  if rl.dual_clip and rl.policy_loss != "ppo":
    raise ConfigError(f"config field 'rl.dual_clip' = {rl.dual_clip}: only "
                      f"rl.policy_loss = 'ppo' has a dual clip")
  try:
    losses.PolicyLossSpec.from_config(rl)
  except ValueError as e:   # the parameter's range (policy_losses.py)
    raise ConfigError(f"config field rl.{e}") from e
  try:
    rollout_correction.validate(rollout_correction.CorrectionSettings
                                .from_config(rl.rollout_correction),
                                rl.old_logp)
  except ValueError as e:
    raise ConfigError(f"config group 'rl': {e}") from e


def _takes_outcome_rewards(name: str) -> bool:
  """Whether the advantage runs as the RL loop calls it on outcome rewards
  (train.advantages): fn(reward_bg, ddof=, eps=, length_bg=) with reward_bg
  [b, g] and length_bg [b, g] the valid tokens of each completion."""
  try:
    inspect.signature(registry.lookup("advantage", name)).bind(
        None, ddof=1, eps=1e-6, length_bg=None)
  except TypeError:
    return False
  return True


def _check_advantage(rl: ConfigDict) -> None:
  """The advantage must run as the loop calls it: outcome rewards
  (train.advantages), or step rewards from rl.process_reward for
  grpo_process (train.process_advantages)."""
  name = rl.advantage
  outcome = [n for n in registry.names("advantage")
             if _takes_outcome_rewards(n)]
  if name in _PROCESS_ADVANTAGES:
    if rl.process_reward not in registry.names("process_reward"):
      raise ConfigError(
          f"config field 'rl.advantage' = {name!r} needs per-step rewards, "
          f"but 'rl.process_reward' = {rl.process_reward!r} gives none: set "
          f"one of {registry.names('process_reward')} (as "
          f"configs/grpo_process.py does), or use an outcome advantage "
          f"{outcome}")
    return
  if not _takes_outcome_rewards(name):
    params = list(inspect.signature(
        registry.lookup("advantage", name)).parameters)
    raise ConfigError(
        f"config field 'rl.advantage' = {name!r} takes {params}, but the RL "
        f"loop gives it only outcome rewards reward_bg [b, g] and token "
        f"counts length_bg (or, with rl.process_reward, per-step rewards to "
        f"{list(_PROCESS_ADVANTAGES)}); allowed: {outcome}")


def _check_final_answer(config: ConfigDict) -> None:
  """Evaluation reads answers (maj@k) with the accuracy reward's registered
  FinalAnswer; a run that evaluates needs one."""
  t = config.train
  evaluates = (config.method == "star" or t.eval_at_start or t.eval_at_end
               or t.eval_every)
  if evaluates and config.accuracy_reward not in registry.names("final_answer"):
    raise ConfigError(
        f"config field 'accuracy_reward' = {config.accuracy_reward!r} has no "
        f"registered final_answer (how evaluation reads an answer); known: "
        f"{registry.names('final_answer')}; or set train.eval_at_start, "
        f"train.eval_at_end and train.eval_every off")


def _check_eval(e: ConfigDict) -> None:
  if e.n < 0 or e.batch_size < 1:
    raise ConfigError(f"config fields 'eval.n'/'eval.batch_size' = "
                      f"{e.n}/{e.batch_size}: need n >= 0, batch_size >= 1")
  if e.n and not (e.ks and all(1 <= k <= e.n for k in e.ks)):
    raise ConfigError(f"config field 'eval.ks' = {tuple(e.ks)}: each k of "
                      f"pass@k / maj@k must be in [1, eval.n = {e.n}]")
  if e.temperature < 0 or not 0 < e.top_p <= 1:
    raise ConfigError(f"config fields 'eval.temperature'/'eval.top_p' = "
                      f"{e.temperature}/{e.top_p}: need temperature >= 0, "
                      f"0 < top_p <= 1")
