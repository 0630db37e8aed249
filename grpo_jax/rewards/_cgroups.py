"""Per-run cgroups for the sandbox, where the host lets this process make them.

A run's launcher is moved into a fresh cgroup before it reads its job, so
everything the run starts is charged there: memory (tmpfs pages included)
and the number of processes are then bounded for the run as a whole, not
only per process as the rlimits inside the sandbox do, and so is CPU time
(`cpu.max`, v1's `cpu.cfs_quota_us`: `cpus` cores per run, 1 by default), so
a run's processes together cannot take its batch neighbours' cores. Where no
cgroup CPU controller is available the fallback is the rlimits alone: each
process's RLIMIT_CPU (the timeout) and RLIMIT_NPROC, so a run may use up to
`processes` cores until its timeout. cgroup v2 is used
when it is mounted with the memory and pids controllers available to this
process's cgroup; else cgroup v1's memory and pids hierarchies; else none
(`describe()` says which, the sandbox's rlimits hold in every case).
"""
from __future__ import annotations

import functools
import os
import secrets
import time

_ROOT = "/sys/fs/cgroup"
_PREFIX = "grpo_jax_sandbox_"
_CPU_PERIOD_US = 100_000


def _own_paths() -> dict[str, str]:
  """Hierarchy ("" for v2, else the controller) -> this process's cgroup."""
  paths = {}
  with open("/proc/self/cgroup", encoding="utf-8") as f:
    for line in f:
      _, controllers, path = line.rstrip("\n").split(":", 2)
      for controller in controllers.split(",") if controllers else [""]:
        paths[controller] = path
  return paths


def _writable_parent(directory: str, files: tuple[str, ...]) -> bool:
  """Whether a child cgroup can be made here with `files` in it."""
  probe = os.path.join(directory, "grpo_jax_probe_" + secrets.token_hex(4))
  try:
    os.mkdir(probe)
  except OSError:
    return False
  try:
    return all(os.path.exists(os.path.join(probe, f)) for f in files)
  finally:
    os.rmdir(probe)


@functools.lru_cache(maxsize=1)
def parents() -> dict[str, str]:
  """Controller -> the directory new run cgroups go under ({} if none).
  {"memory": d, "pids": d} for v2 (one directory), or one each for v1."""
  try:
    own = _own_paths()
  except OSError:
    return {}
  if "" in own and os.path.exists(os.path.join(_ROOT, "cgroup.controllers")):
    directory = os.path.join(_ROOT, own[""].lstrip("/"))
    if _writable_parent(directory, ("memory.max", "pids.max")):
      return {"memory": directory, "pids": directory}
  found = {}
  for controller, limit_file in (("memory", "memory.limit_in_bytes"),
                                 ("pids", "pids.max")):
    if controller in own:
      directory = os.path.join(_ROOT, controller,
                               own[controller].lstrip("/"))
      if _writable_parent(directory, (limit_file,)):
        found[controller] = directory
  found = found if len(found) == 2 else {}
  if found:
    cpu = _cpu_parent(own, found["memory"] == found["pids"] and found["memory"])
    if cpu:
      found["cpu"] = cpu
  for directory in set(found.values()):
    _remove_stale(directory)
  return found


def _cpu_parent(own: dict[str, str], v2_directory: str | bool) -> str | None:
  """Where a run's CPU bound goes: the v2 directory if `cpu.max` is delegated
  there, else cgroup v1's cpu hierarchy (`cpu.cfs_quota_us`), else None."""
  if v2_directory:
    return v2_directory if _writable_parent(v2_directory, ("cpu.max",)) else None
  for controller in ("cpu", "cpu,cpuacct"):
    if controller in own:
      directory = os.path.join(_ROOT, controller, own[controller].lstrip("/"))
      if not os.path.isdir(directory):
        directory = os.path.join(_ROOT, "cpu", own[controller].lstrip("/"))
      if _writable_parent(directory, ("cpu.cfs_quota_us",)):
        return directory
  return None


def _remove_stale(directory: str, min_age_s: float = 60.0) -> None:
  """Empty run cgroups left by trainers that died mid-run (nobody else could
  remove them); young ones may be another trainer's, just being set up."""
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    try:
      if name.startswith(_PREFIX) and (
          time.time() - os.stat(path).st_mtime > min_age_s):
        os.rmdir(path)  # Fails, harmlessly, while processes are in it.
    except OSError:
      pass


def describe() -> str:
  found = parents()
  if not found:
    return ("rlimits only (no cgroup this process may create): memory_mb "
            "bounds each process, a run's total is processes x memory_mb")
  version = "v2" if found["memory"] == found["pids"] else "v1"
  cpu = ", CPU" if "cpu" in found else ""
  return f"cgroup {version} memory{cpu} and pids limits per run, and rlimits"


class RunCgroup:
  """The cgroup(s) of one run: memory and process caps; removed on close.
  Never raises: if the host refuses a step, `error` says which and the run
  goes on under its rlimits alone."""

  def __init__(self, memory_bytes: int, processes: int, cpus: float = 1.0):
    self.dirs: list[str] = []
    self.error: str | None = None
    found = parents()
    if not found:
      return
    name = _PREFIX + secrets.token_hex(8)
    v2 = found["memory"] == found["pids"]
    quota = f"{int(cpus * _CPU_PERIOD_US)} {_CPU_PERIOD_US}"  # Issue 45: CPU per run.
    limits = ({"memory.max": memory_bytes, "memory.swap.max": 0,
               "pids.max": processes, "cpu.max": quota} if v2 else
              {"memory.limit_in_bytes": memory_bytes,
               "memory.memsw.limit_in_bytes": memory_bytes,
               "pids.max": processes, "cpu.cfs_period_us": _CPU_PERIOD_US,
               "cpu.cfs_quota_us": int(cpus * _CPU_PERIOD_US)})
    try:
      for directory in sorted(set(found.values())):
        path = os.path.join(directory, name)
        if path in self.dirs:
          continue
        os.mkdir(path)
        self.dirs.append(path)
        for file, value in limits.items():
          if os.path.exists(os.path.join(path, file)):
            with open(os.path.join(path, file), "w", encoding="ascii") as f:
              f.write(str(value))
    except OSError as e:
      self.error = f"cannot set up a cgroup: {e}"
      self.close()

  def add(self, pid: int) -> None:
    try:
      for path in self.dirs:
        with open(os.path.join(path, "cgroup.procs"), "w",
                  encoding="ascii") as f:
          f.write(str(pid))
    except OSError as e:
      self.error = f"cannot move the run into its cgroup: {e}"

  def close(self) -> None:
    """Removes the cgroups; they are empty once the run's processes are gone
    (a moment after, for the kernel): a few short retries."""
    for path in self.dirs:
      for _ in range(50):
        try:
          os.rmdir(path)
          break
        except FileNotFoundError:
          break
        except OSError:
          time.sleep(0.01)
    self.dirs = []
