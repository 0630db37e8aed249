"""STaR on the bundled SmolLM2-135M with generated tasks, on 2 CPU cores.

    python experiments/run.py --config=configs/star_local.py:word_problems
    python experiments/run.py --config=configs/star_local.py:word_problems \
        --config.star.rationalize=False          # the paper's ablation
    python experiments/run.py --config=configs/star_local.py:commonsense_mc
    python experiments/run.py --config=configs/star_local.py:word_problems_lora

word_problems_lora: word_problems fine-tuning rank-32 adapters on every
projection (a fresh B = 0 each outer iteration: "fine-tune the original
model" is "fresh adapters on the frozen original"), 10x the learning rate.

word_problems: one-step integer word problems with worked rationales
(grpo_jax/data/word_problems.py), scored by the last number.
commonsense_mc: "which of these is the heaviest/fastest/..." with three
lettered choices (grpo_jax/data/commonsense.py), scored by the letter.

The algorithm is the paper's (rationalisation, every iteration fine-tuned
from the original model, +20% steps per iteration); the scale is a CPU's:
64 problems, 8 -> 10 -> 12 fine-tuning steps of 2 packed rows, 64-token
greedy rationales. word_problems adds the paper's few-shot prompt set (3 of
the 64 problems as worked exemplars, hinted under rationalisation) in
iteration 1 and keeps a rationalisation only if its reasoning derives the
answer with true arithmetic (see word_problems below). Measured on
word_problems (64 held-out, greedy accuracy, iterations 0-3;
docs/results.md, 7.5 and 5.7 min on 2 cores): with rationalisation 7.8 -> 46.9 ->
37.5 -> 53.1 (kept directly + by rationalisation: 12+9, 33+11, 23+7);
without 7.8 -> 45.3 -> 25.0 -> 35.9 (kept 12, 28, 24). Without the few-shot
exemplars and the reasoning check, the 135M model's hinted samples echo the
hint ("1. The answer is 31. 2. The answer is 31. ...") and tuning on them
made rationalisation hurt. On commonsense_mc (measured at commit f08e7e1)
both reach 23.4 -> 45.3 -> 45.3, but degenerately: the tuned model answers
"A" every time (29 of the 64 held-out answers are A); most kept examples
were correct "A" guesses, so the correctness filter amplified a position bias.
"""
from grpo_jax.config import base_config


def word_problems(c):
  c.data.source = "word_problems"
  c.data.kwargs = dict(num_examples=64, levels=1, seed=0)
  c.data.eval_kwargs = dict(num_examples=64, levels=1, seed=12345)
  c.data.template = "last_number"
  c.rewards = {"last_number": 1.0}
  c.accuracy_reward = "last_number"
  c.star.iterations = 3
  # The paper's prompt set P: 3 problems (out of the 64) with their worked
  # rationales as few-shot turns in the sampling prompts of iteration 1;
  # under a hint each exemplar shows its own hint, so the rationalisation
  # prompt demonstrates how to reach a hinted answer. Stored and evaluated
  # prompts are zero-shot, so a tuned M_n samples zero-shot too (in a run
  # that kept P in every iteration, M_2 prompted with P solved 26% of the
  # problems, against 45% held-out zero-shot).
  c.star.few_shot = 3
  c.star.few_shot_first_only = True
  # A rationalisation is kept only if its reasoning reaches the answer
  # before the final line states it, with true arithmetic (star.reasoning,
  # equations.arithmetic_holds): at 135M many hinted replies echo the hinted
  # number, assert it after unrelated arithmetic or force it into a false
  # equation ("23 + 4 = 19").
  c.star.rationale_reasoning_check = True
  return c


def commonsense_mc(c):
  c.data.source = "commonsense_mc"
  c.data.kwargs = dict(num_examples=64, levels=2, seed=0)
  c.data.eval_kwargs = dict(num_examples=64, levels=2, seed=12345)
  c.data.template = "dapo_answer"      # a last line "Answer: <letter>"
  c.rewards = {"multiple_choice": 1.0}
  c.accuracy_reward = "multiple_choice"
  return c


def word_problems_lora(c):
  c = word_problems(c)
  c.model.lora.rank, c.model.lora.alpha = 32, 32.0
  c.optim.learning_rate *= 10
  return c


# The `:arg` values get_config accepts (no arg: word_problems), each a function
# of the base config; tests/test_architecture.py validates each and
# `run.py --list` names each.
VARIANTS = {"word_problems": word_problems, "commonsense_mc": commonsense_mc,
            "word_problems_lora": word_problems_lora}

def get_config(arg=None):
  arg = arg or "word_problems"
  if arg not in VARIANTS:
    raise ValueError(f"unknown task {arg!r}; known: {sorted(VARIANTS)}")
  c = base_config()
  c.name = f"star_{arg}"
  c.description = __doc__.splitlines()[0]
  c.method = "star"
  c.model.source = "smollm2-135m-instruct"
  c.data.system_prompt = "You are a concise assistant."
  c.sampling.max_new_tokens = 64
  c.sampling.temperature = 0.0        # greedy rationales (one sampler program)
  c.star.iterations = 2
  c.star.sample_batch = 64
  c.star.sft_steps = 8
  c.star.batch_size = 2               # rows of 256 tokens, ~2 examples each
  c.star.pack = True
  c.star.row_length = 256
  c.optim.learning_rate = 5e-5
  c.train.eval_examples = 64
  c.eval.batch_size = 64
  return VARIANTS[arg](c)
