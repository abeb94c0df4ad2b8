"""First stage of a sandboxed run (see ``sandbox.py``). Runs as the parent's user, in a fresh session.

argv[1] is a JSON policy. In order:

1. read the program, open the report file (both before anything is hidden);
2. new mount, network, pid and IPC namespaces (as root; a network namespace alone otherwise, when permitted);
3. with a pid namespace, fork: the child is the namespace's init (pid 1) and supervises the run; when it ends
   the kernel kills every process left in the namespace, daemons included. Without one, this process
   supervises as a child subreaper (orphans are re-parented to it) and kills every descendant at the end;
4. in the mount namespace: mounts made private, ``/root`` hidden behind a tmpfs (the interpreter's prefix bound
   back read-only), every mount made read-only and nosuid (``mount_setattr``, recursive), a fresh ``/proc``
   (only this run's processes), private tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock`` and a
   tmpfs working directory (mode 0700, owned by the run's uid);
5. fork the program: resource limits, ``no_new_privs``, the per-run uid/gid (when root), a seccomp filter that
   refuses ``socket(AF_UNIX, ...)`` (no path or abstract unix socket can be reached; ``socketpair`` works),
   then ``execve`` the harness (``_sandbox_harness.py``) with a clean environment;
6. wait for it (wall-clock timeout), clean up, write the report (what was obtained, leftovers, timeout).

Only the standard library is used: this file must work without hf_depth importable.
"""

import ctypes
import errno
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWIPC = 0x00020000, 0x40000000, 0x20000000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
SECCOMP_MODE_FILTER = 2
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 442, -100, 0x8000, 1, 2
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_harness.py")
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# (AUDIT_ARCH, __NR_socket, x32 syscall bit or 0) of the architectures the seccomp filter knows
SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 0x40000000), "aarch64": (0xC00000B7, 198, 0)}


def main() -> None:
    policy = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    with open(policy["program"], encoding="utf-8") as f:
        source = f.read()
    with open(HARNESS, encoding="utf-8") as f:
        harness = f.read()
    report_fd = os.open(policy["report"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    is_root = os.geteuid() == 0
    iso = {"netns": False, "mountns": False, "pidns": False, "ipcns": False}
    if policy["namespaces"]:
        if is_root and libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC) == 0:
            iso.update(netns=True, mountns=True, pidns=True, ipcns=True)
        elif is_root and libc.unshare(CLONE_NEWNS | CLONE_NEWNET) == 0:
            iso.update(netns=True, mountns=True)
        elif libc.unshare(CLONE_NEWNET) == 0:
            iso["netns"] = True
    fds = (policy["token_fd"], policy["result_fd"])
    if iso["pidns"]:
        init = os.fork()
        if init:   # stay outside: wait for the namespace's init and end as it did
            for fd in fds:
                os.close(fd)
            os._exit(_exit_code(os.waitpid(init, 0)[1]))
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)   # (its own timeout bounds it if set too late)
    else:
        iso["subreaper"] = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    _supervise(libc, policy, iso, source, harness, report_fd, is_root)


def _exit_code(status: int) -> int:
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _supervise(libc, policy, iso, source, harness, report_fd, is_root) -> None:
    work = policy["work"]
    if iso["mountns"]:
        iso.update(_private_mounts(libc, policy, iso["pidns"]))
    uid = policy.get("uid") if is_root else None
    if uid is not None and not iso.get("root_hidden") and not _reachable_by_others(sys.executable):
        uid = None   # the interpreter lives under a private dir we could not remount: stay root, guard by hooks
    if not os.path.isdir(work):
        os.makedirs(work, 0o700)
    if not iso.get("private_work"):
        os.chmod(work, 0o700)
        if uid is not None:
            os.chown(work, uid, uid)
    program = os.path.join(work, "main.py")
    fd = os.open(program, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(source)
    if uid is not None:
        os.chown(program, uid, uid)
    iso["uid"] = uid if is_root else os.getuid()
    iso["seccomp_unix_sockets"] = os.uname().machine in SECCOMP_ARCH
    stage2 = {"token_fd": policy["token_fd"], "result_fd": policy["result_fd"], "marker": policy["marker"],
              "block_sockets": not iso["netns"], "guard_files": uid is None or not is_root,
              "runs_prefix": None if iso.get("private_tmp") else policy["runs_prefix"], "own_run": policy["base"]}
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _become_program(libc, policy, uid, iso["seccomp_unix_sockets"])
            os.chdir(work)
            os.execve(sys.executable, [sys.executable, "-I", "-c", harness, program, json.dumps(stage2)], env)
        except BaseException as e:
            os.write(2, f"sandbox: could not start the program: {e!r}\n".encode())
        finally:
            os._exit(125)
    for fd in (policy["token_fd"], policy["result_fd"]):
        os.close(fd)
    status, timed_out = _wait(pid, policy["timeout"] - (time.monotonic() - start))
    iso["timed_out"] = timed_out
    iso["leftover"] = _count_others() if iso.get("proc") else _kill_descendants()
    os.write(report_fd, json.dumps(iso).encode())
    os.close(report_fd)
    os._exit(_exit_code(status))   # as pid 1 of the namespace: the kernel now kills whatever is left


def _wait(pid: int, timeout: float) -> tuple[int, bool]:
    """(wait status, timed out): wait for ``pid`` up to ``timeout`` seconds, SIGKILL it after that."""
    try:
        fd = os.pidfd_open(pid)
        try:
            timed_out = not select.select([fd], [], [], max(0.0, timeout))[0]
        finally:
            os.close(fd)
    except (AttributeError, OSError):   # no pidfd: poll
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status, False
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.005)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1], timed_out


def _count_others() -> int:
    """Processes of this pid namespace still alive besides its init (they die when init exits)."""
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        n += 1
            except (OSError, IndexError):
                continue
    return n


def sigkill(pids) -> set[int]:
    """SIGKILL each pid; the ones that were signalled (a pid already gone is skipped). Shared with ``sandbox.py``."""
    done = set()
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
            done.add(p)
        except OSError:
            pass
    return done


def _kill_descendants() -> int:
    """SIGKILL every descendant (as a subreaper, orphans are our children) until none is left; reap them."""
    me, killed = os.getpid(), set()
    for _ in range(500):
        parents = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if fields[0] != "Z":
                        parents[int(name)] = int(fields[1])
                except (OSError, IndexError, ValueError):
                    continue
        tree, frontier = set(), {me}
        while frontier:
            frontier = {p for p, pp in parents.items() if pp in frontier and p not in tree}
            tree |= frontier
        _reap()
        if not tree:
            break
        killed |= sigkill(tree)
        time.sleep(0.002)
    _reap()
    return len(killed)


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _become_program(libc, policy, uid, seccomp) -> None:
    os.setpgid(0, 0)   # its own process group: kill(0) / killpg never reach the supervisor
    for name, value in policy["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
            raise PermissionError("sandbox: could not drop privileges")
    if seccomp:
        _seccomp_no_unix_sockets(libc)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_no_unix_sockets(libc) -> None:
    """A classic-BPF seccomp filter: socket(AF_UNIX, ...) fails with EACCES; syscalls of a foreign ABI (32-bit
    int 0x80, x32) fail with EPERM; everything else is allowed."""
    audit_arch, nr_socket, x32 = SECCOMP_ARCH[os.uname().machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, deny | errno.EPERM), (ld, 0, 0, 0)]
    if x32:
        prog += [(jge, 0, 1, x32), (ret, 0, 0, deny | errno.EPERM)]
    prog += [(jeq, 0, 3, nr_socket), (ld, 0, 0, 16), (jeq, 0, 1, 1),   # args[0] (low word) == AF_UNIX
             (ret, 0, 0, deny | errno.EACCES), (ret, 0, 0, allow)]
    filters = (_SockFilter * len(prog))(*[_SockFilter(*p) for p in prog])
    fprog = _SockFprog(len(prog), filters)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _reachable_by_others(path: str) -> bool:
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i]) or "/").st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o005 == 0o005)


def _mount(libc, src, dst, fstype, flags, data=None) -> None:
    if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {src} -> {dst}")


def _private_mounts(libc, policy, pidns) -> dict:
    """Everything of step 4 that worked, as report entries."""
    info = {"root_hidden": False, "rootfs_readonly": False, "proc": False, "private_tmp": [],
            "private_work": False}
    try:
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    except OSError:
        info["mountns"] = False
        return info
    info["root_hidden"] = _hide_root(libc, policy)
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    libc.syscall.restype = ctypes.c_long
    info["rootfs_readonly"] = libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                                           ctypes.c_size_t(32)) == 0
    if pidns:
        try:
            _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            info["proc"] = True
        except OSError:
            pass
    size = f"size={policy['disk_mb']}m,nr_inodes=16k"
    for d in PRIVATE_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            try:
                _mount(libc, "tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{size}")
                info["private_tmp"].append(d)
            except OSError:
                pass
    work, uid = policy["work"], policy.get("uid")
    try:
        os.makedirs(work, 0o711, exist_ok=True)
        owner = f",uid={uid},gid={uid}" if uid is not None else ""
        _mount(libc, "tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700{owner},{size}")
        info["private_work"] = True
    except OSError:
        pass
    return info


def _hide_root(libc, policy) -> bool:
    """tmpfs over /root, with the interpreter prefix bind-mounted back read-only."""
    try:
        keep = [p for p in {os.path.realpath(sys.base_prefix)} if p.startswith("/root/")]
        stage = policy["stage_dir"]
        for i, p in enumerate(keep):
            os.makedirs(f"{stage}/{i}", exist_ok=True)
            _mount(libc, p, f"{stage}/{i}", None, MS_BIND | MS_REC)
        _mount(libc, "tmpfs", "/root", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        for i, p in enumerate(keep):
            os.makedirs(p, mode=0o755, exist_ok=True)
            _mount(libc, f"{stage}/{i}", p, None, MS_BIND | MS_REC)
            _mount(libc, None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
            libc.umount2(f"{stage}/{i}".encode(), MNT_DETACH)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
