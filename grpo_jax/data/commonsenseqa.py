"""CommonsenseQA records (the STaR paper's data set) for the jsonl, parquet
and tfds readers: `layout="commonsenseqa"`.

Both the original JSONL (`question.stem`, `question.choices[]`) and the
Hugging Face layout (`question`, `choices.label` / `choices.text`) read; the
question is shown with lettered choices (`format_choices`), the gold answer
is the letter.
"""
from __future__ import annotations

from typing import Any, Mapping

from grpo_jax.data.commonsense import format_choices
from grpo_jax.data.example import Example
from grpo_jax.errors import DataError
from grpo_jax.registry import register


def _cqa_choices(record: Mapping[str, Any], where: str
                 ) -> tuple[str, list[str], list[str]]:
  """(stem, labels, texts) from the original JSONL (`question.stem`,
  `question.choices[]`) or the Hugging Face layout (`question`,
  `choices.label` / `choices.text`)."""
  question = record.get("question")
  if isinstance(question, Mapping):
    stem, choices = question.get("stem"), question.get("choices")
  else:
    stem, choices = question, record.get("choices")
  if isinstance(choices, Mapping):
    labels, texts = list(choices.get("label") or []), list(choices.get("text") or [])
  elif isinstance(choices, (list, tuple)):
    labels = [c.get("label") for c in choices]
    texts = [c.get("text") for c in choices]
  else:
    raise DataError(f"{where}: no 'choices' (CommonsenseQA layout)")
  if not isinstance(stem, str) or not stem.strip():
    raise DataError(f"{where}: no question text ('question' or "
                    f"'question.stem')")
  return stem.strip(), labels, texts


@register("layout", "commonsenseqa")
def commonsenseqa_example(record: Mapping[str, Any], where: str) -> Example:
  """A CommonsenseQA row; the answer is `answerKey`, a letter A-E (the
  public test split has none: use the validation split as held-out)."""
  stem, labels, texts = _cqa_choices(record, where)
  letters = [chr(ord("A") + i) for i in range(len(texts))]
  if [str(l).upper() for l in labels] != letters or not all(texts):
    raise DataError(f"{where}: choices should be labelled {letters} in "
                    f"order, with text; got labels {labels}")
  gold = str(record.get("answerKey") or "").strip().upper()
  if gold not in letters:
    raise DataError(f"{where}: field 'answerKey' = {gold!r} is not one of "
                    f"{letters}")
  return Example(question=format_choices(stem, tuple(texts)), answer=gold,
                 choices=tuple(texts), meta={"id": record.get("id")})
