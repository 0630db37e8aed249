"""GRPO as in DeepSeekMath (Shao et al. 2024) on GSM8K: β 0.04, seq-mean-token-mean.

    python experiments/run.py --config=configs/grpo_gsm8k.py \
        --config.model.source=/ckpt/Qwen2.5-0.5B-Instruct \
        --config.data.kwargs.path=/data/gsm8k/train.jsonl \
        --config.data.eval_kwargs.path=/data/gsm8k/test.jsonl

or from TFDS (prepared once with `tfds build gsm8k --file_format=array_record`):
    --config.data.source=tfds --config.data.kwargs='{"name": "gsm8k", "split": "train", "data_dir": "/data/tfds"}'

`configs/grpo_gsm8k.py:gemma3_1b` is tunix's GRPO tutorial (examples/grpo_gemma.ipynb):
Gemma 3 1B-IT with LoRA, `--config.model.source=/ckpt/gemma-3-1b-it`.
"""
from grpo_jax.config import base_config, pick_variant


def deepseekmath(c):
  return c


def gemma3_1b(c):
  """tunix's tutorial: Gemma 3 1B-IT, LoRA r 64 / α 64 on every projection,
  G = 2, β 0.08, ε 0.2, 768 new tokens at temperature 0.9 / top-k 50, AdamW 3e-6 (b2 0.99, decay 0.1) with 10%
  warm-up then cosine, gradient clip 0.1, one prompt per step over 90% of
  GSM8K's 7,473 (3,364 steps). Not as tunix: its four regex rewards on
  <reasoning>/<answer> tags are this project's math verifier on a boxed
  answer (the `boxed` template), the same question and gold answer; and
  prompts are not cut at 256 tokens (GSM8K's fit: prompts are bucketed)."""
  c.name = "grpo_gsm8k_gemma3_1b"
  c.model.lora.update(rank=64, alpha=64.0)
  c.sampling.update(max_new_tokens=768, temperature=0.9, top_p=1.0, top_k=50)
  c.rl.update(prompts_per_step=1, num_generations=2, mini_batch_size=0,
              kl_beta=0.08)
  c.rl.eps_low = c.rl.eps_high = 0.2
  c.optim.update(learning_rate=3e-6, b1=0.9, b2=0.99, weight_decay=0.1,
                 schedule="cosine", grad_clip=0.1)
  c.train.steps = 3364
  c.optim.warmup_steps = c.train.steps // 10
  c.train.eval_every, c.train.eval_examples = 64, 256
  return c


# The `:arg` values get_config accepts (no arg: deepseekmath);
# tests/test_architecture.py validates each.
VARIANTS = {"deepseekmath": deepseekmath, "gemma3_1b": gemma3_1b}


def get_config(arg=None):
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
  return pick_variant(VARIANTS, arg, "deepseekmath",
                      "configs/grpo_gsm8k.py")(c)
