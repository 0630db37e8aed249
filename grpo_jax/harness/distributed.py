"""Multi-host start-up: joining the processes of a run with
`jax.distributed` before anything touches a device, from config.mesh or the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment.

`experiment.started` calls `initialize_distributed` once per run.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Optional

import jax

from grpo_jax.errors import ConfigError


def distributed_args(mesh_cfg) -> Optional[dict]:
  """jax.distributed.initialize's arguments, or None for a single process.

  Each value comes from the config field if set, else the environment:
    mesh.coordinator_address  JAX_COORDINATOR_ADDRESS  "host:port" of process 0
    mesh.num_processes        JAX_NUM_PROCESSES        (0 / unset: auto)
    mesh.process_id           JAX_PROCESS_ID           (-1 / unset: auto)
  Multi-host is on when mesh.distributed is True or any of the three is set.
  On Cloud TPU pods (and Slurm / Open MPI) set only mesh.distributed=True:
  JAX finds the coordinator, process count and id itself.
  """
  address = mesh_cfg.coordinator_address or os.environ.get(
      "JAX_COORDINATOR_ADDRESS", "")
  num = mesh_cfg.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", 0))
  pid = mesh_cfg.process_id
  if pid < 0:
    pid = int(os.environ.get("JAX_PROCESS_ID", -1))
  if not (mesh_cfg.distributed or address or num or pid >= 0):
    return None
  return dict(coordinator_address=address or None,
              num_processes=num or None,
              process_id=pid if pid >= 0 else None)


def initialize_distributed(config) -> bool:
  """Joins the processes of a multi-host run (idempotent). Must run before
  anything touches a JAX device. Returns whether the run is multi-process.

  On CPU, cross-process collectives use gloo (jax's default
  `jax_cpu_collectives_implementation`); nothing to set.
  """
  args = distributed_args(config.mesh)
  if args is None:
    return False
  if not jax.distributed.is_initialized():
    _join(args, int(config.mesh.init_timeout_s))
  logging.info("process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return True


_FIELDS = ("mesh.coordinator_address / JAX_COORDINATOR_ADDRESS (host:port of "
           "process 0), mesh.num_processes / JAX_NUM_PROCESSES and "
           "mesh.process_id / JAX_PROCESS_ID")


def _join(args: dict, timeout_s: int) -> None:
  """jax.distributed.initialize, saying what it waits for and giving up
  after `timeout_s` (mesh.init_timeout_s) with a message naming the fields.
  (JAX itself would abort the process with DEADLINE_EXCEEDED, so a
  watchdog thread ends it first, cleanly.)"""
  who = (f"process {args['process_id'] if args['process_id'] is not None else '?'} of "
         f"{args['num_processes'] or '?'}")
  where = args["coordinator_address"] or "the address JAX detects (TPU pod, Slurm, MPI)"
  logging.warning("multi-host start-up: %s connecting to the coordinator at %s; "
                  "waiting up to %d s (mesh.init_timeout_s) for every process",
                  who, where, timeout_s)

  def give_up():
    print(f"error: gave up after {timeout_s} s (config field mesh.init_timeout_s) "
          f"waiting, as {who}, for every process of the run to connect to the "
          f"coordinator at {where}. Start all processes with the same {_FIELDS} "
          "(each its own process id), or raise mesh.init_timeout_s.",
          file=sys.stderr, flush=True)
    os._exit(1)   # pylint: disable=protected-access
  watchdog = threading.Timer(timeout_s, give_up)
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(**args, initialization_timeout=timeout_s + 60)
  except ValueError as e:
    if args["coordinator_address"] is not None:
      raise
    raise ConfigError(
        f"config field 'mesh.distributed' is True but JAX found no coordinator "
        f"({e}): outside a Cloud TPU pod, Slurm or Open MPI job set {_FIELDS}.") from None
  finally:
    watchdog.cancel()
