"""The all-to-all expert dispatch (`models/expert_parallel.py`): on one
device, its capacity rule (the pairs past a buffer's end dropped and
counted, the rest as `moe.experts`) and no drop at the default capacity;
`-m slow`, on 8 fake devices (tests/moe_sharding_checks.py): the same
output and gradients as `moe.experts`, one layer and the trainer's
log-probs, on meshes whose tensor axis splits the experts 4 and 8 ways."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_sharding_checks import MODEL, SPARSE, check_drops

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.models import expert_parallel, init_params, moe
from grpo_jax.rl import update
from grpo_jax.sharding.placement import resolve_dispatch


def test_buffer_rows_bound_and_factor():
  """A chip's 10 tokens, C = 2 of X = 8 experts over P = 4 chips (2 each):
  at most 10 * 2 pairs reach one chip; f = 1 is the balanced share
  10 * 2 / 4 = 5, rounded up, never past the bound."""
  assert expert_parallel.buffer_rows(10, 2, 2, 4, 0.0) == 20
  assert expert_parallel.buffer_rows(10, 2, 2, 4, 1.0) == 5
  assert expert_parallel.buffer_rows(10, 2, 2, 4, 1.1) == 6
  assert expert_parallel.buffer_rows(10, 2, 2, 4, 9.0) == 20
  assert expert_parallel.buffer_rows(10, 8, 2, 4, 0.0) == 20  # C > X / P


def test_one_device_capacity_drops_as_counted():
  """One chip: nothing dropped at the default capacity (the output is
  `moe.experts`'); at factor 0.5 half the pairs, the last in expert
  order, are dropped and counted."""
  layout = sharding.Layout.from_config(config_lib.base_config(),
                                       jax.devices()[:1])
  dispatch = layout.expert_dispatch("all_to_all")
  assert dispatch.chips == 1
  params = init_params(MODEL, jax.random.key(0))
  lp = {k: params["layers"][k][0] for k in SPARSE}
  h_nd = jax.random.normal(jax.random.key(1), (13, MODEL.dim))
  routing = moe.route(MODEL.moe, lp, h_nd)
  out, dropped = jax.jit(dispatch)(lp, h_nd, routing)
  assert int(dropped) == 0
  np.testing.assert_allclose(out, moe.experts(lp, h_nd, routing),
                             rtol=1e-6, atol=1e-6)
  check_drops(dispatch, lp, h_nd, 0.5)


def test_ragged_dispatch_is_none_and_uneven_experts_are_refused():
  layout = sharding.Layout.from_config(config_lib.base_config(),
                                       jax.devices()[:1])
  assert layout.expert_dispatch("ragged") is None
  mesh = jax.sharding.AbstractMesh((3,), ("tensor",))
  dispatch = expert_parallel.ExpertParallel(mesh, ("tensor",), ("tensor",))
  lp = {k: jax.ShapeDtypeStruct((8,) + s, jnp.float32) for k, s in
        (("expert_gate", (4, 2)), ("expert_up", (4, 2)),
         ("expert_down", (2, 4)))}
  routing = moe.Routing(jnp.zeros((6, 2), jnp.int32), jnp.ones((6, 2)),
                        jnp.ones((6, 8)))
  with pytest.raises(ValueError, match="8 experts do not split over the 3"):
    jax.eval_shape(dispatch, lp, jnp.ones((6, 4)), routing)


def test_auto_dispatch_is_all_to_all_on_tpu_chips_splitting_experts():
  """model.moe.dispatch = auto (the default): all_to_all only where the
  chips are TPUs and the mesh splits the experts; ragged on CPU."""
  assert resolve_dispatch("auto", "tpu", True) == "all_to_all"
  assert resolve_dispatch("auto", "tpu", False) == "ragged"
  assert resolve_dispatch("auto", "cpu", True) == "ragged"
  assert resolve_dispatch("ragged", "tpu", True) == "ragged"
  assert resolve_dispatch("all_to_all", "cpu", False) == "all_to_all"


def test_the_trainers_forward_takes_the_configured_dispatch():
  """model.moe.dispatch reaches the trainer's forward (update and
  scoring): `ragged` none, `all_to_all` the layout's, `auto` (the
  default) none on CPU."""
  config = config_lib.base_config()
  assert config.model.moe.dispatch == "auto"
  layout = sharding.Layout.from_config(config, jax.devices()[:1])
  settings = update.LossSettings.from_config(config)
  assert settings.forward(layout).dispatch is None
  config.model.moe.dispatch = "all_to_all"
  forward = update.LossSettings.from_config(config).forward(layout)
  assert forward.dispatch == layout.expert_dispatch("all_to_all")
  assert update.LossSettings.from_config(config).forward().dispatch is None


@pytest.mark.slow
def test_all_to_all_equals_ragged_on_eight_devices(run_sharding_checks):
  run_sharding_checks("moe_sharding_checks.py", ["2,1,4", "1,1,8", "1,2,4"])
