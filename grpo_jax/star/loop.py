"""STaR: the self-taught reasoner loop (Zelikman et al. 2022, Algorithm 1).

    M_0 = the original model      (star.teacher: a teacher samples instead of
                                   M_{n-1}: off-policy distillation, R1 §2.4)
    for n = 1 .. N:                                       (outer iteration)
      # SAMPLE       a rationale + answer for every problem with M_{n-1}
      # FILTER       keep the verified-correct ones                    (l. 5)
      # RATIONALISE  retry the failures with the correct answer as a hint;
      #              keep those now correct, stored without the hint (l. 4, 6)
      #              (those three: collect.collect_examples)
      # FINE-TUNE    the ORIGINAL M_0 on everything kept, for
      #              sft_steps * sft_growth^(n-1) steps (paper: 40, x1.2) (l. 7)
      # EVALUATE     held-out accuracy of M_n

`run(config, workdir)` is the whole experiment, registered as the method
"star" (config.method = "star"); the RL loop (`train.py`) is its sibling.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import checkpoint, errors, evaluation, registry
from grpo_jax import sharding as sharding_lib
from grpo_jax.algorithms.star import finetune_steps, split_shots
from grpo_jax.data import Example
from grpo_jax.harness import experiment, interrupts, preflight
from grpo_jax.harness import metrics as metrics_lib
from grpo_jax.models import cast, lora
from grpo_jax.rl import distill, nonfinite
from grpo_jax.rl.optimizer import OptimizerSpec
from grpo_jax.rl.spec import RunSpec
from grpo_jax.rl.update import UpdateProgram, init_state
from grpo_jax.star import sft
from grpo_jax.star.collect import Kept, RationaleSampler, collect_examples, sampling_prompts

Params = Any
CURVES = ("eval/greedy_accuracy", "star/train_accuracy", "star/kept_direct",
          "star/kept_rationalized", "sft/steps", "sft/loss_last")


# ----------------------------------------------------------------------------
# FINE-TUNE the original model.
# ----------------------------------------------------------------------------

def sft_optimizer(optim, steps: int) -> OptimizerSpec:
  """The optimizer of a `steps`-step fine-tune, as a value: outer iterations
  get equal specs, so the jitted step compiles once, unless the schedule
  depends on the step count (cosine)."""
  return OptimizerSpec.from_config(
      optim, steps if optim.schedule == "cosine" else 0)


class Tuning(NamedTuple):
  """A fine-tune's fixed parts: the jitted step's program, the endless
  batch stream (`sft.sft_batches`, a function of the seed), how a batch is
  placed, the LoRA base (None: full fine-tuning), the row length and the
  examples dropped as longer than it."""
  program: UpdateProgram
  batches: Iterator[sft.SFTBatch]
  put: Callable[[Any], Any]
  base: Optional[Params]
  row_len: int
  dropped: int


def tuning(config, model_config, original: Params,
           examples: Sequence[sft.SFTExample], steps: int, pad_id: int,
           seed: int, layout: Optional[sharding_lib.Layout] = None,
           drawn: int = 0) -> Tuning:
  """The fine-tune of `original` on `examples` for `steps` steps, its batch
  stream past the first `drawn` batches (the data position of a resumed
  fine-tune: one batch per step)."""
  st = config.star
  row_len = st.row_length or sft.row_length(examples)
  fits = [e for e in examples if sft.example_length(e) <= row_len]
  if not fits:
    raise ValueError(f"no kept example fits star.row_length={row_len}")
  batches = sft.sft_batches(fits, st.batch_size, row_len, st.pack, pad_id,
                            np.random.default_rng(seed))
  for _ in range(drawn):
    next(batches)
  program = UpdateProgram(
      model_config, sft.SFTSettings.from_config(config),
      sft_optimizer(config.optim, steps),
      num_micro=st.batch_size // (st.micro_batch_size or st.batch_size),
      layout=layout)
  base = original if lora.LoraSpec.from_config(config).enabled else None
  return Tuning(program, batches, jnp.asarray if layout is None else layout.rows,
                base, row_len, len(examples) - len(fits))


def fresh_state(config, tune: Tuning, original: Params, seed: int):
  """Step 0: a copy of `original` (the step donates its state; `original`
  stays intact) or, with LoRA, fresh adapters (B = 0) on it, and a fresh
  optimizer state (Algorithm 1, l. 7: M_n = train(M, D_n))."""
  layout = tune.program.layout
  trained = (experiment.init_adapters(config, tune.program.model_config, layout)
             if tune.base is not None else sharding_lib.copy_tree(original))
  return place(tune, init_state(trained, tune.program.optimizer, seed))


def place(tune: Tuning, state):
  """`state` through the same sharding constraint as sft_step's output: with
  `layout.place_state` (device_put), or as restored, the second step's input
  state has another aval type and the step compiles twice."""
  layout = tune.program.layout
  if layout is None:
    return state
  return jax.jit(functools.partial(
      layout.constrain_state, tune.program.model_config,
      tune.program.optimizer.build()))(state)


def tune_steps(tune: Tuning, state, steps: int) -> tuple[Any, list[dict]]:
  """`steps` SFT updates from `state`; their host metrics (loss, the
  non-finite code) in order."""
  step_metrics = []
  for _ in range(steps):
    batch = jax.tree.map(tune.put, next(tune.batches))
    state, m = sft.sft_step(state, batch, tune.program, tune.base)
    step_metrics.append({k: m[k] for k in ("loss", nonfinite.CODE)})
  return state, [{"loss": float(m["loss"]), nonfinite.CODE: int(m[nonfinite.CODE])}
                 for m in jax.device_get(step_metrics)]


def tuned_params(config, tune: Tuning, state) -> Params:
  """The fine-tuned model as full weights (LoRA: adapters merged onto a copy
  of the base)."""
  if tune.base is None:
    return state.params
  return lora.merge(tune.base, state.params, lora.LoraSpec.from_config(config).scale)


def tune_summary(tune: Tuning, step_metrics: Sequence[dict]) -> dict:
  """The fine-tune's metrics from every step's (`tune_steps`)."""
  steps, losses = len(step_metrics), [m["loss"] for m in step_metrics]
  return {**nonfinite.summarise(step_metrics, "sft/skipped"),
          "sft/steps": steps, "sft/loss_first": losses[0],
          "sft/loss_last": float(np.mean(losses[-max(1, steps // 10):])),
          "sft/row_length": tune.row_len, "sft/dropped_too_long": tune.dropped}


def finetune(config, model_config, original: Params,
             examples: Sequence[sft.SFTExample], steps: int, pad_id: int,
             seed: int, layout: Optional[sharding_lib.Layout] = None
             ) -> tuple[Params, dict[str, float]]:
  """`steps` SFT updates starting from the ORIGINAL weights with a fresh
  optimizer state (Algorithm 1, l. 7: M_n = train(M, D_n)). `original` is
  left intact: the jitted step donates its state, so it trains a copy
  (placed on `layout`'s mesh when given). With LoRA (model.lora.rank > 0)
  it trains fresh adapters (B = 0) on the frozen original and returns them
  merged into a copy: M_n as full weights, as the loop keeps them."""
  t0 = time.perf_counter()
  tune = tuning(config, model_config, original, examples, steps, pad_id,
                seed, layout)
  state, step_metrics = tune_steps(
      tune, fresh_state(config, tune, original, seed), steps)
  return tuned_params(config, tune, state), {
      **tune_summary(tune, step_metrics),
      "time/finetune": time.perf_counter() - t0}


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------

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
  experiment.record_config(config, workdir)   # every resume check passed
  if resumed is not None:
    return original, tree["params"], host["history"]
  return tree["params"], tree["params"], []


@registry.register("method", "star")
@experiment.guarded   # workdir lock; SIGTERM / Ctrl-C save, then stop
def run(config, workdir: str) -> dict:
  """STaR as `config` says, writing metrics.jsonl, TensorBoard, curves.png,
  the kept examples (star/iteration_<n>.jsonl) and a checkpoint of M_n every
  train.checkpoint_every outer iterations and after the last (restarting in
  the same workdir resumes there) under `workdir`. Returns eval_before /
  eval_after (held-out greedy accuracy), the per-iteration history and the
  final params."""
  if config.method != "star":
    raise errors.ConfigError(f"star.run needs method='star', got "
                                 f"{config.method!r}")
  st = config.star
  os.makedirs(os.path.join(workdir, "star"), exist_ok=True)
  problems, held_out = experiment.load_examples(config)   # cheap first
  held_out = held_out[:config.train.eval_examples]
  shots, problems = split_shots(problems, st.few_shot)
  tokenizer = experiment.load_tokenizer(config)
  prompts = {f"the training data (data.source = {config.data.source!r}, "
             "data.kwargs; with star.few_shot exemplars and, under "
             "star.rationalize, answer hints)": sampling_prompts(
                 config, tokenizer, problems, shots),
             **preflight.data_prompts(config, tokenizer, [], held_out)}
  preflight.check_model(config, experiment.model_config_of(config), tokenizer,
                        prompts)   # before the weights load
  model_config, original = experiment.load_model(config)
  spec = RunSpec.from_config(config, tokenizer)
  eval_settings = spec.eval
  layout = sharding_lib.Layout.from_config(config)
  teacher = (distill.load_model_as_teacher(config, st.teacher, tokenizer, layout,
                                           "star.teacher") if st.teacher else None)
  sampler = RationaleSampler.of(spec, st, teacher.model_config if teacher
                                else model_config, tokenizer)
  ckpt = experiment.make_checkpointer(config, workdir, model_config)
  original, params, history = _start(
      config, workdir, ckpt, layout.shard_params(model_config, original))
  writer = experiment.metric_writer(
      workdir, history[-1]["step"] if history else None)

  def evaluate(n: int, params, metrics: dict) -> None:
    metrics = {**evaluation.evaluate_policy(
        eval_settings, model_config, params, tokenizer, held_out,
        layout=layout).metrics, **metrics}
    history.append({"step": n, **writer.write(n, metrics)})
    logging.info("%s", metrics_lib.step_line(
        n, st.iterations, metrics, metrics_lib.STAR_LINE,
        metrics_lib.STAR_TIMES, unit="STaR iteration"))

  if not history:
    evaluate(0, original, {})
  progress = metrics_lib.progress_bar(
      st.iterations, config.train.progress and writer.enabled,
      len(history) - 1, desc="star", unit="iteration")
  interrupts.defer_to_step_boundary()
  for n in range(len(history), st.iterations + 1):
    chosen = iteration_problems(st, problems, config.seed, n)
    use_shots = shots if n == 1 or not st.few_shot_first_only else []
    t0 = time.perf_counter()
    kept, metrics = collect_examples(   # off-policy distillation: the teacher's
        config, sampler, cast(teacher.params if teacher else params,
                              spec.eval.compute_dtype), chosen,
        use_shots, jax.random.fold_in(jax.random.key(config.seed), n))
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
      code = m.pop(nonfinite.CODE)
      if code and config.train.on_non_finite == "stop":
        progress.close()
        ckpt.close()   # the earlier iterations' saves finish
        writer.close()
        raise nonfinite.error(code, f"STaR iteration {n}/{st.iterations}, "
                              "fine-tuning", params)
      metrics.update(m)
    else:
      metrics["sft/steps"] = 0
    evaluate(n, params, metrics)
    progress.update(1)
    stop = interrupts.stop_requested()
    ckpt.save(n, {"params": params}, {"history": history},
              force=n == st.iterations or stop)
    if ckpt.preempted or stop:
      interrupts.mark_preempted(n, str(ckpt.step_path(n)))
      break
  progress.close()
  ckpt.close()
  writer.close()
  return _summary(config, workdir, history, params, writer.enabled)


def iteration_problems(st, problems: Sequence[Example], seed: int, n: int
                       ) -> Sequence[Example]:
  """The problems of outer iteration n: a fresh random subset of
  star.problems_per_iteration of them (all when 0)."""
  if st.problems_per_iteration and st.problems_per_iteration < len(problems):
    rng = np.random.default_rng([seed, n])
    idx = rng.choice(len(problems), st.problems_per_iteration, replace=False)
    return [problems[i] for i in sorted(idx)]
  return problems


def _summary(config, workdir: str, history: list, params, primary: bool
             ) -> dict:
  """What `run` returns: held-out accuracy before and after, the history,
  the final params, and the curves' path (written by the primary host)."""
  summary = {"eval_before": history[0]["eval/greedy_accuracy"],
             "eval_after": history[-1]["eval/greedy_accuracy"],
             "history": history, "params": params}
  if config.train.plot and primary:
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
