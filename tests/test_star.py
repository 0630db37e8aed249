"""STaR: hint-free stored examples, fine-tuning from the original weights,
the 20% step growth, config errors, and a 2-iteration run end to end.

A scripted sampler (a model that copies the hint) makes every outcome known
in advance; the CLI smoke run uses the real sampler on the tiny model."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax import errors, validation
from grpo_jax.algorithms import star
from grpo_jax.data import Example, answer_hint, commonsenseqa, templates
from grpo_jax.generate import sampling
from grpo_jax.models.byte_tokenizer import byte_tokenizer
from grpo_jax.rewards import equations
from grpo_jax.rl.spec import RunSpec
from grpo_jax.star import collect as star_collect
from grpo_jax.star import loop as star_loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = byte_tokenizer()


def _config(**star_fields):
  spec = importlib.util.spec_from_file_location(
      "star_tiny", os.path.join(ROOT, "configs", "star_tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  # "What is a + b?" with single digits: the scripted model can solve some.
  c.data.source = "arithmetic"
  c.data.kwargs = dict(num_examples=12, levels=1, seed=0)
  c.sampling.max_new_tokens = 32
  c.star.sample_batch = 16               # one sampler call per phase
  c.star.update(star_fields)
  return c


def _reply(prompt: str) -> str:
  """The scripted model: solves sums whose first term a is odd; given the
  answer n as a hint, cites the hint when n is even (saying "hint" or
  repeating it), else derives n when 4 divides a, forces it into a false
  equation ("a - b = n") when a = 6 mod 8 and only asserts it otherwise."""
  a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1])
  hints = re.findall(r"Hint: The correct answer is (-?\d+)\.", prompt)
  if hints:   # the last one: exemplars show their own hints first
    n = int(hints[-1])
    if n % 2 == 0:
      return f"The hint says {n}." if n % 4 else f"The correct answer is {n}."
    if a % 4 == 0:
      return f"{a} + {b} = {n}.\nSo it is {n}."
    return f"{a} - {b} = {n}.\nSo it is {n}." if a % 8 == 6 else f"So it is {n}."
  return f"{a} + {b} = {a + b}." if a % 2 else "It is 0."


class ScriptedSampler:
  """Stands in for sampling.Sampler.sample: the reply of `_reply`, then the
  stop id; records the parameters each call was given."""

  def __init__(self):
    self.params_seen = []
    self.prompts_seen = []

  def __call__(self, sampler, params, prompts, key, num_generations=1,
               batch_multiple=1):
    del key, batch_multiple
    cfg = sampler.sampling
    self.params_seen.append(jax.tree.map(np.array, params))
    self.prompts_seen.append([TOK.decode(p) for p in prompts])
    T = cfg.max_new_tokens
    rows = [TOK.encode(_reply(TOK.decode(p))) + [cfg.stop_ids[0]]
            for p in prompts for _ in range(num_generations)]
    tokens = np.full((len(rows), T), cfg.pad_id, np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(r)] = r
    length = np.array([len(r) for r in rows], np.int32)
    mask = np.arange(T)[None] < length[:, None]
    return sampling.Samples(tokens, np.zeros((len(rows), T), np.float32), mask,
                            length, np.zeros(len(rows), bool), np.int32(T))


@pytest.fixture
def scripted(monkeypatch):
  sampler = ScriptedSampler()
  monkeypatch.setattr(sampling.Sampler, "sample",
                      lambda self, *args: sampler(self, *args))
  return sampler


def _problems(n=12):
  """a = 1..n, b = 1, 2, 3, 1, ...: answers of both parities."""
  return [Example(question=f"What is {i + 1} + {i % 3 + 1}?",
                  answer=str(i + 1 + i % 3 + 1)) for i in range(n)]


def _collect(config, problems, shots=()):
  from grpo_jax.harness.experiment import load_model_and_tokenizer  # pylint: disable=g-import-not-at-top
  model_config, params, tokenizer = load_model_and_tokenizer(config)
  sampler = star_collect.RationaleSampler.of(
      RunSpec.from_config(config, tokenizer), config.star, model_config,
      tokenizer)
  return star_collect.collect_examples(config, sampler, params, problems,
                                       shots, jax.random.key(0))


def test_render_is_the_rollout_prompt_without_hint_or_shots():
  q = "What is 2 + 3?"
  plain = templates.render_prompts(TOK, "last_number", [q], "Be brief.")[0]
  assert star_collect.render(TOK, "last_number", q, "Be brief.") == plain
  shot = Example("What is 1 + 1?", "2", rationale="1 + 1 = 2. The answer is 2.")
  hinted = star_collect.render(TOK, "last_number", q, "", hint=answer_hint("5"),
                       shots=[shot])
  # The exemplar shows its gold rationale and, under a hint, its own hint.
  assert "assistant: 1 + 1 = 2. The answer is 2." in hinted
  assert hinted.count("Hint: The correct answer is") == 2
  assert hinted.endswith("assistant: ")


def test_hint_never_appears_in_a_stored_example(scripted):
  config = _config(few_shot=0)
  problems = _problems()
  shots = [Example("What is 9 + 9?", "18", rationale="9 + 9 = 18.")]
  kept, metrics = _collect(config, problems, shots)
  odd_first = [i for i in range(12) if (i + 1) % 2]     # a = i + 1 odd
  fixable = [i for i in range(12) if (i + 1) % 2 == 0
             and int(problems[i].answer) % 2]
  assert [i for i, r in zip(kept.problem, kept.rationalized) if not r] == odd_first
  assert [i for i, r in zip(kept.problem, kept.rationalized) if r] == fixable
  assert metrics["star/kept_direct"] == 6
  assert metrics["star/kept_rationalized"] == len(fixable) > 0
  # Even answers were reached by citing the hint: dropped.
  assert metrics["star/dropped_hint_mentions"] == 6 - len(fixable)
  plain = templates.render_prompts(TOK, config.data.template,
                                 [p.question for p in problems],
                                 config.data.system_prompt)
  for e, i in zip(kept.examples, kept.problem):
    prompt, completion = TOK.decode(e.prompt_ids), TOK.decode(e.completion_ids)
    assert prompt == plain[i]                 # hint-free, shot-free
    assert "Hint" not in prompt and answer_hint(problems[i].answer) not in prompt
    assert "hint" not in completion.lower()
    assert answer_hint(problems[i].answer) not in completion
    assert completion.rstrip("\0").endswith(f"{problems[i].answer}.")
  # One call for the direct attempts, one for the hinted retries.
  assert len(scripted.params_seen) == 2


def test_without_rationalisation_only_direct_successes_are_kept(scripted):
  kept, metrics = _collect(_config(rationalize=False), _problems())
  assert not any(kept.rationalized) and len(kept.examples) == 6
  assert "star/rationalization_accuracy" not in metrics
  assert len(scripted.params_seen) == 1      # no second (hinted) sampling


def test_reasoning_check_drops_asserted_rationalisations(scripted):
  kept, metrics = _collect(_config(rationale_reasoning_check=True),
                           _problems())
  # Of the odd answers reached with the hint (problems 3, 5, 9, 11), only
  # those with a = 4, 12 derive the answer before stating it: a = 6 writes
  # "6 - 3 = 9.", a = 10 only asserts 11.
  assert [i for i, r in zip(kept.problem, kept.rationalized) if r] == [3, 11]
  assert metrics["star/dropped_unreasoned"] == 2


def test_arithmetic_holds_checks_every_stand_alone_equation():
  holds = equations.arithmetic_holds
  assert holds("4 packs of 4 is 4 * 4 = 16 more, so 15 + 16 = 31.")
  assert holds("26 x 2 = 52, 5 - 7 = -2, 10 / 4 = 2.5, 10 / 3 = 3.33.")
  assert holds("No equation here: 31.") and holds("2 + 3 * 4 = 14")
  # Hinted replies seen at 135M: the hinted number in a false equation.
  assert not holds("Noah starts with 23. 4 marbles are Ava's, so 23 + 4 = 19.")
  assert not holds("He buys 2 packs of 5, so 15 - 25 = 25.")
  assert not holds("27 bags = 3 x 10 = 33 apples")
  assert not holds("14 + 17 = 31, then 31 / 2 = 15.") and not holds("1 / 0 = 0")
  assert not holds("10 / 3 = 3.4") and not holds("10 / 4 = 2")


def test_reasoning_is_the_text_without_answer_statements():
  r = star.reasoning
  assert r("14 + 17 = 31.\nSo 31.") == "14 + 17 = 31."
  assert r("So 31.\n") == r("31.") == ""
  # A one-line reply loses its last sentence, not the whole line.
  assert r("Noah starts with 14. Finding 17 more gives 14 + 17 = 31. "
           "The answer is 31.") == (
               "Noah starts with 14. Finding 17 more gives 14 + 17 = 31.")
  # Echoes of the answer (seen at 135M) are no derivation; list numbers
  # ("3. The answer is 3.") are not read as numbers of the text.
  assert r("1. The answer is 3.\n2. The answer is 3.\n3. The answer is 3."
           "\n\nThe solution is 3.") == ""
  assert r("1. Noah has 14 + 17 = 21 cards.\n2. The answer is 31.\n\n"
           "The answer is 31.") == "Noah has 14 + 17 = 21 cards."
  assert r("- 30 + 30 = 60\n- Noah has 60 cards now\n\nThe answer is 60."
           ) == "30 + 30 = 60 Noah has 60 cards now"
  assert r("Step 1.5 kg. Then 3.5 + 1 = 4.5 kg.\nAnswer: 4.5") == (
      "Step 1.5 kg. Then 3.5 + 1 = 4.5 kg.")


def test_finetune_steps_grow_twenty_percent_per_iteration():
  c = config_lib.base_config().star
  assert [star.finetune_steps(c, n) for n in (1, 2, 3, 4)] == [40, 48, 58, 69]


def test_each_iteration_finetunes_the_original_weights(scripted, monkeypatch,
                                                       tmp_path):
  starts, results = [], []
  real_finetune = star_loop.finetune

  def spy(config, model_config, original, *args, **kwargs):
    starts.append(jax.tree.map(np.array, original))
    params, metrics = real_finetune(config, model_config, original, *args,
                                    **kwargs)
    results.append(jax.tree.map(np.array, params))
    return params, metrics

  monkeypatch.setattr(star_loop, "finetune", spy)
  # Iteration 1, then a second run in the same workdir that resumes from its
  # checkpoint for iteration 2.
  config = _config(iterations=1, few_shot=0, sft_steps=3, sft_growth=1.5)
  star_loop.run(config, str(tmp_path))
  config.star.iterations = 2
  summary = star_loop.run(config, str(tmp_path))
  from grpo_jax.harness.experiment import load_model_and_tokenizer  # pylint: disable=g-import-not-at-top
  original = jax.tree.map(np.array, load_model_and_tokenizer(config)[1])
  same = lambda a, b: all(np.array_equal(x, y) for x, y in
                          zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert len(starts) == 2
  assert same(starts[0], original) and same(starts[1], original)
  assert not same(results[0], original)
  # Sampler calls: eval 0, (direct, hinted), eval 1 | resumed: (direct,
  # hinted), eval 2. Iteration 2 samples with M_1 (restored), tunes M_0.
  seen = scripted.params_seen
  assert len(seen) == 7
  assert same(seen[1], original) and same(seen[2], original)
  assert same(seen[4], results[0]) and same(seen[5], results[0])
  assert same(summary["params"], results[1])
  history = summary["history"]
  assert [h["step"] for h in history] == [0, 1, 2]
  assert [h["sft/steps"] for h in history[1:]] == [3, 4]   # 3 * 1.5 = 4.5
  assert all(h["star/kept_total"] > 0 for h in history[1:])
  assert history[1]["sft/loss_last"] < history[1]["sft/loss_first"]
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [0, 1, 2]
  kept = [json.loads(l) for l in open(tmp_path / "star" / "iteration_1.jsonl")]
  assert len(kept) == history[1]["star/kept_total"]
  assert not any("Hint" in r["prompt"] for r in kept)


@pytest.mark.parametrize("first_only", [True, False])
def test_few_shot_exemplars_prompt_the_first_iteration_or_all(
    scripted, tmp_path, first_only):
  config = _config(iterations=2, few_shot=1, few_shot_first_only=first_only,
                   sft_steps=1)
  star_loop.run(config, str(tmp_path))
  # Sampler calls: eval 0, (direct, hinted) 1, eval 1, (direct, hinted) 2,
  # eval 2. The exemplar ("What is 1 + 1?", problem 0 of the data) is a
  # few-shot turn of the sampling prompts, never of the evaluation's.
  calls = scripted.prompts_seen
  assert len(calls) == 7
  shot = re.findall(r"What is \d+ \+ \d+\?", calls[1][0])[0]
  with_shot = [[p.count("What is") == 2 and shot in p for p in c]
               for c in calls]
  assert all(with_shot[1]) and all(with_shot[2])
  assert all(with_shot[4]) == all(with_shot[5]) == (not first_only)
  assert not any(with_shot[0] + with_shot[3] + with_shot[6])
  for n in (1, 2):
    kept = [json.loads(l) for l in
            open(tmp_path / "star" / f"iteration_{n}.jsonl")]
    assert kept and all(r["prompt"].count("What is") == 1 for r in kept)


def test_cli_runs_two_iterations_of_the_tiny_config(tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "run.py"),
       f"--config={os.path.join(ROOT, 'configs', 'star_tiny.py')}",
       f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=300,
      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-3000:]
  assert "eval_before: " in result.stdout and "eval_after: " in result.stdout
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [0, 1, 2]
  for r in rows[1:]:
    assert r["star/problems"] == 10
    assert {"eval/greedy_accuracy", "star/kept_direct",
            "star/kept_rationalized", "sft/steps"} <= set(r)
  assert (tmp_path / "star" / "iteration_2.jsonl").exists()


def test_config_errors_name_the_field():
  spec = importlib.util.spec_from_file_location(
      "star_cqa", os.path.join(ROOT, "configs", "star_commonsenseqa.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for arg in ("commonsenseqa", "gsm8k", "gsm8k_tfds"):
    with pytest.raises(errors.ConfigError, match=r"data\.(eval_)?kwargs"):
      validation.validate(module.get_config(arg))
  c = module.get_config("commonsenseqa")
  c.data.kwargs.path = c.data.eval_kwargs.path = "/data/cqa.jsonl"
  validation.validate(c)
  c.star.micro_batch_size = 3
  with pytest.raises(errors.ConfigError, match="star.micro_batch_size"):
    validation.validate(c)
  c = _config()
  c.method = "dpo"
  with pytest.raises(errors.ConfigError, match="'method'"):
    validation.validate(c)


def test_commonsenseqa_layout_reads_both_record_shapes(tmp_path):
  from grpo_jax import registry  # pylint: disable=g-import-not-at-top
  original = {"answerKey": "B", "id": "x1", "question": {
      "stem": "Where is a fish?", "choices": [
          {"label": "A", "text": "tree"}, {"label": "B", "text": "river"}]}}
  hf = {"id": "x2", "question": "Where is a fish?", "answerKey": "B",
        "choices": {"label": ["A", "B"], "text": ["tree", "river"]}}
  path = tmp_path / "cqa.jsonl"
  path.write_text(json.dumps(original) + "\n" + json.dumps(hf) + "\n")
  a, b = registry.lookup("dataset", "jsonl")(path=str(path),
                                             layout="commonsenseqa")
  assert a.question == b.question == (
      "Where is a fish?\n(A) tree\n(B) river\n"
      "Answer with the letter of the correct choice.")
  assert a.answer == b.answer == "B" and a.choices == ("tree", "river")
  from grpo_jax.errors import DataError  # pylint: disable=g-import-not-at-top
  with pytest.raises(DataError, match="answerKey"):
    commonsenseqa.commonsenseqa_example({**hf, "answerKey": "F"}, "row 3")


def test_plot_comparison_draws_every_run(tmp_path):
  for name, acc in (("rat", [0.1, 0.3]), ("norat", [0.1, 0.2])):
    os.makedirs(tmp_path / name)
    with open(tmp_path / name / "metrics.jsonl", "w") as f:
      for step, a in enumerate(acc):
        f.write(json.dumps({"step": step, "eval/greedy_accuracy": a}) + "\n")
  png = star_loop.plot_comparison({"with": str(tmp_path / "rat"),
                              "without": str(tmp_path / "norat")},
                             str(tmp_path / "cmp.png"),
                             keys=("eval/greedy_accuracy", "sft/steps"))
  assert os.path.getsize(png) > 1000


def test_evaluate_cli_runs_the_star_commonsenseqa_config(tmp_path):
  """The commonsenseqa layout exists for experiments/evaluate.py, which never
  imports the STaR loop (it once failed with "unknown layout")."""
  rng = np.random.default_rng(0)
  path = tmp_path / "cqa.jsonl"
  golds = []
  with open(path, "w", encoding="utf-8") as f:
    for i in range(3):
      golds.append("ABCDE"[rng.integers(5)])
      f.write(json.dumps({"id": f"q{i}", "answerKey": golds[-1], "question": {
          "stem": f"Where would you put thing {i}?", "choices": [
              {"label": l, "text": f"place {l}{i}"} for l in "ABCDE"]}}) + "\n")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "evaluate.py"),
       f"--config={os.path.join(ROOT, 'configs', 'star_commonsenseqa.py')}",
       f"--config.data.kwargs.path={path}",
       f"--config.data.eval_kwargs.path={path}",
       "--config.model.source=tiny", "--config.sampling.max_new_tokens=4",
       f"--workdir={tmp_path}"],
      capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "eval/greedy_accuracy" in proc.stdout
  record = json.loads((tmp_path / "eval" / "pretrained.json").read_text())
  assert [p["gold"] for p in record["problems"]] == golds
  assert "(E) place E0" in record["problems"][0]["question"]
