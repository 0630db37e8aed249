r"""Exports a checkpoint's policy as a Hugging Face (safetensors) directory.

  python experiments/export.py --workdir=runs/dapo_local --out=/tmp/dapo_hf
  python experiments/export.py --workdir=runs/dapo_local --step=300 --out=/tmp/dapo_hf_300

`--workdir` also accepts a checkpoints directory or one step directory.
A non-empty --out is refused unless --overwrite is given; then the export is
written beside it and replaces it only once complete.
The result loads with `transformers.AutoModelForCausalLM.from_pretrained`
and `grpo_jax.models.load_pretrained`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from absl import logging

from grpo_jax import checkpoint
from grpo_jax.harness import cli, outdir

_WORKDIR = flags.DEFINE_string("workdir", None, "Run workdir (or checkpoint dir).",
                               required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)   # orbax logs every file at INFO
  with cli.user_errors():
    outdir.check_empty(_OUT.value, _OVERWRITE.value)   # before reading anything
    directory, step = checkpoint.find_step(_WORKDIR.value, _STEP.value)
    with outdir.staged(_OUT.value) as staging:
      checkpoint.export_checkpoint(directory, step, staging)
  print(f"exported step {step} of {directory} to {_OUT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
