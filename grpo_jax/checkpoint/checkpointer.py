"""The run's Checkpointer: when a checkpoint is written (every N steps, on
request, on SIGTERM), what it holds, and restoring the latest one."""
from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from typing import Any, Iterable, Optional

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from grpo_jax.checkpoint.integrity import (
  UNSAFE_FIELDS,
  abstract_target,
  check_shapes,
  config_to_json,
  nonfinite_leaves,
  refused_class,
  to_json,
  tree_checksums,
  unsafe_changes,
)
from grpo_jax.checkpoint.paths import PathLike, check_writable
from grpo_jax.checkpoint.storage import (
  FORMAT,
  READ_ERRORS,
  damaged,
  manager,
  read_meta,
  saved_tree,
  verify,
)
from grpo_jax.errors import CheckpointError, NonFiniteError, UnsafeResumeError


class Checkpointer:
  """Saves and restores one run's checkpoints (see the module docstring).

  Args:
    directory: the run's checkpoint directory, `checkpoint_dir(workdir)`;
      created and write-checked here, before any compute.
    save_every: `should_save(step)` is true at multiples of this (step > 0);
      0 saves only when forced or pre-empted.
    keep: how many of the newest checkpoints to keep (None: all).
    async_save: write in the background; `save` returns once the arrays are
      copied to host memory, so the caller may donate them right away.
    config: the run config (ConfigDict or dict), stored with every checkpoint;
      if this directory already holds checkpoints, the fields in
      `UNSAFE_FIELDS` must equal the latest checkpoint's or
      UnsafeResumeError is raised now (`check_resume`).
    model_config: the ModelConfig, stored so that any checkpoint exports to a
      Hugging Face directory; a change of it is unsafe as well.
    handle_sigterm: on a single host, SIGTERM requests a save at the next
      step boundary (`should_save` turns true, then `preempted`); a second
      SIGTERM falls through to the previous handler. On several hosts JAX's
      preemption sync point (orbax `reached_preemption`) plays that role.
  """

  def __init__(self, directory: PathLike, *, save_every: int,
               keep: Optional[int] = 3, async_save: bool = True,
               config: Any = None, model_config: Any = None,
               handle_sigterm: bool = True):
    if save_every < 0 or (keep is not None and keep < 1):
      raise ValueError(f"save_every={save_every} must be >= 0 and keep={keep} >= 1")
    self.directory = check_writable(directory)
    self._save_every = save_every
    self._config = config_to_json(config)
    # As stored (JSON: tuples such as Gemma's layer_types become lists),
    # so that a resume compares like with like.
    self._model_config = (None if model_config is None else json.loads(
        json.dumps(dataclasses.asdict(model_config))))
    self._manager = manager(self.directory, keep=keep, async_save=async_save)
    try:
      self.check_resume()
    except CheckpointError:
      self._manager.close()
      raise
    self._sigterm = False
    self._preempted = False
    self._previous_handler = self._install_sigterm() if handle_sigterm else None

  # -- queries ---------------------------------------------------------------

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    """The newest complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def step_path(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def check_resume(self, unsafe_fields: Iterable[str] = UNSAFE_FIELDS):
    """Raises UnsafeResumeError if the latest checkpoint was written under a
    config (or ModelConfig) that differs in fields that make resuming unsafe."""
    step = self.latest_step()
    if step is None or (self._config is None and self._model_config is None):
      return
    meta = read_meta(self._manager, step)
    changes = []
    if self._config is not None and meta.get("config") is not None:
      changes += unsafe_changes(meta["config"], self._config, unsafe_fields)
    if self._model_config is not None and meta.get("model_config") is not None:
      changes += unsafe_changes({"model_config": meta["model_config"]},
                                {"model_config": self._model_config}, ["model_config"])
    if changes:
      lines = "\n".join(f"  {k}: {a!r} in the checkpoint, {b!r} now"
                        f" ({refused_class(k) or 'the model'})" for k, a, b in changes)
      raise UnsafeResumeError(
          f"cannot resume from {self.step_path(step)}: the config changed in "
          f"fields that make resuming unsafe:\n{lines}\nResume with the "
          "checkpoint's values, or start a new run in a fresh --workdir "
          f"(init_from={self.step_path(step)} starts it from these weights).")

  # -- saving ----------------------------------------------------------------

  def should_save(self, step: int) -> bool:
    """True at multiples of save_every and at the first step boundary after a
    pre-emption notice; false for a step already saved."""
    if step in self._manager.all_steps():
      return False
    if self._sigterm or self._manager.reached_preemption(step):
      self._preempted = True
      return True
    return self._save_every > 0 and step > 0 and step % self._save_every == 0

  @property
  def preempted(self) -> bool:
    """True once `should_save` answered a pre-emption: save, then exit."""
    return self._preempted

  def save(self, step: int, state_tree: Any, host_state: Optional[dict] = None,
           *, force: bool = False) -> bool:
    """Writes a checkpoint if `should_save(step)` (or `force`); True if written.

    host_state must be JSON-able (numpy scalars are converted); restore
    returns its JSON round trip. On several hosts only process 0's copy is
    written, so it must be the same on every host. A state with a NaN or inf
    anywhere is refused (NonFiniteError): the checkpoints before it stay the
    latest.
    """
    if step in self._manager.all_steps() or not (force or self.should_save(step)):
      return False
    bad = nonfinite_leaves(state_tree)
    if bad:
      raise NonFiniteError(
          f"refusing to save checkpoint step {step} in {self.directory}: "
          f"{bad[0]!r}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}"
          f" holds a NaN or inf; the latest checkpoint stays step "
          f"{self.latest_step()}")
    host = to_json(host_state or {}, "host_state")
    meta = {"format": FORMAT, "step": step, "saved_at": time.time(),
            "config": self._config, "model_config": self._model_config,
            "checksums": tree_checksums(state_tree)}
    self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state_tree), host=ocp.args.JsonSave(host),
        meta=ocp.args.JsonSave(meta)))
    if self._preempted:  # the process is about to exit: finish writing first
      self._manager.wait_until_finished()
    return True

  # -- restoring -------------------------------------------------------------

  def restore(self, target: Any, step: Optional[int] = None
              ) -> tuple[Any, dict]:
    """(state, host_state) of `step` (default: the latest) on the current mesh.

    `target` is the state's pytree of ShapeDtypeStructs with `.sharding` (or
    of arrays, whose shardings are used): the checkpoint is resharded onto
    it whatever mesh wrote it. Shapes are checked first (a mismatch names the
    parameter and both shapes), checksums after.
    """
    self._manager.wait_until_finished()  # a step being written is not there yet
    step = self.latest_step() if step is None else step
    if step is None or step not in self.all_steps():
      raise CheckpointError(f"no complete checkpoint {'' if step is None else step} "
                            f"in {self.directory}; steps there: {self.all_steps()}")
    abstract = abstract_target(target)
    check_shapes(abstract, saved_tree(self._manager, step),
                 f"checkpoint step {step} at {self.step_path(step)}")
    meta = read_meta(self._manager, step)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()))
    except READ_ERRORS as e:
      raise damaged(self.directory, step, e) from e
    verify(self.directory, step, out.state, meta["checksums"])
    return out.state, out.host

  # -- lifetime --------------------------------------------------------------

  def wait(self):
    """Blocks until pending asynchronous saves are on disk."""
    self._manager.wait_until_finished()

  def close(self):
    """Finishes pending saves and gives SIGTERM back to its previous handler."""
    self._manager.wait_until_finished()
    self._manager.close()
    if self._previous_handler is not None:
      signal.signal(signal.SIGTERM, self._previous_handler)
      self._previous_handler = None

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc):
    self.close()

  def _install_sigterm(self):
    # Python signals only reach the main thread; several hosts must agree on
    # the step to save at, which JAX's preemption sync point does for them.
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
      return None
    return signal.signal(signal.SIGTERM, self._on_sigterm) or signal.SIG_DFL

  def _on_sigterm(self, signum, frame):
    if self._sigterm:  # asked twice: stop waiting for the step boundary
      signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
      self._previous_handler = None
      signal.raise_signal(signum)
      return
    self._sigterm = True
    logging.warning("SIGTERM: saving a checkpoint at the next step boundary, then exiting")
