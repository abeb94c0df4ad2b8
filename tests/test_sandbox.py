"""The code sandbox: hostile programs fail and harm nothing; execution needs an explicit opt-in."""

import os
import shutil
import signal
import socket
import tempfile
import textwrap
from pathlib import Path

import pytest

from hf_depth.evaluation import sandbox
from hf_depth.evaluation.sandbox import CodeExecutionRefused, Limits, run_program


def run(src, private_uid=True, **limits):
    # private_uid=False: the fallback of a machine without namespaces or root (audit hooks guard the run)
    return run_program(textwrap.dedent(src), Limits(**{"timeout": 20.0, **limits}), allow=True,
                       private_uid=private_uid, namespaces=private_uid)


# As root the kernel enforces containment (private uid); the audit-hook fallback used by non-root callers is
# exercised as well by private_uid=False. (Not for the fork bomb: RLIMIT_NPROC does not bind root.)
MODES = [True] + ([False] if os.geteuid() == 0 else [])


def no_survivors(result):
    uid = result.isolation.get("uid")
    if os.geteuid() == 0 and uid is not None and uid != 0:
        assert sandbox._processes_of_uid(uid) == []


def test_refused_without_opt_in(monkeypatch):
    monkeypatch.delenv(sandbox.ALLOW_ENV, raising=False)
    with pytest.raises(CodeExecutionRefused, match="confirm-run-unsafe-code"):
        run_program("print(1)")
    monkeypatch.setenv(sandbox.ALLOW_ENV, "1")
    assert run_program("print(1)").stdout == "1\n"


def test_pass_fail_and_isolation_report():
    ok = run("import sys; print('hi')")
    assert ok.passed and ok.stdout == "hi\n"
    assert not run("import sys; print('hi'); sys.exit(0)").passed   # issue 13: an early exit never passes
    assert not run("assert 1 == 2").passed
    assert not run("raise SystemExit(3)").passed
    if os.geteuid() == 0 and ok.isolation["mountns"]:   # root with namespaces: a private unprivileged uid
        assert ok.isolation["uid"] not in (0, None)


def test_infinite_loop_times_out():
    r = run("while True:\n    pass", timeout=1.5)
    assert r.status == "timeout" and r.duration < 10
    no_survivors(r)


def test_fork_bomb_is_bounded_and_cleaned_up():
    r = run("""
        import os, sys, time
        n = 0
        for _ in range(300):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            n += 1
        print(n, flush=True)
        time.sleep(60)
    """, timeout=3.0, max_processes=8)
    assert r.status == "timeout"
    n = int(r.stdout.split()[0])
    assert r.leftover_killed >= n
    no_survivors(r)
    if os.geteuid() == 0 and r.isolation.get("uid") is None:
        pytest.skip("root without a private uid (no mount namespace here): RLIMIT_NPROC does not bind root")
    assert n < 8 + (0 if os.geteuid() == 0 else 8)   # RLIMIT_NPROC stopped it


def test_memory_bomb_fails():
    r = run("x = bytearray(8 << 30)\nprint('allocated')", memory_mb=512)
    assert not r.passed and "MemoryError" in r.stderr and "allocated" not in r.stdout
    r = run("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))", memory_mb=512)
    assert not r.passed and "MemoryError" in r.stderr


@pytest.fixture
def host_dir():
    """A folder outside the temp dirs a contained run gets privately (/tmp, /var/tmp, /dev/shm): the attacks
    below must meet the real files."""
    root = Path(__file__).resolve().parents[1] / ".pytest_cache"
    root.mkdir(exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="sandbox-canary-", dir=root))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("private_uid", MODES, ids=lambda m: "private_uid" if m else "hooks")
def test_cannot_delete_or_write_outside(host_dir, private_uid):
    tmp_path = host_dir
    outside = tmp_path / "outside"
    outside.mkdir()
    canary = outside / "canary.txt"
    canary.write_text("alive")
    os.chmod(tmp_path, 0o755)
    os.chmod(outside, 0o755)
    os.chmod(canary, 0o644)
    for attack in (f"import os; os.remove({str(canary)!r})",
                   f"open({str(canary)!r}, 'w').write('pwned')",
                   f"import shutil; shutil.rmtree({str(outside)!r})",
                   f"import os; os.rename({str(canary)!r}, 'stolen.txt')",
                   f"import subprocess; subprocess.run(['rm', '-f', {str(canary)!r}], check=True)"):
        r = run(attack, private_uid=private_uid)
        assert not r.passed, attack
        assert canary.read_text() == "alive", attack
    # ...while its own working directory is writable
    assert run("open('mine.txt', 'w').write('ok'); import os; os.remove('mine.txt')", private_uid=private_uid).passed


@pytest.mark.parametrize("private_uid", MODES, ids=lambda m: "private_uid" if m else "hooks")
def test_environment_is_clean(monkeypatch, private_uid):
    monkeypatch.setenv("HFD_FAKE_SECRET_TOKEN", "s3cr3t-value")
    r = run("""
        import os
        print(sorted(os.environ.items()))
        for path in (f"/proc/{os.getppid()}/environ", "/proc/1/environ"):
            try:
                print(open(path, "rb").read())
            except OSError as e:
                print("denied", path, type(e).__name__)
    """, private_uid=private_uid)
    assert "s3cr3t" not in r.stdout + r.stderr
    assert "HFD_FAKE_SECRET_TOKEN" not in r.stdout
    assert r.stdout.count("denied") == 2


@pytest.mark.parametrize("private_uid", MODES, ids=lambda m: "private_uid" if m else "hooks")
def test_no_network(private_uid):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        r = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'x')", private_uid=private_uid)
        assert not r.passed
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


@pytest.mark.parametrize("private_uid", MODES, ids=lambda m: "private_uid" if m else "hooks")
def test_cannot_signal_parent(private_uid):
    before = signal.getsignal(signal.SIGTERM)
    r = run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", private_uid=private_uid)
    assert not r.passed and ("PermissionError" in r.stderr or "Operation not permitted" in r.stderr)
    assert signal.getsignal(signal.SIGTERM) == before     # and we are obviously still alive


def test_huge_stdout_is_capped():
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", max_output=1 << 20)
    assert not r.passed and r.status != "timeout"   # killed by SIGXFSZ at the cap, not by the clock
    assert len(r.stdout) <= 1 << 20


def test_orphans_are_killed():
    r = run("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
            os._exit(0)
        print("parent done")
    """)
    assert r.passed and r.leftover_killed >= 1
    no_survivors(r)


def test_run_many_in_parallel():
    progs = [f"assert {i} % 2 == 0" for i in range(8)]
    assert [r.passed for r in sandbox.run_many(progs, allow=True, workers=4)] == [i % 2 == 0 for i in range(8)]
