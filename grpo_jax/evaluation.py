"""Evaluation metrics: avg@n, unbiased pass@k, maj@k, greedy accuracy.

Pure Python/numpy over per-sample outcomes; sampling and verification happen
elsewhere. Per problem p with n samples of which c are correct:

- avg@n = c / n, the pass@1 estimate averaged over n samples (DAPO's avg@32).
- pass@k = 1 - C(n-c, k) / C(n, k), the unbiased estimator of Chen et al. 2021
  (the chance that k of the n samples, drawn without replacement, include a
  correct one), computed as a product so no large binomial is formed.
- maj@k: the answer most of the first k samples agree on, answers grouped by
  an equivalence (e.g. "1/2" and "0.5"), compared with the gold answer.
Data-set scores are means over problems.

`evaluate_policy` (below) samples a policy on held-out problems and reports
all of these; the trainer calls it every `train.eval_every` steps and
`experiments/evaluate.py` calls it on a checkpoint (`experiment.load_policy`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from grpo_jax import registry, sharding
from grpo_jax.envs import base as envs
from grpo_jax.generate import rollout, sampling
from grpo_jax.models import cast
from grpo_jax.rewards import choice, extract, last_number, minerva
from grpo_jax.rewards import math as math_rewards

Equivalent = Callable[[str, str], bool]


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).

  C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), a product of numbers
  in [0, 1] that neither overflows nor loses precision for large n.
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:  # Every k-subset holds a correct sample.
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def avg_at_n(correct: Sequence[bool]) -> float:
  """Fraction of one problem's n samples that are correct (pass@1 over n samples)."""
  if len(correct) == 0:
    raise ValueError("avg@n needs at least one sample")
  return float(np.mean(np.asarray(correct, dtype=np.float64)))


def cluster_answers(answers: Sequence[str | None], equivalent: Equivalent
                    ) -> list[tuple[str, int]]:
  """Groups answers by equivalence: [(representative, count)], in first-seen order.

  Each answer joins the first earlier cluster whose representative (its first
  member) it is equivalent to, called as `equivalent(representative, answer)`;
  None (nothing extracted) joins no cluster. Exact repeats skip the call.
  """
  clusters: list[list] = []  # [representative, count]
  for answer in answers:
    if answer is None:
      continue
    for cluster in clusters:
      if answer == cluster[0] or equivalent(cluster[0], answer):
        cluster[1] += 1
        break
    else:
      clusters.append([answer, 1])
  return [(representative, count) for representative, count in clusters]


def majority_answer(answers: Sequence[str | None], equivalent: Equivalent) -> str | None:
  """The representative of the largest equivalence cluster, None if nothing was extracted.

  Ties go to the cluster seen first (the one whose earliest answer comes
  first in `answers`), so the vote is deterministic given the sample order.
  """
  clusters = cluster_answers(answers, equivalent)
  if not clusters:
    return None
  return max(clusters, key=lambda cluster: cluster[1])[0]  # max keeps the first of ties.


def maj_at_k(answers: Sequence[str | None], gold: str, equivalent: Equivalent,
             k: int | None = None) -> bool:
  """Whether the majority answer of the first k samples (all when None) matches gold.

  The gold is compared as `equivalent(gold, majority)`, the order of
  `grpo_jax.rewards.math.verify(gold, prediction)`.
  """
  k = len(answers) if k is None else k
  if not 1 <= k <= len(answers):
    raise ValueError(f"maj@k needs 1 <= k <= {len(answers)} samples, got k={k}")
  majority = majority_answer(answers[:k], equivalent)
  return majority is not None and equivalent(gold, majority)


def greedy_accuracy(correct: Sequence[bool]) -> float:
  """Fraction of problems whose one greedy (temperature 0) answer is correct."""
  if len(correct) == 0:
    raise ValueError("greedy accuracy needs at least one problem")
  return float(np.mean(np.asarray(correct, dtype=np.float64)))


def sampled_metrics(correct_per_problem: Sequence[Sequence[bool]],
                    ks: Sequence[int] = (1,)) -> dict[str, float]:
  """Means over problems of avg@n and pass@k for each k in `ks`.

  Args:
    correct_per_problem: for each problem, the correctness of its n samples
      (n may differ between problems, but must be >= max(ks)).
    ks: the k of each pass@k reported.

  Returns:
    {"avg@n": ..., "pass@1": ..., "pass@8": ...}; "avg@n" names n itself
    (e.g. "avg@32") when every problem has the same n.
  """
  if len(correct_per_problem) == 0:
    raise ValueError("no problems to score")
  sizes = {len(c) for c in correct_per_problem}
  avg_name = f"avg@{sizes.pop()}" if len(sizes) == 1 else "avg@n"
  metrics = {avg_name: float(np.mean([avg_at_n(c) for c in correct_per_problem]))}
  for k in ks:
    metrics[f"pass@{k}"] = float(np.mean(
        [pass_at_k(len(c), int(sum(c)), k) for c in correct_per_problem]))
  return metrics


def majority_metrics(answers_per_problem: Sequence[Sequence[str | None]],
                     golds: Sequence[str], equivalent: Equivalent,
                     ks: Sequence[int] = (1,)) -> dict[str, float]:
  """{"maj@k": fraction of problems whose majority of the first k answers is right}."""
  if len(answers_per_problem) != len(golds) or not golds:
    raise ValueError(f"need one gold per problem, got {len(golds)} golds for "
                     f"{len(answers_per_problem)} problems")
  return {f"maj@{k}": float(np.mean([maj_at_k(a, g, equivalent, k)
                                     for a, g in zip(answers_per_problem, golds)]))
          for k in ks}


# ----------------------------------------------------------------------------
# Final answers for maj@k, per accuracy reward.
# ----------------------------------------------------------------------------

class FinalAnswer(NamedTuple):
  """How maj@k reads a completion's answer and groups answers, registered
  (kind "final_answer") under the name of the accuracy reward it mirrors, so
  the vote agrees with what that reward calls correct."""
  extract: Callable[[str], str | None]   # completion -> answer, None: none
  equivalent: Equivalent                 # (gold or representative, answer)


def _last_number_answer(text: str) -> str | None:
  value = last_number.last_number(text)
  return None if value is None else str(value)  # Fraction: "7", "-1/2"


def _same_number(a: str, b: str) -> bool:
  x, y = last_number.parse_gold(a), last_number.parse_gold(b)
  return x is not None and x == y


def _boxed_or_anchored(text: str) -> str | None:
  return extract.extract_answer(text).text or None


def _dapo_answer_line(text: str) -> str | None:
  line = minerva.extract_answer_line(text)
  return None if line == minerva.INVALID else line


def _same_dapo_answer(a: str, b: str) -> bool:
  return minerva.normalize_final_answer(a) == minerva.normalize_final_answer(b)


def _same_letter(a: str, b: str) -> bool:
  x = choice.gold_letter(a)
  return x is not None and x == choice.gold_letter(b)


registry.register("final_answer", "last_number")(
    FinalAnswer(_last_number_answer, _same_number))
registry.register("final_answer", "math")(
    FinalAnswer(_boxed_or_anchored, math_rewards.verify))
registry.register("final_answer", "math_dapo")(
    FinalAnswer(_dapo_answer_line, _same_dapo_answer))
registry.register("final_answer", "multiple_choice")(
    FinalAnswer(choice.predicted_letter, _same_letter))


def final_answer(accuracy_reward: str) -> FinalAnswer:
  """The registered FinalAnswer of a reward; an unknown name raises, listing
  the known ones (config validation checks it before any work)."""
  return registry.lookup("final_answer", accuracy_reward)


# ----------------------------------------------------------------------------
# Evaluating a policy: SAMPLE (n per problem, and greedy), SCORE, summarise.
# ----------------------------------------------------------------------------

class Completions(NamedTuple):
  """G completions of each of B problems (prompts), scored by the accuracy
  reward."""
  texts: list[list[str]]              # [B][G]
  answers: list[list[str | None]]     # [B][G], FinalAnswer.extract of each
  correct_bg: np.ndarray              # bool [B, G]
  length_bg: np.ndarray               # int32 [B, G], tokens
  tools: dict | None = None           # with an env: its "env/..." means
  episodes: list | None = None        # with an env: [B][G] (text, calls)



@dataclasses.dataclass
class PolicyEval:
  """What `evaluate_policy` measured: scalar `metrics` (named "eval/...")
  and every completion behind them."""
  metrics: dict[str, float]
  questions: list[str]
  golds: list[str]
  sampled: Completions | None         # n samples per problem (None: n = 0)
  greedy: Completions | None          # one greedy completion per problem

  def to_json(self) -> dict[str, Any]:
    """Metrics and, per problem, each completion with its answer and verdict."""
    problems = []
    for p, (question, gold) in enumerate(zip(self.questions, self.golds)):
      row = {"question": question, "gold": gold}
      for name, done in (("greedy", self.greedy), ("samples", self.sampled)):
        if done is not None:
          row[name] = [{"completion": t, "answer": a, "correct": bool(c)}
                       for t, a, c in zip(done.texts[p], done.answers[p],
                                          done.correct_bg[p])]
          if done.episodes is not None:
            for sample, (text, calls) in zip(row[name], done.episodes[p]):
              sample.update(episode=text, tool_calls=calls)
      problems.append(row)
    return {"metrics": self.metrics, "problems": problems}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """What evaluating a policy reads, built once per run from the settings
  the loop already has (`from_config`): the run's sampler settings (its
  completion budget, stop and pad ids, chunking and continuous batching;
  an evaluation sets its own temperature and top-p, and no top-k), the
  rewards and the one that decides correctness, the prompt template, the
  trainer's compute dtype, and config.eval's: n samples per problem (0:
  none), the k of pass@k and maj@k (each in [1, n]), their temperature and
  top-p, the prompts per sampler call, and whether to decode greedily once
  per problem too (greedy accuracy). One evaluation that differs says so
  with `dataclasses.replace(settings, n=0)`."""
  sampling: sampling.SamplingConfig
  rewards: rollout.RewardSpec
  accuracy_reward: str
  template: str
  system_prompt: str
  compute_dtype: str
  seed: int
  n: int
  ks: tuple[int, ...]
  temperature: float
  top_p: float
  batch_size: int
  greedy: bool = True
  env: envs.EnvSpec | None = None     # episodes with tools (config.env)

  @classmethod
  def from_config(cls, config, sample_cfg: sampling.SamplingConfig,
                  rewards: rollout.RewardSpec | None = None) -> "EvalSettings":
    e = config.eval
    return cls(sampling=sample_cfg,
               rewards=rewards or rollout.RewardSpec.from_config(config),
               accuracy_reward=config.accuracy_reward,
               template=config.data.template,
               system_prompt=config.data.system_prompt,
               compute_dtype=config.model.compute_dtype, seed=config.seed,
               n=e.n, ks=tuple(e.ks), temperature=e.temperature,
               top_p=e.top_p, batch_size=e.batch_size,
               env=envs.EnvSpec.from_config(config))

  def sampler(self, greedy: bool) -> sampling.SamplingConfig:
    """The sampler settings of an evaluation: greedy, or at the settings'
    temperature and top-p."""
    if greedy:
      return dataclasses.replace(self.sampling, temperature=1.0, top_p=1.0,
                                 top_k=0, greedy=True)
    return dataclasses.replace(self.sampling, temperature=self.temperature,
                               top_p=self.top_p, top_k=0, greedy=False)


def completion_texts(tokenizer, groups: rollout.Groups) -> list[list[str]]:
  """The completion texts of a group batch, [b][g], as the rewards read them
  (`rollout.answer_texts`: with an env, each episode's last turn)."""
  B, G = groups.tokens_bgt.shape[:2]
  texts_n = rollout.answer_texts(tokenizer, groups)
  return [texts_n[b * G:(b + 1) * G] for b in range(B)]


def episode_records(tokenizer, groups: rollout.Groups) -> list[list[tuple]]:
  """With an env, each episode [b][g]: (its whole trajectory's text, the
  tool-turn markers and observations included; its tool calls, the
  observation spans)."""
  B, G, T = groups.tokens_bgt.shape
  obs_nt = groups.observation_bgt.reshape(B * G, T)
  calls_n = (obs_nt[:, 1:] & ~obs_nt[:, :-1]).sum(1) + obs_nt[:, 0]
  rows = [(tokenizer.decode(t[:n]), int(c)) for t, n, c in zip(
      groups.tokens_bgt.reshape(B * G, T), groups.length_bg.reshape(-1),
      calls_n)]
  return [rows[b * G:(b + 1) * G] for b in range(B)]


def sample_completions(settings: EvalSettings, sampler: sampling.Sampler,
                       params, tokenizer, examples, key: jax.Array, n: int
                       ) -> Completions:
  """n completions per example through the group sampler (G = n), scored by
  the run's rewards; correct = the accuracy reward > 0. With the sampler's
  layout its rows are split over the mesh."""
  answer = final_answer(settings.accuracy_reward).extract
  # One padded chunk shape for the whole set: the sampler compiles once.
  size = min(settings.batch_size, len(examples))
  groups = rollout.GroupSettings(n, settings.rewards, settings.template,
                                 settings.system_prompt, batch_multiple=size,
                                 env=settings.env)
  texts, correct, lengths, tools, episodes = [], [], [], [], []
  for start in range(0, len(examples), size):
    batch, metrics = rollout.generate_groups(
        sampler, params, tokenizer, examples[start:start + size],
        jax.random.fold_in(key, start), groups)
    texts += completion_texts(tokenizer, batch)
    correct.append(batch.correct_bg)
    lengths.append(batch.length_bg)
    tools.append({k: v for k, v in metrics.items() if k.startswith("env/")})
    if settings.env is not None:
      episodes += episode_records(tokenizer, batch)
  answers = [[answer(t) for t in row] for row in texts]
  return Completions(texts, answers, np.concatenate(correct),
                     np.concatenate(lengths),
                     {k: float(np.mean([t[k] for t in tools])) for k in tools[0]}
                     if settings.env is not None else None, episodes or None)


def summarise(sampled: Completions | None, greedy: Completions | None,
              golds: Sequence[str], ks: Sequence[int], equivalent: Equivalent
              ) -> dict[str, float]:
  """avg@n, pass@k, maj@k of the samples and the greedy accuracy, "eval/"-named."""
  metrics: dict[str, float] = {"num_examples": len(golds)}
  if greedy is not None:
    metrics["greedy_accuracy"] = greedy_accuracy(greedy.correct_bg[:, 0])
    metrics["response_length"] = float(greedy.length_bg.mean())
    metrics.update({f"greedy_{k[len('env/'):]}": v
                    for k, v in (greedy.tools or {}).items()})
  if sampled is not None:
    metrics.update(sampled_metrics(sampled.correct_bg.tolist(), ks))
    metrics.update(majority_metrics(sampled.answers, golds, equivalent, ks))
    metrics["sampled_response_length"] = float(sampled.length_bg.mean())
    metrics.update({f"sampled_{k[len('env/'):]}": v
                    for k, v in (sampled.tools or {}).items()})
  return {f"eval/{k}": v for k, v in metrics.items()}


def evaluate_policy(settings: EvalSettings, model_config, params, tokenizer,
                    examples, key: jax.Array | None = None,
                    layout: sharding.Layout | None = None) -> PolicyEval:
  """Samples n completions per problem (and one greedy), scores and summarises.

  Args:
    settings: the run's `EvalSettings`: n, ks, temperature, top_p,
      batch_size and greedy (config.eval's; `dataclasses.replace` for an
      evaluation that differs); the accuracy reward decides correctness
      and (via `final_answer`) the answers maj@k votes on.
    model_config, params, tokenizer: the policy; params are cast to the
      trainer's compute dtype here.
    examples: the problems (`grpo_jax.data.Example`).
    key: PRNG key of the sampled completions (default: from config.seed,
      so periodic evaluations of one run use the same sampling noise).
    layout: the run's mesh and rules: the sampler's rows are split over the
      batch mesh axes (default: XLA's choice from the params' shardings).

  Returns:
    PolicyEval whose metrics are "eval/greedy_accuracy",
    "eval/response_length" (greedy), "eval/avg@<n>", "eval/pass@<k>",
    "eval/maj@<k>", "eval/sampled_response_length", "eval/num_examples" and
    "eval/seconds".
  """
  n, greedy = settings.n, settings.greedy
  if not examples or not (n or greedy):
    raise ValueError(f"nothing to evaluate: {len(examples)} examples, n={n}, "
                     f"greedy={greedy}")
  key = jax.random.key(settings.seed) if key is None else key
  t0 = time.perf_counter()
  params = cast(params, settings.compute_dtype)

  def sample(greedy: bool, g: int) -> Completions:
    sampler = sampling.Sampler(model_config, settings.sampler(greedy),
                               layout)
    return sample_completions(settings, sampler, params, tokenizer, examples,
                              key, g)

  greedy_done = sample(True, 1) if greedy else None
  sampled = sample(False, n) if n else None
  golds = [str(x.answer) for x in examples]
  metrics = summarise(sampled, greedy_done, golds, settings.ks,
                      final_answer(settings.accuracy_reward).equivalent)
  metrics["eval/seconds"] = time.perf_counter() - t0
  return PolicyEval(metrics, [x.question for x in examples], golds, sampled,
                    greedy_done)
