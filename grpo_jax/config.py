"""The base experiment config: every field, its default and what it means.

Every `configs/*.py` starts from `base_config()` and changes a few fields;
`validation.validate(config)` checks every field against it (once, before
any compile), naming the field and the allowed values.
"""
from __future__ import annotations

from typing import Any, Mapping

import ml_collections
from flax import traverse_util

from grpo_jax.errors import ConfigError

ConfigDict = ml_collections.ConfigDict


def _rl_defaults() -> ConfigDict:
  """config.rl: the RL loop (GRPO / DAPO and the losses that followed)."""
  return ConfigDict(dict(
      prompts_per_step=8,              # B groups per optimizer step (kept)
      num_generations=8,               # G
      advantage="grpo",                # an "advantage" registry name
      process_reward="",               # a "process_reward" name ("": none),
                                       # needed by advantage = grpo_process;
                                       # with another advantage only its
                                       # process/* metrics are logged
      adv_ddof=1, adv_eps=1e-6,
      loss_agg="token-mean",           # a "loss_agg" registry name
      max_len_norm=0,                  # T_max of seq-mean-token-sum-norm (0: T)
      eps_low=0.2, eps_high=0.28,
      dual_clip=0.0,                   # 0: off; verl uses 3, DAPO scripts 10
      policy_loss="ppo",               # a "policy_loss" registry name
      cispo_cap=5.0,                   # cispo_cap: TRL's absolute cap on ρ
      gmpo_eps=0.4,                    # gmpo: log-space clip
      sapo_tau_pos=1.0, sapo_tau_neg=1.05,   # sapo: gate temperatures
      kl_beta=0.0, kl_estimator="k3",
      kl_reference="start",            # π_ref: start (the policy the run
                                       # starts from: init_from's when set)
                                       # | model (model.source's weights)
      kl_start_step=0, kl_ramp_steps=0,
      num_updates=1,                   # μ: passes over each rollout
      mini_batch_size=0,               # completions per optimizer update (0: all)
      micro_batch_size=0,              # completions per forward/backward (0: all)
      micro_batch_tokens=0,            # else: the most rows whose tokens fit
                                       # this budget (0: the whole mini-batch)
      old_logp="sampler",              # sampler | recompute
      shared_prompt=True,              # run each group's prompt once in the update
      packing="auto",                  # sequences packed into rows of s
                                       # tokens for scoring and the update
                                       # (packing.py): on | off | auto (when
                                       # packed rows cost fewer tokens)
      dynamic_sampling=True,
      max_gen_batches=3,               # cap on generation batches per step
      on_cap="fill",                   # fill | fewer | raise
      overlong_filter=False,           # truncated completions get no gradient
      # Sampler vs trainer mismatch (algorithms/rollout_correction.py).
      rollout_correction=ConfigDict(dict(
          is_level="none",             # none | token | sequence
          is_mode="truncate",          # truncate: min(ρ, C) | mask: ρ·[ρ<=C]
          is_threshold=2.0,            # C (verl 2.0; TRL masks at 3.0)
          band=(0.0, 0.0),             # IcePop token band, e.g. (0.5, 5.0)
          reject="none",               # none | k1_sum | k1_mean | k3_mean
          reject_min=-1e30, reject_max=1e30,
          denominator="verl",          # verl: dropped rows leave the
                                       # normalisers | trl: weight 0 only
      )),
      # On-policy distillation (rl/distill.py): the advantage of each sampled
      # token is -(log π_student - log π_teacher), scored in the same pass.
      distill=ConfigDict(dict(
          mode="off",                  # off | on_policy
          teacher="",                  # preset, HF dir, .gguf or a run dir
      )),
  ))


def _star_defaults() -> ConfigDict:
  """config.star: the STaR loop, read when method == "star"."""
  return ConfigDict(dict(
      iterations=3,                    # outer iterations (Algorithm 1's N)
      teacher="",                      # "": the model samples itself; else
                                       # a teacher samples (preset, HF dir or
                                       # run): off-policy distillation
      rationalize=True,                # retry failures with the answer as a
                                       # hint (off: the paper's ablation)
      samples_per_problem=1,           # attempts; the first correct is kept
      problems_per_iteration=0,        # a fresh random subset (0: all)
      few_shot=0,                      # exemplars (question + gold rationale)
                                       # in the generation prompt only
      few_shot_first_only=False,       # drop them once the model is tuned
      drop_hint_mentions=True,         # rationales that say "hint" or repeat
                                       # the hint are not kept
      rationale_reasoning_check=False, # keep a rationalisation only if its
                                       # reasoning (no final line, no answer
                                       # statements) verifies and its
                                       # equations hold: derived, not
                                       # asserted (star.first_correct)
      sample_batch=64,                 # prompts per sampler call
      sft_steps=40,                    # fine-tuning steps of iteration 1 (paper)
      sft_growth=1.2,                  # x steps per iteration (paper: +20%)
      batch_size=8,                    # rows per fine-tuning step (paper: 8)
      micro_batch_size=0,              # rows per forward/backward (0: all)
      pack=False,                      # several examples per row, isolated
      row_length=0,                    # tokens per row (0: the longest,
                                       # rounded up, sft.row_length)
  ))


def _lora_defaults() -> ConfigDict:
  """config.model.lora: low-rank adapters on a frozen base (models/lora.py).
  rank 0 trains every parameter; rank r > 0 trains only A (in x r) and
  B (r x out) of the targets, the base frozen in model.compute_dtype."""
  return ConfigDict(dict(
      rank=0,                          # r; 0: off (full fine-tuning)
      alpha=32.0,                      # α: the update is (α/r)·(x·A)·B
      # fnmatch patterns over the projections' names (or "layers/<name>"):
      # wq wk wv wo (attention), w_gate w_up w_down (MLP). All of them by
      # default: attention-only LoRA trails full fine-tuning ("LoRA Without
      # Regret", Schulman et al. 2025).
      targets=("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"),
      dropout=0.0,                     # only 0: see validation.groups.check_lora
      sampler="merged",                # merged: W + α/r·A·B once per update
                                       # | unmerged: the low-rank path in
                                       # every decode step (docs/lora.md)
  ))


def _moe_defaults() -> ConfigDict:
  """config.model.moe: a mixture-of-experts policy's training settings
  (docs/models.md; no effect on a dense model)."""
  return ConfigDict(dict(
      routing_replay="off",            # off | rollout: the trainer uses the
                                       # experts the sampler chose
      aux_loss_coef=-1.0,              # the balancing loss's weight in the
                                       # update; < 0: the checkpoint's
                                       # router_aux_loss_coef
      dispatch="auto",                 # the trainer's token dispatch:
                                       # ragged (grouped matmul, GSPMD) |
                                       # all_to_all (tokens to the chips
                                       # holding their experts) | auto:
                                       # all_to_all on TPU chips splitting
                                       # the experts, else ragged
                                       # (docs/models.md)
  ))


def _rollout_defaults() -> ConfigDict:
  """config.rollout: where the sampler runs and how stale its rows may be
  (rl/async_rollouts.py, docs/async.md). The defaults are the synchronous
  loop: sample on every device, then update, then sample again."""
  return ConfigDict(dict(
      sampler_devices=0,               # devices given to the sampler (the
                                       # last ones of each host); 0: the
                                       # sampler shares the trainer's
      sampler_mesh=(),                 # the sampler's own grid over those
                                       # devices (axes: mesh.axes, rules:
                                       # mesh.rules; (): mesh.shape's),
                                       # e.g. (-1, 1, 4): more tensor
                                       # parallelism than the trainer
      max_staleness=0,                 # k: step u's rows come from policy
                                       # version u - k (0: synchronous);
                                       # k >= 1 needs an active
                                       # rl.rollout_correction
      sync_every=1,                    # n: weights reach the sampler after
                                       # every n-th update step (n <= k + 1)
      timeout_s=3600.0,                # a sampler with no batch for this
                                       # long is hung: the run stops
      partial=False,                   # partial rollouts: a step ends once
                                       # its rows have; rows in flight
                                       # continue under the next version
                                       # (rl/partial_rollouts.py)
  ))


def _env_defaults() -> ConfigDict:
  """config.env: multi-turn episodes with tools (generate/agent.py,
  docs/agents.md). name "" is the single-turn rollout, unchanged."""
  return ConfigDict(dict(
      name="",                         # an "env" registry name: python |
                                       # calculator | scripted ("": none)
      max_turns=4,                     # model turns per episode
      max_observation_tokens=64,       # an observation's tokens, the
                                       # tool-turn markers included
                                       # (longer output is cut)
      tool_timeout_s=5.0,              # wall-clock per tool call: past it
                                       # the observation is a time-out
      kwargs=ConfigDict(),             # the env's own keyword arguments
      engine="turns",                  # turns: a sampler call per turn;
                                       # parked: rows wait on the paged
                                       # engine (kv_cache paged)
      engine_steps=16,                 # parked: decode steps per device
                                       # call, at most
  ))


def _mesh_defaults() -> ConfigDict:
  """config.mesh: the device grid, the logical-axis rules, multi-host start-up."""
  return ConfigDict(dict(
      shape=(-1, 1, 1), axes=("data", "fsdp", "tensor"),
      rules=(("batch", ("data", "fsdp")),
             ("embed", "fsdp"),
             ("vocab", "tensor"), ("q_heads", "tensor"),
             ("kv_heads", "tensor"), ("mlp", "tensor"),
             ("head_dim", None), ("layers", None), ("norm", None),
             # MoE: experts split over `tensor` (expert parallelism), each
             # expert's width whole (models/moe.py)
             ("experts", "tensor"), ("expert_mlp", None)),
      # Multi-host: config field, else env JAX_COORDINATOR_ADDRESS /
      # JAX_NUM_PROCESSES / JAX_PROCESS_ID; on TPU pods only distributed=True.
      distributed=False, coordinator_address="", num_processes=0,
      process_id=-1,
      init_timeout_s=300,    # how long start-up waits for every process
      # Split the update's residual stream (and the per-layer remat
      # checkpoints) over `tensor` along the sequence as well: long rows on
      # small chips (docs/pod.md, v6e:16x16).
      sequence_parallel=False))


def base_config() -> ConfigDict:
  """Every field an experiment can set, with the GRPO defaults."""
  c = ConfigDict()
  c.name = "base"
  c.description = "GRPO defaults"
  c.seed = 0
  c.init_from = ""          # a checkpoint dir to start from (resume order)
  c.method = "rl"           # a "method" registry name: rl (train.run) |
                            # star (star_loop.run) | sft (star/sft_run.py) |
                            # pipeline (harness/pipeline.py: `stages`)
  c.stages = ()             # pipeline: dicts {"kind", "name", "overrides"}

  c.model = ConfigDict(dict(
      source="smollm2-135m-instruct",  # preset, HF directory or .gguf file
      tokenizer="",                    # "" = same as source
      param_dtype="float32",           # master weights and optimizer state
      compute_dtype="float32",         # forward/backward (bfloat16 option)
      remat="none",                    # none | dots | full
      logprob_chunk=256,               # tokens per chunk of the vocab head
      attention="auto",                # update/scoring attention: dense |
                                       # blockwise | auto (blockwise from
                                       # 2048 key columns)
      lora=_lora_defaults(),
      moe=_moe_defaults(),
  ))

  c.data = ConfigDict(dict(
      source="arithmetic",             # a "dataset" registry name
      kwargs=ConfigDict(dict(num_examples=5000, levels=1, seed=0)),
      eval_source="",                  # "" = the same generator, other seed
      eval_kwargs=ConfigDict(dict(num_examples=200, levels=1, seed=12345)),
      template="last_number",          # a "template" registry name
      system_prompt="",
  ))

  c.sampling = ConfigDict(dict(
      max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=0,
      chunk_rows=0,                    # rows per sampler call; 0: as many as
                                       # the device memory holds (CPU: all)
      continuous_batching=False,       # rows take turns in `slots` cache
                                       # slots (grpo_jax/generate/continuous.py);
                                       # chunk_rows is then not used
      slots=0,                         # 0: automatic (sampling.auto_slots)
      kv_cache="dense",                # continuous batching's cache: dense
                                       # (P + T columns per slot) | paged (a
                                       # page pool, prompt pages shared;
                                       # generate/paged_slots.py)
      page_size=16,                    # columns per page (paged)
      pages=0,                         # pages per row shard (paged; 0: as
                                       # many as dense slots hold)
      stop_check_every=1,              # continuous batching: decode steps
                                       # per check of "any row still live"
      paged_kernel="auto",             # paged decode attention: reference
                                       # (plain JAX) | pallas (the TPU
                                       # kernel) | auto (pallas on TPU where
                                       # it can take the model)
      compute_dtype="",                # the sampler's dtype ("" = model's)
      weights_dtype="",                # "" | int8: the sampler's weights
                                       # quantised after each sync, the
                                       # trainer's kept (models/quant.py)
      kv_dtype=""))                    # "" | int8: the paged pool's keys
                                       # and values, a scale per column
                                       # (models/paged.py)

  c.rl = _rl_defaults()
  c.rollout = _rollout_defaults()
  c.env = _env_defaults()

  # Rewards: name -> weight; reward_kwargs: name -> keyword arguments.
  c.rewards = ConfigDict({"last_number": 1.0})
  c.reward_kwargs = ConfigDict()
  c.accuracy_reward = "last_number"     # whose value > 0 counts as correct

  # STaR (Zelikman et al. 2022), read when method == "star"; fine-tuning
  # uses `optim` (a fresh optimizer each outer iteration).
  c.star = _star_defaults()

  c.optim = ConfigDict(dict(
      learning_rate=1e-6, warmup_steps=0, schedule="constant",  # | cosine
      weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))

  c.train = ConfigDict(dict(
      steps=10, log_every=1, eval_every=0, eval_at_start=True,
      eval_at_end=True, eval_examples=200, checkpoint_every=0,
      keep_checkpoints=2, progress=True, plot=True,
      # An update whose loss, gradient norm or new parameters are not finite
      # is never applied (rl/nonfinite.py); then: stop (one line naming the
      # step and the quantity) | skip (counted in update/skipped, sft/skipped)
      on_non_finite="stop"))

  # Held-out evaluation (grpo_jax/evaluation.py) at start, every
  # train.eval_every steps and at the end, on train.eval_examples problems of
  # data.eval_source: greedy accuracy always; with n > 0 also avg@n and, for
  # each k in ks, pass@k and maj@k of n samples (DAPO: n=32, top_p=0.7).
  c.eval = ConfigDict(dict(
      n=0, ks=(1,), temperature=1.0, top_p=1.0,
      batch_size=50))                  # prompts per sampler call

  # Devices as a (data, fsdp, tensor) grid; -1 takes the rest. The rules map
  # the model's logical axes to mesh axes (a mesh axis or a tuple, None:
  # replicated); see grpo_jax/sharding/.
  c.mesh = _mesh_defaults()
  return c


def no_variants(arg: Any, config_file: str) -> None:
  """For `get_config(arg)` of a config without variants: `file.py:x` is a
  mistake, not something to ignore."""
  if arg:
    raise ConfigError(f"{config_file} has no variants, got ':{arg}': drop it "
                      f"(--config={config_file})")


def pick_variant(variants: dict, arg: Any, default: str, config_file: str):
  """The variant function `file.py:arg` names (`default` when none is given);
  an unknown name lists the known ones."""
  variant = variants.get(arg or default)
  if variant is None:
    raise ValueError(f"{config_file}:{arg}: unknown variant; allowed: "
                     f"{sorted(variants)} ({default} is the default)")
  return variant


def flat_fields(tree: Mapping[str, Any]) -> dict[str, Any]:
  """{"a": {"b": 1}, "c": {}} -> {"a.b": 1, "c": {}}: a config (as a dict)
  by dotted field path; an empty group stays a value."""
  flat = traverse_util.flatten_dict(dict(tree), sep=".", keep_empty_nodes=True)
  return {k: {} if v is traverse_util.empty_node else v
          for k, v in flat.items()}
