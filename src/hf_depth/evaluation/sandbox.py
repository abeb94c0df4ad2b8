"""Run untrusted (model-generated) Python programs, one process tree per candidate.

What is enforced for every run (``run_program``):

* **Opt-in.** Nothing runs unless the caller passes ``allow=True`` (the ``--confirm-run-unsafe-code`` flag,
  lm-eval's ``confirm_run_unsafe_code``) or sets ``HF_DEPTH_ALLOW_CODE_EXECUTION=1``; otherwise
  :class:`CodeExecutionRefused` says why.
* **Own process group / session** (``start_new_session``), **wall-clock timeout**, and after every run, passed
  or not, SIGKILL to the group and — when running as root — to every process of the run's private uid
  (so children that ``setsid()`` away are found too).
* **rlimits**: address space (memory), CPU seconds, number of processes (fork bombs), file size (which also
  caps stdout/stderr: they are files, a program writing more is killed by SIGXFSZ), open files, no core dumps.
* **Throwaway working directory** (removed afterwards), ``HOME``/``TMPDIR`` point into it, **clean
  environment** (only PATH, HOME, TMPDIR, LANG; the interpreter runs with ``-I``), stdin is /dev/null.
* **No network**: a fresh network namespace (no interfaces but a down loopback) where the kernel allows
  ``unshare(CLONE_NEWNET)``; otherwise socket creation is refused by an audit hook.
* **As root** (this project's machines): a fresh mount namespace hides ``/root`` behind an empty tmpfs (the
  interpreter's prefix is bound back read-only), ``no_new_privs`` is set, and the program runs under a
  random unused uid/gid with no supplementary groups. The kernel then refuses writes to files it does not
  own (everything outside its working directory), signals to other users' processes (``os.kill`` of the
  parent), reading other processes' ``/proc/<pid>/environ``, and counts RLIMIT_NPROC for that uid alone.
* **Not root**: the same limits, plus audit hooks that refuse writes/removals outside the working directory,
  ``/proc/<pid>`` reads, signals outside the sandbox's process group, starting other programs
  (``subprocess``, ``os.system``, ``os.exec*``) and ``ctypes``. Audit hooks are
  defence in depth, not a security boundary (a determined program could find a way around them).

Reading world-readable files (e.g. the standard library, this repository) is allowed in both modes.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

ALLOW_ENV = "HF_DEPTH_ALLOW_CODE_EXECUTION"
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
_NPROC_LOCK = threading.Lock()


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

    def __post_init__(self):
        for name in ("timeout", "memory_mb", "max_processes", "max_output", "max_open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0, got {getattr(self, name)!r}")


@dataclass
class ExecResult:
    status: str                    # "passed" | "failed" | "timeout"
    returncode: int | None
    stdout: str
    stderr: str
    duration: float
    isolation: dict = field(default_factory=dict)   # netns / mountns / uid actually obtained
    leftover_killed: int = 0       # processes still alive after the program ended, killed by cleanup

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
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed.add(p)
            except OSError:
                pass
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


def run_program(source: str, limits: Limits | None = None, *, allow: bool | None = None,
                python: str | None = None, private_uid: bool = True) -> ExecResult:
    """Run ``source`` as ``__main__`` in the sandbox; ``passed`` iff it exits with status 0 within the limits.

    ``private_uid=False`` (testing the non-root fallback while root) keeps the caller's uid and relies on the
    audit-hook guards, like a non-root caller."""
    check_allowed(allow)
    limits = limits or Limits()
    is_root = os.geteuid() == 0 and private_uid
    base = tempfile.mkdtemp(prefix="hfd-sbx-")
    uid = random.SystemRandom().randrange(1_000_000, 2_000_000_000) if is_root else None
    try:
        os.chmod(base, 0o711)
        work = os.path.join(base, "work")
        os.mkdir(work, 0o700)
        program = os.path.join(work, "main.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        if uid is not None:
            os.chown(work, uid, uid)
            os.chown(program, uid, uid)
        nproc = limits.max_processes
        if uid is None:   # RLIMIT_NPROC counts all processes of the user: allow the current ones plus ours
            with _NPROC_LOCK:
                nproc += _user_process_count()
        policy = {
            "program": program, "uid": uid, "report": os.path.join(base, "report.json"),
            "stage_dir": os.path.join(base, "stage"),
            "limits": {
                "RLIMIT_AS": limits.memory_mb << 20, "RLIMIT_CPU": int(limits.timeout) + 1,
                "RLIMIT_NPROC": nproc, "RLIMIT_FSIZE": limits.max_output,
                "RLIMIT_NOFILE": limits.max_open_files, "RLIMIT_CORE": 0,
            },
        }
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
        out_path, err_path = os.path.join(base, "stdout"), os.path.join(base, "stderr")
        start = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([python or sys.executable, "-I", "-S", _CHILD, json.dumps(policy)], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                    close_fds=True)
            status = "failed" if _wait(proc, limits.timeout) else "timeout"
            duration = time.perf_counter() - start
            leftovers = _kill_all(_processes_of_session, proc.pid)
            if uid is not None:
                leftovers += _kill_all(_processes_of_uid, uid)
            proc.wait()
        if status != "timeout" and proc.returncode == 0:
            status = "passed"
        isolation = {}
        try:
            with open(policy["report"]) as f:
                isolation = json.load(f)
        except (OSError, ValueError):
            pass
        return ExecResult(status, proc.returncode, _read_capped(out_path, limits.max_output),
                          _read_capped(err_path, limits.max_output), duration, isolation, leftovers)
    finally:
        shutil.rmtree(base, ignore_errors=True)


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
    """Run ``setup + program + tests`` (assert statements or a ``check(...)`` call)."""
    tests = tests if isinstance(tests, str) else "\n".join(tests)
    return run_program(f"{setup}\n{program}\n\n{tests}\n", Limits(timeout=timeout), allow=allow)
