"""Supervised fine-tuning on a file of worked examples: the method "sft"
(R1's cold start: a few curated chains of thought before RL).

The data is `config.data` as for any run (e.g. `data.source = "jsonl"` with
a layout that reads a worked solution, such as "math"); each training
example's `rationale` is the completion, after the prompt the template
renders (`star.collect.render`, as sampling sees it), ended by the
tokenizer's end-of-sequence token. The fine-tune is STaR's
(`star.loop.finetune`): `star.sft_steps` steps of `star.batch_size` rows,
from config.init_from's parameters when set (the previous stage of a
pipeline) or the pretrained model.

A checkpoint ({"params"}, step 1) is written when the fine-tune ends; a
restart with it present only evaluates, and one before it fine-tunes again
from the start (the same steps: batches are a function of the seed).
"""
from __future__ import annotations

import logging

from grpo_jax import errors, evaluation, registry
from grpo_jax import sharding as sharding_lib
from grpo_jax.harness import experiment
from grpo_jax.rl import nonfinite
from grpo_jax.rl.spec import RunSpec
from grpo_jax.star.collect import render
from grpo_jax.star.loop import finetune
from grpo_jax.star.sft import SFTExample


def sft_examples(config, tokenizer, problems) -> list[SFTExample]:
  """(prompt ids, rationale ids + eos) of every problem; one without a
  rationale is refused, naming it."""
  d, out = config.data, []
  eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  for i, p in enumerate(problems):
    if not p.rationale:
      raise errors.DataError(
          f"method 'sft': example {i} of data.source {d.source!r} has no worked "
          f"solution (its layout gives no rationale): {p.question[:60]!r}")
    prompt = render(tokenizer, d.template, p.question, d.system_prompt)
    out.append(SFTExample(tuple(tokenizer.encode(prompt)),
                          tuple(tokenizer.encode(p.rationale)) + tuple(eos)))
  return out


@registry.register("method", "sft")
@experiment.guarded
def run(config, workdir: str) -> dict:
  """Fine-tunes on the data's worked solutions and evaluates before and
  after; returns eval_before / eval_after, the sft/* metrics and params."""
  problems, held_out = experiment.load_examples(config)
  held_out = held_out[:config.train.eval_examples]
  tokenizer = experiment.load_tokenizer(config)
  examples = sft_examples(config, tokenizer, problems)
  model_config, params = experiment.load_model(config)
  layout = sharding_lib.Layout.from_config(config)
  ckpt = experiment.make_checkpointer(config, workdir, model_config)
  start = experiment.restore_or_init(
      ckpt, workdir, config, {"params": layout.shard_params(model_config, params)})
  experiment.record_config(config, workdir)
  settings = RunSpec.from_config(config, tokenizer).eval
  evaluate = lambda p: evaluation.evaluate_policy(
      settings, model_config, p, tokenizer, held_out,
      layout=layout).metrics["eval/greedy_accuracy"] if held_out else float("nan")
  summary = dict(start.host.get("summary", {}))
  params = start.state["params"]
  if start.step is None:
    summary["eval_before"] = evaluate(params)
    params, metrics = finetune(config, model_config, params, examples,
                               config.star.sft_steps, tokenizer.pad_id or 0,
                               config.seed, layout)
    code = metrics.pop(nonfinite.CODE)
    if code and config.train.on_non_finite == "stop":
      raise nonfinite.error(code, "sft fine-tuning", params)
    summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    summary["eval_after"] = evaluate(params)
    ckpt.save(1, {"params": params}, {"summary": summary}, force=True)
    logging.info("sft: %d examples, %d steps, eval %.3f -> %.3f", len(examples),
                 config.star.sft_steps, summary["eval_before"], summary["eval_after"])
  ckpt.close()
  return {**summary, "params": params}
