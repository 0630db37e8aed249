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
# JAX's file lock, so two workers never read a half-written entry. Programs
# that compile in under 0.5 s are not cached. Caching all of a tiny run's
# ~140 programs (threshold 0) made one run faster (20.4 s -> 12.8 s warm)
# but the whole suite slower (1,900 s of tests against 1,547 s); the likely
# cause: JAX's size-limited cache scans its whole directory, under the lock,
# on every write (jax/_src/lru_cache.py).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="grpo_jax_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
