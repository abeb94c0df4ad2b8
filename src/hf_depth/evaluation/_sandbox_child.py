"""First stage of a sandboxed run (see ``sandbox.py``). Runs as the parent's user, in a fresh process group.

argv[1] is a JSON policy. In order: new network + mount namespaces (when permitted), hide ``/root`` behind a
tmpfs (keeping only the interpreter's prefix, read-only), resource limits, ``no_new_privs``, drop to the
per-run uid/gid (when root), then ``execv`` the interpreter on the second stage, which installs audit hooks
and runs the program. Only the standard library is used: this file must work without hf_depth importable.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38

STAGE2 = r'''
import json, os, runpy, sys
program, policy = sys.argv[1], json.loads(sys.argv[2])
sys.argv = [program]
work = os.path.realpath(os.getcwd())
pgid = os.getpgid(0)

def _inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return p == work or p.startswith(work + os.sep)

def _own_group(pid):
    try:
        return pid > 0 and os.getpgid(pid) == pgid
    except OSError:
        return False

def hook(event, args):
    if event == "socket.__new__" and policy["block_sockets"]:
        raise PermissionError("sandbox: network access is disabled")
    if event in ("os.kill", "os.killpg"):
        pid = args[0]
        if event == "os.killpg" and pid != pgid or event == "os.kill" and pid not in (0,) and not _own_group(pid):
            raise PermissionError("sandbox: signals only to processes of the sandbox")
    if policy["guard_files"]:
        if event == "open":
            path, mode = args[0], args[1] or "r"
            if isinstance(path, int):
                return
            writes = any(c in str(mode) for c in "wax+") or (isinstance(args[2], int) and args[2] & 3)
            p = os.fsdecode(path)
            if (writes and not _inside(path)) or (p.startswith("/proc/") and not p.startswith("/proc/self")):
                raise PermissionError(f"sandbox: access to {p!r} denied")
        elif event in ("os.remove", "os.rmdir", "os.rename", "os.chmod", "os.chown", "shutil.rmtree", "os.truncate"):
            if not isinstance(args[0], int) and not _inside(args[0]):
                raise PermissionError(f"sandbox: {event} outside the working directory denied")
        elif event in ("ctypes.dlopen", "ctypes.dlsym"):
            raise PermissionError("sandbox: ctypes is disabled")
        elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn"):
            raise PermissionError("sandbox: starting other programs is disabled")

sys.addaudithook(hook)
del hook
runpy.run_path(program, run_name="__main__")
'''


def main() -> None:
    policy = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    is_root = os.geteuid() == 0
    netns = mountns = False
    if is_root and libc.unshare(CLONE_NEWNS | CLONE_NEWNET) == 0:
        netns = mountns = True
    elif libc.unshare(CLONE_NEWNET) == 0:
        netns = True
    if mountns:
        mountns = _hide_root(libc, policy)
    limits = policy["limits"]
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    uid = policy.get("uid")
    if is_root and not mountns and not _reachable_by_others(sys.executable):
        uid = None  # the interpreter lives under a private dir we could not remount: stay root, guard by hooks
    with open(policy["report"], "w") as f:
        json.dump({"netns": netns, "mountns": mountns, "uid": uid if is_root else os.getuid()}, f)
    stage2 = {"block_sockets": not netns, "guard_files": uid is None or not is_root}
    if is_root and uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise SystemExit("sandbox: could not drop privileges")
    os.execv(sys.executable, [sys.executable, "-I", "-c", STAGE2, policy["program"], json.dumps(stage2)])


def _reachable_by_others(path: str) -> bool:
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i]) or "/").st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o005 == 0o005)


def _hide_root(libc, policy) -> bool:
    """In the new mount namespace: tmpfs over /root, with the interpreter prefix bind-mounted back read-only."""
    def mount(src, dst, fstype, flags, data=None):
        if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                      data and data.encode()) != 0:
            raise OSError(ctypes.get_errno(), f"mount {src} -> {dst}")

    try:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        keep = [p for p in {os.path.realpath(sys.base_prefix)} if p.startswith("/root/")]
        stage = policy["stage_dir"]
        for i, p in enumerate(keep):
            os.makedirs(f"{stage}/{i}", exist_ok=True)
            mount(p, f"{stage}/{i}", None, MS_BIND | MS_REC)
        mount("tmpfs", "/root", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        for i, p in enumerate(keep):
            os.makedirs(p, mode=0o755, exist_ok=True)
            mount(f"{stage}/{i}", p, None, MS_BIND | MS_REC)
            mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
            libc.umount2(f"{stage}/{i}".encode(), MNT_DETACH)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
