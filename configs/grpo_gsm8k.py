"""GRPO as in DeepSeekMath (Shao et al. 2024) on GSM8K: β 0.04, seq-mean-token-mean.

    python experiments/run.py --config=configs/grpo_gsm8k.py \
        --config.model.source=/ckpt/Qwen2.5-0.5B-Instruct \
        --config.data.kwargs.path=/data/gsm8k/train.jsonl \
        --config.data.eval_kwargs.path=/data/gsm8k/test.jsonl

or from TFDS (prepared once with `tfds build gsm8k --file_format=array_record`):
    --config.data.source=tfds --config.data.kwargs='{"name": "gsm8k", "split": "train", "data_dir": "/data/tfds"}'
"""
from grpo_jax.config import base_config, no_variants

# The `:arg` values get_config accepts ("": none);
# tests/test_architecture.py validates each.
VARIANTS = ("",)


def get_config(arg=None):
  no_variants(arg, "configs/grpo_gsm8k.py")
  c = base_config()
  c.name = "grpo_gsm8k"
  c.description = __doc__.splitlines()[0]
  c.model.source = ""                          # an instruct model, HF dir
  c.model.compute_dtype = "bfloat16"
  c.model.remat = "full"
  c.data.source = "jsonl"
  c.data.kwargs = dict(path="", layout="gsm8k")
  c.data.eval_source = "jsonl"
  c.data.eval_kwargs = dict(path="", layout="gsm8k")
  c.data.template = "boxed"
  c.sampling.max_new_tokens = 1024             # DeepSeekMath: max length 1024
  c.sampling.temperature = 1.0
  # 1,024 rows of long-tailed length per step: continuous batching decodes
  # them in slots that stay busy (benchmarks/ragged.py).
  c.sampling.continuous_batching = True
  # GRPO (DeepSeekMath §4.1): z-scored group advantage, per-sequence mean,
  # symmetric clip, k3 KL to the reference with β = 0.04; no DAPO additions.
  c.rl.advantage = "grpo"
  c.rl.loss_agg = "seq-mean-token-mean"
  c.rl.eps_low = c.rl.eps_high = 0.2
  c.rl.kl_beta, c.rl.kl_estimator = 0.04, "k3"
  c.rl.dynamic_sampling = False
  c.rl.prompts_per_step, c.rl.num_generations = 16, 64   # 64 samples/question
  c.rl.mini_batch_size = 256
  c.rewards = {"math": 1.0}
  c.accuracy_reward = "math"
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.train.steps = 500
  c.train.eval_every, c.train.eval_examples = 50, 1319
  c.train.checkpoint_every = 50
  return c
