"""The slot-schedule simulator (grpo_jax/aot/schedule.py) against the
samplers it simulates: the device's rows (their completion lengths, which
the (key, row, t) noise makes independent of the schedule) through
`schedule.paged` and `paged_slots.sample_pages`, and through
`schedule.dense` and `continuous.sample_slots`, give the same schedule:
decode steps, and for pages the rows preempted, the slot-steps a live row
waited for a page and the most pages in use. A change to either side's
admission rule (grant order, the page kept per live row, the victim, the
refill order) changes these counts on the tight pool."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.aot import schedule
from grpo_jax.generate import continuous, paged_slots, sampling
from grpo_jax.models import get_preset, init_params

CONFIG = get_preset("tiny")
P, Z, T, G = 16, 4, 20, 3        # every prompt fills its bucket: 4 pages
PROMPTS = 4
STOPS = (7, 11, 200, 3, 50)
# Every row sees P prompt columns, read whole; nothing else is costed.
COST = schedule.Cost(prompt_len=P, column_bytes=1.0, weight_bytes=0.0,
                     slot_flops=0.0, column_flops=0.0, bandwidth=1.0,
                     peak_flops=1.0, block=Z)


@pytest.fixture(scope="module")
def params():
  return jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))


def _prompts():
  """PROMPTS prompts of exactly P tokens (the simulator's rows all have the
  bucket's prompt length)."""
  rng = np.random.RandomState(0)
  prompt_bp = rng.randint(1, CONFIG.vocab_size, (PROMPTS, P)).astype(np.int32)
  return jnp.asarray(prompt_bp), jnp.full((PROMPTS,), P, jnp.int32)


def _sampling(**kwargs) -> sampling.SamplingConfig:
  return sampling.SamplingConfig(max_new_tokens=T, top_p=0.9, stop_ids=STOPS,
                                 continuous_batching=True, **kwargs)


def _lengths(out) -> np.ndarray:
  """The rows' completion lengths as the simulator takes them: (R=1, N)."""
  lengths = np.asarray(out.length_n)
  assert len(set(lengths.tolist())) > 3, lengths    # ragged rows
  return lengths[None]


@pytest.mark.parametrize("slots, pages", [(4, 25), (6, 60)])
def test_paged_admission_is_the_devices(params, slots, pages):
  """25 pages: the prompts' 16 plus one whole row of 9, so rows wait for
  pages and the youngest is preempted; 60: room for every slot's row."""
  call = sampling.CallSpec(CONFIG, _sampling(kv_cache="paged", page_size=Z),
                           G, None, slots, pages)
  out, stats = paged_slots.sample_pages(call, params, *_prompts(),
                                        jax.random.key(5), jnp.int32(PROMPTS))
  sim = schedule.paged(_lengths(out), slots, pages, Z, G, COST)
  device = (int(out.steps), int(stats.preempted), int(stats.waited),
            int(stats.peak_pages))
  assert (sim.steps, sim.preempted, sim.waited, sim.peak_pages) == device
  tight = pages < 30
  assert (sim.preempted > 0 and sim.waited > 0) == tight, device


def test_dense_refill_is_the_devices(params):
  """Idle slots take the next rows in order: the same decode steps."""
  slots = 4
  call = sampling.CallSpec(CONFIG, _sampling(), G, None, slots)
  out = continuous.sample_slots(call, params, *_prompts(), jax.random.key(5),
                                jnp.int32(PROMPTS))
  sim = schedule.dense(_lengths(out), slots, COST)
  assert sim.steps == int(out.steps)
  assert sim.live_k.sum() == (np.asarray(out.length_n) - 1).sum()
