"""An agent that uses a tool: SmolLM2-135M-Instruct learns to call a calculator on 3-operand arithmetic.

    python experiments/run.py --config=configs/tool_use.py:warm --workdir=workdirs/tool_use_warm

Three 3-digit operands with + - * (data level 5): a 135M model rarely gets them
right in its head. The `calculator` env (envs/calculator.py) answers a turn's
<calc>EXPR</calc> with the value; the episode's reward is the last number of
its last turn (`last_number`), trained with DAPO's token-mean loss over the
model's tokens only (docs/agents.md). `:local` is sized for 2 CPU cores;
`:warm` is it after an SFT warm-up on tool-call transcripts (the model
writes no call of its own before). `:pod` is the multi-turn fit check for
experiments/aot.py (Qwen2.5-7B, 8 turns, a 16K context).
"""
from grpo_jax.config import base_config, pick_variant


def default(c):
  return c


def local(c):
  """2 CPU cores: 4 prompts x 8 episodes a step, turns of 48 tokens."""
  c.name = "tool_use_local"
  c.rl.update(prompts_per_step=4, num_generations=8, micro_batch_size=8)
  c.sampling.max_new_tokens = 48
  c.train.steps = 60
  c.train.eval_every, c.train.eval_examples = 20, 64
  return c


def warm(c):
  """`:local` after a short SFT warm-up on generated tool-call transcripts
  (the model never writes a call of its own, docs/agents.md): a pipeline,
  SFT on two-turn transcripts (data source calculator_calls: a call
  `<calc>EXPRESSION</calc>`, then the answer after the tool's value), then
  RL with the calculator: about 30 min on 2 busy CPU cores."""
  c = local(c)
  c.name = "tool_use_warm"
  c.method = "pipeline"
  c.train.eval_at_start = False     # each stage evaluates at its end
  c.train.steps = 5
  c.train.eval_every, c.train.eval_examples = 5, 16
  c.star.batch_size = 8
  c.stages = (
      {"kind": "sft", "name": "warm_up", "overrides": {
          "data.source": "calculator_calls", "data.template": "calculator",
          "star.sft_steps": 8, "optim.learning_rate": 2e-5}},
      {"kind": "rl", "name": "rl"},
  )
  return c


def pod(c):
  """The multi-turn fit at pod scale (experiments/aot.py, docs/agents.md):
  Qwen2.5-7B, 8 turns of at most 1,536 tokens, observations of at most 511
  (+ the turn's last id: a 512-column prefill), 512-token prompts: a 16,377-
  column context per row; 64 prompts x G = 8 on the parked engine, bf16
  pages sized for every row's whole context (sampling.pages 0)."""
  c.name = "tool_use_pod"
  c.model.source = "qwen2.5-7b"
  c.model.update(param_dtype="float32", compute_dtype="bfloat16",
                 remat="full")
  c.env.update(max_turns=8, max_observation_tokens=511, engine="parked")
  c.sampling.update(max_new_tokens=1536, continuous_batching=True,
                    kv_cache="paged")
  c.rl.update(prompts_per_step=64, num_generations=8, mini_batch_size=128,
              micro_batch_size=16, dynamic_sampling=False)
  c.mesh.shape = (-1, 4, 4)    # 7B: FSDP 4 x tensor 4 per replica
  c.train.eval_examples = 16
  return c


# The `:arg` values get_config accepts (no arg: default);
# tests/test_architecture.py validates each.
VARIANTS = {"default": default, "local": local, "warm": warm, "pod": pod}


def get_config(arg=None):
  c = base_config()
  c.name = "tool_use"
  c.description = __doc__.splitlines()[0]
  c.model.source = "smollm2-135m-instruct"
  c.data.source = "arithmetic"
  c.data.kwargs = dict(num_examples=5000, levels=5, seed=0)
  c.data.eval_kwargs = dict(num_examples=200, levels=5, seed=12345)
  c.env.update(name="calculator", max_turns=3, max_observation_tokens=32,
               tool_timeout_s=5.0)
  c.sampling.max_new_tokens = 96
  c.sampling.temperature = 1.0
  c.rewards = {"last_number": 1.0}
  c.accuracy_reward = "last_number"
  # DAPO's objective: clip-higher, token-mean over the model's tokens.
  c.rl.update(loss_agg="token-mean", eps_low=0.2, eps_high=0.28,
              prompts_per_step=16, num_generations=8, dynamic_sampling=True,
              max_gen_batches=3, on_cap="fill")
  c.optim.update(learning_rate=1e-5, warmup_steps=5)
  c.train.steps = 200
  c.train.eval_every, c.train.eval_examples = 25, 200
  return pick_variant(VARIANTS, arg, "default", "configs/tool_use.py")(c)
