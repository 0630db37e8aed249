"""evaluate_policy: sampling, scoring and summarising a policy on held-out problems.

Hand-computed summaries, the answer grouping maj@k votes with, and on the
tiny random model a controlled reward (the parity of the first byte) whose
per-sample verdicts the reported metrics must agree with; then the CLI, on
pretrained weights and on a checkpoint.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import errors, evaluation, models, registry, validation
from grpo_jax.evaluation import Completions
from grpo_jax.harness import experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import tiny  # pylint: disable=g-import-not-at-top,wrong-import-position


# A controlled accuracy reward for the random tiny model: its first byte is
# about as often even as odd, so groups are mixed and every metric is exercised.
def _parity(text: str) -> str | None:
  return None if not text else ("even" if ord(text[0]) % 2 == 0 else "odd")


@registry.register("reward", "test_first_byte_even")
def first_byte_even(prompts, completions, answers, completion_lengths):
  del prompts, answers, completion_lengths
  return np.asarray([_parity(t) == "even" for t in completions], np.float32)


registry.register("final_answer", "test_first_byte_even")(
    evaluation.FinalAnswer(_parity, lambda a, b: a == b))


def parity_config(**eval_fields):
  c = tiny.get_config()
  c.rewards = {"test_first_byte_even": 1.0}
  c.accuracy_reward = "test_first_byte_even"
  c.eval.update(eval_fields)
  return validation.validate(c)


def even_examples(config):
  """The held-out problems, each with the gold answer "even"."""
  return [dataclasses.replace(ex, answer="even")
          for ex in experiment.load_examples(config)[1]]


def completions(correct, answers, lengths=None) -> Completions:
  correct = np.asarray(correct, bool)
  lengths = np.ones(correct.shape, np.int32) if lengths is None else lengths
  return Completions([[""] * correct.shape[1]] * correct.shape[0], answers,
                     correct, np.asarray(lengths, np.int32))


# ----------------------------------------------------------------------------
# Summaries and answer grouping, by hand.
# ----------------------------------------------------------------------------

def test_summarise_hand_computed():
  same = evaluation.final_answer("last_number").equivalent
  sampled = completions(
      [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]],
      [["1/2", "3", "3", "1/2"],     # tie 2-2: "1/2" seen first wins
       ["4", None, None, None],      # one answer, wrong
       ["7", "7", "7", "7"]],
      lengths=[[2, 4, 6, 8]] * 3)
  greedy = completions([[1], [0], [0]], [["1/2"], [None], ["6"]])
  m = evaluation.summarise(sampled, greedy, ["0.5", "5", "7"], (1, 2, 4), same)
  assert m["eval/avg@4"] == pytest.approx((0.5 + 0 + 1) / 3)
  assert m["eval/pass@1"] == pytest.approx(0.5)
  # Problem 1: 1 - C(2,2)/C(4,2) = 5/6; problem 2: 0; problem 3: 1.
  assert m["eval/pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
  assert m["eval/pass@4"] == pytest.approx(2 / 3)
  # maj@1: "1/2" = 0.5 yes, "4" no, "7" yes; maj@2: {1/2, 3} tie -> 1/2.
  assert m["eval/maj@1"] == m["eval/maj@2"] == m["eval/maj@4"] == pytest.approx(2 / 3)
  assert m["eval/greedy_accuracy"] == pytest.approx(1 / 3)
  assert m["eval/sampled_response_length"] == 5.0
  assert m["eval/num_examples"] == 3


def test_summarise_majority_differs_from_pass_at_k():
  same = evaluation.final_answer("last_number").equivalent
  # 1 of 3 right: pass@3 counts it, the majority ("2") does not.
  sampled = completions([[0, 1, 0]], [["2", "3", "2"]])
  m = evaluation.summarise(sampled, None, ["3"], (1, 3), same)
  assert m["eval/pass@3"] == 1.0 and m["eval/maj@3"] == 0.0
  assert m["eval/maj@1"] == 0.0 and m["eval/pass@1"] == pytest.approx(1 / 3)
  assert "eval/greedy_accuracy" not in m


@pytest.mark.parametrize("reward, texts, gold, majority, right", [
    # The last number, as an exact fraction: 0.50 = 0.5 = 1/2; "1,000" = 1000.
    ("last_number", ["so 0.50", "it is 0.5", "x 3", "y 3", "z 0.500"], "1/2", "1/2", True),
    ("last_number", ["1,000 apples", "1000", "999", "no number"], "1000", "1000", True),
    ("last_number", ["no number", "none"], "1", None, False),
    # DAPO's normalised `Answer:` line: \frac12 = \frac{1}{2}.
    ("math_dapo", ["Answer: \\frac12", "Answer: 3", "Answer: \\frac{1}{2}"],
     "\\frac{1}{2}", "\\frac12", True),
    # Choice letters: "(b)" and "B" are one vote; "A or B" is none.
    ("multiple_choice", ["The answer is (b).", "Answer: A", "B", "A or B"], "B",
     "B", True),
])
def test_final_answers_group_what_the_reward_equates(reward, texts, gold,
                                                     majority, right):
  rule = evaluation.final_answer(reward)
  answers = [rule.extract(t) for t in texts]
  assert evaluation.majority_answer(answers, rule.equivalent) == majority
  assert evaluation.maj_at_k(answers, gold, rule.equivalent) is right


def test_final_answer_of_last_number_agrees_with_its_reward():
  texts = ["5", "it is 05.0", "-0.50", "12 then 7", "", "1,234"]
  golds = ["5", "5", "-1/2", "12", "0", "1234"]
  rule = evaluation.final_answer("last_number")
  reward = registry.lookup("reward", "last_number")(None, texts, golds, None)
  votes = [(a := rule.extract(t)) is not None and rule.equivalent(g, a)
           for t, g in zip(texts, golds)]
  assert votes == [bool(r) for r in reward] == [True, True, True, False, False, True]


def test_a_reward_without_a_final_answer_fails_naming_the_known_ones():
  # It once fell back to the math verifier silently; config validation now
  # rejects such a run before any work (tests/test_train.py).
  with pytest.raises(KeyError, match=r"final_answer 'countdown'.*'math'"):
    evaluation.final_answer("countdown")


# ----------------------------------------------------------------------------
# The tiny model under the controlled reward.
# ----------------------------------------------------------------------------

def _settings(config, tokenizer) -> evaluation.EvalSettings:
  return evaluation.EvalSettings.from_config(
      config, experiment.sampling_config(config, tokenizer))


@pytest.fixture(scope="module")
def tiny_policy():
  config = parity_config(n=4, ks=(1, 2, 4), batch_size=3)
  model_config, params, tokenizer = experiment.load_model_and_tokenizer(config)
  return config, model_config, params, tokenizer, even_examples(config)


def test_metrics_agree_with_the_per_sample_verdicts(tiny_policy):
  config, model_config, params, tokenizer, examples = tiny_policy
  result = evaluation.evaluate_policy(_settings(config, tokenizer), model_config, params, tokenizer,
                                      examples)
  s, m = result.sampled, result.metrics
  assert s.correct_bg.shape == (8, 4) and len(s.texts) == 8
  assert 0 < s.correct_bg.mean() < 1, "the controlled reward should mix"
  # The verdicts belong to the texts reported next to them.
  assert [[_parity(t) == "even" for t in row] for row in s.texts] == s.correct_bg.tolist()
  assert s.answers == [[_parity(t) for t in row] for row in s.texts]
  c_p = s.correct_bg.sum(axis=1)
  assert m["eval/avg@4"] == pytest.approx(s.correct_bg.mean())
  for k in (1, 2, 4):
    want = np.mean([1 - math.comb(4 - c, k) / math.comb(4, k) for c in c_p])
    assert m[f"eval/pass@{k}"] == pytest.approx(want)
    assert m[f"eval/maj@{k}"] == pytest.approx(np.mean(
        [_majority_is_even(row[:k]) for row in s.answers]))
  assert m["eval/greedy_accuracy"] == pytest.approx(result.greedy.correct_bg.mean())


def _majority_is_even(answers) -> bool:
  """Counting votes directly; a tie goes to the answer seen first."""
  votes = [a for a in answers if a is not None]
  even, odd = votes.count("even"), votes.count("odd")
  return even > odd or (even == odd > 0 and votes[0] == "even")


def test_greedy_only_evaluation_scores_the_greedy_texts(tiny_policy):
  config, model_config, params, tokenizer, examples = tiny_policy
  result = evaluation.evaluate_policy(dataclasses.replace(_settings(config, tokenizer), n=0),
                                      model_config, params, tokenizer, examples)
  assert result.sampled is None and len(result.greedy.texts) == len(examples)
  verdicts = [_parity(row[0]) == "even" for row in result.greedy.texts]
  assert result.greedy.correct_bg[:, 0].tolist() == verdicts
  assert result.metrics["eval/greedy_accuracy"] == pytest.approx(np.mean(verdicts))
  assert result.metrics["eval/response_length"] == pytest.approx(
      result.greedy.length_bg.mean())


def test_temperature_zero_samples_are_the_greedy_completion(tiny_policy):
  config, model_config, params, tokenizer, examples = tiny_policy
  result = evaluation.evaluate_policy(
      dataclasses.replace(_settings(config, tokenizer), temperature=0.0), model_config, params,
      tokenizer, examples)
  for greedy, samples in zip(result.greedy.texts, result.sampled.texts):
    assert samples == greedy * 4
  m = result.metrics
  assert m["eval/avg@4"] == m["eval/pass@4"] == m["eval/maj@4"] == m["eval/greedy_accuracy"]


def test_eval_config_is_validated():
  with pytest.raises(errors.ConfigError, match="eval.ks"):
    parity_config(n=4, ks=(1, 8))
  with pytest.raises(errors.ConfigError, match="eval.top_p"):
    parity_config(top_p=0.0)
  with pytest.raises(errors.ConfigError, match="eval.n"):
    parity_config(n=-1)


# ----------------------------------------------------------------------------
# experiments/evaluate.py
# ----------------------------------------------------------------------------

def run_cli(*flags) -> str:
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "evaluate.py"),
       f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}", *flags],
      capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_cli_evaluates_a_checkpoint_and_writes_json(tmp_path, tiny_policy):
  config, model_config, init_params, tokenizer, _ = tiny_policy
  # Weights unlike the config's own init, so only a real load reproduces them.
  params = models.init_params(model_config, jax.random.key(7))
  with ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(tmp_path), save_every=1,
                             config=config, model_config=model_config,
                             handle_sigterm=False) as ckpt:
    ckpt.save(5, {"params": params}, force=True)
  out = run_cli(f"--checkpoint={tmp_path}", "--config.eval.n=4",
                "--config.eval.ks=(1,4)", "--config.eval.batch_size=3")
  path = tmp_path / "eval" / "step_5.json"
  assert f"wrote {path}" in out and "eval/pass@4" in out
  record = json.loads(path.read_text())
  assert record["step"] == 5 and record["eval"]["n"] == 4
  problems = record["problems"]
  assert len(problems) == config.train.eval_examples
  correct = [[s["correct"] for s in p["samples"]] for p in problems]
  assert np.asarray(correct).shape == (8, 4)
  assert record["metrics"]["eval/avg@4"] == pytest.approx(np.mean(correct))
  # The samples are those of the checkpoint's params (same key, same
  # settings), not of the config's own initialisation.
  tiny_config = tiny.get_config()
  tiny_config.eval.update(n=4, ks=(1, 4), batch_size=3)
  examples = experiment.load_examples(tiny_config)[1]
  samples = lambda p: evaluation.evaluate_policy(
      dataclasses.replace(_settings(tiny_config, tokenizer), greedy=False), model_config, p,
      tokenizer, examples).sampled.texts
  got = [[s["completion"] for s in p["samples"]] for p in problems]
  assert got == samples(params)
  assert got != samples(init_params)


@pytest.mark.slow   # a CLI run: ~20 s of compiles
def test_cli_evaluates_with_tools_and_records_each_episode(tmp_path):
  """experiments/evaluate.py with an env (issue 42 item 5): pass@k over
  episodes, the tool-use metrics, and per sample its whole episode and its
  tool calls, which the metrics count (the scripted env answers "ok")."""
  out = run_cli("--config.env.name=scripted", "--config.env.max_turns=2",
                "--config.sampling.max_new_tokens=24", "--config.eval.n=4",
                "--config.eval.ks=(1,4)", f"--workdir={tmp_path}")
  assert "eval/pass@4" in out and "eval/sampled_tool_call_rate" in out
  record = json.loads((tmp_path / "eval" / "pretrained.json").read_text())
  samples = [s for p in record["problems"] for s in p["samples"]]
  assert len(samples) == 8 * 4
  calls = np.array([s["tool_calls"] for s in samples])
  m = record["metrics"]
  assert m["eval/sampled_tool_call_rate"] == pytest.approx(np.mean(calls > 0))
  assert m["eval/sampled_tool_calls_mean"] == pytest.approx(calls.mean())
  assert calls.max() == 1                    # one scripted observation
  for s in samples:
    assert s["episode"].endswith(s["completion"]) or not s["completion"]
    assert ("ok" in s["episode"]) >= (s["tool_calls"] > 0)
  assert all("tool_calls" in p["greedy"][0] for p in record["problems"])
