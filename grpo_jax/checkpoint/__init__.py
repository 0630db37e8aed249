"""Orbax checkpoints: what a checkpoint holds, when it is written, the resume order.

One checkpoint is one step directory `<workdir>/checkpoints/<step>/` with three items:

  state/  the state pytree, written by every host from its shards and
          restorable onto any mesh: the RL loop's TrainState (params,
          optimizer state, step, PRNG key data), STaR's {"params": M_n};
  host/   JSON the loop hands in: the RL loop's data iterator position and
          run summary, STaR's per-iteration metrics history;
  meta/   JSON: the run config, the ModelConfig (so any checkpoint exports to a
          Hugging Face directory) and one checksum per array.

Orbax writes a step under `<step>.orbax-checkpoint-tmp*` and renames it once
every item is complete (on GCS: a commit_success.txt marker), so a run killed
mid-save leaves a tmp directory that `latest_step` never returns.

Modules: `paths` (where, which step is the latest, the resume order),
`integrity` (checksums, shape checks, config JSON, unsafe changes),
`storage` (orbax I/O, reading another run's checkpoint), `checkpointer`
(the run's Checkpointer). Everything public is re-exported here.

    ckpt = Checkpointer(checkpoint_dir(workdir), save_every=c.train.checkpoint_every,
                        keep=c.train.keep_checkpoints, config=c, model_config=model_config)
    kind, where = resolve_init(workdir, c.init_from, c.model.source)
    if kind == "resume":             # (experiment.restore_or_init does this)
      state, host = ckpt.restore(abstract_state, where)
    for step in range(start + 1, c.train.steps + 1):
      state = update(state, ...)
      ckpt.save(step, state, host_state, force=step == c.train.steps)
      if ckpt.preempted:                   # SIGTERM: saved above, exit cleanly
        break
    ckpt.close()
"""
# pylint: disable=unused-import
from grpo_jax.checkpoint.checkpointer import Checkpointer
from grpo_jax.checkpoint.integrity import (
                                           UNSAFE_FIELDS,
                                           array_text,
                                           check_shapes,
                                           config_to_json,
                                           model_config_from_json,
                                           text_array,
                                           tree_checksums,
                                           unsafe_changes,
)
from grpo_jax.checkpoint.paths import (
                                           CHECKPOINT_SUBDIR,
                                           PathLike,
                                           check_writable,
                                           checkpoint_dir,
                                           finalized_steps,
                                           find_step,
                                           latest_checkpoint,
                                           latest_step,
                                           locate,
                                           resolve_init,
)
from grpo_jax.checkpoint.storage import (
                                           export_checkpoint,
                                           load_config,
                                           load_host_state,
                                           load_model_config,
                                           load_params,
)
