# Makes `import grpo_jax` work from a plain checkout (pytest puts this folder on sys.path).
import atexit
import os
import shutil
import tempfile

# The tests run on CPU. requirements-test.txt brings libtpu (tests/test_aot.py
# compiles for TPU topologies with it): JAX must not probe for a TPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One XLA compilation cache for the whole test run: many tests (and the
# `experiments/run.py` subprocesses they start) compile the same tiny-model
# programs, and compiling is most of the suite's time. The cache lives for
# this run only (a fresh directory, removed at the end), so a run never
# depends on an earlier one. It is set here, before the xdist workers and
# any subprocess start, so all of them share it. The size limit turns on
# JAX's file lock, so two workers never read a half-written entry. Every
# program is cached, however fast it compiled (threshold 0): a tiny-config
# `experiments/run.py` compiles ~140 programs, most under 0.5 s, and with
# them cached a second run takes 12.8 s instead of 20.4 s.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="grpo_jax_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
