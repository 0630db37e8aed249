"""One GRPO step, phase by phase: grpo_jax next to TRL's GRPOTrainer.

    python benchmarks/grpo_step.py [--prompts 8] [--generations 8]
        [--new-tokens 64] [--micro-batch 32] [--threads N] [--quick]

The same SmolLM2-135M-Instruct weights in float32 (grpo_jax loads the
bundled GGUF; TRL loads the transformers directory grpo_jax builds from it),
the same 8 chat-templated arithmetic prompts (configs/dapo_aime.py:local's
task, template and system prompt), G = 8 completions of at most 64 tokens
(both stop at EOS), the same reward (grpo_jax's `last_number` function),
beta = 0 (no reference model), mu = 1 (one optimizer update per rollout),
token-mean loss, clip 0.2 / 0.28, AdamW lr 1e-6, grad-norm clip 1.

grpo_jax: configs/dapo_aime.py:local with the sizes above, dynamic
sampling off (one generation batch, as TRL) and only the last_number reward;
the step is `train.run`'s loop body: rollout.collect (SAMPLE + SCORE),
pack, advantages, step_lib.train_step (REFERENCE + UPDATE).

TRL: GRPOTrainer on an in-memory Dataset of the 8 prompts, one generation
of B*G rows per optimizer step (per_device_train_batch_size = --micro-batch,
gradient_accumulation_steps = B*G / --micro-batch, the same micro-batch as
grpo_jax's; all B*G rows at once needed ~15 GiB in TRL and was OOM-killed on
a shared 24 GiB machine), num_iterations = 1, max_steps = 2, use_cpu, no
bf16, no gradient checkpointing. Phases are timed by wrapping the trainer's
own methods: sample = `_generate` (chat template, generate, decode), score =
`_calculate_rewards`, reference = log-prob passes inside
`_generate_and_score_completions` (none at beta = 0, mu = 1), update = the
rest of the step (loss, backward, optimizer step), total = on_step_begin to
on_step_end of a TrainerCallback.

grpo_jax runs --warmup-steps steps (default 2: the first compiles the
sampler and the update; on 2026-11-29 the second still compiled one small
program, 5 s), then the measured step, which must not compile. TRL runs one
warm-up step and the measured step.
"""
from __future__ import annotations

import argparse
import collections
import functools
import gc
import importlib.util
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import _common
import jax
import numpy as np
import torch
import transformers

from grpo_jax import models, validation
from grpo_jax.data import templates
from grpo_jax.generate import rollout, sampling
from grpo_jax.harness import experiment
from grpo_jax.models import loading
from grpo_jax.rewards import last_number
from grpo_jax.rl import optimizer as optimizer_lib
from grpo_jax.rl import step as step_lib
from grpo_jax.rl import train, update
from grpo_jax.rl.batch import to_rows
from grpo_jax.rl.spec import AdvantageSettings

# pylint: enable=g-import-not-at-top,wrong-import-position

PHASES = ("sample", "score", "reference", "update", "other", "total")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=8, help="B prompts per step")
  p.add_argument("--generations", type=int, default=8, help="G per prompt")
  p.add_argument("--new-tokens", type=int, default=64,
                 help="max completion tokens")
  p.add_argument("--micro-batch", type=int, default=32,
                 help="rows per forward/backward on both sides (grpo_jax "
                      "micro_batch_size, TRL per_device_train_batch_size "
                      "with gradient accumulation up to B*G); 0: all B*G")
  p.add_argument("--levels", default="1", help="arithmetic levels")
  p.add_argument("--warmup-steps", type=int, default=2,
                 help="grpo_jax steps before the measured one (2: the "
                      "second step still compiles update_step once more)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--lr", type=float, default=1e-6)
  p.add_argument("--threads", type=int, default=os.cpu_count(),
                 help="torch intra-op threads (default: all cores)")
  p.add_argument("--skip-trl", action="store_true",
                 help="time grpo_jax only (no ratio)")
  p.add_argument("--quick", action="store_true",
                 help="smoke check: 2 prompts x 4 generations x 8 tokens, "
                      "micro-batch 4")
  args = p.parse_args(argv)
  if args.quick:
    args.prompts, args.generations, args.new_tokens = 2, 4, 8
    args.micro_batch = 4
  if args.generations < 2:
    p.error("--generations must be >= 2 (GRPO's group baseline)")
  rows = args.prompts * args.generations
  args.micro_batch = min(args.micro_batch or rows, rows)
  if rows % args.micro_batch:
    p.error(f"--micro-batch {args.micro_batch} must divide B*G = {rows}")
  return args


# ----------------------------------------------------------------------------
# grpo_jax.
# ----------------------------------------------------------------------------

def ours_config(args):
  """configs/dapo_aime.py:local at the benchmark's sizes (validated)."""
  path = os.path.join(_common.REPO_ROOT, "configs", "dapo_aime.py")
  spec = importlib.util.spec_from_file_location("dapo_aime_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("local")
  c.seed = args.seed
  c.sampling.max_new_tokens = args.new_tokens
  c.rl.prompts_per_step, c.rl.num_generations = args.prompts, args.generations
  c.rl.kl_beta, c.rl.num_updates = 0.0, 1
  c.rl.dynamic_sampling = False            # one generation batch, as TRL
  c.rl.mini_batch_size, c.rl.micro_batch_size = 0, args.micro_batch
  c.rewards = {"last_number": 1.0}          # TRL gets the same function
  c.reward_kwargs = {}
  c.accuracy_reward = "last_number"
  c.optim.learning_rate, c.optim.warmup_steps = args.lr, 0
  c.train.progress = False
  validation.validate(c)
  return c


class OursStep:
  """train.run's loop body for a fixed list of examples, timed by phase."""

  def __init__(self, config, examples):
    self.config, self.examples = config, examples
    self.model_config, params, self.tokenizer = (
        experiment.load_model_and_tokenizer(config))
    self.spec = rollout.RewardSpec.from_config(config)
    self.update = step_lib.UpdateSpec.from_config(config)
    self.sample_cfg = experiment.sampling_config(config, self.tokenizer)
    self.optimizer = optimizer_lib.make_optimizer(config.optim, 100)
    self.state = update.init_state(params, self.optimizer, config.seed)
    self.rng = np.random.default_rng(config.seed)
    self.clock = _common.CompileClock()

  def prompt_ids(self) -> list[list[int]]:
    c = self.config
    texts = templates.render_prompts(self.tokenizer, c.data.template,
                                   [e.question for e in self.examples],
                                   c.data.system_prompt)
    return self.tokenizer.encode_batch(texts)

  def __call__(self, step: int) -> dict[str, float]:
    """One step; returns phase seconds and rollout statistics."""
    c, rl = self.config, self.config.rl
    mark = self.clock.mark()
    t0 = time.perf_counter()
    key = jax.random.fold_in(jax.random.key(c.seed), step)
    compute = models.cast(self.state.params, c.model.compute_dtype)
    generate = lambda i: rollout.generate_groups(
        sampling.Sampler(self.model_config, self.sample_cfg), compute,
        self.tokenizer, self.examples, jax.random.fold_in(key, i),
        rollout.GroupSettings(rl.num_generations, self.spec, c.data.template,
                              c.data.system_prompt))
    # SAMPLE + SCORE
    groups, m = rollout.collect(generate, rl.prompts_per_step)
    batch = to_rows(groups, self.tokenizer.pad_id or 0, rl.overlong_filter)
    # ADVANTAGE
    adv_n = train.advantages(AdvantageSettings.from_config(c), batch.reward_bg,
                             batch.mask_nt)
    # REFERENCE + UPDATE
    self.state, um = step_lib.train_step(
        self.update, self.update.program(self.model_config, self.optimizer),
        self.state, batch, adv_n, step_lib.Frozen(), self.rng)
    jax.block_until_ready(self.state.params)
    total = time.perf_counter() - t0
    out = {"sample": m["time/sample"], "score": m["time/score"],
           "reference": um["time/reference"], "update": um["time/update"],
           "total": total}
    out["other"] = total - sum(out[k] for k in PHASES[:4])
    out["compiles"], out["compile_s"] = self.clock.since(mark)
    out.update(tokens=int(m["sample/tokens"]),
               longest=int(m["response_length/max"]),
               mean_length=m["response_length/mean"],
               reward=m["reward/mean"])
    return out


# ----------------------------------------------------------------------------
# TRL.
# ----------------------------------------------------------------------------

class PhaseClock:
  """Seconds spent in wrapped trainer methods, per step."""

  def __init__(self):
    self.seconds = collections.defaultdict(float)
    self.in_rollout = False          # inside _generate_and_score_completions
    self.lengths: list[int] = []
    self.rewards: list[float] = []

  def wrap(self, obj, method: str, phase: str, only_in_rollout: bool = False):
    """Replaces obj.method with a call timed into `phase`; the phase
    "rollout" marks its extent for the `only_in_rollout` wrappers."""
    inner = getattr(obj, method)

    @functools.wraps(inner)
    def timed(*a, **kw):
      if only_in_rollout and not self.in_rollout:
        return inner(*a, **kw)
      outer = self.in_rollout
      self.in_rollout = outer or phase == "rollout"
      t0 = time.perf_counter()
      try:
        return inner(*a, **kw)
      finally:
        self.seconds[phase] += time.perf_counter() - t0
        self.in_rollout = outer
    setattr(obj, method, timed)

  def reset(self):
    self.seconds.clear()
    self.lengths.clear()
    self.rewards.clear()


def trl_reward(clock: PhaseClock):
  """grpo_jax's last_number reward as a TRL reward function; it also records
  each completion's token count (TRL masks after the first EOS)."""

  def last_number_reward(prompts, completions, completion_ids, answer,
                         **kwargs):
    del kwargs
    texts = [c[-1]["content"] if isinstance(c, list) else c
             for c in completions]
    out = last_number.last_number_reward(prompts, texts, answer, None)
    clock.lengths.extend(len(ids) for ids in completion_ids)
    clock.rewards.extend(float(x) for x in out)
    return [float(x) for x in out]
  return last_number_reward


def trl_step_times(args, examples, messages) -> list[dict[str, float]]:
  """Runs GRPOTrainer for 2 steps; returns each step's phase seconds."""
  # The peer's packages (requirements-bench.txt), imported only when it runs:
  # the grpo_jax side alone (--skip-trl, ragged.py --samplers-only) needs
  # neither.
  import datasets  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top
  directory = loading.preset_directory(_common.MODEL)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  dataset = datasets.Dataset.from_list(
      [{"prompt": m, "answer": e.answer} for m, e in zip(messages, examples)])
  clock = PhaseClock()
  steps: list[dict[str, float]] = []

  class StepTimer(transformers.TrainerCallback):

    def on_step_begin(self, *a, **kw):
      clock.reset()
      self.t0 = time.perf_counter()

    def on_step_end(self, *a, **kw):
      total = time.perf_counter() - self.t0
      s = dict(clock.seconds)
      rollout = s.get("rollout", 0.0)
      row = {"sample": s.get("sample", 0.0), "score": s.get("score", 0.0),
             "reference": s.get("reference", 0.0),
             "update": total - rollout, "total": total}
      row["other"] = total - sum(row[k] for k in PHASES[:4])
      n = len(clock.lengths)
      row.update(tokens=sum(clock.lengths),
                 longest=max(clock.lengths, default=0),
                 mean_length=sum(clock.lengths) / max(n, 1),
                 reward=sum(clock.rewards) / max(n, 1))
      steps.append(row)

  with tempfile.TemporaryDirectory() as out_dir:
    rows = args.prompts * args.generations
    config = trl.GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch,
        num_generations=args.generations,
        max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0,
        top_k=0, beta=0.0, num_iterations=1, loss_type="dapo", epsilon=0.2,
        epsilon_high=0.28, learning_rate=args.lr, lr_scheduler_type="constant",
        max_grad_norm=1.0, max_steps=2, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, fp16=False,
        activation_checkpointing=False, seed=args.seed, disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=trl_reward(clock), args=config,
        train_dataset=dataset, processing_class=tokenizer,
        callbacks=[StepTimer()])
    clock.wrap(trainer, "_generate_and_score_completions", "rollout")
    clock.wrap(trainer, "_generate", "sample")
    clock.wrap(trainer, "_calculate_rewards", "score")
    # Old / reference log-probs are computed in the rollout; the loss's own
    # log-prob pass (outside it) is part of the update.
    clock.wrap(trainer, "_get_per_token_logps_and_entropies", "reference",
               only_in_rollout=True)
    torch.set_num_threads(args.threads)   # the Trainer may have changed it
    trainer.train()
  if len(steps) != 2:
    raise RuntimeError(f"TRL ran {len(steps)} steps, expected 2")
  return steps


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------

def print_report(ours: list[dict], theirs: list[dict] | None, args,
                 threads: int) -> None:
  o = ours[-1]
  t = theirs[-1] if theirs else {}
  rows = []
  for phase in PHASES:
    rows.append((f"{phase} (s)", o[phase], t.get(phase, "-"),
                 _common.ratio(o[phase], t[phase], False) if t else "-"))
  rows.append(("first step (s)", ours[0]["total"],
               theirs[0]["total"] if theirs else "-",
               _common.ratio(ours[0]["total"], theirs[0]["total"], False)
               if theirs else "-"))
  rows.append(("JAX compile, warm-up steps (s)",
               sum(r["compile_s"] for r in ours[:-1]), "-", "-"))
  for key, label in (("tokens", "completion tokens"),
                     ("longest", "longest completion"),
                     ("mean_length", "mean completion length"),
                     ("reward", "reward mean")):
    rows.append((label, o[key], t.get(key, "-"), "-"))
  print(f"\nmeasured step: grpo_jax step {len(ours)} (after "
        f"{len(ours) - 1} warm-up), TRL step {len(theirs or [0, 0])} (after "
        "1); ratio = TRL time / grpo_jax time (> 1: grpo_jax faster); "
        "other = advantages, packing, host copies\n")
  _common.print_table(("phase", "grpo_jax", "TRL", "ratio"), rows)
  if not theirs:
    return
  B, G, T = args.prompts, args.generations, args.new_tokens
  print("\nREADME row:")
  print(f"| GRPO step: SmolLM2-135M fp32, {B} prompts x G={G}, {T} tokens, "
        f"beta=0, mu=1, {threads} CPU threads | {o['total']:.1f} s "
        f"(sample {o['sample']:.1f}, update {o['update']:.1f}) | "
        f"{t['total']:.1f} s (sample {t['sample']:.1f}, update "
        f"{t['update']:.1f}) | **{t['total'] / o['total']:.2f}x** | "
        "`python benchmarks/grpo_step.py` |")


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------

def main(argv=None) -> int:
  args = parse_args(argv)
  threads = _common.set_torch_threads(args.threads)
  B, G, T = args.prompts, args.generations, args.new_tokens
  _common.print_header("one GRPO step: grpo_jax vs TRL GRPOTrainer", {
      "model": f"{_common.MODEL} (float32, both sides)",
      "step": f"{B} prompts x G={G} = {B * G} completions, <= {T} new tokens "
              "(stop at EOS), beta=0, mu=1, token-mean, clip 0.2/0.28, "
              f"lr {args.lr}",
      "prompts": f"arithmetic levels {args.levels}, seed {args.seed}, "
                 "last_number template + system prompt (dapo_aime:local)",
      "reward": "last_number (grpo_jax's function on both sides)",
      "grpo_jax": "configs/dapo_aime.py:local, dynamic sampling off, "
                  f"micro_batch_size {args.micro_batch}",
      "TRL": "trl GRPOTrainer, per_device_train_batch_size="
             f"{args.micro_batch} x gradient_accumulation_steps="
             f"{B * G // args.micro_batch} (one generation of {B * G} rows "
             "per optimizer step), max_steps=2, use_cpu, bf16=False, no "
             "gradient checkpointing",
      "timing": f"grpo_jax {args.warmup_steps} warm-up step(s), TRL 1, "
                "then one measured step each",
  }, threads)
  examples = _common.arithmetic_examples(B, _common.parse_ints(args.levels),
                                         args.seed)
  messages = [_common.chat_messages(e.question) for e in examples]
  ours, prompt_ids = run_ours(args, examples)
  print(f"peak RSS after grpo_jax: {_common.peak_rss_gib():.1f} GiB")
  theirs = None
  if not args.skip_trl:
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        loading.preset_directory(_common.MODEL))
    if _common.hf_prompt_ids(tokenizer, messages) != prompt_ids:
      raise RuntimeError("grpo_jax and transformers render the prompts to "
                         "different token ids")
    print("prompt token ids identical on both sides")
    theirs = trl_step_times(args, examples, messages)
    for i, row in enumerate(theirs):
      print(f"TRL step {i + 1}: {row['total']:.2f} s")
    print(f"peak RSS after TRL: {_common.peak_rss_gib():.1f} GiB")
  print_report(ours, theirs, args, threads)
  return 0


def run_ours(args, examples) -> tuple[list[dict], list[list[int]]]:
  """grpo_jax's warm-up and measured steps, then its memory is released
  (the TRL side runs in the same process)."""
  step = OursStep(ours_config(args), examples)
  ours = []
  for i in range(args.warmup_steps + 1):
    ours.append(step(i))
    print(f"grpo_jax step {i + 1}: {ours[-1]['total']:.2f} s, "
          f"{ours[-1]['compiles']} compilation(s) taking "
          f"{ours[-1]['compile_s']:.1f} s")
    sys.stdout.flush()
  if ours[-1]["compiles"]:
    raise RuntimeError("grpo_jax compiled during the measured step; raise "
                       "--warmup-steps")
  prompt_ids = step.prompt_ids()
  del step
  gc.collect()
  jax.clear_caches()
  return ours, prompt_ids


if __name__ == "__main__":
  try:
    sys.exit(main())
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.exit(1)
