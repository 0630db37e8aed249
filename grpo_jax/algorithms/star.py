"""STaR: the self-taught reasoner loop (Zelikman et al. 2022, Algorithm 1).

    M_0 = the original model
    for n = 1 .. N:                                       (outer iteration)
      # SAMPLE       a rationale + answer for every problem with M_{n-1}
      # FILTER       keep the verified-correct ones                    (l. 5)
      # RATIONALISE  retry the failures with the correct answer as a hint
      #              (`answer_hint`); keep those now correct, stored with
      #              the prompt built WITHOUT the hint            (l. 4, 6)
      # FINE-TUNE    the ORIGINAL M_0 on everything kept, for
      #              sft_steps * sft_growth^(n-1) steps (paper: 40, x1.2) (l. 7)
      # EVALUATE     held-out accuracy of M_n

A stored example is (prompt ids, completion ids). The prompt is the plain
rendering of the question (template + chat template; no hint, no few-shot
exemplars): what the held-out evaluation shows the model. The completion is
the sampled token ids, stop token included, so nothing is re-tokenised.

`run(config, workdir)` is the whole experiment (config.method = "star").
"""
from __future__ import annotations

import fractions
import functools
import json
import logging
import os
import re
import time
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from grpo_jax import checkpoint
from grpo_jax import config as config_lib
from grpo_jax import evaluation, experiment, registry, rollout, sampling, sft
from grpo_jax import metrics as metrics_lib
from grpo_jax import sharding as sharding_lib
from grpo_jax.data import DataError, Example, answer_hint, format_choices
from grpo_jax.update import cast, init_state, make_optimizer

Params = Any
CURVES = ("eval/greedy_accuracy", "star/train_accuracy", "star/kept_direct",
          "star/kept_rationalized", "sft/steps", "sft/loss_last")


# ----------------------------------------------------------------------------
# Prompts.
# ----------------------------------------------------------------------------

def render(tokenizer, template: str, question: str, system_prompt: str = "",
           hint: Optional[str] = None, shots: Sequence[Example] = ()) -> str:
  """The prompt text of one question: the system message if any, few-shot
  turns (each exemplar's question and gold rationale; under a hint the
  exemplars show their own hints, as the paper's rationalisation prompt),
  then the question through the template. Without hint and shots it equals
  `rollout.render_prompts`, the prompt of training and evaluation."""
  fmt = registry.lookup("template", template)
  messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
  for shot in shots:
    shot_hint = None if hint is None else answer_hint(shot.answer)
    messages += fmt(shot.question, shot_hint)
    messages.append({"role": "assistant", "content": shot.rationale})
  messages += fmt(question, hint)
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def mentions_hint(text: str, hint: str) -> bool:
  """A rationalisation that talks about its hint ("as the hint says") or
  repeats it ("The correct answer is B.") is no rationale for the prompt it
  is stored with, which has no hint; and the hint must never reach a stored
  example."""
  return "hint" in text.lower() or hint in text


# ----------------------------------------------------------------------------
# SAMPLE + FILTER, RATIONALISE.
# ----------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_LIST_MARKER = re.compile(r"^\s*(?:\d+[.)]|[-*\u2022])\s+")


def reasoning(text: str) -> str:
  """What a completion offers as the derivation of its answer: the text
  without its final answer statement (the last line, or the last sentence
  of a one-line reply) and without any sentence that states an answer
  (contains "answer"): "1. The answer is 31.\n2. The answer is 31." derives
  nothing, "14 + 17 = 31." does. Sentences end at . ! ? before whitespace;
  list markers ("3. ", "- ") are not part of a line's text."""
  lines = [_LIST_MARKER.sub("", l) for l in text.strip().split("\n")
           if l.strip()]
  if len(lines) == 1:
    lines = _SENTENCE_END.split(lines[0])
  sentences = [s for line in lines[:-1] for s in _SENTENCE_END.split(line)]
  return " ".join(s for s in sentences if "answer" not in s.lower())


# "a op b = c" standing alone: not preceded by a number or an operator, c
# not followed by one (a chain such as "2 + 3 * 4 = 14" is not checked).
_EQUATION = re.compile(
    r"(?<![\d.\-+*/\u00d7])(?<![\-+*/\u00d7] )(\d+(?:\.\d+)?)\s*"
    r"([-+*/x\u00d7])\s*(\d+(?:\.\d+)?)\s*=\s*(-?\d+(?:\.\d+)?)"
    r"(?!\.?\d|\s*[-+*/x\u00d7]\s*\d)")


def arithmetic_holds(text: str) -> bool:
  """Whether every stand-alone "a op b = c" in `text` (op: + - * / x; a c
  with decimals may be rounded to them) is true. A hint can pull the
  hinted number into a false equation ("23 + 4 = 19. The answer is 19."):
  the answer is then asserted, not derived."""
  for a, op, b, c in _EQUATION.findall(text):
    x, y = fractions.Fraction(a), fractions.Fraction(b)
    if op == "/" and y == 0:
      return False
    value = {"+": x + y, "-": x - y, "/": x / y}.get(op, x * y)
    decimals = len(c.partition(".")[2])
    error = abs(value - fractions.Fraction(c))
    if error > (fractions.Fraction(1, 2 * 10 ** decimals) if decimals else 0):
      return False
  return True


def first_correct(model_config, params, tokenizer, prompts: Sequence[str],
                  answers: Sequence[str], key: jax.Array,
                  cfg: sampling.SamplingConfig, num_samples: int,
                  spec: rollout.RewardSpec, batch: int,
                  hints: Optional[Sequence[str]] = None,
                  reasoning_check: bool = False
                  ) -> tuple[list[Optional[tuple[int, ...]]], dict[str, int]]:
  """Samples `num_samples` completions per prompt; per prompt, the token ids
  (stop token included) of the first one that the accuracy reward verifies
  and that ended within the budget, else None. Also counts. Every call is
  padded to `batch` prompts: one compiled shape however many remain.

  For rationalisations: with `hints` (one per prompt) completions that
  mention or repeat their hint are rejected (`mentions_hint`);
  `reasoning_check` rejects those whose `reasoning` (no final line, no
  answer statements) does not itself verify, i.e. the answer is asserted
  after the hint rather than derived ("14 + 17 = 21.\nThe answer is 31.",
  "1. The answer is 31.\n2. The answer is 31.\nSo 31.")."""
  G, size = num_samples, batch
  found: list[Optional[tuple[int, ...]]] = []
  counts = dict(sampled=0, correct=0, truncated=0, hint_mentions=0,
                unreasoned=0, tokens=0)
  for start in range(0, len(prompts), size):
    texts, golds = prompts[start:start + size], answers[start:start + size]
    chunk_hints = None if hints is None else hints[start:start + size]
    out = jax.device_get(sampling.sample(
        model_config, params, tokenizer.encode_batch(texts),
        jax.random.fold_in(key, start), cfg, G, batch_multiple=size))
    ends = out.length_b - (~out.truncated_b)   # the text excludes the stop
    completions = [tokenizer.decode(row[:n], skip_special_tokens=True)
                   for row, n in zip(out.tokens_bt, ends)]
    _, correct, _ = rollout.score(spec, np.repeat(texts, G).tolist(),
                                  completions, np.repeat(golds, G).tolist(),
                                  out.length_b)
    usable = correct & ~out.truncated_b
    if chunk_hints is not None:
      mention = np.array([mentions_hint(c, h) for c, h in
                          zip(completions, np.repeat(chunk_hints, G))])
      counts["hint_mentions"] += int((usable & mention).sum())
      usable &= ~mention
    if reasoning_check:
      _, derived, _ = rollout.score(
          spec, np.repeat(texts, G).tolist(),
          [reasoning(c) for c in completions],
          np.repeat(golds, G).tolist(), out.length_b)
      derived &= np.array([arithmetic_holds(c) for c in completions])
      counts["unreasoned"] += int((usable & ~derived).sum())
      usable &= derived
    for b in range(len(texts)):
      good = np.flatnonzero(usable[b * G:(b + 1) * G])
      row = b * G + good[0] if good.size else None
      found.append(None if row is None else
                   tuple(int(t) for t in out.tokens_bt[row, :out.length_b[row]]))
    counts["sampled"] += len(completions)
    counts["correct"] += int(correct.sum())
    counts["truncated"] += int(out.truncated_b.sum())
    counts["tokens"] += int(out.length_b.sum())
  return found, counts


class Kept(NamedTuple):
  """The fine-tuning set of one outer iteration."""
  examples: list[sft.SFTExample]     # (hint-free prompt ids, completion ids)
  problem: list[int]                 # index into the iteration's problems
  rationalized: list[bool]           # kept only through the hint


def collect_examples(config, model_config, params, tokenizer,
                     problems: Sequence[Example], shots: Sequence[Example],
                     key: jax.Array, spec: rollout.RewardSpec
                     ) -> tuple[Kept, dict[str, float]]:
  """SAMPLE + FILTER with the current model, then RATIONALISE the failures
  (when star.rationalize): Algorithm 1, lines 3-6."""
  st, d = config.star, config.data
  cfg = experiment.sampling_config(config, tokenizer)
  if cfg.is_greedy:  # the evaluation's greedy program: compiled once for both
    cfg = evaluation.eval_sampling_config(config, tokenizer, greedy=True)
  questions = [p.question for p in problems]
  answers = [p.answer for p in problems]
  stored = rollout.render_prompts(tokenizer, d.template, questions,
                                  d.system_prompt)
  attempt = lambda prompts, golds, k, **checks: first_correct(
      model_config, params, tokenizer, prompts, golds, k, cfg,
      st.samples_per_problem, spec, st.sample_batch, **checks)
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


# ----------------------------------------------------------------------------
# FINE-TUNE the original model.
# ----------------------------------------------------------------------------

def finetune_steps(star, iteration: int) -> int:
  """Steps of outer iteration n >= 1: sft_steps * sft_growth^(n-1) (paper:
  40 steps, 20% more each iteration)."""
  return max(1, int(round(star.sft_steps * star.sft_growth ** (iteration - 1))))


def sft_optimizer(optim, steps: int):
  """The optimizer of a `steps`-step fine-tune. The jitted step takes it as
  a static argument, so outer iterations share one object (one compile)
  unless the schedule depends on the step count (cosine)."""
  total = steps if optim.schedule == "cosine" else 0
  return _cached_optimizer(tuple(sorted(optim.items())), total)


@functools.lru_cache(maxsize=16)
def _cached_optimizer(optim_items: tuple, total: int):
  return make_optimizer(ml_collections.ConfigDict(dict(optim_items)), total)


def finetune(config, model_config, original: Params,
             examples: Sequence[sft.SFTExample], steps: int, pad_id: int,
             seed: int, layout: Optional[sharding_lib.Layout] = None
             ) -> tuple[Params, dict[str, float]]:
  """`steps` SFT updates starting from the ORIGINAL weights with a fresh
  optimizer state (Algorithm 1, l. 7: M_n = train(M, D_n)). `original` is
  left intact: the jitted step donates its state, so it trains a copy
  (placed on `layout`'s mesh when given)."""
  st = config.star
  row_len = st.row_length or sampling.bucket(
      max(map(sft.example_length, examples)))
  fits = [e for e in examples if sft.example_length(e) <= row_len]
  if not fits:
    raise ValueError(f"no kept example fits star.row_length={row_len}")
  optimizer = sft_optimizer(config.optim, steps)
  state = init_state(sharding_lib.copy_tree(original), optimizer, seed)
  put = jnp.asarray
  if layout is not None:
    # Placed through the same sharding constraint as sft_step's output: with
    # `layout.place_state` (device_put) the second step's input state has
    # another aval type and the step compiles twice.
    state = jax.jit(functools.partial(layout.constrain_state, model_config,
                                      optimizer))(state)
    put = layout.rows
  batches = sft.sft_batches(fits, st.batch_size, row_len, st.pack, pad_id,
                            np.random.default_rng(seed))
  num_micro = st.batch_size // (st.micro_batch_size or st.batch_size)
  settings = sft.SFTSettings.from_config(config)
  t0, losses = time.perf_counter(), []
  for _ in range(steps):
    batch = jax.tree.map(put, next(batches))
    state, m = sft.sft_step(state, batch, model_config, optimizer, num_micro,
                            settings, layout)
    losses.append(m["loss"])
  losses = [float(x) for x in jax.device_get(losses)]
  return state.params, {
      "sft/steps": steps, "sft/loss_first": losses[0],
      "sft/loss_last": float(np.mean(losses[-max(1, steps // 10):])),
      "sft/row_length": row_len,
      "sft/dropped_too_long": len(examples) - len(fits),
      "time/finetune": time.perf_counter() - t0}


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------

def split_shots(problems: Sequence[Example], k: int
                ) -> tuple[list[Example], list[Example]]:
  """The first k problems with a gold rationale become few-shot exemplars
  (the paper's small prompt set P); the rest stay problems."""
  with_rationale = [i for i, p in enumerate(problems) if p.rationale]
  if len(with_rationale) < k:
    raise ValueError(f"star.few_shot={k} exemplars need gold rationales; "
                     f"the data has {len(with_rationale)}")
  chosen = set(with_rationale[:k])
  return ([problems[i] for i in sorted(chosen)],
          [p for i, p in enumerate(problems) if i not in chosen])


def _save_kept(path: str, tokenizer, problems: Sequence[Example],
               kept: Kept) -> None:
  """One JSON line per kept example: what the model will be tuned on."""
  with open(path, "w", encoding="utf-8") as f:
    for e, i, rat in zip(kept.examples, kept.problem, kept.rationalized):
      f.write(json.dumps({
          "question": problems[i].question, "answer": problems[i].answer,
          "rationalized": rat, "prompt": tokenizer.decode(e.prompt_ids),
          "completion": tokenizer.decode(e.completion_ids)}) + "\n")


def _start(config, workdir: str, ckpt: checkpoint.Checkpointer,
           original: Params) -> tuple[Params, Params, list[dict]]:
  """(original model, current model, history) by the resume order
  (experiment.restore_or_init): this run's latest outer iteration (its M_n
  and metrics), else config.init_from's params as the original model, else
  the pretrained weights."""
  tree, host, resumed = experiment.restore_or_init(ckpt, workdir, config,
                                                   {"params": original})
  if resumed is not None:
    return original, tree["params"], host["history"]
  return tree["params"], tree["params"], []


def run(config, workdir: str) -> dict:
  """STaR as `config` says, writing metrics.jsonl, TensorBoard, curves.png,
  the kept examples (star/iteration_<n>.jsonl) and a checkpoint of M_n every
  train.checkpoint_every outer iterations and after the last (restarting in
  the same workdir resumes there) under `workdir`. Returns eval_before /
  eval_after (held-out greedy accuracy), the per-iteration history and the
  final params."""
  config_lib.validate(config)
  if config.method != "star":
    raise config_lib.ConfigError(f"star.run needs method='star', got "
                                 f"{config.method!r}")
  sharding_lib.initialize_distributed(config)  # before any device is used
  st = config.star
  os.makedirs(os.path.join(workdir, "star"), exist_ok=True)
  model_config, original, tokenizer = experiment.load_model_and_tokenizer(config)
  problems, held_out = experiment.load_examples(config)
  held_out = held_out[:config.train.eval_examples]
  shots, problems = split_shots(problems, st.few_shot)
  spec = rollout.RewardSpec.from_config(config)
  layout = sharding_lib.Layout.from_config(config)
  ckpt = experiment.make_checkpointer(config, workdir, model_config)
  original, params, history = _start(
      config, workdir, ckpt, layout.shard_params(model_config, original))
  writer = experiment.metric_writer(
      workdir, history[-1]["step"] if history else None)

  def evaluate(n: int, params, metrics: dict) -> None:
    metrics = {**evaluation.evaluate_policy(
        config, model_config, params, tokenizer, held_out,
        layout=layout).metrics, **metrics}
    history.append({"step": n, **writer.write(n, metrics)})
    logging.info("STaR iteration %d: %s", n, history[-1])

  if not history:
    evaluate(0, original, {})
  for n in range(len(history), st.iterations + 1):
    chosen = problems
    if st.problems_per_iteration and st.problems_per_iteration < len(problems):
      rng = np.random.default_rng([config.seed, n])
      idx = rng.choice(len(problems), st.problems_per_iteration, replace=False)
      chosen = [problems[i] for i in sorted(idx)]
    use_shots = shots if n == 1 or not st.few_shot_first_only else []
    t0 = time.perf_counter()
    kept, metrics = collect_examples(
        config, model_config, cast(params, config.model.compute_dtype),
        tokenizer, chosen, use_shots, jax.random.fold_in(
            jax.random.key(config.seed), n), spec)
    metrics["time/sample"] = time.perf_counter() - t0
    if writer.enabled:
      _save_kept(os.path.join(workdir, "star", f"iteration_{n}.jsonl"),
                 tokenizer, chosen, kept)
    # FINE-TUNE the original model; nothing kept leaves it unchanged.
    params = original
    if kept.examples:
      params, m = finetune(config, model_config, original, kept.examples,
                           finetune_steps(st, n), tokenizer.pad_id or 0,
                           config.seed + n, layout)
      metrics.update(m)
    else:
      metrics["sft/steps"] = 0
    evaluate(n, params, metrics)
    ckpt.save(n, {"params": params}, {"history": history},
              force=n == st.iterations)
    if ckpt.preempted:
      logging.warning("pre-empted: checkpoint saved after iteration %d", n)
      break
  ckpt.close()
  writer.close()
  summary = {"eval_before": history[0]["eval/greedy_accuracy"],
             "eval_after": history[-1]["eval/greedy_accuracy"],
             "history": history, "params": params}
  if config.train.plot and writer.enabled:
    summary["plot"] = metrics_lib.plot_curves(
        history, os.path.join(workdir, "curves.png"), keys=CURVES,
        title=f"{config.name} (x: outer iteration)")
  return summary


def plot_comparison(runs: Mapping[str, str], png_path: str,
                    keys: Sequence[str] = CURVES) -> str:
  """Runs side by side (label -> workdir), one panel per metric against the
  outer iteration, e.g. STaR with and without rationalisation."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  rows = {label: metrics_lib.read_jsonl(os.path.join(d, "metrics.jsonl"))
          for label, d in runs.items()}
  fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.0),
                           squeeze=False)
  for ax, key in zip(axes[0], keys):
    for label, history in rows.items():
      pts = [(r["step"], r[key]) for r in history if key in r]
      if pts:
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_title(key)
    ax.set_xlabel("outer iteration")
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
  axes[0][0].legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return png_path


# ----------------------------------------------------------------------------
# CommonsenseQA records (the paper's data set), for the jsonl/parquet/tfds
# readers: layout="commonsenseqa".
# ----------------------------------------------------------------------------

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


@registry.register("layout", "commonsenseqa")
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
