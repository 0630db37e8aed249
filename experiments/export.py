r"""Exports a checkpoint's policy as a Hugging Face (safetensors) directory.

  python experiments/export.py --workdir=runs/dapo_local --out=/tmp/dapo_hf
  python experiments/export.py --workdir=runs/dapo_local --step=300 --out=/tmp/dapo_hf_300

A LoRA run's checkpoint (model.lora.rank > 0: adapters only) exports merged
(--format=hf, W + alpha/r A.B on the base its host state names and checks) or
as a PEFT adapter directory (--format=peft: adapter_config.json +
adapter_model.safetensors for `peft.PeftModel.from_pretrained`):

  python experiments/export.py --workdir=runs/dapo_lora --format=peft --out=/tmp/adapter
  python experiments/export.py --workdir=runs/dapo_lora --base=/ckpt/moved --out=/tmp/merged

`--workdir` also accepts a checkpoints directory or one step directory.
A non-empty --out is refused unless --overwrite is given; then the export is
written beside it and replaces it only once complete.
The result loads with `transformers.AutoModelForCausalLM.from_pretrained`
and `grpo_jax.models.load_pretrained`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import (
  app,  # pylint: disable=g-import-not-at-top
  flags,
  logging,
)

from grpo_jax import checkpoint
from grpo_jax.harness import cli, interrupts, lora_export, outdir

_WORKDIR = flags.DEFINE_string("workdir", None, "Run workdir (or checkpoint dir).",
                               required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out.")
_FORMAT = flags.DEFINE_enum("format", "hf", lora_export.FORMATS,
                            "hf: a transformers directory (LoRA: merged); "
                            "peft: a PEFT adapter directory (LoRA runs).")
_BASE = flags.DEFINE_string("base", "", "LoRA: the base model, where it is no "
                            "longer at the run's model.source (checked by "
                            "checksum).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)   # orbax logs every file at INFO
  # SIGTERM / Ctrl-C stop at once: the staging directory is removed, --out
  # is as it was; one line, status 143 / 130.
  with cli.user_errors(exit_hard=True), interrupts.handle_signals():
    outdir.check_empty(_OUT.value, _OVERWRITE.value)   # before reading anything
    directory, step = checkpoint.find_step(_WORKDIR.value, _STEP.value)
    with outdir.staged(_OUT.value) as staging:
      lora_export.export(directory, step, staging, _FORMAT.value, _BASE.value)
  print(f"exported step {step} of {directory} to {_OUT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
