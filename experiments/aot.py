"""Does a config fit a TPU topology? Compiles its programs ahead of time.

    python experiments/aot.py --config=configs/dapo_aime.py \\
        --topology=v5p:8x8x4 --config.model.source=qwen2.5-32b

Needs libtpu (pip install -r requirements-tpu.txt), no TPU, no weights, no
tokenizer and no data: model.source is a preset name or a directory with
only config.json. Compiles the training sampler call (continuous batching
with sampling.continuous_batching), an update mini-batch in its
micro-batches, reference / old-log-prob scoring when the config uses them
(padded, packed with rl.packing=on, both with auto), and the evaluation
sampler for the topology's chips (with an env on the parked engine,
env.engine=parked: the engine's decode call and its prefills instead of the
training sampler call and of the evaluation sampler, grpo_jax/aot/engine.py),
and
prints per-chip memory against the chip's HBM, then the step's analytic
FLOPs and roofline time (grpo_jax/aot/check.py). Exit status 0 only when every
program fits with 5% to spare; otherwise it names what does not and the
largest micro-batch / sampler chunk that would. --programs compiles a
subset (the table names the rest as not compiled).

With continuous batching it first simulates the slot schedule of dense
slots and of the paged KV cache on the same drawn rows (--lengths;
grpo_jax/aot/schedule.py) and compiles the configured one (the paged one
with the TPU kernel). --sampler_devices / --sampler_topology: sampler and
trainer apart (grpo_jax/aot/split.py), docs/pod.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Compiling for a topology needs libtpu, never a TPU: stay on the CPU backend
# (so a TPU VM's chips are left alone) and let libtpu load beside another
# process that holds it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import app, flags  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags

from grpo_jax.harness import cli  # pylint: disable=g-import-not-at-top

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.")
_TOPOLOGY = flags.DEFINE_string("topology", None,
                                "TPU topology, e.g. v5e:2x2, v5p:8x8x4.")
_SEARCH = flags.DEFINE_bool(
    "search", True, "When a program does not fit, compile smaller "
    "micro-batches / chunks to name the largest that fits.")
_LENGTHS = flags.DEFINE_string(
    "lengths", "cap", "Completion lengths of the continuous sampler's "
    "simulated slot schedule: cap (every row at max_new_tokens), "
    "lognormal:F (sigma 1, mean F of the cap), or a run's metrics.jsonl "
    "(a lognormal fitted to its mean length and truncation rate).")
_SEED = flags.DEFINE_integer("lengths_seed", 0, "Seed of the drawn lengths.")
_SCHEDULE_ONLY = flags.DEFINE_bool(
    "schedule_only", False, "Compile nothing: print the simulated slot "
    "schedule and the step's roofline only.")
_SAMPLER_DEVICES = flags.DEFINE_list(
    "sampler_devices", [], "Sampler and trainer apart: chip counts of the "
    "sampler's share to try (rollout.sampler_devices: each host's last N / "
    "hosts chips sample, the rest train, as a run places them), e.g. "
    "64,128,192; prints each split's step time against the colocated loop "
    "and compiles the fastest split's sampler and update (none with "
    "--schedule_only).")
_SAMPLER_TOPOLOGY = flags.DEFINE_string(
    "sampler_topology", "", "Sampler and trainer on two slices: the sampler "
    "on all chips of this topology (e.g. v6e:16x16), the trainer on all of "
    "--topology's; the weights cross DCN (--dcn_gbps).")
_SAMPLER_MESH = flags.DEFINE_string(
    "sampler_mesh", "", "The sampler side's mesh.shape, e.g. (1,64,4) "
    "(default: rollout.sampler_mesh, whose () is config.mesh.shape).")
_DCN_GBPS = flags.DEFINE_float(
    "dcn_gbps", 50.0, "With --sampler_topology: the DCN bandwidth each "
    "sampler chip receives the weights at, Gbit/s (an assumption: give the "
    "pod's figure).")
_PROGRAMS = flags.DEFINE_list(
    "programs", [], "Compile only these kinds of program (default: all the "
    "config runs): sampler, update, update_packed, score, score_packed, "
    "eval. The others are printed as not compiled and the verdict covers "
    "the compiled ones only.")
_PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", 512, "Prompt tokens per row (the sampler's power-of-two "
    "bucket of the longest prompt).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None or _TOPOLOGY.value is None:
    raise app.UsageError("--config and --topology are required")
  from grpo_jax.aot import check as aot  # pylint: disable=import-outside-toplevel
  try:
    aot.check_programs(_PROGRAMS.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  with cli.user_errors():
    _check(_CONFIG.value, _TOPOLOGY.value)


def _check(config, topology: str) -> None:
  from grpo_jax.aot import check as aot  # pylint: disable=import-outside-toplevel
  from grpo_jax.aot import programs, schedule, split_check
  from grpo_jax.harness import preflight
  preflight.check_backend(config, backend="tpu")   # what a TPU run warns of
  if _SAMPLER_DEVICES.value or _SAMPLER_TOPOLOGY.value:
    mesh = (tuple(int(x) for x in _SAMPLER_MESH.value.strip("()").split(","))
            if _SAMPLER_MESH.value else ())
    splits = split_check.Splits(
        topology, tuple(int(x) for x in _SAMPLER_DEVICES.value),
        _SAMPLER_TOPOLOGY.value, mesh, _DCN_GBPS.value * 1e9 / 8)
    fits = split_check.run(config, splits, _PROMPT_LEN.value, _LENGTHS.value,
                     _SEED.value, not _SCHEDULE_ONLY.value)
    sys.exit(0 if fits else 1)
  rows = config.rl.prompts_per_step * config.rl.num_generations
  lengths = schedule.lengths_from_flag(
      _LENGTHS.value, rows, config.sampling.max_new_tokens, _SEED.value)
  report = aot.check(config, topology, _PROMPT_LEN.value, search=_SEARCH.value,
                     lengths=lengths, compile_programs=not _SCHEDULE_ONLY.value,
                     only=tuple(_PROGRAMS.value))
  print("per training step (analytic FLOPs, roofline at peak bf16 FLOP/s "
        "and HBM bandwidth):")
  for line in aot.format_step(report):
    print("  " + line)
  if _SCHEDULE_ONLY.value:
    return
  if not report.fits:
    print("DOES NOT FIT: " + "; ".join(report.advice))
    sys.exit(1)
  every = ("every compiled program (not compiled: "
           f"{', '.join(report.skipped)})" if report.skipped else
           "every program")
  print(f"fits: {every} leaves >= {100 * programs.SPARE:.0f}% of "
        f"{report.hbm / programs.GiB:.2f} GiB free on each of {report.chips} chips")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
