"""Record layouts of the public math data sets, each mapped to an `Example`.

A layout is a function `(record: Mapping, where: str, **options) -> Example`
registered under kind "layout"; `where` ("data.jsonl line 3") prefixes every
error so a bad file is found at once. File readers and the TFDS source share
these, so a GSM8K row parses the same from JSONL, Parquet or TFDS.

| layout | fields | gold answer |
| --- | --- | --- |
| dapo_math | `prompt` (chat messages), `reward_model.ground_truth` | ground_truth |
| aime | `Problem`/`problem`, `Answer`/`answer` (integer) | str(int) |
| gsm8k | `question`, `answer` ending in `#### 42` | text after `####` |
| math | `problem`, `solution` (with `\\boxed{}`), `level`, `type` | `answer` field, else last `\\boxed{}` |
| question_answer | `question`, `answer` | answer as is |

A gold answer that is empty or blank (`"answer": ""`, a solution whose only
box is `\\boxed{}`) can score nothing and is refused by the readers, naming
the record (`empty_answer_error`), unless they are told `on_empty_answer="drop"`.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from grpo_jax.data.example import Example
from grpo_jax.errors import DataError
from grpo_jax.registry import register

# Fields that identify each layout, checked in this order by `detect_layout`
# (MATH-500 rows carry `answer` too, so `math` must be tried before `aime`).
REQUIRED_FIELDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "dapo_math": (("prompt",), ("reward_model",)),
    "math": (("problem",), ("solution",)),
    "aime": (("Problem", "problem"), ("Answer", "answer")),
    "gsm8k": (("question",), ("answer",)),
}


# Where each layout reads its gold answer (named when the answer is empty).
GOLD_ANSWER = {
    "dapo_math": "field 'reward_model.ground_truth'",
    "aime": "field 'Answer'",
    "gsm8k": "the text after '####' in field 'answer'",
    "math": "field 'answer', else the last \\boxed{} of field 'solution'",
    "question_answer": "field 'answer'",
    "commonsenseqa": "field 'answerKey'",
}
# What a reader does with a record whose gold answer is empty or blank.
ON_EMPTY_ANSWER = ("error", "drop")


def empty_answer_error(where: str, layout: str) -> DataError:
  """The error for a record whose gold answer is empty or blank."""
  source = GOLD_ANSWER.get(layout, "the layout's answer")
  return DataError(
      f"{where}: the gold answer is empty ({source}, {layout} layout), so no "
      "completion can be scored against it: fix or remove the record, or pass "
      "on_empty_answer='drop' in the data kwargs to skip such records")


def detect_layout(fields: Iterable[str], where: str) -> str:
  """The first layout whose required fields are all among `fields`."""
  present = set(fields)
  for layout, groups in REQUIRED_FIELDS.items():
    if all(present.intersection(group) for group in groups):
      return layout
  wanted = {k: [g[0] for g in v] for k, v in REQUIRED_FIELDS.items()}
  raise DataError(
      f"{where}: cannot tell the layout from fields {sorted(present)}; "
      f"known layouts and their fields: {wanted}")


def missing_fields(layout: str, fields: Iterable[str]) -> list[str]:
  """Required fields of `layout` absent from `fields` (first spelling named)."""
  present = set(fields)
  return [g[0] for g in REQUIRED_FIELDS.get(layout, ()) if not present.intersection(g)]


def _field(record: Mapping[str, Any], names: tuple[str, ...], where: str, layout: str) -> Any:
  """The value of the first of `names` in `record`; a clear error if none is set."""
  for name in names:
    if record.get(name) is not None:
      return record[name]
  raise DataError(
      f"{where}: missing field {names[0]!r} (the {layout} layout needs it); "
      f"fields present: {sorted(record)}")


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced.

  `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`; `\\boxed 5` gives `5`;
  escaped braces (`\\{`) do not count. None when there is no complete box.
  """
  boxed, fbox = text.rfind("\\boxed"), text.rfind("\\fbox")
  if boxed < 0 and fbox < 0:
    return None
  rest = text[boxed + len("\\boxed"):] if boxed > fbox else text[fbox + len("\\fbox"):]
  if rest[:1] == " ":
    token = rest.split(None, 1)
    return token[0].rstrip("$.") if token else None
  return _braced(rest) if rest[:1] == "{" else None


def _braced(text: str) -> str | None:
  """The content of the brace group opening at text[0], or None if unclosed."""
  depth, i = 0, 0
  while i < len(text):
    char = text[i]
    if char == "\\":
      i += 2  # An escaped character, e.g. \{ or \}, never opens or closes.
      continue
    depth += {"{": 1, "}": -1}.get(char, 0)
    if depth == 0:
      return text[1:i]
    i += 1
  return None


_DAPO_FORMAT_LINE = re.compile(r"Answer:\s*\$Answer")
_DAPO_REMINDER = re.compile(r"^Remember to put your answer .*Answer:", re.S)


def strip_answer_instructions(prompt: str) -> str:
  """Removes DAPO-Math-17k's own answer-format paragraphs around the problem.

  Its prompts are `<instruction naming "Answer: $Answer">\\n\\n<problem>\\n\\n
  <reminder to put the answer after "Answer:">`; only those two paragraphs go.
  """
  paragraphs = prompt.strip().split("\n\n")
  if len(paragraphs) > 1 and _DAPO_FORMAT_LINE.search(paragraphs[0]):
    paragraphs = paragraphs[1:]
  if len(paragraphs) > 1 and _DAPO_REMINDER.match(paragraphs[-1]):
    paragraphs = paragraphs[:-1]
  return "\n\n".join(paragraphs).strip()


def _user_text(prompt: Any, where: str) -> str:
  """The text of the last user message of a chat `prompt` (or the prompt string)."""
  if isinstance(prompt, str):
    return prompt
  users = [m.get("content") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
  if not users or not isinstance(users[-1], str):
    raise DataError(f"{where}: field 'prompt' has no user message with text content")
  return users[-1]


def _integer_text(value: Any, where: str, field: str) -> str:
  """An integer answer as canonical text ("033" and 33.0 become "33")."""
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise DataError(f"{where}: field {field!r} should be an integer, got {value!r}") from None
  if not number.is_integer():
    raise DataError(f"{where}: field {field!r} should be an integer, got {value!r}")
  return str(int(number))


@register("layout", "dapo_math")
def dapo_math_example(record: Mapping[str, Any], where: str,
                      strip_instructions: bool = True) -> Example:
  """A verl-style row: `prompt` chat messages, `reward_model.ground_truth`.

  With `strip_instructions` (default) the question is the bare problem and the
  configured template adds the answer format; pass False (and the "as_is"
  template) to train on DAPO's prompt exactly as shipped.
  """
  prompt = _user_text(_field(record, ("prompt",), where, "dapo_math"), where)
  reward_model = _field(record, ("reward_model",), where, "dapo_math")
  if not isinstance(reward_model, Mapping):
    raise DataError(f"{where}: field 'reward_model' should be a mapping with 'ground_truth'")
  gold = _field(reward_model, ("ground_truth",), f"{where} reward_model", "dapo_math")
  extra = record.get("extra_info") or {}
  meta = {"data_source": record.get("data_source"), "index": extra.get("index")}
  question = strip_answer_instructions(prompt) if strip_instructions else prompt
  return Example(question=question, answer=_gold_text(gold, where),
                 meta={k: v for k, v in meta.items() if v is not None})


def _gold_text(gold: Any, where: str) -> str:
  """`reward_model.ground_truth` as the answer text: a value, or a list
  (a parquet array) of exactly one; several golds are refused, naming the
  row (their text, "['2', '3']", would never match an answer)."""
  if hasattr(gold, "tolist") and not isinstance(gold, (str, bytes)):
    gold = gold.tolist()
  if isinstance(gold, (list, tuple)):
    if len(gold) != 1:
      raise DataError(f"{where}: field 'reward_model.ground_truth' is a list of "
                      f"{len(gold)} answers {gold!r}; one answer per row is supported "
                      "(a list of one is read as that answer)")
    gold = gold[0]
  return str(gold).strip()


@register("layout", "aime")
def aime_example(record: Mapping[str, Any], where: str) -> Example:
  """AIME rows: `Problem`/`problem`, integer `Answer`/`answer`, optional `Solution`."""
  question = _field(record, ("Problem", "problem"), where, "aime")
  answer = _field(record, ("Answer", "answer"), where, "aime")
  solution = record.get("Solution") or record.get("solution")
  meta = {k: record[k] for k in ("ID", "id", "url", "year") if record.get(k) is not None}
  return Example(question=str(question).strip(),
                 answer=_integer_text(answer, where, "answer"),
                 rationale=solution, meta=meta)


_CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")


@register("layout", "gsm8k")
def gsm8k_example(record: Mapping[str, Any], where: str) -> Example:
  """GSM8K rows: the gold follows the final `####` (commas dropped: "1,000" -> "1000").

  The rationale is the text before `####`, without the `<<48/2=24>>`
  calculator annotations.
  """
  question = _field(record, ("question",), where, "gsm8k")
  solution = str(_field(record, ("answer",), where, "gsm8k"))
  if "####" not in solution:
    raise DataError(f"{where}: field 'answer' has no final '#### <answer>' line")
  rationale, gold = solution.rsplit("####", 1)
  gold = gold.strip().replace(",", "")
  if not gold:
    raise DataError(f"{where}: field 'answer' has nothing after '####'")
  return Example(question=str(question).strip(), answer=gold,
                 rationale=_CALCULATOR_NOTE.sub("", rationale).strip())


def _math_level(level: Any) -> Any:
  """MATH's "Level 3" as the int 3; anything else ("Level ?") unchanged."""
  match = re.fullmatch(r"Level (\d+)", str(level))
  return int(match.group(1)) if match else level


@register("layout", "math")
def math_example(record: Mapping[str, Any], where: str) -> Example:
  """MATH rows: gold is the `answer` field if present (MATH-500), else the
  last `\\boxed{}` of `solution`."""
  question = _field(record, ("problem",), where, "math")
  solution = str(_field(record, ("solution",), where, "math"))
  gold = record.get("answer")
  gold = last_boxed(solution) if gold is None else str(gold)
  if gold is None:
    raise DataError(f"{where}: field 'solution' has no complete \\boxed{{...}} answer")
  meta = {"type": record.get("type"), "level": _math_level(record.get("level"))}
  return Example(question=str(question).strip(), answer=gold.strip(), rationale=solution,
                 meta={k: v for k, v in meta.items() if v is not None})


@register("layout", "question_answer")
def question_answer_example(record: Mapping[str, Any], where: str) -> Example:
  """Plain `question`/`answer` rows (TFDS math_dataset); the answer is kept as is."""
  question = _field(record, ("question",), where, "question_answer")
  answer = _field(record, ("answer",), where, "question_answer")
  return Example(question=str(question).strip(), answer=str(answer).strip())
