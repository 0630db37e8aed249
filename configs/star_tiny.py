"""STaR on the tiny random model: 2 outer iterations in seconds (tests, CI)."""
from grpo_jax.config import base_config, no_variants

# The `:arg` values get_config accepts ("": none);
# tests/test_architecture.py validates each.
VARIANTS = ("",)


def get_config(arg=None):
  no_variants(arg, "configs/star_tiny.py")
  c = base_config()
  c.name = "star_tiny"
  c.description = __doc__.splitlines()[0]
  c.method = "star"
  c.model.source = "tiny"
  c.model.logprob_chunk = 16
  c.data.source = "word_problems"
  c.data.kwargs = dict(num_examples=10, levels=1, seed=0)
  c.data.eval_kwargs = dict(num_examples=4, levels=1, seed=1)
  c.data.template = "last_number"
  c.sampling.max_new_tokens = 8
  c.sampling.temperature = 0.0        # greedy: eval and STaR share one program
  c.star.iterations = 2
  c.star.sample_batch = 4
  c.star.sft_steps = 2
  c.star.batch_size = 4
  c.star.micro_batch_size = 2
  c.star.pack = True
  c.optim.learning_rate = 1e-3
  c.train.eval_examples = 4
  c.train.progress = False
  c.train.plot = False
  c.eval.batch_size = 4
  return c
