"""Non-finite updates: found on device, never applied, never saved.

Inside the jitted update (RL `update.update_step`, SFT `sft.sft_step`, both
through `update.apply_gradients`) `first_nonfinite` gives one int32 code for
the first quantity of the update that is not finite, in this order:

    0       none: the update is applied
    1       the loss
    2       the gradient norm (a NaN or inf anywhere in the gradient)
    3 + i   parameter leaf i (jax.tree.leaves order) after the update

Where it is not 0, `keep_if` keeps the parameters and the optimizer state as
they were (a select: a finite update is bit-identical to an unchecked one);
the step counter still advances. The loop reads the codes with the step's
other metrics (no extra device sync) and, as train.on_non_finite says, stops
with a `NonFiniteError` naming the step and the quantity (`error`), or goes
on, counting the skipped updates in `update/skipped`.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.errors import NonFiniteError

CODE = "update/nonfinite"      # a metric of each update, not logged
SKIPPED = "update/skipped"     # updates not applied in a step (logged)


def first_nonfinite(loss: jax.Array, grad_norm: jax.Array,
                    params: Any) -> jax.Array:
  """The update's code (module docstring), an int32 scalar."""
  ok_leaves = jnp.stack([jnp.isfinite(x).all()
                         for x in jax.tree.leaves(params)])
  param = jnp.where(ok_leaves.all(), 0, 3 + jnp.argmin(ok_leaves))
  return jnp.where(~jnp.isfinite(loss), 1,
                   jnp.where(~jnp.isfinite(grad_norm), 2, param)
                   ).astype(jnp.int32)


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
  """`new` where `ok`, else `old`, leaf by leaf (same structure)."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def leaf_names(tree: Any) -> list[str]:
  """'layers/attn/q'-style names of a pytree's leaves, in leaves order."""
  return [jax.tree_util.keystr(path, simple=True, separator="/")
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def describe(code: int, param_names: Sequence[str]) -> str:
  """What a non-zero code says, e.g. "the loss is not finite"."""
  if code == 1:
    return "the loss is not finite"
  if code == 2:
    return "the gradient norm is not finite"
  return f"parameter {param_names[code - 3]!r} is not finite after the update"


def summarise(update_metrics: Sequence[dict], skipped: str = SKIPPED
              ) -> dict:
  """{skipped: how many of a step's updates were not applied, CODE: the
  first one's code (0: none)} from the updates' host metrics."""
  codes = [int(m[CODE]) for m in update_metrics]
  return {skipped: float(np.count_nonzero(codes)),
          CODE: next((c for c in codes if c), 0)}


def error(code: int, where: str, params: Any) -> NonFiniteError:
  """The one-line error of a run stopped at a non-finite update of `where`
  ('step 2/3'), `params` naming the parameter leaves."""
  return NonFiniteError(
      f"{where}: {describe(code, leaf_names(params))}, so its update was not "
      f"applied and the run stopped (the checkpoints hold only finite steps; "
      f"--config.train.on_non_finite=skip skips such updates instead, "
      f"counting them in {SKIPPED})")
