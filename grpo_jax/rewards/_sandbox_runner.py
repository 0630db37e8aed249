"""The sandbox itself (`sandbox.py` starts it): builds the isolation with
plain Linux system calls, then runs the model's program and evaluates the
given expressions in it. Standard library only; never imported by the trainer.

`sandbox.py` runs it as `python -I -S -B -c BOOT LABEL` with this file's
source, then the job (JSON: program, calls, stdin, limits) on stdin, so that
no path of the trainer's checkout is in its command line or code objects.
Four kinds of process, each trusted but the last:

  L (launcher, host side): reads the job; creates new user, mount, PID,
    network, IPC, UTS and cgroup namespaces, where the sandbox's uid maps to
    the caller's, or for a root caller to a random unprivileged host uid
    (never host root; RLIMIT_NPROC then binds); waits for G and kills it at
    the wall-clock timeout or on SIGTERM. Its exit status says how it ended.
  G (init, PID 1 of the new PID namespace): builds a new root on a tmpfs
    (read-only binds of /usr, the /lib dirs and the standard library only;
    a /proc of the run's processes only; a /dev of null, zero, full, random,
    urandom; a size-bounded tmpfs at /tmp, which /dev/shm points to), pivots
    into it, renames itself "sandbox LABEL", forks W and reaps. When G exits,
    the kernel kills everything left in the namespace, and L's waitpid on G
    returns only after that: nothing outlives the run.
  W (worker): rlimits (CPU, memory, file size, processes, files), all
    capabilities dropped, no new privileges, a seccomp filter (no execve,
    ptrace, mount, setns, unshare, namespaces via clone, bpf, io_uring,
    sysinfo, SysV IPC, sockets but unix and IP ones, ...). It never runs
    the model's code itself, so it stays trusted: for each stdin, then for
    each call, it forks a child C that runs the program (and then the call's
    setup and expression), reads back what C reports, writes one JSON line
    per call or stdin to the result pipe (the serialised value, the output,
    or the exception's type name), kills every other process of the run and
    empties /tmp. So no call sees another's setup, values or leftovers, and
    only W's relays write results. W is a zygote (issue 45): it reads only
    the job's header (program, limits); each call's frame (setup and
    expression) and each stdin stay in the job pipe until the child C that
    runs it reads its own, and a relay R forked from W per run forks C and
    forwards C's result, so W never holds another call's input or output.
    Nothing in the sandbox sees the expected values: the trusted side
    compares (`_checker.py`).
  C: the model's program, one call or stdin.

Exit status of L: 0 done, 3 killed at the timeout or on request, 70 setup
failed (the reason on stderr).
"""
import ctypes
import json
import os
import platform
import resource
import select
import signal
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080
NAMESPACES = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC
              | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
# statvfs f_flag bits -> the mount flags a remount in a user namespace must
# keep (the kernel locks them on mounts inherited from the host).
_LOCKED = ((8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME),
           (4096, MS_RELATIME), (2, MS_NOSUID), (4, MS_NODEV))

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP = 1, 4, 22
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 38, 47
SECCOMP_MODE_FILTER = 2

INSIDE_ID = 1000  # The sandbox's uid and gid inside its user namespace.
HOST_ID_BASE = 0x40000000  # Root callers map it to a random uid above this.
EXIT_TIMEOUT, EXIT_SETUP = 3, 70

_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
  pass


def _check(result, what):
  if result != 0:
    err = ctypes.get_errno()
    raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _prctl(option, arg2=0, arg3=0, arg4=0, arg5=0):
  fn = _libc.prctl
  fn.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
  return fn(option, arg2, arg3, arg4, arg5)


def _mount(source, target, fstype, flags, data=None):
  fn = _libc.mount
  fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                 ctypes.c_ulong, ctypes.c_char_p]
  enc = lambda s: None if s is None else os.fsencode(s)
  _check(fn(enc(source), enc(target), enc(fstype), flags, enc(data)),
         f"mount {fstype or source} on {target}")


# ---------------------------------------------------------------- L: launcher

_PACKAGE_DIRS = ("site-packages", "dist-packages", "lib/python3*/site-packages",
                 "lib/python3*/dist-packages", "local/lib/python3*/site-packages",
                 "local/lib/python3*/dist-packages", "lib/python3/dist-packages")


def _package_dirs(sources):
  """Issue 45: the interpreter's and the system's installed packages, under
  the bound directories; each is hidden by an empty read-only tmpfs, so the
  sandbox has the standard library and nothing else."""
  import glob  # pylint: disable=import-outside-toplevel
  found = set()
  for path, source in sources:
    if isinstance(source, int) and os.path.isdir(path):
      for pattern in _PACKAGE_DIRS:
        found.update(p for p in glob.glob(os.path.join(glob.escape(path), pattern))
                     if os.path.isdir(p) and not os.path.islink(p))
  return sorted(found)


def _bind_sources():
  """What the sandbox sees of the host, read-only: (path, symlink target or
  O_PATH fd). The standard library may sit under /root: the fds are opened
  while the caller's (or host root's file-owner) permissions still apply."""
  paths = ["/usr", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache",
           "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
  library = sorted({os.path.realpath(p) for p in sys.path if os.path.isdir(p)})
  for path in library:  # A directory below another one comes with it.
    if not any(path.startswith(other + "/") for other in library):
      paths.append(path)
  return [(path, os.readlink(path) if os.path.islink(path)
           else os.open(path, os.O_PATH | os.O_CLOEXEC))
          for path in paths if os.path.lexists(path)]


def _write(path, text):
  fd = os.open(path, os.O_WRONLY)  # Bytes: no codec imports needed.
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


def _map_ids_from_host(ready_read, ready_write):
  """Host root only: a helper left in the host's user namespace maps the
  sandbox's uid and gid to a random unprivileged host id (nothing on the
  host is owned by it, and RLIMIT_NPROC, which never binds host root,
  does). Returns the helper's pid."""
  host_id = HOST_ID_BASE + int.from_bytes(os.urandom(3), "little")
  target = os.getpid()
  pid = os.fork()
  if pid == 0:
    try:
      os.close(ready_write)  # EOF, not a hang, if the launcher gives up.
      if os.read(ready_read, 1) != b"1":
        os._exit(1)
      _write(f"/proc/{target}/setgroups", "deny")
      _write(f"/proc/{target}/uid_map", f"{INSIDE_ID} {host_id} 1\n")
      _write(f"/proc/{target}/gid_map", f"{INSIDE_ID} {host_id} 1\n")
      os._exit(0)
    except BaseException:  # pylint: disable=broad-except
      os._exit(1)
  return pid


def is_host_root():
  """Root of the host's user namespace (not of a container's own one, whose
  root is an unprivileged uid on the host and maps itself like any user)."""
  if os.geteuid() != 0:
    return False
  with open("/proc/self/uid_map", "rb") as f:
    return f.read().split()[:3] == [b"0", b"0", b"4294967295"]


def _enter_namespaces(job):
  """New namespaces; the sandbox's uid (INSIDE_ID) maps to the caller's uid,
  or, for host root, to a random unprivileged one."""
  uid, gid = os.geteuid(), os.getegid()
  host_root = is_host_root()
  job["limits"]["host_root"] = host_root
  if host_root:
    os.setgroups([])  # Not host root's groups either.
  ready_read, ready_write = os.pipe()
  helper = (_map_ids_from_host(ready_read, ready_write) if host_root
            else None)
  try:
    _check(_libc.unshare(NAMESPACES), "unshare(user, mount, pid, net, ipc, "
           "uts, cgroup namespaces)")
  except SetupError:
    if helper is not None:  # Let it see EOF and exit before we do.
      os.close(ready_write)
      os.waitpid(helper, 0)
    raise
  if helper is None:
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{INSIDE_ID} {uid} 1\n")
    _write("/proc/self/gid_map", f"{INSIDE_ID} {gid} 1\n")
    return
  os.write(ready_write, b"1")
  _, status = os.waitpid(helper, 0)
  if status != 0:
    raise SetupError("could not map the sandbox's uid to an unprivileged "
                     "host uid")


def read_frame(fd):
  """One `<length>\n<JSON>` frame from `fd`, read exactly (never a byte of
  the next frame: the calls after it stay in the pipe, unread)."""
  head = b""
  while not head.endswith(b"\n"):
    byte = os.read(fd, 1)
    if not byte or len(head) > 20:
      raise EOFError("no frame")
    head += byte
  size, data = int(head), bytearray()
  while len(data) < size:
    chunk = os.read(fd, min(size - len(data), 1 << 20))
    if not chunk:
      raise EOFError("short frame")
    data += chunk
  return json.loads(bytes(data).decode("ascii"))


def main():
  # Only the header (program, limits, counts): each call's setup and each
  # stdin stay in the pipe until the child that runs it reads them.
  job = read_frame(0)
  job_fd = os.dup(0)
  parent = os.getppid()
  _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != parent:
    os._exit(EXIT_SETUP)
  null = os.open("/dev/null", os.O_RDWR)
  os.dup2(null, 0)
  try:
    _enter_namespaces(job)
  except (OSError, SetupError) as e:
    os.write(2, f"sandbox setup: {e}\n".encode("utf-8", "replace"))
    os._exit(EXIT_SETUP)
  _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # Credential changes clear it.
  if os.getppid() != parent:
    os._exit(EXIT_SETUP)
  life_read, life_write = os.pipe()
  child = []

  def stop(*_):
    for pid in child:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass

  signal.signal(signal.SIGALRM, stop)
  signal.signal(signal.SIGTERM, stop)
  pid = os.fork()
  if pid == 0:
    os.close(life_write)
    _init(job, life_read, job_fd)
  os.close(job_fd)
  child.append(pid)
  os.close(life_read)
  signal.setitimer(signal.ITIMER_REAL, float(job["limits"]["timeout"]))
  # Returns once G is reaped, which the kernel allows only after every other
  # process of its PID namespace is gone.
  _, status = os.waitpid(pid, 0)
  if os.WIFSIGNALED(status):
    os._exit(EXIT_TIMEOUT)
  os._exit(EXIT_SETUP if os.WEXITSTATUS(status) == EXIT_SETUP else 0)


# ---------------------------------------------------------------- G: init

def _unescape(field):
  """A mountinfo path: octal escapes (\\040) back to bytes; no codec imports
  (the standard library may not be readable any more)."""
  parts = field.split(b"\\")
  raw = parts[0] + b"".join(bytes([int(p[:3], 8)]) + p[3:] for p in parts[1:])
  return os.fsdecode(raw)


def _remount_read_only(target):
  """Every mount at or below `target` (a recursive bind) becomes read-only."""
  with open("/proc/self/mountinfo", "rb") as f:
    points = [_unescape(line.split()[4]) for line in f]
  for point in points:
    if point == target or point.startswith(target + "/"):
      f_flag = os.statvfs(point).f_flag
      flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
      for bit, ms in _LOCKED:
        flags |= ms if f_flag & bit else 0
      _mount(None, point, None, flags)


def _build_root(sources, limits, hidden=()):
  """A new root at /tmp (shadowed in this mount namespace only), pivoted to;
  the `hidden` directories (installed packages) covered by empty tmpfs."""
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  root = "/tmp"
  _mount("sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
  os.makedirs(root + "/dev", 0o755)
  _mount("sandbox", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC,
         "size=64k,mode=755")
  for path, source in sources:
    target = root + path
    os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
    if isinstance(source, str):
      os.symlink(source, target)
      continue
    if os.path.isdir(f"/proc/self/fd/{source}"):
      os.makedirs(target, 0o755, exist_ok=True)
    else:
      os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(f"/proc/self/fd/{source}", target, None, MS_BIND | MS_REC)
    _remount_read_only(target)
    os.close(source)
  for path in hidden:
    _mount("sandbox", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
           "size=4k,mode=555")
  for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                     ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
    os.symlink(link, f"{root}/dev/{name}")
  os.makedirs(root + "/proc", 0o555)
  # This process is PID 1 of the new namespace: it sees only the run, and
  # with subset=pid (Linux 5.8+) none of the host-wide files (meminfo,
  # loadavg, sys/kernel/random/boot_id, the kernel's command line, ...).
  for options in ("subset=pid", None):
    try:
      _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
             options)
      break
    except SetupError:
      pass  # A host that masks its /proc forbids this; then there is none.
  os.makedirs(root + "/tmp", 0o755)
  disk = int(limits["disk_mb"]) * 2**20
  _mount("sandbox", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
         f"size={disk},nr_inodes=4096,mode=700,uid={INSIDE_ID},gid={INSIDE_ID}")
  _mount(None, root + "/dev", None, MS_BIND | MS_REMOUNT | MS_RDONLY
         | MS_NOSUID | MS_NOEXEC)
  _mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
         | MS_NODEV)
  os.chdir(root)
  pivot = _PIVOT_ROOT.get(platform.machine())
  if pivot is None:
    raise SetupError(f"no pivot_root number known for {platform.machine()}")
  _check(_libc.syscall(pivot, b".", b"."), "pivot_root")
  _check(_libc.umount2(b".", MNT_DETACH), "detach the host's root")
  os.chdir("/tmp")


def _rename(argv):
  """This process's /proc/<pid>/cmdline (W inherits it) becomes `argv`, not
  the interpreter's path: the bytes the kernel reads it from are ours."""
  try:
    with open("/proc/self/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
  except OSError:
    return  # No /proc: nothing shows it.
  start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end
  if 0 < len(argv) < end - start:
    ctypes.memmove(start, argv.ljust(end - start, b"\0"), end - start)


def _init(job, life_read, job_fd):
  signal.signal(signal.SIGALRM, signal.SIG_DFL)
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  try:
    sources = _bind_sources()
    hidden = _package_dirs(sources)
    # Files can be created in the new tmpfs only by a uid mapped inside; a
    # root caller's uid 0 is not (capabilities in the namespace stay).
    os.setresgid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
    os.setresuid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
    # After the uid change, which clears it: G dies with L.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([life_read], [], [], 0)[0]:
      os._exit(EXIT_SETUP)  # L died before that: EOF on its pipe.
    _build_root(sources, job["limits"], hidden)
    _check(_libc.sethostname(b"sandbox", 7), "sethostname")
    _rename(b"sandbox\0" + os.fsencode(sys.argv[-1]))
  except (OSError, SetupError) as e:
    os.write(2, f"sandbox setup: {e}\n".encode("utf-8", "replace"))
    os._exit(EXIT_SETUP)
  _prctl(PR_SET_DUMPABLE, 0)  # W may not read or write this process.
  worker = os.fork()
  if worker == 0:
    _worker(job, job_fd)
  os.close(job_fd)
  while True:  # Reap orphans until W is done; then exit, killing the rest.
    try:
      pid, status = os.wait()
    except ChildProcessError:
      os._exit(0)
    if pid == worker:
      os._exit(EXIT_SETUP if os.WIFEXITED(status)
               and os.WEXITSTATUS(status) == EXIT_SETUP else 0)


# ---------------------------------------------------------------- W: worker

_DENIED_X86_64 = (
    59, 322,  # execve, execveat
    101, 310, 311, 312, 438, 440,  # ptrace, process_vm_*, kcmp, pidfd_getfd, process_madvise
    165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442,  # mount family, chroot
    308, 272,  # setns, unshare
    248, 249, 250,  # add_key, request_key, keyctl
    321, 298, 323,  # bpf, perf_event_open, userfaultfd
    425, 426, 427,  # io_uring
    246, 320, 175, 313, 176, 169, 167, 168, 163,  # kexec, modules, reboot, swap, acct
    303, 304, 172, 173, 103, 300, 153, 179,  # handles, iopl/ioperm, syslog, fanotify, vhangup, quotactl
    159, 164, 227,  # adjtimex, settimeofday, clock_settime
    99,  # sysinfo: the host's load, memory and uptime
    29, 30, 31, 67, 64, 65, 66, 220, 68, 69, 70, 71,  # SysV shm, sem, msg
    # Issue 45: shared host inodes and uncharged memory. flock on a bound
    # host file; inotify and fanotify watch host files; memfd_create and
    # memfd_secret hold memory that RLIMIT_AS does not count.
    73, 253, 254, 255, 294, 301, 319, 447,
)
# socket(2) and socketpair(2) accept only these families; any other fails with
# EAFNOSUPPORT, as on a kernel without it. Unix sockets and the IP families
# live in the run's own (empty) namespaces; vsock, netlink, packet, alg, ...
# would reach VM-wide or kernel-wide state outside them.
_SOCKET_CALLS_X86_64 = (41, 53)  # socket, socketpair
_SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6


def _seccomp_filter():
  """BPF: x86_64 only, denied calls fail with EPERM, clone3 with ENOSYS (the
  C library then uses clone, whose flags can be checked: no namespaces),
  sockets of other families than `_SOCKET_FAMILIES` with EAFNOSUPPORT."""
  ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
  allow, kill = 0x7FFF0000, 0x80000000
  eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
  eafnosupport = 0x00050000 | 97
  ns_flags = NAMESPACES | CLONE_NEWTIME
  prog = [(ld, 0, 0, 4), (jeq, 1, 0, 0xC000003E), (ret, 0, 0, kill),
          (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]
  for nr in _DENIED_X86_64:
    prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
  families = len(_SOCKET_FAMILIES)
  socket, socketpair = _SOCKET_CALLS_X86_64
  prog += [(jeq, 1, 0, socket), (jeq, 0, families + 3, socketpair),
           (ld, 0, 0, 16)]  # args[0], the family (an int: the low half).
  prog += [(jeq, families - k, 0, family)
           for k, family in enumerate(_SOCKET_FAMILIES)]
  prog += [(ret, 0, 0, eafnosupport), (ret, 0, 0, allow)]
  prog += [(jeq, 0, 1, 435), (ret, 0, 0, enosys),
           (jeq, 0, 3, 56), (ld, 0, 0, 16), (jset, 0, 1, ns_flags),
           (ret, 0, 0, eperm), (ret, 0, 0, allow)]
  return b"".join(struct.pack("HBBI", *insn) for insn in prog), len(prog)


def _lock_down(limits):
  """Limits, then no capabilities, no new privileges, the seccomp filter."""
  # G shares the sandbox's uid, and L does unless it is host root.
  nproc = int(limits["processes"]) + (2 if limits["host_root"] else 3)  # + the relay
  for name, value in (
      ("RLIMIT_CPU", int(float(limits["timeout"])) + 1),
      ("RLIMIT_AS", int(limits["memory_mb"]) * 2**20),
      ("RLIMIT_FSIZE", int(limits["disk_mb"]) * 2**20),
      ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0), ("RLIMIT_MEMLOCK", 0),
      ("RLIMIT_MSGQUEUE", 0), ("RLIMIT_NPROC", nproc)):
    resource.setrlimit(getattr(resource, name), (value, value))
  _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
  _check(_prctl(PR_CAP_AMBIENT, 4), "clear ambient capabilities")
  for cap in range(64):
    if _prctl(PR_CAPBSET_DROP, cap) != 0 and ctypes.get_errno() != 22:
      _check(-1, f"drop capability {cap} from the bounding set")
  header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
  data = ctypes.create_string_buffer(24)  # Two zeroed {eff, perm, inh}.
  _check(_libc.capset(ctypes.c_char_p(header), data), "capset(none)")
  if platform.machine() == "x86_64":
    code, length = _seccomp_filter()
    buffer = ctypes.create_string_buffer(code)

    class FProg(ctypes.Structure):
      _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = FProg(length, ctypes.addressof(buffer))
    _check(_prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog)),
           "seccomp filter")


def encode(value, depth=0):
  """Plain data as tagged JSON (exact, hex for numbers); anything else raises."""
  if depth > 200:
    raise ValueError("nested too deeply")
  if value is None or isinstance(value, bool):
    return value if value is None else bool(value)
  if isinstance(value, int):
    return {"i": format(int(value), "x")}
  if isinstance(value, float):
    return {"f": float(value).hex()}
  if isinstance(value, complex):
    return {"c": [float(value.real).hex(), float(value.imag).hex()]}
  if isinstance(value, str):
    return str(value)
  if isinstance(value, (bytes, bytearray)):
    return {"b": bytes(value).hex()}
  items = lambda xs: [encode(x, depth + 1) for x in xs]
  if isinstance(value, dict):
    return {"d": [[encode(k, depth + 1), encode(v, depth + 1)]
                  for k, v in dict.items(value)]}
  for kind, tag in ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "z")):
    if isinstance(value, kind):
      return {tag: items(value)}
  if hasattr(type(value), "__iter__"):  # A generator, map, range, deque...:
    iterated = []  # its items (tests do list(f(x))), at most a million.
    for item in value:
      if len(iterated) == 10**6:
        raise ValueError("more than a million items")
      iterated.append(encode(item, depth + 1))
    return {"it": iterated}
  raise TypeError(f"cannot serialise a {type(value).__name__}")


def _send(fd, obj):
  line = (json.dumps(obj, ensure_ascii=True) + "\n").encode("ascii")
  while line:
    line = line[os.write(fd, line):]


def _own_frame(job_fd, marker_fd):
  """In a fresh child: its one frame from the job pipe, then the pipe closed
  before any model code runs, and b"r" on `marker_fd` (the frame is read)."""
  frame = read_frame(job_fd)
  os.close(job_fd)
  os.write(marker_fd, b"r")
  return frame


def _run_as_main(code, job_fd, k, result_fd):
  """The program as a script on the next stdin frame, in a child: {"o": k,
  "v": stdout}; None if the child could not read its frame (the run stops)."""
  in_path, out_path = f"/tmp/.stdin_{k}", f"/tmp/.stdout_{k}"
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:
    status = 1
    try:
      os.close(read)
      os.close(result_fd)  # Its output is its stdout only.
      stdin = _own_frame(job_fd, write)
      os.close(write)
      with open(in_path, "wb") as f:
        f.write(stdin.encode("utf-8", "replace"))
      os.dup2(os.open(in_path, os.O_RDONLY), 0)
      os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
              1)
      sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
      sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
      exec(code, {"__name__": "__main__"})  # pylint: disable=exec-used
      status = 0
    except SystemExit as e:
      status = 0 if e.code in (None, 0) else 1
    except BaseException:  # pylint: disable=broad-except
      pass
    try:
      sys.stdout.flush()
    except BaseException:  # pylint: disable=broad-except
      status = 1
    os._exit(status)
  os.close(write)
  marker = os.read(read, 1)
  os.close(read)
  _, status = os.waitpid(pid, 0)
  if marker != b"r":
    return None
  try:
    with open(out_path, "rb") as f:
      out = f.read(1 << 20)
  except OSError:
    out, status = b"", status or 1
  if status != 0:
    return {"o": k, "e": f"exit status {status}"}
  return {"o": k, "v": out.decode("utf-8", "replace")}


def _call(code, i, job_fd, result_fd, cap):
  """The program, then the next call frame's setup and expression, in a
  fresh child of this process, which never ran model code nor read any
  call: the child reads its own frame (`_own_frame`), so no other call's
  setup, values or side effects reach it. Only this process writes results:
  {"i": i, "v": value} or {"i": i, "e": exception}, from the first line the
  child reports after its marker; None if it could not read its frame."""
  read, write = os.pipe()
  try:
    pid = os.fork()
  except OSError:  # The process limit, say: the frame stays unread.
    os.close(read)
    os.close(write)
    return None
  if pid == 0:
    try:
      os.close(read)
      os.close(result_fd)
      setup, expression = _own_frame(job_fd, write)
      namespace = {"__name__": "solution"}  # Not "__main__": no main() runs.
      exec(code, namespace)  # pylint: disable=exec-used
      exec(compile(setup, f"test_{i}_setup.py", "exec"), namespace)  # pylint: disable=exec-used
      value = eval(compile(expression, f"test_{i}.py", "eval"), namespace)  # pylint: disable=eval-used
      record = {"v": encode(value)}
    except BaseException as e:  # pylint: disable=broad-except
      record = {"e": type(e).__name__}
    try:
      _send(write, record)
    finally:
      os._exit(0)
  os.close(write)
  data = bytearray()
  while b"\n" not in data and len(data) <= cap:
    chunk = os.read(read, 1 << 16)  # EOF: the child and its children exited.
    if not chunk:
      break
    data += chunk
  os.close(read)
  try:
    os.kill(pid, signal.SIGKILL)  # It has answered, or may never.
  except ProcessLookupError:
    pass
  os.waitpid(pid, 0)
  if data[:1] != b"r":
    return None
  if len(data) > cap:
    return {"i": i, "e": "ResultTooLarge"}
  try:
    record = json.loads(bytes(data[1:].partition(b"\n")[0]).decode("ascii"))
  except ValueError:
    return {"i": i, "e": "BadRecord"}
  if isinstance(record, dict) and "e" in record:
    return {"i": i, "e": str(record["e"])[:100]}
  return {"i": i, "v": record["v"]} if isinstance(record, dict) and (
      "v" in record) else {"i": i, "e": "BadRecord"}


def _reset():
  """Between two runs of the program: none of the last one's processes is
  left (kill(-1) spares only init and this process), nor any file in /tmp."""
  try:
    os.kill(-1, signal.SIGKILL)
  except ProcessLookupError:
    pass
  for _ in range(1000):  # Until init has reaped them (a few ms).
    try:
      os.kill(-1, 0)
    except ProcessLookupError:
      break
    select.select([], [], [], 0.001)
  _remove_below("/tmp")


def _remove_below(directory):
  for entry in os.scandir(directory):
    if entry.is_dir(follow_symlinks=False):
      os.chmod(entry.path, 0o700)
      _remove_below(entry.path)
      os.rmdir(entry.path)
    else:
      os.remove(entry.path)


def _relayed(run, args, result_fd):
  """`run(*args)` in a relay R forked from this zygote: R forks the child
  that runs the model's code, reads its result and writes it. So this
  process never holds a result either (a program that echoes its input
  into its result would otherwise hand it to every later child). False if
  the child could not read its frame."""
  try:
    pid = os.fork()
  except OSError:
    return False
  if pid == 0:
    record = None
    try:
      record = run(*args)
      if record is not None:
        _send(result_fd, record)
    finally:
      os._exit(0 if record is not None else 3)
  _, status = os.waitpid(pid, 0)
  return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _worker(job, job_fd):
  """The zygote: it holds the program and the limits, never a call's setup
  or a stdin (each child reads its own from `job_fd`), and runs no model code."""
  result_fd = os.dup(1)  # Before fds 0-2 become /dev/null.
  try:
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):
      os.dup2(null, fd)
    keep = sorted((result_fd, job_fd))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 1 << 16)
    _lock_down(job["limits"])
  except (OSError, SetupError) as e:
    os.write(2, f"sandbox setup: {e}\n".encode("utf-8", "replace"))
    os._exit(EXIT_SETUP)
  os.dup2(0, 2)  # From here on nothing reaches the trainer but results.
  _send(result_fd, {"ready": True})
  # This process never runs the model's code: each run of it is a child.
  try:
    code = compile(job["program"], "solution.py", "exec")
  except BaseException as e:  # pylint: disable=broad-except
    _send(result_fd, {"program": type(e).__name__})
    os._exit(0)
  runs = [(_run_as_main, (code, job_fd, k, result_fd))
          for k in range(int(job["num_stdin"]))]
  cap = int(job["limits"]["result_mb"]) * 2**20
  runs += [(_call, (code, i, job_fd, result_fd, cap))
           for i in range(int(job["num_calls"]))]
  for run, args in runs:
    if not _relayed(run, args, result_fd):
      os._exit(0)  # A frame went unread: the rest would be misread.
    _reset()
  os._exit(0)


if __name__ == "__main__":
  main()
