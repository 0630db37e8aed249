"""GRPO with process vs outcome supervision (DeepSeekMath §4.1.3), SmolLM2 on word problems.

    python experiments/run.py --config=configs/grpo_process.py:local
    python experiments/run.py --config=configs/grpo_process.py:local_outcome

:local rewards every step: each stand-alone equation "a op b = c" is a step
(reward 1 if it holds, 0 if not; the "equations" process reward in
grpo_jax/rewards/process.py) and the final answer is the last step (1 if the
last number is right). The step rewards of all G completions of a prompt are
z-scored together and token t's advantage is the sum of the normalised
rewards of the steps ending at or after t. :local_outcome is the same run
with one reward per completion (the last number) and GRPO's z-scored
outcome advantage; it still logs the process reward's process/* metrics
(equations written, fraction that hold), which do not enter its loss. Both
run 12 steps of 8 prompts x G=8 at a constant learning rate of 2e-5 after 2
warm-up steps, with greedy accuracy on 128 held-out problems at steps 0, 4,
8 and 12 (binomial standard error about 0.03 at the starting accuracy).
Both without dynamic sampling (DeepSeekMath has none), so
a group whose answers are all wrong still teaches through its equations
under process supervision, and teaches nothing under outcome supervision.
"""
from grpo_jax.config import base_config, pick_variant


def local(c):
  """Process supervision: each equation that holds, then the answer."""
  c.name = "grpo_process_local"
  c.model.source = "smollm2-135m-instruct"
  c.model.remat = "dots"
  c.data.source = "word_problems"
  c.data.kwargs = dict(num_examples=512, levels=1, seed=0)
  c.data.eval_kwargs = dict(num_examples=128, levels=1, seed=12345)
  c.data.template = "last_number"
  c.sampling.max_new_tokens = 48
  c.rl.prompts_per_step, c.rl.num_generations = 8, 8
  c.rl.micro_batch_size = 16
  c.rl.advantage = "grpo_process"
  c.rl.process_reward = "equations"
  c.rl.loss_agg = "seq-mean-token-mean"       # DeepSeekMath eq. 3
  c.rl.eps_low = c.rl.eps_high = 0.2
  c.rl.kl_beta = 0.0                          # no reference model on 2 cores
  c.rl.dynamic_sampling = False
  c.rewards = {"last_number": 1.0}
  c.accuracy_reward = "last_number"
  c.optim.learning_rate, c.optim.warmup_steps = 2e-5, 2
  c.train.steps = 12
  c.train.eval_every = 4                      # held-out curve: 0, 4, 8, 12
  c.train.eval_examples = 128                 # binomial s.e. <= 0.044
  return c


def local_outcome(c):
  """The same run with outcome supervision (one reward per completion)."""
  c = local(c)
  c.name = "grpo_outcome_local"
  c.rl.advantage = "grpo"
  return c


# The `:arg` values get_config accepts (no arg: local), each a function
# of the base config; tests/test_architecture.py validates each and
# `run.py --list` names each.
VARIANTS = {"local": local, "local_outcome": local_outcome}


def get_config(arg=None):
  c = base_config()
  c.description = __doc__.splitlines()[0]
  return pick_variant(VARIANTS, arg, "local", "configs/grpo_process.py")(c)
