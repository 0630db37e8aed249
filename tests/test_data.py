"""The data layer: readers on files written here, TFDS on locally prepared copies,
generated tasks re-checked with Python arithmetic, templates and the iterator."""
import collections
import dataclasses
import json
import os
import re
import types
from unittest import mock

import pytest

import grpo_jax.envs  # noqa: F401  registers the calculator template, as every run does
from grpo_jax import data, errors
from grpo_jax.data import arithmetic, commonsense, generated, layouts
from grpo_jax.registry import lookup, names

# --------------------------------------------------------------------- rows
# One raw record per layout, with what it must parse to (question, answer).

_DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your "
                "response should be of the form Answer: $Answer (without quotes) where "
                "$Answer is the answer to the problem.\n\nFind $x$ if $2x = 14$.\n\n"
                'Remember to put your answer on its own line after "Answer:".')
ROWS = {
    "dapo_math": ({"data_source": "math_dapo",
                   "prompt": [{"role": "user", "content": _DAPO_PROMPT}],
                   "reward_model": {"ground_truth": "7", "style": "rule-based"},
                   "extra_info": {"index": "a1"}},
                  "Find $x$ if $2x = 14$.", "7"),
    "aime": ({"ID": "2024-I-1", "Problem": "How many...?", "Solution": "Count.", "Answer": 33},
             "How many...?", "33"),
    "gsm8k": ({"question": "Tom has 3 bags of 16. How many?",
               "answer": "3 bags of 16 is 3*16=<<3*16=48>>48.\n#### 48"},
              "Tom has 3 bags of 16. How many?", "48"),
    "math": ({"problem": "Compute $\\frac{2}{4}$.", "level": "Level 2", "type": "Prealgebra",
              "solution": "We get $\\boxed{1}$ first, then $\\boxed{\\frac{1}{2}}$."},
             "Compute $\\frac{2}{4}$.", "\\frac{1}{2}"),
}


def write_jsonl(path, records):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  return str(path)


def write_parquet(path, records):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(records), path)
  return str(path)


@pytest.mark.parametrize("layout", sorted(ROWS))
@pytest.mark.parametrize("reader, writer", [("jsonl", write_jsonl), ("parquet", write_parquet)])
def test_readers_parse_each_layout(tmp_path, layout, reader, writer):
  record, question, answer = ROWS[layout]
  path = writer(tmp_path / f"rows.{reader}", [record, record])
  for given in (layout, "auto"):
    examples = lookup("dataset", reader)(path=path, layout=given)
    assert len(examples) == 2
    assert (examples[0].question, examples[0].answer) == (question, answer)


def test_jsonl_and_parquet_agree(tmp_path):
  records = [ROWS["math"][0], {**ROWS["math"][0], "solution": "So $\\boxed{x^{2}}$."}]
  from_jsonl = data.read_jsonl(write_jsonl(tmp_path / "m.jsonl", records))
  from_parquet = data.read_parquet(write_parquet(tmp_path / "m.parquet", records))
  assert from_jsonl == from_parquet
  assert [e.answer for e in from_jsonl] == ["\\frac{1}{2}", "x^{2}"]
  assert from_jsonl[0].meta == {"type": "Prealgebra", "level": 2}


def test_gsm8k_rationale_and_gold(tmp_path):
  record = {"question": "q", "answer": "She earns 1,000 + 200 = <<1000+200=1200>>1200.\n#### 1,200"}
  (example,) = data.read_jsonl(write_jsonl(tmp_path / "g.jsonl", [record]), layout="gsm8k")
  assert example.answer == "1200"
  assert example.rationale == "She earns 1,000 + 200 = 1200."


def test_dapo_instructions_stripped_or_kept(tmp_path):
  path = write_parquet(tmp_path / "dapo.parquet", [ROWS["dapo_math"][0]])
  (stripped,) = data.read_parquet(path, layout="dapo_math")
  (kept,) = data.read_parquet(path, layout="dapo_math", strip_instructions=False)
  assert "Answer:" not in stripped.question
  assert kept.question == _DAPO_PROMPT
  assert stripped.meta == {"data_source": "math_dapo", "index": "a1"}


def test_aime_lowercase_fields_and_integer_answers(tmp_path):
  path = write_jsonl(tmp_path / "aime.jsonl", [{"problem": "p1", "answer": "033"},
                                               {"problem": "p2", "answer": 204.0}])
  assert [e.answer for e in data.read_jsonl(path, layout="aime")] == ["33", "204"]
  bad = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "p", "answer": "1/2"}])
  with pytest.raises(errors.DataError, match=r"bad\.jsonl line 1: field 'answer' should be an integer"):
    data.read_jsonl(bad, layout="aime")


def test_math500_answer_field_wins_over_boxed(tmp_path):
  record = {"problem": "p", "solution": "... \\boxed{0.5}", "answer": "\\frac12", "level": 3}
  (example,) = data.read_jsonl(write_jsonl(tmp_path / "m.jsonl", [record]))
  assert example.answer == "\\frac12" and example.meta["level"] == 3


@pytest.mark.parametrize("text, boxed", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\left\\{ 1, 2 \\right.}", "\\left\\{ 1, 2 \\right."),  # escaped brace, unpaired
    ("\\boxed{x^{2}+1} and more", "x^{2}+1"),
    ("the answer is $\\boxed 5$", "5"),
    ("\\fbox{3}", "3"),
    ("\\boxed{unclosed", None),
    ("no box here", None),
])
def test_last_boxed_handles_nested_braces(text, boxed):
  assert data.last_boxed(text) == boxed


def test_missing_field_error_names_file_line_and_field(tmp_path):
  path = write_jsonl(tmp_path / "gsm.jsonl", [ROWS["gsm8k"][0], {"question": "no answer here"}])
  with pytest.raises(errors.DataError, match=r"gsm\.jsonl line 2: missing field 'answer'"):
    data.read_jsonl(path, layout="gsm8k")


def test_missing_column_error_names_file_and_column(tmp_path):
  path = write_parquet(tmp_path / "dapo.parquet", [{"prompt": "p", "data_source": "x"}])
  with pytest.raises(errors.DataError, match=r"dapo\.parquet: missing column 'reward_model'"):
    data.read_parquet(path, layout="dapo_math")


@pytest.mark.parametrize("lines, message", [
    (['{"question": "q", "answer": "#### 1"}', "{not json"], r"line 2: not valid JSON"),
    (['["a", "list"]'], r"line 1: expected a JSON object"),
    (['{"question": "q", "answer": "no final line"}'], r"no final '#### <answer>' line"),
    (['{"q": 1, "a": 2}'], r"cannot tell the layout from fields \['a', 'q'\]"),
])
def test_bad_jsonl_files_fail_clearly(tmp_path, lines, message):
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(errors.DataError, match=message):
    data.read_jsonl(str(path))


def test_math_without_boxed_answer_fails_clearly(tmp_path):
  path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "solution": "it is 4"}])
  with pytest.raises(errors.DataError, match=r"m\.jsonl line 1: field 'solution' has no complete"):
    data.read_jsonl(path)


def test_unreadable_inputs_fail_clearly(tmp_path):
  with pytest.raises(errors.DataError, match="no such file"):
    data.read_jsonl(str(tmp_path / "absent.jsonl"))
  not_parquet = tmp_path / "x.parquet"
  not_parquet.write_text("plain text")
  with pytest.raises(errors.DataError, match=r"x\.parquet: not a readable Parquet file"):
    data.read_parquet(str(not_parquet))
  with pytest.raises(KeyError, match="known layouts"):
    data.read_jsonl(write_jsonl(tmp_path / "g.jsonl", [ROWS["gsm8k"][0]]), layout="gsm9k")


def test_limit(tmp_path):
  path = write_jsonl(tmp_path / "g.jsonl", [ROWS["gsm8k"][0]] * 5)
  assert len(data.read_jsonl(path, limit=3)) == 3
  assert len(data.read_parquet(write_parquet(tmp_path / "g.parquet", [ROWS["gsm8k"][0]] * 5),
                               limit=2)) == 2


# --------------------------------------------------------------------- TFDS
# Real TFDS builders, prepared from local raw files (download replaced), read
# through tfds.data_source: no TensorFlow anywhere.


@pytest.fixture(scope="module")
def tfds_data_dir(tmp_path_factory):
  pytest.importorskip("importlib_resources", reason="TFDS's builder code path imports it "
                      "(a dependency of etils[epath]) to prepare a data set")
  import tensorflow_datasets as tfds
  from tensorflow_datasets.datasets.math_dataset import math_dataset_dataset_builder

  root = tmp_path_factory.mktemp("tfds")
  raw = {split: write_jsonl(root / f"{split}.jsonl", [
      {"question": f"{split} question {i}", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"}
      for i in range(5)]) for split in ("train", "test", "train_socratic", "test_socratic")}
  with mock.patch.object(tfds.download.DownloadManager, "download_and_extract",
                         lambda self, urls: {k: raw[k] for k in urls}):
    data.prepare_tfds("gsm8k", str(root / "data"))

  # math_dataset's raw layout: alternating question and answer lines per module file.
  for category in ("train-easy", "train-medium", "train-hard", "interpolate"):
    folder = root / "raw" / "mathematics_dataset-v1.0" / category
    folder.mkdir(parents=True)
    (folder / "arithmetic__mul.txt").write_text(f"What is 6 * 7?\n42\n{category}: 2 * 3?\n6\n")
  # Preparing math_dataset is the one step that needs TensorFlow (tf.io.gfile.exists);
  # stand in for it with os.path so the rest of the real builder runs.
  gfile = types.SimpleNamespace(io=types.SimpleNamespace(gfile=types.SimpleNamespace(exists=os.path.exists)))
  with mock.patch.object(tfds.download.DownloadManager, "download_and_extract",
                         lambda self, url: str(root / "raw")), \
       mock.patch.object(math_dataset_dataset_builder, "tf", gfile):
    data.prepare_tfds("math_dataset/arithmetic__mul", str(root / "data"))
  return str(root / "data")


def test_tfds_gsm8k_reads_the_real_builder_output(tfds_data_dir):
  examples = lookup("dataset", "tfds")(name="gsm8k", split="test", data_dir=tfds_data_dir)
  assert isinstance(examples, data.tfds_source.TfdsExamples) and len(examples) == 5
  by_question = {e.question: e for e in examples}
  assert sorted(by_question) == [f"test question {i}" for i in range(5)]
  example = by_question["test question 3"]
  assert (example.answer, example.rationale) == ("6", "3 + 3 = 6")
  assert [e.question for e in examples[1:3]] == [examples[1].question, examples[2].question]
  assert len(data.read_tfds("gsm8k", split="train", data_dir=tfds_data_dir, limit=2)) == 2


def test_tfds_math_dataset_reads_question_answer(tfds_data_dir):
  examples = data.read_tfds("math_dataset/arithmetic__mul", split="test", data_dir=tfds_data_dir)
  assert sorted((e.question, e.answer) for e in examples) == [
      ("What is 6 * 7?", "42"), ("interpolate: 2 * 3?", "6")]
  train = data.read_tfds("math_dataset/arithmetic__mul", split="train", data_dir=tfds_data_dir)
  assert len(train) == 6


def test_tfds_missing_copy_says_how_to_prepare(tmp_path):
  with pytest.raises(errors.DataError, match=r"tfds build gsm8k --file_format=array_record"):
    data.read_tfds("gsm8k", data_dir=str(tmp_path))
  with pytest.raises(errors.DataError, match="no default layout"):
    data.read_tfds("mnist", data_dir=str(tmp_path))


def test_tfds_tfrecord_copy_is_refused_with_a_reason(tfds_data_dir, tmp_path):
  import shutil
  copy = tmp_path / "data"
  shutil.copytree(tfds_data_dir, copy)
  info_path = copy / "gsm8k" / "1.0.0" / "dataset_info.json"
  info = json.loads(info_path.read_text())
  info["fileFormat"] = "tfrecord"
  info_path.write_text(json.dumps(info))
  with pytest.raises(errors.DataError, match="Re-prepare it with --file_format=array_record"):
    data.read_tfds("gsm8k", split="test", data_dir=str(copy))


# ----------------------------------------------------------- generated tasks

TASKS = ["arithmetic", "countdown", "word_problems", "commonsense_mc"]


@pytest.mark.parametrize("task", TASKS)
def test_generated_sets_are_deterministic_and_seeded(task):
  make = lookup("dataset", task)
  first = make(num_examples=12, levels=[1, 2, 3], seed=7)
  assert first == make(num_examples=12, levels=[1, 2, 3], seed=7)
  assert first[:5] == make(num_examples=5, levels=[1, 2, 3], seed=7)  # prefix-stable
  assert [e.meta["level"] for e in first[:4]] == [1, 2, 3, 1]
  other = make(num_examples=12, levels=[1, 2, 3], seed=8)
  assert [e.question for e in first] != [e.question for e in other]


def test_arithmetic_answers_recomputed_with_python():
  for level in range(1, 8):
    spec = arithmetic.arithmetic_spec(level)
    for example in data.generated_examples("arithmetic", 40, level, seed=level):
      expression = re.fullmatch(r"What is (.*)\?", example.question).group(1)
      assert int(example.answer) == eval(expression)  # pylint: disable=eval-used
      numbers = re.findall(r"\d+", expression)
      assert len(numbers) == spec.num_operands
      assert all(len(n) == spec.digits for n in numbers)
      assert set(re.findall(r"[+\-*]", expression)) <= set(spec.operators)


def test_arithmetic_level_1_is_single_digit_addition():
  questions = {e.question for e in data.generated_examples("arithmetic", 200, 1, seed=0)}
  assert all(re.fullmatch(r"What is [1-9] \+ [1-9]\?", q) for q in questions)
  assert len(questions) > 50  # Spread over the 81 possible problems.


def test_countdown_is_solvable_and_checked_by_rule():
  for level in (1, 2, 3):
    count, largest = arithmetic.countdown_spec(level)
    for example in data.generated_examples("countdown", 30, level, seed=1):
      numbers, target = example.meta["numbers"], example.meta["target"]
      assert len(numbers) == count and all(1 <= n <= largest for n in numbers)
      assert 1 <= target <= 1000 and str(target) in example.question
      # The gold expression is a solution: Python agrees, every number used once.
      assert eval(example.answer) == target  # pylint: disable=eval-used
      assert sorted(map(int, re.findall(r"\d+", example.answer))) == sorted(numbers)
      assert data.countdown_check(example.answer, numbers, target)


@pytest.mark.parametrize("expression, ok", [
    ("(25 - 3) * 7", True), ("7 * (25 - 3) = 154", True), ("7 × (25 - 3)", True),
    ("(25 - 3) * 7 + 0", False),     # 0 is not one of the numbers
    ("(25 - 3) * 7 * 7", False),     # 7 used twice
    ("25 * 7", False),               # 3 unused
    ("25 ** 3 - 7", False),          # power is not allowed
    ("(25 - 3) / (7 - 7)", False),   # division by zero, and 7 twice
    ("22 * 7", False), ("", False), ("import os", False), ("(((", False),
])
def test_countdown_check(expression, ok):
  assert data.countdown_check(expression, [25, 3, 7], 154) is ok


def test_countdown_division_is_exact():
  assert data.countdown_check("(6 + 3) / 2 * 4", [6, 3, 2, 4], 18)
  assert not data.countdown_check("7 / 2 + 1", [7, 2, 1], 4)  # 4.5, not 4


def _replay(start, steps):
  """The word problem's answer recomputed from its recorded operations."""
  amount = start
  for op, *args in steps:
    amount = {"add": lambda: amount + args[0], "sub": lambda: amount - args[0],
              "mul": lambda: amount * args[0], "div": lambda: amount // args[0],
              "add_product": lambda: amount + args[0] * args[1]}[op]()
    assert amount >= 0
  return amount


def test_word_problems_answers_and_rationales():
  for level in (1, 2, 3, 4):
    for example in data.generated_examples("word_problems", 30, level, seed=3):
      steps = example.meta["steps"]
      assert len(steps) == level
      assert int(example.answer) == _replay(example.meta["start"], steps)
      assert example.rationale.endswith(f"The answer is {example.answer}.")
      for op, *args in steps:
        if op in ("add", "sub", "add_product"):
          assert all(str(a) in example.question for a in args)
      assert example.question.endswith("have now?")


def test_word_problem_divisions_are_exact():
  for example in data.generated_examples("word_problems", 200, 4, seed=5):
    amount = example.meta["start"]
    for op, *args in example.meta["steps"]:
      if op == "div":
        assert amount % args[0] == 0
      amount = _replay(amount, [(op, *args)])


def test_commonsense_answer_is_the_extreme_choice():
  letters = collections.Counter()
  for level in (1, 2, 3, 4, 5):
    for example in data.generated_examples("commonsense_mc", 40, level, seed=2):
      _, _, _, table = data.ATTRIBUTE_TABLES[example.meta["attribute"]]
      values = [table[c] for c in example.choices]
      best = max(values) if example.meta["direction"] == "max" else min(values)
      index = "ABCDEF".index(example.answer)
      assert values[index] == best and values.count(best) == 1
      assert len(example.choices) == level + 1
      assert f"({example.answer}) {example.choices[index]}" in example.question
      assert example.rationale.endswith(f"The answer is {example.answer}.")
      if level == 3:
        letters[example.answer] += 1
  assert set(letters) == set("ABCD")  # Shuffled: the answer is not always in one place.


def test_commonsense_tables_are_unambiguous():
  for attribute, (_, _, _, table) in data.ATTRIBUTE_TABLES.items():
    values = sorted(table.values())
    for low, high in zip(values, values[1:]):
      if attribute == "temperature":
        assert high - low >= 20, (attribute, low, high)
      else:
        assert high >= 2 * low, (attribute, low, high)


# ----------------------------------------------------------------- templates


def test_templates_are_registered_and_ask_for_their_format():
  assert names("template") == ["as_is", "boxed", "calculator", "dapo_answer", "last_number",
                               "r1_think"]
  wanted = {"r1_think": ["<think>", "</think>", "\\boxed{"], "boxed": ["\\boxed{}"],
            "dapo_answer": ["Answer: $Answer"], "last_number": ["number"], "as_is": [],
            "calculator": ["<calc>expression</calc>"]}
  question = "What is 2 + 3?"
  for name, phrases in wanted.items():
    messages = lookup("template", name)(question)
    assert [m["role"] for m in messages] == ["user"]
    assert question in messages[0]["content"]
    for phrase in phrases:
      assert phrase in messages[0]["content"], (name, phrase)
  assert lookup("template", "as_is")(question) == [{"role": "user", "content": question}]


def test_hint_only_when_asked():
  hint = data.answer_hint("5")
  assert hint == "The correct answer is 5."
  for name in names("template"):
    template = lookup("template", name)
    plain, hinted = template("What is 2 + 3?"), template("What is 2 + 3?", hint=hint)
    assert "Hint" not in plain[0]["content"] and hint not in plain[0]["content"]
    assert f"Hint: {hint}" in hinted[0]["content"]
    assert hinted[0]["content"].replace(f"\n\nHint: {hint}", "") == plain[0]["content"]


class _ChatTokenizer:
  """grpo_jax.models.tokenizer's interface."""

  def apply_chat_template(self, messages, add_generation_prompt=True):
    turns = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
    return turns + ("<assistant>" if add_generation_prompt else "")


class _HuggingFaceLikeTokenizer:
  """Returns token ids unless tokenize=False, as transformers does."""

  def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
    text = _ChatTokenizer().apply_chat_template(messages, add_generation_prompt)
    return [ord(c) for c in text] if tokenize else text


def test_render_prompt_adds_the_generation_prompt():
  messages = lookup("template", "as_is")("Q?")
  assert data.render_prompt(messages, _ChatTokenizer()) == "<user>Q?</user><assistant>"
  assert data.render_prompt(messages, _HuggingFaceLikeTokenizer()) == "<user>Q?</user><assistant>"


# ------------------------------------------------------------------ iterator


def _numbered(count):
  return [data.Example(question=str(i), answer=str(i)) for i in range(count)]


def _ids(batch):
  return [int(e.question) for e in batch]


def test_iterator_resumes_exactly_from_its_state():
  examples = _numbered(10)
  it = data.BatchIterator(examples, global_batch_size=4, seed=3)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.state_dict()))  # Survives a JSON checkpoint.
  expected = [_ids(next(it)) for _ in range(5)]
  resumed = data.BatchIterator.from_state(examples, state)
  assert [_ids(next(resumed)) for _ in range(5)] == expected


def test_iterator_epochs_cover_without_repeats_and_reshuffle():
  examples = _numbered(12)
  it = data.BatchIterator(examples, global_batch_size=4, seed=0)
  epochs = [sum((_ids(next(it)) for _ in range(3)), []) for _ in range(2)]
  assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(12))
  assert epochs[0] != epochs[1]
  assert it.state_dict()["epoch"] == 1
  unshuffled = data.BatchIterator(examples, global_batch_size=4, shuffle=False)
  assert _ids(next(unshuffled)) == [0, 1, 2, 3]


def test_host_slices_are_disjoint_and_complete():
  examples = _numbered(13)  # 13 mod 6 = 1 example skipped per epoch
  single = data.BatchIterator(examples, global_batch_size=6, seed=5)
  hosts = [data.BatchIterator(examples, global_batch_size=6, seed=5, host_index=i, host_count=3)
           for i in range(3)]
  for _ in range(5):  # Crosses an epoch boundary.
    parts = [_ids(next(h)) for h in hosts]
    assert all(len(p) == 2 for p in parts)
    assert len(set(sum(parts, []))) == 6  # disjoint
    assert sum(parts, []) == _ids(next(single))  # complete: the one-host batch


def test_hosts_index_only_their_own_examples():
  touched = set()

  class Recording(list):
    def __getitem__(self, i):
      touched.add(i)
      return super().__getitem__(i)

  examples = Recording(_numbered(8))
  batch = next(data.BatchIterator(examples, global_batch_size=8, seed=1, host_index=1, host_count=4))
  assert touched == set(_ids(batch)) and len(touched) == 2


def test_iterator_rejects_bad_settings():
  with pytest.raises(ValueError, match="multiple of host_count"):
    data.BatchIterator(_numbered(10), global_batch_size=5, host_count=2)
  with pytest.raises(ValueError, match="cannot fill one batch"):
    data.BatchIterator(_numbered(3), global_batch_size=4)
  state = data.BatchIterator(_numbered(10), global_batch_size=2).state_dict()
  with pytest.raises(ValueError, match="not the same data set"):
    data.BatchIterator.from_state(_numbered(11), state)


def test_registered_names():
  # The registry is open (other modules, e.g. STaR, add layouts): every name
  # this package documents must be there.
  assert {"arithmetic", "commonsense_mc", "countdown", "jsonl", "parquet", "tfds",
          "word_problems"} <= set(names("dataset"))
  assert {"aime", "dapo_math", "gsm8k", "math", "question_answer"} <= set(names("layout"))
  assert {"arithmetic", "commonsense_mc", "countdown", "word_problems"} <= set(names("task"))
  assert dataclasses.is_dataclass(data.Example)
  assert generated.generated_examples is data.generated_examples
  assert layouts.last_boxed is data.last_boxed and commonsense.letter(2) == "C"
