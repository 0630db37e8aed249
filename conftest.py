# Makes `import grpo_jax` work from a plain checkout (pytest puts this folder on sys.path).
import os

# The tests run on CPU. requirements-test.txt brings libtpu (tests/test_aot.py
# compiles for TPU topologies with it): JAX must not probe for a TPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
