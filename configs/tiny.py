"""Tiny random model, byte tokenizer, single-digit sums: tests and smoke runs."""
from grpo_jax.config import base_config, no_variants

# The `:arg` values get_config accepts ("": none);
# tests/test_architecture.py validates each.
VARIANTS = ("",)


def get_config(arg=None):
  no_variants(arg, "configs/tiny.py")
  c = base_config()
  c.name = "tiny"
  c.description = __doc__.splitlines()[0]
  c.model.source = "tiny"
  c.model.logprob_chunk = 16
  c.data.source = "arithmetic"
  c.data.kwargs = dict(num_examples=64, levels=1, seed=0)
  c.data.eval_kwargs = dict(num_examples=8, levels=1, seed=1)
  c.data.template = "last_number"
  c.sampling.max_new_tokens = 8
  c.rl.prompts_per_step = 2
  c.rl.num_generations = 4
  c.rl.dynamic_sampling = False
  c.rl.micro_batch_size = 4
  c.optim.learning_rate = 1e-3
  c.train.steps = 3
  c.train.eval_examples = 8
  c.train.progress = False
  c.train.plot = False
  return c
