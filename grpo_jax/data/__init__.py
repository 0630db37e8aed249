"""Data: problems as `Example`s, from files, TFDS or generators; prompts; batches.

Everything chosen by name in a config is registered (see grpo_jax.registry):

- kind "dataset": jsonl, parquet, tfds, arithmetic, countdown, word_problems,
  commonsense_mc; each `(**kwargs) -> Sequence[Example]`.
- kind "layout": dapo_math, aime, gsm8k, math, question_answer, commonsenseqa
  (record -> Example).
- kind "task": arithmetic, countdown, word_problems, commonsense_mc
  (`(rng, level) -> Example`, used by the generated data sets).
- kind "template": r1_think, boxed, dapo_answer, last_number, as_is
  (`(question, hint=None) -> messages`).

    examples = lookup("dataset", config.data.source)(**config.data.kwargs)
    messages = lookup("template", config.data.template)(examples[0].question)
    prompt = render_prompt(messages, tokenizer)
    prompts = render_prompts(tokenizer, config.data.template, questions,
                             config.data.system_prompt)   # the same, many
"""
from grpo_jax.data.arithmetic import arithmetic_spec, countdown_check, countdown_spec
from grpo_jax.data.commonsense import ATTRIBUTE_TABLES, format_choices
from grpo_jax.data.commonsenseqa import commonsenseqa_example
from grpo_jax.data.example import Example
from grpo_jax.data.files import read_jsonl, read_parquet
from grpo_jax.data.generated import generated_examples
from grpo_jax.data.iterator import BatchIterator
from grpo_jax.data.layouts import detect_layout, last_boxed, strip_answer_instructions
from grpo_jax.data.templates import Messages, answer_hint, render_prompt, render_prompts
from grpo_jax.data.tfds_source import prepare_tfds, read_tfds
