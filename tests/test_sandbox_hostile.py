"""Hostile programs against the code sandbox: a wrong candidate never passes, whatever it does to end the
process, to the harness or to the output; nothing it writes, binds or spawns survives or reaches outside.

Each case is a HumanEval-style program: a WRONG ``add`` (returns a - b) plus a trick, then the tests
(``check(add)``). With the old rule (exit status 0 = pass) every case in ``EARLY_EXITS`` and ``HARNESS_TRICKS``
passed; now none may.
"""

import os
import socket
import subprocess
import textwrap
import threading
import time
import uuid

import pytest

from hf_depth.evaluation import sandbox
from hf_depth.evaluation.sandbox import Limits, join_program, run_program

TESTS = """
import math

def check(candidate):
    assert abs(candidate(2, 3) - 5) < 1e-9
    assert math.isclose(candidate(0.1, 0.2), 0.3)
    assert all([candidate(i, i) == 2 * i for i in range(1, 3)])
    assert len([x for x in [candidate(1, 1)] if x == 2]) == 1
    return None

check(add)
"""
WRONG = "import os, sys, signal, builtins, atexit, threading, time\n\ndef add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"

EARLY_EXITS = {
    "sys.exit": "sys.exit(0)",
    "exit()": "exit()",
    "quit()": "quit()",
    "os._exit": "os._exit(0)",
    "raise SystemExit": "raise SystemExit",
    "SystemExit in test call": "def add(a, b):\n    raise SystemExit(0)",
    "KeyboardInterrupt": "raise KeyboardInterrupt",
    "KeyboardInterrupt in test call": "def add(a, b):\n    raise KeyboardInterrupt",
    "BaseException subclass": "class Done(BaseException):\n    pass\ndef add(a, b):\n    raise Done()",
    "GeneratorExit": "def add(a, b):\n    raise GeneratorExit",
    "atexit os._exit": "atexit.register(os._exit, 0)",
    "atexit in test": "atexit.register(lambda: os._exit(0))\ndef add(a, b):\n    raise ValueError",
    "excepthook": "sys.excepthook = lambda *a: os._exit(0)",
    "excepthook + threading": "sys.excepthook = threading.excepthook = lambda *a: os._exit(0)",
    "signal.alarm handler": "signal.signal(signal.SIGALRM, lambda *a: os._exit(0))\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\n"
                            "_add = add\ndef add(a, b):\n    time.sleep(2)\n    return _add(a, b)",
    "alarm handler raising SystemExit": "def h(*a):\n    raise SystemExit(0)\nsignal.signal(signal.SIGALRM, h)\n"
                                        "signal.setitimer(signal.ITIMER_REAL, 0.05)\ntime.sleep(1)",
    "SIGXFSZ ignored": "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\ntry:\n    sys.stdout.write('x' * (3 << 20))\n"
                       "    sys.stdout.flush()\nfinally:\n    os._exit(0)",
    "os.kill self SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
    "os.kill self SIGTERM": "os.kill(os.getpid(), signal.SIGTERM)",
    "SIGINT to self": "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(1)",
    "SIGTERM handler exits 0": "signal.signal(signal.SIGTERM, lambda *a: os._exit(0))\nos.kill(os.getpid(), signal.SIGTERM)",
    "killpg own group": "os.killpg(0, signal.SIGKILL)",
    "kill group 0": "os.kill(0, signal.SIGKILL)",
    "kill -1": "os.kill(-1, signal.SIGKILL)",
    "fork: parent exits 0": "if os.fork():\n    os._exit(0)",
    "fork: child prints passed, parent exits": "pid = os.fork()\nif pid == 0:\n    print('passed'); sys.stdout.flush(); os._exit(0)\n"
                                                "os.waitpid(pid, 0)\nos._exit(0)",
    "fork: parent returns child's 0": "pid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
                                      "_, st = os.waitpid(pid, 0)\nos._exit(os.WEXITSTATUS(st))",
    "thread os._exit": "threading.Thread(target=lambda: (time.sleep(0.05), os._exit(0)), daemon=True).start()\n"
                       "_add = add\ndef add(a, b):\n    time.sleep(1)\n    return _add(a, b)",
    "thread SystemExit + main blocks": "def f():\n    time.sleep(0.05)\n    os._exit(0)\nthreading.Thread(target=f).start()\n"
                                       "threading.Event().wait()",
    "sys.exit in __del__": "class D:\n    def __del__(self):\n        os._exit(0)\n_d = D()\nsys.exit(1)",
    "exit inside generator finally": "def g():\n    try:\n        yield 1\n    finally:\n        os._exit(0)\n"
                                     "it = g(); next(it); del it\nraise ValueError",
}

# every way of making abs / math.isclose / all / len lie to the tests
_LIES = "lambda x: 0", "lambda *a, **k: True", "lambda it: True", "lambda x: 1"
HARNESS_TRICKS = {
    "builtins + math patched": "import math\nbuiltins.abs, math.isclose, builtins.all, builtins.len = " + ", ".join(_LIES),
    "__builtins__ dict": "import math\nb = __builtins__ if isinstance(__builtins__, dict) else __builtins__.__dict__\n"
                         "b['abs'], math.isclose, b['all'], b['len'] = " + ", ".join(_LIES),
    "setattr on builtins/math": "import math\nfor m, k, v in ((builtins, 'abs', {}), (math, 'isclose', {}), "
                                "(builtins, 'all', {}), (builtins, 'len', {})):\n    setattr(m, k, v)".format(*_LIES),
    "sys.modules math faked": "import types\nm = types.ModuleType('math'); m.isclose = {}\nsys.modules['math'] = m\n"
                              "builtins.abs, builtins.all, builtins.len = {}, {}, {}".format(_LIES[1], _LIES[0], *_LIES[2:]),
    "__import__ replaced": "import types\nm = types.ModuleType('math'); m.isclose = {}\n_imp = builtins.__import__\n"
                           "builtins.__import__ = lambda n, *a, **k: m if n == 'math' else _imp(n, *a, **k)\n"
                           "builtins.abs, builtins.all, builtins.len = {}, {}, {}".format(_LIES[1], _LIES[0], *_LIES[2:]),
    "meta_path import hook": "import types\nclass F:\n    def find_spec(self, name, path, target=None):\n"
                             "        raise SystemExit(0)\nsys.meta_path.insert(0, F())\nsys.modules.pop('math', None)",
    "builtins.print/exec/AssertionError": "builtins.print = lambda *a, **k: os._exit(0)\n"
                                          "builtins.AssertionError = type('AE', (Exception,), {})\n"
                                          "builtins.exec = builtins.compile = lambda *a, **k: None",
    "check predefined": "def check(candidate):\n    pass\nbuiltins.check = check",
    "thread replaces check": "def swap():\n    m = sys.modules['__main__']\n    for _ in range(4000):\n"
                             "        if 'check' in m.__dict__:\n            m.__dict__['check'] = lambda c: None\n"
                             "        time.sleep(0.0002)\n"
                             "threading.Thread(target=swap, daemon=True).start()\n"
                             "_add = add\ndef add(a, b):\n    time.sleep(0.05)\n    return _add(a, b)",
    "settrace skips asserts": "def tr(frame, event, arg):\n    if frame.f_code.co_name == 'check' and event == 'line':\n"
                              "        try:\n            frame.f_lineno = frame.f_lineno + 1\n"
                              "        except ValueError:\n            pass\n    return tr\nsys.settrace(tr)",
    "setprofile exit on call": "sys.setprofile(lambda f, e, a: os._exit(0) if f.f_code.co_name == 'check' else None)",
    "audit hook exits": "sys.addaudithook(lambda e, a: os._exit(0) if e == 'exec' else None)",
    "audit hook on compile": "sys.addaudithook(lambda e, a: os._exit(0) if e in ('compile', 'import') else None)",
    "fake passed on stdout/stderr": "print('passed'); print('ok: 1/1 passed', file=sys.stderr)\n"
                                    "print('{\"passed\": true}'); sys.exit(0)",
    "fake tokens to every fd": "import secrets\nfor fd in range(3, 256):\n    try:\n"
                               "        os.write(fd, secrets.token_hex(32).encode())\n    except OSError:\n        pass\n"
                               "os._exit(0)",
    "close every fd then exit": "os.closerange(0, 256)\nos._exit(0)",
    "dup stdout over every fd": "for fd in range(3, 256):\n    try:\n        os.dup2(1, fd)\n    except OSError:\n"
                                "        pass\nos._exit(0)",
    "read every fd and echo": "for fd in range(3, 256):\n    try:\n        os.set_blocking(fd, False)\n"
                              "        data = os.read(fd, 4096)\n        os.write(fd, data)\n    except OSError:\n        pass\n"
                              "os._exit(0)",
    "gc scan for token": "import gc, re\nfor o in gc.get_objects():\n    pass\nos._exit(0)",
    "stdout replaced": "sys.stdout = sys.stderr = None\nsys.exit(0)",
    "os.write patched": "_w = os.write\nos.write = lambda fd, b: _w(fd, b)\nos._exit = lambda c: None\nsys.exit(0)",
}


def hostile(trick: str, candidate: str = WRONG) -> str:
    return join_program(candidate + "\n" + trick + "\n", TESTS)


def run(src, **kw):
    limits = {"timeout": 10.0, **kw.pop("limits", {})}
    return run_program(src, Limits(**limits), allow=True, **kw)


MODES = {"contained": {}, "fallback": {"namespaces": False, "private_uid": False}}
if os.geteuid() != 0:
    MODES = {"fallback": {}}


def no_survivors(result):
    uid = result.isolation.get("uid")
    if os.geteuid() == 0 and uid not in (None, 0):
        assert sandbox._processes_of_uid(uid) == []


def test_the_right_candidate_passes_in_every_mode():
    for mode in MODES.values():
        r = run(hostile("", RIGHT), **mode)
        assert r.passed and r.completed, r.stderr
        assert not run(hostile(""), **mode).passed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(EARLY_EXITS) + list(HARNESS_TRICKS))
def test_wrong_candidate_never_passes(case, mode):
    trick = {**EARLY_EXITS, **HARNESS_TRICKS}[case]
    r = run(hostile(trick), **MODES[mode])
    assert not r.passed and not r.completed, (case, r.status, r.stdout[-300:], r.stderr[-600:])
    no_survivors(r)


@pytest.mark.parametrize("case", ["exit()", "sys.exit", "os._exit", "atexit os._exit", "fork: parent exits 0"])
def test_mbpp_style_asserts_follow_the_same_rule(case):
    """MBPP: the candidate, then ``test_list`` asserts (no check function)."""
    from hf_depth.evaluation import scorers

    problem = {"test_list": ["assert add(2, 3) == 5", "assert add(0, 0) == 0"], "test_setup_code": ""}
    assert run(scorers.mbpp_program(problem, RIGHT)).passed
    assert not run(scorers.mbpp_program(problem, WRONG + "\n" + EARLY_EXITS[case])).passed
    # an early exit *after* a correct candidate: the tests never ran (in the program's own process), so it is no
    # pass either (an atexit hook runs only after the end, which the harness never reaches: that one passes)
    late = run(scorers.mbpp_program(problem, RIGHT + "import os, sys, atexit\n" + EARLY_EXITS[case]))
    assert late.passed == (case == "atexit os._exit")


def test_exit_status_is_irrelevant_only_the_token_counts():
    assert run("import sys\nprint('done')\n").passed
    r = run("import os\nprint('done', flush=True)\nos._exit(0)\n")
    assert r.returncode == 0 and r.stdout == "done\n" and not r.passed
    r = run("import os, sys\nsys.stdout.flush()\n")   # a clean end of the program is a pass ...
    assert r.passed
    r = run("import os\nos.close(1)\n")               # ... whatever it did to its own fds
    assert r.passed


# ------------------------------------------------------------------------------------------- nothing leaks

contained_only = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root here")


def _world_writable():
    out = subprocess.run(["find", "/", "-xdev", "(", "-path", "/proc", "-o", "-path", "/sys", ")", "-prune", "-o",
                          "-perm", "-0002", "-type", "d", "-print"], capture_output=True, text=True, timeout=120)
    dirs = {d for d in out.stdout.split() if not d.startswith("/tmp/")}
    return sorted(dirs | {d for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
                          if os.path.isdir(d)})


@contained_only
def test_writes_to_every_world_writable_place_leave_nothing(tmp_path):
    tag = f"hfd-hostile-{uuid.uuid4().hex[:12]}"
    dirs = _world_writable()
    assert "/tmp" in dirs and "/dev/shm" in dirs
    r = run(hostile(textwrap.dedent(f"""
        import tempfile
        from multiprocessing import shared_memory
        wrote = []
        for d in {dirs!r} + [tempfile.gettempdir(), os.path.expanduser("~"), os.getcwd()]:
            try:
                with open(os.path.join(d, {tag!r}), "w") as f:
                    f.write("leak")
                os.chmod(os.path.join(d, {tag!r}), 0o666)
                wrote.append(d)
            except OSError:
                pass
        try:
            shm = shared_memory.SharedMemory(name={tag!r}, create=True, size=4096)
            wrote.append("shm")
        except OSError:
            pass
        print("wrote", wrote)
    """)))
    assert not r.passed and "wrote" in r.stdout, r.stderr
    assert "/tmp" in r.stdout      # inside the run /tmp etc. are writable (private tmpfs) ...
    for d in dirs:                  # ... and none of it is outside
        assert not os.path.exists(os.path.join(d, tag)), d
    assert not any(tag in name for name in os.listdir("/dev/shm"))
    no_survivors(r)


@contained_only
def test_sysv_ipc_is_private():
    key = int(uuid.uuid4().int % 2**31)
    r = run(hostile(f"import ctypes\nlibc = ctypes.CDLL(None)\nprint('shm', libc.shmget({key}, 4096, 0o1666))"))
    assert "shm" in r.stdout and not r.passed
    with open("/proc/sysvipc/shm") as f:
        assert str(key) not in {line.split()[0] for line in f.read().splitlines()[1:]}


@contained_only
def test_unix_sockets_outside_are_unreachable(tmp_path):
    tag = uuid.uuid4().hex[:12]
    paths = [f"/tmp/hfd-{tag}.sock", f"/run/hfd-{tag}.sock"]
    servers = []
    for path in paths:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, 0o777)
        s.listen(4)
        s.setblocking(False)
        servers.append(s)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0hfd-{tag}")
    abstract.listen(4)
    abstract.setblocking(False)
    servers.append(abstract)
    try:
        r = run(hostile(textwrap.dedent(f"""
            import socket, ctypes
            for addr in {paths!r} + ["\\0hfd-{tag}"]:
                try:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(addr)
                    s.sendall(b"x")
                    print("connected", repr(addr))
                except OSError as e:
                    print("refused", repr(addr), e.errno)
            # a raw socket(2) call, bypassing the socket module (and any audit hook)
            libc = ctypes.CDLL(None, use_errno=True)
            print("raw socket(AF_UNIX)", libc.socket(1, 1, 0), ctypes.get_errno())
        """)))
        assert "connected" not in r.stdout and r.stdout.count("refused") == 3, r.stdout + r.stderr
        assert "raw socket(AF_UNIX) -1 13" in r.stdout          # EACCES from the seccomp filter
        for s in servers:
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in servers:
            s.close()
        for p in paths:
            os.unlink(p)


def test_abstract_sockets_are_per_network_namespace():
    """Without the seccomp filter's help: a socketpair is allowed, and the network namespace alone keeps an
    abstract address of the host unreachable (checked from the inside with a socket passed nowhere)."""
    if os.geteuid() != 0:
        pytest.skip("namespaces need root here")
    tag = uuid.uuid4().hex[:12]
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.bind(f"\0hfd-{tag}")
    host.listen(1)
    try:
        r = run(textwrap.dedent(f"""
            import socket
            a, b = socket.socketpair()
            a.sendall(b"ok"); assert b.recv(2) == b"ok"
            with open("/proc/net/unix") as f:
                assert "hfd-{tag}" not in f.read()
        """))
        assert r.passed, r.stderr
    finally:
        host.close()


@contained_only
def test_runs_cannot_read_each_other():
    secret = "VICTIM-" + uuid.uuid4().hex
    victim = (f"import time, os\nopen('secret.txt', 'w').write({secret!r})\nos.environ['S'] = {secret!r}\ntime.sleep(4)\n")
    attacker = textwrap.dedent("""
        import glob, os, re
        found = []
        for pattern in ("/tmp/hfd-sbx-*/**", "/proc/*/cwd/*", "/proc/*/root/tmp/**", "/proc/*/environ",
                        "/proc/*/cmdline", "/var/tmp/**", "/dev/shm/**", "/tmp/**"):
            for p in glob.glob(pattern, recursive=True):
                try:
                    found += re.findall(rb"VIC" rb"TIM-[0-9a-f]{32}", open(p, "rb").read())
                except OSError:
                    pass
        print("found", found)
        print(os.listdir("/proc"))
    """)
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("victim", run(victim)))
    t.start()
    time.sleep(1.5)
    r = run(attacker)
    t.join()
    assert r.passed and "found []" in r.stdout and secret not in r.stdout, r.stdout + r.stderr
    assert results["victim"].passed


@pytest.mark.parametrize("mode", MODES)
def test_daemons_do_not_outlive_the_run(mode):
    r = run(hostile(textwrap.dedent("""
        for _ in range(3):
            if os.fork() == 0:          # double fork + setsid: a classic daemon
                os.setsid()
                if os.fork() == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    signal.signal(signal.SIGHUP, signal.SIG_IGN)
                    print("daemon", os.getpid(), flush=True)
                    time.sleep(60)
                os._exit(0)
        time.sleep(0.3)
    """)), **MODES[mode])
    assert not r.passed and r.stdout.count("daemon") == 3, r.stderr
    assert r.leftover_killed >= 3
    no_survivors(r)
    if not r.isolation.get("pidns"):     # host pids: each must be gone
        for line in r.stdout.splitlines():
            pid = int(line.split()[1])
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.parametrize("trick", [
    "for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1):\n    signal.signal(s, signal.SIG_IGN)\n"
    "while True:\n    pass",
    "os.kill(os.getpid(), signal.SIGSTOP)",
    "signal.pthread_sigmask(signal.SIG_BLOCK, range(1, signal.NSIG))\nwhile True:\n    time.sleep(0.01)",
])
def test_signal_games_end_in_a_timeout_and_nothing_survives(trick):
    r = run(hostile(trick), limits={"timeout": 1.5})
    assert r.status == "timeout" and not r.passed
    no_survivors(r)


@pytest.mark.parametrize("mode", MODES)
def test_the_supervisor_survives_the_program(mode):
    """A correct candidate that also shoots at its parent (the supervisor) and its process group's leader: the
    supervisor survives, reports, and kills the daemon left behind."""
    trick = textwrap.dedent("""
        import os, signal, time
        for pid in (os.getppid(), -os.getppid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                print("denied", flush=True)
        if os.fork() == 0:
            os.setsid()
            time.sleep(30)
            os._exit(0)
    """)
    r = run(hostile(trick, RIGHT), **MODES[mode])
    assert r.passed and r.stdout.count("denied") == 2 and r.isolation and r.leftover_killed >= 1, r.stderr
    no_survivors(r)


@contained_only
def test_cannot_signal_the_supervisor_or_the_host():
    before = os.getpid()
    r = run(hostile("for pid in (1, os.getppid()):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
                    "    except OSError as e:\n        print('denied', pid, e.errno)"))
    assert r.stdout.count("denied") == 2 and not r.passed
    assert r.isolation["pidns"] and os.getpid() == before


@contained_only
def test_run_folder_is_private_and_owned_by_the_run():
    r = run(textwrap.dedent("""
        import os, stat
        st = os.stat(os.getcwd())
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid() != 0, (oct(st.st_mode), st.st_uid)
        assert os.listdir(os.getcwd()) == ["main.py"], os.listdir(os.getcwd())
        assert os.environ["HOME"] == os.environ["TMPDIR"] == os.getcwd()
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            assert os.listdir(d) in ([], [os.getcwd().split("/")[2]]), (d, os.listdir(d))
        try:
            open("/work/hfd-should-not-exist", "w")
            raise AssertionError("the host filesystem is writable")
        except OSError:
            pass
    """))
    assert r.passed, r.stderr
    iso = r.isolation
    assert iso["rootfs_readonly"] and iso["private_work"] and iso["pidns"] and iso["proc"]
    assert set(iso["private_tmp"]) >= {"/tmp", "/dev/shm"}
    assert sandbox.containment(iso)["not_contained"] == []


def test_fallback_metadata_says_what_is_not_contained():
    r = run("pass\n", namespaces=False, private_uid=False)
    assert r.passed and not r.isolation["netns"] and not r.isolation["pidns"]
    words = sandbox.containment(r.isolation)
    assert any("network" in w for w in words["not_contained"])
    assert any("/tmp" in w for w in words["not_contained"])
    assert words["contained"][0].startswith("success only through")
