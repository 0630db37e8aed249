"""DAPO (Yu et al. 2025): Qwen2.5-32B base on DAPO-Math-17k, AIME 2024 avg@32.

    python experiments/run.py --config=configs/dapo_aime.py \
        --config.model.source=/ckpt/Qwen2.5-32B \
        --config.data.kwargs.path=/data/dapo-math-17k.parquet \
        --config.data.eval_kwargs.path=/data/aime-2024.parquet

Variant `:local` runs the same algorithm (clip-higher, dynamic sampling,
token-mean, soft overlong punishment, no KL) on the bundled SmolLM2-135M with
generated integer-answer arithmetic, on 2 CPU cores in minutes.

The same local run with another policy loss (grpo_jax/algorithms/
policy_losses.py), each at its paper's / verl's settings:
  :local_gspo       GSPO, ε 3e-4 / 4e-4, seq-mean-token-mean (fixed)
  :local_cispo      CISPO as verl: w = clip(ρ, 1-10, 1+0.2), token-mean
  :local_cispo_cap  CISPO as TRL: w = min(ρ, 5), token-mean
  :local_gmpo       GMPO, log-space clip 0.4, mean over sequences (fixed)
  :local_sapo       SAPO, τ+ 1.0 / τ- 1.05, seq-mean-token-mean (fixed)
Sampling in bfloat16 while the trainer runs in float32 (π_old recomputed by
the trainer, so ρ = π_old / π_rollout is what the sampler's dtype changes):
  :local_bf16       no correction
  :local_bf16_tis   token-level truncated IS, C = 2 (verl's default)
  :local_int8_tis   the paged sampler on int8 weights (W8A8) and int8 KV
                    pages, token TIS, C = 2 (docs/paged.md#int8-rollout-weights-and-pages)
Asynchronous rollouts (docs/async.md):
  :local_async      rows one policy version stale (a sampler thread samples
                    step u + 1 while the trainer updates on step u), on the
                    decoupled objective: π_old recomputed, token TIS, C = 2
LoRA (docs/lora.md: adapters on a frozen base, the base is the reference):
  :local_lora       the local run with rank-32 adapters on every projection,
                    10x the learning rate (LoRA Without Regret)
  :paper_lora       the paper's run with rank-32 adapters on 4 chips
                    (experiments/aot.py --topology=v5p:2x2x1 fits it; full
                    fine-tuning does not: 16 bytes x 32.8B parameters)
"""
from grpo_jax.config import base_config, pick_variant

_UNSET = ""   # fields a user must set; validated with a clear message


def dapo_common(c):
  """What makes GRPO into DAPO (the tunix view: a variant is a config)."""
  c.rl.eps_low, c.rl.eps_high = 0.2, 0.28     # clip-higher
  c.rl.loss_agg = "token-mean"                 # token-level loss (eq. 8)
  c.rl.kl_beta = 0.0                           # no KL, no reference model
  c.rl.dynamic_sampling = True                 # keep 0 < correct < G
  c.rl.overlong_filter = False                 # paper: soft punishment instead
  c.sampling.temperature, c.sampling.top_p = 1.0, 1.0
  return c


def paper(c):
  """The paper's run: Qwen2.5-32B base, 512 prompts x G=16, L_max 20480."""
  c.name = "dapo_aime"
  c.model.source = _UNSET                      # a Qwen2.5-32B (base) HF dir
  c.model.tokenizer = _UNSET
  c.model.param_dtype, c.model.compute_dtype = "float32", "bfloat16"
  c.model.remat = "full"
  c.data.source = "parquet"
  c.data.kwargs = dict(path=_UNSET, layout="dapo_math", strip_instructions=False)
  c.data.eval_source = "parquet"
  c.data.eval_kwargs = dict(path=_UNSET, layout="aime")
  c.data.template = "as_is"                    # DAPO-Math-17k ships its prompt
  c.sampling.max_new_tokens = 20480            # L_max
  c.rl.prompts_per_step, c.rl.num_generations = 512, 16
  c.rl.mini_batch_size = 512 * 16 // 16        # 16 updates per step
  # 64 rows of a 512-token prompt + L_max per micro-batch: one row per batch
  # shard on v5p:8x8x4 (experiments/aot.py: 58.5% of a chip, docs/pod.md)
  c.rl.micro_batch_tokens = 64 * (512 + 20480)
  c.rl.max_gen_batches = 3
  c.rewards = {"math_dapo": 1.0, "overlong": 1.0}
  c.reward_kwargs = {"overlong": dict(max_length=20480, cache_length=4096)}
  c.accuracy_reward = "math_dapo"
  c.optim.learning_rate, c.optim.warmup_steps = 1e-6, 20
  c.optim.weight_decay, c.optim.grad_clip = 0.1, 1.0
  c.train.steps = 400
  c.train.eval_every, c.train.eval_examples = 5, 30
  c.train.checkpoint_every = 5
  c.mesh.shape = (-1, 8, 4)    # 32B: FSDP 8 x tensor 4 per replica (docs/pod.md)
  # Sampler and trainer apart on v5p:8x8x4 (docs/pod.md, simulated):
  # rollout.sampler_devices = 128 at completions ~0.3 of the cap, 160 (with
  # rl.packing = "on") at ~0.5; with rollout.max_staleness >= 1.
  return c


def local(c):
  """The same algorithm at laptop scale: the README's first command."""
  c.name = "dapo_local"
  c.model.source = "smollm2-135m-instruct"
  c.model.remat = "dots"   # keeps the update under ~5 GB (none: ~9 GB)
  c.data.source = "arithmetic"
  c.data.kwargs = dict(num_examples=4000, levels=1, seed=0)
  c.data.eval_kwargs = dict(num_examples=200, levels=1, seed=12345)
  c.data.template = "last_number"
  c.data.system_prompt = "You are a concise math assistant."
  c.sampling.max_new_tokens = 32
  c.rl.prompts_per_step, c.rl.num_generations = 8, 8
  c.rl.max_gen_batches = 2
  c.rl.micro_batch_size = 16
  c.rewards = {"last_number": 1.0, "overlong": 1.0}
  c.reward_kwargs = {"overlong": dict(max_length=32, cache_length=8)}
  c.accuracy_reward = "last_number"
  c.optim.learning_rate, c.optim.warmup_steps = 2e-5, 2
  c.train.steps = 4
  c.train.eval_examples = 200
  return c


def _loss(name, agg, **fields):
  def variant(c):
    c = local(c)
    c.name = f"dapo_local_{name}"
    c.rl.policy_loss, c.rl.loss_agg = name, agg
    for key, value in fields.items():
      c.rl[key] = value
    return c
  return variant


def local_bf16(c):
  """The local run with a bfloat16 sampler and a float32 trainer."""
  c = local(c)
  c.name = "dapo_local_bf16"
  c.sampling.compute_dtype = "bfloat16"
  c.rl.old_logp = "recompute"        # decoupled: π_old from the trainer
  return c


def local_bf16_tis(c):
  """local_bf16 with token-level truncated IS, C = 2 (verl's default)."""
  c = local_bf16(c)
  c.name = "dapo_local_bf16_tis"
  c.rl.rollout_correction.is_level = "token"
  c.rl.rollout_correction.is_threshold = 2.0
  return c


def local_int8_tis(c):
  """local_bf16_tis with the sampler's weights and KV pages in int8 (the
  paged continuous-batching sampler; the trainer in float32)."""
  c = local_bf16_tis(c)
  c.name = "dapo_local_int8_tis"
  c.sampling.update(continuous_batching=True, kv_cache="paged",
                    weights_dtype="int8", kv_dtype="int8")
  return c


def local_async(c):
  """The local run with rows one version stale (rollout.max_staleness = 1):
  stale rows need a correction, so π_old is recomputed by the trainer and
  ρ = π_old / π_rollout truncated at 2 (validation refuses stale rows
  without one)."""
  c = local(c)
  c.name = "dapo_local_async"
  c.rollout.max_staleness = 1
  c.rl.old_logp = "recompute"
  c.rl.rollout_correction.is_level = "token"
  c.rl.rollout_correction.is_threshold = 2.0
  return c


def lora_common(c):
  """Rank-32 adapters on all seven projections (attention and MLP), α = 32
  (scale 1), and 10x full fine-tuning's learning rate: the settings of
  "LoRA Without Regret" (Schulman et al. 2025) for RL."""
  c.model.lora.rank, c.model.lora.alpha = 32, 32.0
  c.optim.learning_rate *= 10
  return c


def local_lora(c):
  """The local run with LoRA (compare with :local from the same seed)."""
  c = lora_common(local(c))
  c.name = "dapo_local_lora"
  return c


def paper_lora(c):
  """The paper's run with LoRA on 4 chips (v5p:2x2x1): the frozen base in
  bfloat16 (65.5 GB) split 4 ways, adapters + Adam state ~3 GB; one row of
  a micro-batch per chip."""
  c = lora_common(paper(c))
  c.name = "dapo_aime_lora"
  c.mesh.shape = (1, -1, 1)                    # FSDP over the 4 chips
  c.rl.micro_batch_tokens = 4 * (512 + 20480)
  return c


# The `:arg` values get_config accepts (no arg: paper), each a function
# of the base config; tests/test_architecture.py validates each and
# `run.py --list` names each.
VARIANTS = {
    "paper": paper, "local": local,
    "local_gspo": _loss("gspo", "seq-mean-token-mean", eps_low=3e-4,
                        eps_high=4e-4),
    "local_cispo": _loss("cispo", "token-mean", eps_low=10.0, eps_high=0.2),
    "local_cispo_cap": _loss("cispo_cap", "token-mean", cispo_cap=5.0),
    "local_gmpo": _loss("gmpo", "seq-mean-token-mean", gmpo_eps=0.4),
    "local_sapo": _loss("sapo", "seq-mean-token-mean", sapo_tau_pos=1.0,
                        sapo_tau_neg=1.05),
    "local_bf16": local_bf16, "local_bf16_tis": local_bf16_tis,
    "local_int8_tis": local_int8_tis,
    "local_async": local_async,
    "local_lora": local_lora, "paper_lora": paper_lora,
}


def get_config(arg=None):
  c = dapo_common(base_config())
  c.description = __doc__.splitlines()[0]
  return pick_variant(VARIANTS, arg, "paper", "configs/dapo_aime.py")(c)
