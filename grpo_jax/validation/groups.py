"""The config's groups checked one by one (`validate` calls each): the
rollout, LoRA, the data's locations and reading options, STaR, the
optimizer, the policy loss and its rollout correction, the advantage, the
final answer evaluation reads, evaluation.
"""
from __future__ import annotations

import inspect
import os
import threading

import ml_collections

from grpo_jax import registry
from grpo_jax.algorithms import losses, rollout_correction
from grpo_jax.data.files import MAX_RECORD_BYTES, check_reading_options
from grpo_jax.envs import base as envs
from grpo_jax.errors import ConfigError
from grpo_jax.models import lora

ConfigDict = ml_collections.ConfigDict

# Advantages the loop feeds per-step rewards (train.process_advantages).
_PROCESS_ADVANTAGES = ("grpo_process",)


def check_rollout(config: ConfigDict) -> None:
  """config.rollout (rl/async_rollouts.py): counts in range, sync_every
  within the staleness bound, and stale rows only with a rollout
  correction (never π_rollout of an older policy silently taken as π_old).
  The device split is checked against the devices at start-up
  (async_rollouts.split_devices)."""
  r = config.rollout
  for name in ("sampler_devices", "max_staleness"):
    if r[name] < 0:
      raise ConfigError(f"config field 'rollout.{name}' = {r[name]} must "
                        "be >= 0 (0: off)")
  if not 1 <= r.sync_every <= r.max_staleness + 1:
    raise ConfigError(
        f"config field 'rollout.sync_every' = {r.sync_every} must be in "
        f"[1, rollout.max_staleness + 1 = {r.max_staleness + 1}]: between two "
        "syncs the sampler's weights age by sync_every - 1 steps, which the "
        "staleness bound must cover")
  if not 0 < r.timeout_s <= threading.TIMEOUT_MAX:
    raise ConfigError(f"config field 'rollout.timeout_s' = {r.timeout_s} "
                      "must be > 0 (seconds the trainer waits for a batch) and "
                      f"at most {threading.TIMEOUT_MAX:.0f} (the longest wait "
                      "Python's threads take)")
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

  if r.partial:
    check_partial(config)


def check_partial(config: ConfigDict) -> None:
  """rollout.partial (rl/partial_rollouts.py): rows carried across a weight
  switch need stale rows to exist (k >= 1), a version at every step
  (sync_every 1), the paged continuous sampler
  (generate/parked.py's engine), and single-turn rows (an env's rows wait
  on the parked engine already)."""
  r, field = config.rollout, "config field 'rollout.partial' = True"
  refusals = (
      (r.max_staleness < 1, "needs rollout.max_staleness >= 1: at k = 0 "
       "every row must end before its version is trained, so none is "
       "carried"),
      (r.sync_every != 1, "needs rollout.sync_every = 1: a checkpoint's "
       "carried rows are those at the switch to its version"),
      (not config.sampling.continuous_batching
       or config.sampling.kv_cache != "paged",
       "runs the paged continuous sampler (generate/parked.py): set "
       "sampling.continuous_batching=True and sampling.kv_cache='paged', not "
       "the lockstep sampler"),
      (bool(config.env.name), "is for single-turn rows (env.name = ''); "
       "an env's rows already wait with env.engine='parked'"),
      (config.method != "rl", f"is for the RL loop, not method = "
       f"{config.method!r}"))
  for refused, why in refusals:
    if refused:
      raise ConfigError(f"{field} {why}")


def check_env(config: ConfigDict) -> None:
  """config.env (envs/, generate/agent.py): a registered env, its budgets
  in range, its host able to run it (the python env needs the sandbox), and
  no setting that reads a single-turn completion's text (process rewards,
  STaR)."""
  e = config.env
  if not e.name:
    return
  if e.name not in registry.names("env"):
    raise ConfigError(f"config field 'env.name' = {e.name!r}; allowed: "
                      f"{[''] + registry.names('env')}")
  for name in ("max_turns", "max_observation_tokens"):
    if e[name] < 1:
      raise ConfigError(f"config field 'env.{name}' = {e[name]} must be >= 1")
  if e.engine not in envs.ENGINES:
    raise ConfigError(f"config field 'env.engine' = {e.engine!r}; allowed: "
                      f"{list(envs.ENGINES)}")
  if e.engine == "parked" and config.sampling.kv_cache != "paged":
    raise ConfigError("config field 'env.engine' = 'parked' runs on the paged "
                      "pool: set sampling.continuous_batching=True and "
                      "sampling.kv_cache='paged', or env.engine='turns'")
  if e.engine_steps < 1:
    raise ConfigError(f"config field 'env.engine_steps' = {e.engine_steps} "
                      "must be >= 1")
  if not e.tool_timeout_s > 0:
    raise ConfigError(f"config field 'env.tool_timeout_s' = "
                      f"{e.tool_timeout_s} must be > 0 (seconds per tool call)")
  if config.method not in ("rl", "sft", "pipeline"):   # sft: a warm-up
    raise ConfigError(f"config field 'env.name' = {e.name!r}: episodes with "
                      f"tools are trained by method 'rl' (or an 'sft' warm-up, "
                      f"a pipeline of them), not {config.method!r}")
  if config.rl.advantage == "grpo_process" or config.rl.process_reward:
    raise ConfigError("config field 'env.name': process rewards read a "
                      "single completion's steps; set rl.process_reward='' "
                      "and an outcome advantage with an env")
  check_host = getattr(registry.lookup("env", e.name), "check_host", None)
  if check_host is not None:
    try:
      check_host()
    except Exception as err:  # pylint: disable=broad-except
      raise ConfigError(f"config field 'env.name' = {e.name!r} cannot run "
                        f"on this host: {err}") from err


def check_lora(c: ConfigDict) -> None:
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


def check_data_paths(data: ConfigDict) -> None:
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


def check_layouts(data: ConfigDict) -> None:
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


def check_star(star: ConfigDict) -> None:
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


def check_optim(optim: ConfigDict) -> None:
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


def check_policy_loss(rl: ConfigDict) -> None:
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


def check_distill(rl: ConfigDict) -> None:
  """On-policy distillation needs a teacher, and every sampled group: the
  teacher grades each token, so a group whose rewards are equal still
  teaches (dynamic sampling would drop it)."""
  d = rl.distill
  if d.mode == "off":
    return
  if not d.teacher:
    raise ConfigError("config field 'rl.distill.teacher' is empty but rl.distill.mode = "
                      f"{d.mode!r}: name the teacher (a preset, an HF directory or a run)")
  if rl.dynamic_sampling:
    raise ConfigError("config field 'rl.dynamic_sampling' = True with rl.distill.mode = "
                      f"{d.mode!r}: distillation trains on every group; set it False")
  if rl.advantage == "grpo_process":
    raise ConfigError("config field 'rl.advantage' = 'grpo_process' with rl.distill.mode = "
                      f"{d.mode!r}: the teacher gives the per-token advantage")


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


def check_advantage(rl: ConfigDict) -> None:
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


def check_final_answer(config: ConfigDict) -> None:
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


def check_eval(e: ConfigDict) -> None:
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


# Bytes a step's host arrays take per token (ids, log-probs, masks, the
# behaviour and old log-probs, advantages, rewards...): 8 4-byte arrays.
STEP_BYTES_PER_TOKEN = 32


def host_memory() -> int:
  """This host's physical memory in bytes (0 where the OS does not say)."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return 0


def sampler_rows(config: ConfigDict) -> int:
  """The most rows one sampler call of this run can have: a step's B*G
  (RL) or a STaR call's star.sample_batch prompts x star.samples_per_problem,
  and an evaluation batch's eval.batch_size x max(eval.n, 1)."""
  rows = config.eval.batch_size * max(config.eval.n, 1)
  if config.method == "star":
    return max(rows, config.star.sample_batch * config.star.samples_per_problem)
  return max(rows, config.rl.prompts_per_step * config.rl.num_generations)


def check_sizes(config: ConfigDict) -> None:
  """Upper bounds of the sampler's sizes, against what the run can use:
  cache slots beyond the most rows a call has (`sampler_rows`) are
  allocated and never filled; a stop check every more decode steps than a
  completion has runs past its end."""
  s, rows = config.sampling, sampler_rows(config)
  if s.continuous_batching and s.slots > rows:
    raise ConfigError(
        f"config field 'sampling.slots' = {s.slots} is more than the {rows} rows "
        "the largest sampler call of this run has (RL: rl.prompts_per_step x "
        "rl.num_generations; STaR: star.sample_batch x star.samples_per_problem; "
        f"evaluation: eval.batch_size x eval.n): use at most {rows} (or 0: automatic)")
  rows_per_step = config.rl.prompts_per_step * config.rl.num_generations
  need, have = rows_per_step * s.max_new_tokens * STEP_BYTES_PER_TOKEN, host_memory()
  if config.method == "rl" and have and need > have / 2:
    raise ConfigError(
        f"config field 'rl.num_generations' = {config.rl.num_generations} (x "
        f"rl.prompts_per_step = {config.rl.prompts_per_step}): a step's "
        f"{rows_per_step} rows of up to {s.max_new_tokens} tokens take "
        f"{need / 1e9:.1f} GB of host arrays ({STEP_BYTES_PER_TOKEN} bytes a token), "
        f"more than half this host's {have / 1e9:.1f} GB: lower them")
  if s.stop_check_every > s.max_new_tokens:
    raise ConfigError(
        f"config field 'sampling.stop_check_every' = {s.stop_check_every} is more "
        f"than sampling.max_new_tokens = {s.max_new_tokens}: a completion ends by "
        f"then; use at most {s.max_new_tokens}")

