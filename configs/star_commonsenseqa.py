"""STaR on the paper's data sets: CommonsenseQA or GSM8K, from JSONL or TFDS.

    python experiments/run.py --config=configs/star_commonsenseqa.py:commonsenseqa \
        --config.data.kwargs.path=/data/cqa/train_rand_split.jsonl \
        --config.data.eval_kwargs.path=/data/cqa/dev_rand_split.jsonl
    python experiments/run.py --config=configs/star_commonsenseqa.py:gsm8k \
        --config.data.kwargs.path=/data/gsm8k/train.jsonl \
        --config.data.eval_kwargs.path=/data/gsm8k/test.jsonl
    python experiments/run.py --config=configs/star_commonsenseqa.py:gsm8k_tfds \
        --config.data.kwargs.data_dir=/data/tfds \
        --config.data.eval_kwargs.data_dir=/data/tfds

CommonsenseQA rows may be the original JSONL (`question.stem`,
`question.choices`) or the Hugging Face layout (`question`, `choices.label`/
`choices.text`); its test split has no answers, so evaluate on the dev split
as the paper does. TFDS must be prepared once as array_record (see
grpo_jax/data/tfds_source.py). The paths have no default: validation names
the unset field. Any other model: --config.model.source=<HF dir or .gguf>.

Paper settings kept (Zelikman et al. 2022, §3-4): 40 fine-tuning steps in
the first outer iteration and 20% more each iteration, 8 sequences per step,
a constant learning rate, rationalisation on, every iteration fine-tuned from
the original model. Changed for the bundled 135M model: lr 1e-5 (GPT-J: 1e-6).
"""
from grpo_jax.config import base_config

_UNSET = ""   # a field the user must set; validation names it


def _common(c):
  c.method = "star"
  c.model.source = "smollm2-135m-instruct"
  c.star.iterations = 10
  c.star.rationalize = True
  c.star.sft_steps, c.star.sft_growth = 40, 1.2
  c.star.batch_size = 8
  c.star.pack = True
  c.optim.learning_rate, c.optim.schedule, c.optim.warmup_steps = 1e-5, "constant", 0
  c.train.eval_examples = 10_000          # the whole held-out split
  return c


def commonsenseqa(c, source="jsonl"):
  c.name = "star_commonsenseqa"
  c.data.source = c.data.eval_source = source
  c.data.kwargs = dict(path=_UNSET, layout="commonsenseqa")
  c.data.eval_kwargs = dict(path=_UNSET, layout="commonsenseqa")
  c.data.template = "dapo_answer"         # a last line "Answer: <letter>"
  c.rewards = {"multiple_choice": 1.0}
  c.accuracy_reward = "multiple_choice"
  c.sampling.max_new_tokens = 128         # paper: 96 tokens of rationale
  c.star.few_shot = 0                     # CQA has no gold rationales
  return c


def gsm8k(c, source="jsonl"):
  c.name = "star_gsm8k"
  c.data.source = c.data.eval_source = source
  if source == "tfds":
    c.data.kwargs = dict(name="gsm8k", split="train", data_dir=_UNSET)
    c.data.eval_kwargs = dict(name="gsm8k", split="test", data_dir=_UNSET)
  else:
    c.data.kwargs = dict(path=_UNSET, layout="gsm8k")
    c.data.eval_kwargs = dict(path=_UNSET, layout="gsm8k")
  c.data.template = "last_number"
  c.rewards = {"last_number": 1.0}
  c.accuracy_reward = "last_number"
  c.sampling.max_new_tokens = 256
  c.star.few_shot = 3                     # gold GSM8K rationales as exemplars
  return c


# The `:arg` values get_config accepts (no arg: commonsenseqa), each a function
# of the base config; tests/test_architecture.py validates each and
# `run.py --list` names each.
VARIANTS = {
    "commonsenseqa": commonsenseqa,
    "commonsenseqa_parquet": lambda c: commonsenseqa(c, "parquet"),
    "gsm8k": gsm8k,
    "gsm8k_tfds": lambda c: gsm8k(c, "tfds"),
}

def get_config(arg=None):
  arg = arg or "commonsenseqa"
  if arg not in VARIANTS:
    raise ValueError(f"unknown variant {arg!r}; known: {sorted(VARIANTS)}")
  c = _common(base_config())
  c.description = __doc__.splitlines()[0]
  return VARIANTS[arg](c)
