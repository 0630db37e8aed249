"""Supervised fine-tuning on a file of worked examples: the method "sft"
(R1's cold start: a few curated chains of thought before RL).

The data is `config.data` as for any run (e.g. `data.source = "jsonl"` with
a layout that reads a worked solution, such as "math"); each training
example's `rationale` is the completion, after the prompt the template
renders (`star.collect.render`, as sampling sees it), ended by the
tokenizer's end-of-sequence token. The fine-tune is STaR's
(`star.loop.tuning`): `star.sft_steps` steps of `star.batch_size` rows,
from config.init_from's parameters when set (the previous stage of a
pipeline) or the pretrained model.

Checkpoint step s is SFT step s: the fine-tuned model as full weights
("params", what a later stage's init_from loads), the rest of the
TrainState (optimizer state, step; with LoRA the adapters) and, in the host
state, the summary so far, every step's loss and the data position (the
batches drawn, one per step). It is written every train.checkpoint_every
steps, at a stop (SIGTERM, Ctrl-C: at the end of the step it lands in) and
after the last step's evaluation. A restart resumes after step s, exactly:
the batch stream is a function of the seed, advanced past the s batches
drawn, so the remaining steps see the batches an uninterrupted run would
(tests/test_pipeline.py compares the two bit for bit). A restart with the
last step saved only returns its results.
"""
from __future__ import annotations

import logging
import time

from grpo_jax import checkpoint, errors, evaluation, registry
from grpo_jax import sharding as sharding_lib
from grpo_jax.data import templates
from grpo_jax.harness import experiment, interrupts
from grpo_jax.models import lora
from grpo_jax.rl import nonfinite
from grpo_jax.rl.spec import RunSpec
from grpo_jax.rl.update import TrainState
from grpo_jax.star import loop
from grpo_jax.star.collect import render
from grpo_jax.star.sft import Params, SFTExample


def sft_examples(config, tokenizer, problems) -> list[SFTExample]:
  """(prompt ids, rationale ids + eos) of every problem, the prompt its
  question through data.template, or the chat in its meta["messages"]
  where it has one (a later turn of a tool-call transcript); one without a
  rationale is refused, naming it."""
  d, out = config.data, []
  eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  for i, p in enumerate(problems):
    if not p.rationale:
      raise errors.DataError(
          f"method 'sft': example {i} of data.source {d.source!r} has no worked "
          f"solution (its layout gives no rationale): {p.question[:60]!r}")
    if "messages" in p.meta:      # a chat up to the turn (a tool transcript)
      system = ([{"role": "system", "content": d.system_prompt}]
                if d.system_prompt else [])
      prompt = templates.render_prompt([*system, *p.meta["messages"]],
                                       tokenizer)
    else:
      prompt = render(tokenizer, d.template, p.question, d.system_prompt)
    out.append(SFTExample(tuple(tokenizer.encode(prompt)),
                          tuple(tokenizer.encode(p.rationale)) + tuple(eos)))
  return out


def _tree(state, params: Params, lora_on: bool) -> dict:
  """What a checkpoint holds: the fine-tuned model as full weights
  ("params": what a later stage's init_from loads) and the rest of the
  TrainState (with LoRA its adapters as "adapters")."""
  tree = {"params": params, "opt_state": state.opt_state, "step": state.step,
          "key": state.key}
  return {**tree, "adapters": state.params} if lora_on else tree


def _state(tree: dict, lora_on: bool) -> TrainState:
  return TrainState(tree["step"], tree["adapters"] if lora_on else tree["params"],
                    tree["opt_state"], tree["key"])


def _lora_base(config, params: Params) -> Params:
  """A resumed LoRA fine-tune's frozen base: what a fresh start trained on
  (config.init_from's params, else the pretrained `params`)."""
  return checkpoint.load_params(config.init_from, params) if config.init_from else params


@registry.register("method", "sft")
@experiment.guarded
def run(config, workdir: str) -> dict:
  """Fine-tunes on the data's worked solutions and evaluates before and
  after; returns eval_before / eval_after, the sft/* metrics and params.
  Resumes at the step its checkpoint holds (module docstring)."""
  problems, held_out = experiment.load_examples(config)
  held_out = held_out[:config.train.eval_examples]
  tokenizer = experiment.load_tokenizer(config)
  examples = sft_examples(config, tokenizer, problems)
  model_config, params = experiment.load_model(config)
  layout = sharding_lib.Layout.from_config(config)
  params = layout.shard_params(model_config, params)
  lora_on, steps = lora.LoraSpec.from_config(config).enabled, config.star.sft_steps
  ckpt = experiment.make_checkpointer(config, workdir, model_config)
  # The template: step 0 of a fine-tune of the pretrained weights (shapes).
  tune = loop.tuning(config, model_config, params, examples, steps,
                         tokenizer.pad_id or 0, config.seed, layout)
  fresh = loop.fresh_state(config, tune, params, config.seed)
  start = experiment.restore_or_init(
      ckpt, workdir, config, _tree(fresh, params if lora_on else fresh.params, lora_on))
  experiment.record_config(config, workdir)
  del fresh
  done = start.step or 0
  host = {"summary": {}, "sft_metrics": [], **start.host}
  original = start.state["params"]   # fresh: init_from's or the pretrained
  if lora_on and start.step is not None:
    original = _lora_base(config, params)
  tune = loop.tuning(config, model_config, original, examples, steps,
                         tokenizer.pad_id or 0, config.seed, layout,
                         drawn=host.get("sft_batches_drawn", 0))
  state = loop.place(tune, _state(start.state, lora_on))
  settings = RunSpec.from_config(config, tokenizer).eval
  evaluate = lambda p: evaluation.evaluate_policy(
      settings, model_config, p, tokenizer, held_out,
      layout=layout).metrics["eval/greedy_accuracy"] if held_out else float("nan")
  summary, history = host["summary"], host["sft_metrics"]
  if done == 0:
    summary["eval_before"] = evaluate(original)
  interrupts.defer_to_step_boundary()
  t0 = time.perf_counter()
  for step in range(done + 1, steps + 1):
    state, m = loop.tune_steps(tune, state, 1)
    history += m
    if m[0][nonfinite.CODE] and config.train.on_non_finite == "stop":
      ckpt.close()   # the earlier steps' saves finish
      raise nonfinite.error(m[0][nonfinite.CODE], f"sft step {step}/{steps}",
                            state.params)
    stop = interrupts.stop_requested()
    if step < steps and (stop or ckpt.should_save(step)):
      _save(ckpt, step, state, loop.tuned_params(config, tune, state), lora_on,
            {"summary": summary, "sft_metrics": history, "sft_batches_drawn": step})
    if step < steps and (ckpt.preempted or stop):
      interrupts.mark_preempted(step, str(ckpt.step_path(step)))
      ckpt.close()
      return {**summary, "sft/steps_done": step}
  params = loop.tuned_params(config, tune, state)
  if done < steps:
    summary.update({k: v for k, v in loop.tune_summary(tune, history).items()
                    if k != nonfinite.CODE})
    summary["time/finetune"] = time.perf_counter() - t0
    summary["eval_after"] = evaluate(params)
    _save(ckpt, steps, state, params, lora_on,
          {"summary": summary, "sft_metrics": history, "sft_batches_drawn": steps})
    logging.info("sft: %d examples, %d steps, eval %.3f -> %.3f", len(examples),
                 steps, summary["eval_before"], summary["eval_after"])
  ckpt.close()
  return {**summary, "params": params}


def _save(ckpt, step: int, state, params: Params, lora_on: bool, host: dict) -> None:
  ckpt.save(step, _tree(state, params, lora_on), host, force=True)
