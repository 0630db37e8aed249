"""STaR's data step (Zelikman et al. 2022, Algorithm 1, lines 3-6): sample a
rationale for every problem, keep the verified ones, rationalise the failures.

    # SAMPLE + FILTER  a rationale + answer per problem with M_{n-1}; keep
    #                  the first verified-correct one                 (l. 5)
    # RATIONALISE      retry the failures with the correct answer as a hint
    #                  (`answer_hint`); keep those now correct, stored with
    #                  the prompt built WITHOUT the hint             (l. 4, 6)

A stored example is (prompt ids, completion ids). The prompt is the plain
rendering of the question (template + chat template; no hint, no few-shot
exemplars): what the held-out evaluation shows the model. The completion is
the sampled token ids, stop token included, so nothing is re-tokenised. The
filters themselves are pure functions in `algorithms/star.py`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np

from grpo_jax import registry
from grpo_jax.algorithms.star import mentions_hint, reasoning
from grpo_jax.data import Example, answer_hint, templates
from grpo_jax.generate import rollout, sampling
from grpo_jax.rewards import equations
from grpo_jax.rl.spec import RunSpec
from grpo_jax.star import sft

# ----------------------------------------------------------------------------
# Prompts.
# ----------------------------------------------------------------------------

def render(tokenizer, template: str, question: str, system_prompt: str = "",
           hint: Optional[str] = None, shots: Sequence[Example] = ()) -> str:
  """The prompt text of one question: the system message if any, few-shot
  turns (each exemplar's question and gold rationale; under a hint the
  exemplars show their own hints, as the paper's rationalisation prompt),
  then the question through the template. Without hint and shots it equals
  `templates.render_prompts`, the prompt of training and evaluation."""
  fmt = registry.lookup("template", template)
  messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
  for shot in shots:
    shot_hint = None if hint is None else answer_hint(shot.answer)
    messages += fmt(shot.question, shot_hint)
    messages.append({"role": "assistant", "content": shot.rationale})
  messages += fmt(question, hint)
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def sampling_prompts(config, tokenizer, problems: Sequence[Example],
                     shots: Sequence[Example]) -> list[str]:
  """Each problem's longest sampling prompt (preflight.check_model): with
  the few-shot exemplars and, under star.rationalize, its answer hint."""
  d, hinted = config.data, config.star.rationalize
  return [render(tokenizer, d.template, p.question, d.system_prompt,
                 hint=answer_hint(p.answer) if hinted else None, shots=shots)
          for p in problems]


# ----------------------------------------------------------------------------
# SAMPLE + FILTER, RATIONALISE.
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RationaleSampler:
  """How an outer iteration samples rationales and keeps verified ones: the
  model and tokenizer, the sampler's settings, `num_samples` completions
  per prompt (star.samples_per_problem), the rewards whose accuracy reward
  verifies them, `batch` prompts per sampler call (star.sample_batch)."""
  model_config: Any
  tokenizer: Any
  sampler: sampling.SamplingConfig
  num_samples: int
  reward: rollout.RewardSpec
  batch: int

  @classmethod
  def of(cls, spec: RunSpec, star, model_config, tokenizer
         ) -> "RationaleSampler":
    """The run's sampler settings (`spec`: the RunSpec, `star`:
    config.star); greedy ones are the evaluation's greedy program, compiled
    once for both."""
    sampler = spec.sampling
    if sampler.is_greedy:
      sampler = spec.eval.sampler(greedy=True)
    return cls(model_config, tokenizer, sampler, star.samples_per_problem,
               spec.reward, star.sample_batch)

  def first_correct(self, params, prompts: Sequence[str],
                    answers: Sequence[str], key: jax.Array,
                    hints: Optional[Sequence[str]] = None,
                    reasoning_check: bool = False
                    ) -> tuple[list[Optional[tuple[int, ...]]],
                               dict[str, int]]:
    """Samples `num_samples` completions per prompt; per prompt, the token
    ids (stop token included) of the first one that the accuracy reward
    verifies and that ended within the budget, else None. Also counts.
    Every call is padded to `batch` prompts: one compiled shape however
    many remain.

    For rationalisations: with `hints` (one per prompt) completions that
    mention or repeat their hint are rejected (`mentions_hint`);
    `reasoning_check` rejects those whose `reasoning` (no final line, no
    answer statements) does not itself verify, i.e. the answer is asserted
    after the hint rather than derived ("14 + 17 = 21.\nThe answer is 31.",
    "1. The answer is 31.\n2. The answer is 31.\nSo 31.")."""
    G, size = self.num_samples, self.batch
    spec, tokenizer = self.reward, self.tokenizer
    found: list[Optional[tuple[int, ...]]] = []
    counts = dict(sampled=0, correct=0, truncated=0, hint_mentions=0,
                  unreasoned=0, tokens=0)
    for start in range(0, len(prompts), size):
      texts, golds = prompts[start:start + size], answers[start:start + size]
      chunk_hints = None if hints is None else hints[start:start + size]
      out = jax.device_get(sampling.sample(
          self.model_config, params, tokenizer.encode_batch(texts),
          jax.random.fold_in(key, start), self.sampler, G,
          batch_multiple=size))
      completions = rollout.completion_texts(tokenizer, out.tokens_nt,
                                            out.length_n, out.truncated_n)
      _, correct, _ = rollout.score(spec, np.repeat(texts, G).tolist(),
                                    completions, np.repeat(golds, G).tolist(),
                                    out.length_n)
      usable = correct & ~out.truncated_n
      if chunk_hints is not None:
        mention = np.array([mentions_hint(c, h) for c, h in
                            zip(completions, np.repeat(chunk_hints, G))])
        counts["hint_mentions"] += int((usable & mention).sum())
        usable &= ~mention
      if reasoning_check:
        _, derived, _ = rollout.score(
            spec, np.repeat(texts, G).tolist(),
            [reasoning(c) for c in completions],
            np.repeat(golds, G).tolist(), out.length_n)
        derived &= np.array([equations.arithmetic_holds(c)
                             for c in completions])
        counts["unreasoned"] += int((usable & ~derived).sum())
        usable &= derived
      for b in range(len(texts)):
        good = np.flatnonzero(usable[b * G:(b + 1) * G])
        row = b * G + good[0] if good.size else None
        found.append(None if row is None else tuple(
            int(t) for t in out.tokens_nt[row, :out.length_n[row]]))
      counts["sampled"] += len(completions)
      counts["correct"] += int(correct.sum())
      counts["truncated"] += int(out.truncated_n.sum())
      counts["tokens"] += int(out.length_n.sum())
    return found, counts


class Kept(NamedTuple):
  """The fine-tuning set of one outer iteration."""
  examples: list[sft.SFTExample]     # (hint-free prompt ids, completion ids)
  problem: list[int]                 # index into the iteration's problems
  rationalized: list[bool]           # kept only through the hint


def collect_examples(config, sampler: RationaleSampler, params,
                     problems: Sequence[Example], shots: Sequence[Example],
                     key: jax.Array) -> tuple[Kept, dict[str, float]]:
  """SAMPLE + FILTER with the current model, then RATIONALISE the failures
  (when star.rationalize): Algorithm 1, lines 3-6."""
  st, d, tokenizer = config.star, config.data, sampler.tokenizer
  questions = [p.question for p in problems]
  answers = [p.answer for p in problems]
  stored = templates.render_prompts(tokenizer, d.template, questions,
                                  d.system_prompt)
  attempt = lambda prompts, golds, k, **checks: sampler.first_correct(
      params, prompts, golds, k, **checks)
  # SAMPLE + FILTER
  prompts = stored if not shots else [
      render(tokenizer, d.template, q, d.system_prompt, shots=shots)
      for q in questions]
  direct, counts = attempt(prompts, answers, jax.random.fold_in(key, 0))
  kept = {i: (ids, False) for i, ids in enumerate(direct) if ids is not None}
  # RATIONALISE: the hint goes into the sampling prompt only.
  failed = [i for i, ids in enumerate(direct) if ids is None]
  hinted_counts: dict[str, int] = {}
  if st.rationalize and failed:
    hints = [answer_hint(answers[i]) for i in failed]
    hinted = [render(tokenizer, d.template, questions[i], d.system_prompt,
                     hint=h, shots=shots) for i, h in zip(failed, hints)]
    fixed, hinted_counts = attempt(
        hinted, [answers[i] for i in failed], jax.random.fold_in(key, 1),
        hints=hints if st.drop_hint_mentions else None,
        reasoning_check=st.rationale_reasoning_check)
    kept.update({i: (ids, True) for i, ids in zip(failed, fixed)
                 if ids is not None})
  order = sorted(kept)
  prompt_ids = tokenizer.encode_batch([stored[i] for i in order])
  result = Kept([sft.SFTExample(tuple(p), kept[i][0])
                 for p, i in zip(prompt_ids, order)],
                order, [kept[i][1] for i in order])
  return result, _collect_metrics(len(problems), counts, hinted_counts, result)


def _collect_metrics(num_problems: int, direct: dict, hinted: dict,
                     kept: Kept) -> dict[str, float]:
  n_rat = int(sum(kept.rationalized))
  metrics = {
      "star/problems": num_problems,
      "star/train_accuracy": direct["correct"] / max(direct["sampled"], 1),
      "star/truncation_rate": direct["truncated"] / max(direct["sampled"], 1),
      "star/kept_direct": len(kept.examples) - n_rat,
      "star/kept_rationalized": n_rat,
      "star/kept_total": len(kept.examples),
      "star/sample_tokens": direct["tokens"] + hinted.get("tokens", 0),
  }
  if hinted:
    metrics["star/rationalization_accuracy"] = (
        hinted["correct"] / max(hinted["sampled"], 1))
    metrics["star/dropped_hint_mentions"] = hinted["hint_mentions"]
    metrics["star/dropped_unreasoned"] = hinted["unreasoned"]
  return metrics
