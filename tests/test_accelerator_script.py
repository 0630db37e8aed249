"""benchmarks/accelerator.sh --dry-run: the script for a lent GPU/TPU runs end
to end on this CPU (tiny model, no install) and prints each part's tokens/s,
FLOP/s (MFU) and HBM bandwidth."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_accelerator_script_dry_run():
  env = {**os.environ, "PYTHON": sys.executable}
  out = subprocess.run(["bash", "benchmarks/accelerator.sh", "--dry-run"],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  for part in ("sampler (static, EOS off)", "ragged static",
               "ragged continuous dense", "ragged continuous paged",
               "update (one AdamW step"):
    line = next((l for l in out.stdout.splitlines() if l.startswith(part)),
                None)
    assert line is not None, f"no {part!r} line:\n{out.stdout}"
    assert "tok/s" in line and "MFU" in line and "GB/s" in line, line
