"""Run untrusted (model-generated) Python programs, one contained run per candidate (threat model and the
full list of what is and is not contained: ``docs/sandbox.md``).

* **Opt-in.** Nothing runs unless the caller passes ``allow=True`` (the ``--confirm-run-unsafe-code`` flag,
  lm-eval's ``confirm_run_unsafe_code``) or sets ``HF_DEPTH_ALLOW_CODE_EXECUTION=1``; otherwise
  :class:`CodeExecutionRefused` says why.
* **Success is proven, not assumed.** A program passes only when the harness (``_sandbox_harness.py``) has run
  its last statement, and for a candidate + tests program (:func:`join_program`) the tests' last statement,
  without any exception (``SystemExit``, ``KeyboardInterrupt`` included) and then written this run's random
  token to a pipe only the parent reads. The exit status never counts: ``sys.exit(0)``, ``os._exit(0)``,
  ``atexit`` hooks, signal handlers, a forked child that exits 0 or prints "passed" all fail. The tests run
  with the builtins, the modules they import and the import hooks as they were before the candidate ran.
* **Contained** (``_sandbox_child.py``), as root: new mount, network, pid and IPC namespaces; every mount
  read-only, private tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock`` and the working directory
  (0700, owned by the run's random uid); ``/root`` hidden; a fresh ``/proc``; ``no_new_privs``; a seccomp filter
  refusing ``socket(AF_UNIX)``; the run's pid namespace dies with it, double-forked daemons included.
  Always: own session, wall-clock timeout, rlimits (memory, CPU, processes, file size — stdout/stderr
  included —, open files, no core dumps), clean environment, stdin /dev/null, and a kill of every process left.
* **Not root / no namespaces**: the same limits, a subreaper that kills every descendant, plus audit hooks
  refusing writes outside the working directory, reads of other runs and of ``/proc/<pid>``, signals outside
  the run, sockets, starting programs and ``ctypes``: defence in depth, not a security boundary.
  :attr:`ExecResult.isolation` reports what a run obtained; :func:`containment` turns it into words.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import os
import random
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ._sandbox_child import sigkill

ALLOW_ENV = "HF_DEPTH_ALLOW_CODE_EXECUTION"
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
_NPROC_LOCK = threading.Lock()
RUN_PREFIX = "hfd-sbx-"
# Separates the candidate from its tests in a program (:func:`join_program`); the last occurrence counts.
TESTS_MARKER = "\n# ---- hf_depth sandbox: the tests start here ----\n"
GRACE_S = 5.0   # the supervisor enforces the timeout; the parent kills everything after timeout + GRACE_S
logger = logging.getLogger(__name__)


class CodeExecutionRefused(PermissionError):
    """Raised when code execution was not explicitly allowed."""


REFUSAL = (
    "Refusing to execute model-generated code: it is untrusted and may be hostile. hf_depth runs it in a "
    "sandbox (own process group, rlimits, no network, throwaway dir, clean env, separate uid when root), but "
    "a sandbox is never perfect, so you must opt in: pass --confirm-run-unsafe-code to `hf-depth eval` "
    "(lm-eval: --confirm_run_unsafe_code / confirm_run_unsafe_code=True), allow=True in Python, or set "
    f"{ALLOW_ENV}=1."
)


def check_allowed(allow: bool | None = None) -> None:
    """Raise :class:`CodeExecutionRefused` unless code execution was opted into."""
    if allow or os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes"):
        return
    raise CodeExecutionRefused(REFUSAL)


@dataclass
class Limits:
    timeout: float = 10.0          # wall-clock seconds
    memory_mb: int = 2048          # RLIMIT_AS
    max_processes: int = 16        # RLIMIT_NPROC (per private uid when root)
    max_output: int = 1 << 20      # RLIMIT_FSIZE: bytes per file, stdout/stderr included
    max_open_files: int = 256      # RLIMIT_NOFILE
    disk_mb: int = 64              # size of each private tmpfs (/tmp, /var/tmp, /dev/shm, the working dir)

    def __post_init__(self):
        for name in ("timeout", "memory_mb", "max_processes", "max_output", "max_open_files", "disk_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0, got {getattr(self, name)!r}")


@dataclass
class ExecResult:
    status: str                    # "passed" | "failed" | "timeout"
    returncode: int | None         # for information only: it never decides the status
    stdout: str
    stderr: str
    duration: float
    isolation: dict = field(default_factory=dict)   # what the run obtained (see :func:`containment`)
    leftover_killed: int = 0       # processes still alive after the program ended, killed by cleanup
    completed: bool = False        # the harness reported completion with this run's token

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _processes_of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["Uid"].split()[1]) == uid and not status["State"].strip().startswith("Z"):
                pids.append(int(name))
        except (OSError, KeyError, ValueError):
            continue
    return pids


def _processes_of_session(sid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z" and sid in (int(fields[2]), int(fields[3])):   # process group or session
                    pids.append(int(name))
            except (OSError, IndexError, ValueError):
                continue
    return pids


def _kill_all(find, key) -> int:
    """SIGKILL every process ``find(key)`` lists, until none is left (fork bombs respawn)."""
    killed = set()
    for _ in range(200):
        pids = [p for p in find(key) if p != os.getpid()]
        if not pids:
            break
        killed |= sigkill(pids)
        time.sleep(0.01)
    return len(killed)


def _user_process_count() -> int:
    uid, n = os.getuid(), 0
    for pid in _processes_of_uid(uid):
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            n += 1
    return n


def join_program(candidate: str, tests: str) -> str:
    """One program: ``candidate``, then ``tests`` (run with pristine builtins after the candidate)."""
    return f"{candidate}\n{TESTS_MARKER}{tests}\n"


def run_program(source: str, limits: Limits | None = None, *, allow: bool | None = None,
                python: str | None = None, private_uid: bool = True, namespaces: bool = True) -> ExecResult:
    """Run ``source`` as ``__main__`` in the sandbox. ``passed`` iff the harness ran it to its end (candidate and
    tests, see :func:`join_program`) without an exception and proved it with the run's token, in time.

    Test switches: ``private_uid=False`` (while root) keeps the caller's uid and relies on the audit-hook guards;
    ``namespaces=False`` skips the namespaces (the fallback of a machine that has none)."""
    check_allowed(allow)
    limits = limits or Limits()
    is_root = os.geteuid() == 0 and private_uid
    base = tempfile.mkdtemp(prefix=RUN_PREFIX)
    uid = random.SystemRandom().randrange(1_000_000, 2_000_000_000) if is_root else None
    token = secrets.token_hex(32).encode()
    fds: list[int] = []
    try:
        os.chmod(base, 0o711 if uid is not None else 0o700)   # enterable by the run's uid, never listable
        program = os.path.join(base, "program.py")
        with open(os.open(program, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            f.write(source)
        nproc = limits.max_processes
        if uid is None:   # RLIMIT_NPROC counts all processes of the user: allow the current ones plus ours
            with _NPROC_LOCK:
                nproc += _user_process_count()
        token_r, token_w = os.pipe()
        result_r, result_w = os.pipe()
        fds += [token_r, token_w, result_r, result_w]
        os.write(token_w, token)
        policy = {
            "program": program, "uid": uid, "report": os.path.join(base, "report.json"), "base": base,
            "work": os.path.join(base, "work"), "stage_dir": os.path.join(base, "stage"),
            "runs_prefix": os.path.join(os.path.realpath(tempfile.gettempdir()), RUN_PREFIX),
            "token_fd": token_r, "result_fd": result_w, "marker": TESTS_MARKER, "namespaces": namespaces,
            "timeout": limits.timeout, "disk_mb": limits.disk_mb,
            "limits": {
                "RLIMIT_AS": limits.memory_mb << 20, "RLIMIT_CPU": int(limits.timeout) + 1,
                "RLIMIT_NPROC": nproc, "RLIMIT_FSIZE": limits.max_output,
                "RLIMIT_NOFILE": limits.max_open_files, "RLIMIT_CORE": 0,
            },
        }
        out_path, err_path = os.path.join(base, "stdout"), os.path.join(base, "stderr")
        start = time.perf_counter()
        with open(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out, \
                open(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as err:
            proc = subprocess.Popen([python or sys.executable, "-I", "-S", _CHILD, json.dumps(policy)], cwd=base,
                                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True, close_fds=True,
                                    pass_fds=(token_r, result_w))
            for fd in (token_w, token_r, result_w):
                os.close(fd)
                fds.remove(fd)
            exited = _wait(proc, limits.timeout + GRACE_S)
            duration = time.perf_counter() - start
            leftovers = _kill_all(_processes_of_session, proc.pid)
            if uid is not None:
                leftovers += _kill_all(_processes_of_uid, uid)
            proc.wait()
        received = _read_pipe(result_r)
        isolation = {}
        try:
            with open(policy["report"]) as f:
                isolation = json.load(f)
        except (OSError, ValueError):
            pass
        # the supervisor's report is part of the proof: without it the run was not contained to its end
        completed = hmac.compare_digest(received, token) and bool(isolation)
        if not exited or isolation.get("timed_out"):
            status = "timeout"
        else:
            status = "passed" if completed else "failed"
        leftovers += isolation.get("leftover") or 0
        return ExecResult(status, proc.returncode, _read_capped(out_path, limits.max_output),
                          _read_capped(err_path, limits.max_output), duration, isolation, leftovers, completed)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(base, ignore_errors=True)


def _read_pipe(fd: int, cap: int = 1 << 16) -> bytes:
    """Whatever is in the pipe now (its writers are gone or dead), at most ``cap`` bytes."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < cap:
        try:
            chunk = os.read(fd, cap)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for ``proc`` up to ``timeout`` s; True if it exited. A pidfd wakes us at once (Popen.wait(timeout)
    polls with a backoff of up to 50 ms, which would dominate the overhead of short programs)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return bool(ready)


def _read_capped(path: str, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", errors="replace")


def run_many(sources: Sequence[str], limits: Limits | None = None, *, allow: bool | None = None,
             workers: int | None = None) -> list[ExecResult]:
    """``run_program`` over many programs, ``workers`` at a time (threads waiting on child processes)."""
    check_allowed(allow)
    workers = workers or max(1, min(8, (os.cpu_count() or 1) * 2))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda s: run_program(s, limits, allow=True), sources))


def check_program(program: str, tests: Iterable[str] | str, *, timeout: float = 10.0, allow: bool | None = None,
                  setup: str = "") -> ExecResult:
    """Run ``setup + program``, then ``tests`` (assert statements or a ``check(...)`` call)."""
    tests = tests if isinstance(tests, str) else "\n".join(tests)
    return run_program(join_program(f"{setup}\n{program}", tests), Limits(timeout=timeout), allow=allow)


def containment(isolation: dict) -> dict:
    """What a run with this ``isolation`` report contained and did not, in words (for results metadata)."""
    yes, no = ["success only through the harness's per-run token after the last test (exit status ignored)"], []

    def say(ok, contained, not_contained):
        (yes if ok else no).append(contained if ok else not_contained)

    uid = isolation.get("uid")
    private_uid = uid not in (None, 0) and uid != os.getuid()
    say(isolation.get("netns"), "network: own network namespace (no interfaces; its own abstract unix sockets)",
        "network: only an audit hook refusing socket creation (bypassable)")
    say(isolation.get("seccomp_unix_sockets"), "unix sockets: socket(AF_UNIX) refused by seccomp",
        "unix sockets: no seccomp filter")
    say(isolation.get("pidns") and isolation.get("proc"),
        "processes: own pid namespace and /proc; all killed when the run ends (daemons included)",
        "processes: subreaper + kill of descendants, session and uid (no pid namespace)")
    say(isolation.get("ipcns"), "System V / POSIX IPC: own IPC namespace", "System V / POSIX IPC: shared with the host")
    say(isolation.get("rootfs_readonly"), "filesystem: every mount read-only and nosuid",
        "filesystem: host mounts writable where permissions allow")
    tmp = isolation.get("private_tmp") or []
    say(bool(tmp), f"private tmpfs over {', '.join(tmp)}", "/tmp, /var/tmp, /dev/shm: shared with the host")
    say(isolation.get("private_work"), "working directory: private tmpfs, 0700, owned by the run's uid",
        "working directory: a 0700 folder on the host temp dir")
    say(private_uid, "user: a random unprivileged uid/gid per run, no supplementary groups, no_new_privs",
        "user: the caller's uid (audit hooks guard writes, /proc, signals, programs, ctypes)")
    return {"contained": yes, "not_contained": no}


@functools.lru_cache(maxsize=1)
def describe() -> dict:
    """The isolation this machine gives a run (one trivial run) and :func:`containment` of it."""
    r = run_program("pass\n", Limits(timeout=30.0), allow=True)
    return {"isolation": r.isolation, **containment(r.isolation)}
