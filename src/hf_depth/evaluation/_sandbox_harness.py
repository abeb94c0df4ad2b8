"""Second stage of a sandboxed run (see ``sandbox.py``): the harness that runs the program and proves success.

Not imported: ``_sandbox_child.py`` reads this file and runs it with ``python -I -c`` as the run's own user, in
the run's working directory. argv: ``[program path, JSON policy]``. Only the standard library is used.

The program file holds the candidate, then (after the last ``TESTS_MARKER`` line, when present) the tests. The
harness

1. reads the run's random token from ``token_fd`` and closes it (the token is never in argv, env or a file);
2. imports the modules the tests import and snapshots them, the builtins and the import hooks;
3. runs the candidate as ``__main__``; then undoes what it changed in those modules, the builtins, the import
   hooks and the trace/profile functions, and runs the tests in a copy of the candidate's namespace with a
   private copy of the builtins;
4. only if both ran to their last statement without raising anything (``BaseException``: ``SystemExit`` and
   ``KeyboardInterrupt`` are failures too), in the process it started in (not in a forked child), writes the
   token to ``result_fd`` and ends the process at once.

The parent counts a pass only when exactly that token arrives. Every other way of ending (``sys.exit``,
``os._exit``, signals, ``atexit``, exit status 0 from anywhere) never writes it.
"""

import ast
import builtins
import json
import os
import sys
import traceback
import types


def _harness():

    program, policy = sys.argv[1], json.loads(sys.argv[2])
    write, read, close, _exit, dup, getpid = os.write, os.read, os.close, os._exit, os.dup, os.getpid
    main_pid = getpid()
    token = b""
    while True:
        chunk = read(policy["token_fd"], 256)
        if not chunk:
            break
        token += chunk
    close(policy["token_fd"])
    result_fd = policy["result_fd"]
    os.set_inheritable(result_fd, False)          # programs the candidate execs never get it
    err_fd = dup(2)                               # our own stderr, whatever the candidate does to fd 2
    os.set_inheritable(err_fd, False)
    _install_audit_hook(policy)

    with open(program, encoding="utf-8") as f:
        source = f.read()
    candidate, marker, tests = source.rpartition(policy["marker"])
    if not marker:
        candidate, tests = source, ""
    test_offset = (candidate + marker).count("\n")

    def flush():
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except BaseException:
                pass

    def fail(stage):
        try:
            flush()
            text = f"[sandbox] the {stage} raised:\n" + traceback.format_exc()
            write(err_fd, text.encode("utf-8", "replace"))
        finally:
            _exit(1)

    try:
        test_code = compile("\n" * test_offset + tests, program, "exec", dont_inherit=True, optimize=0)
        cand_code = compile(candidate, program, "exec", dont_inherit=True, optimize=0)
    except BaseException:
        fail("compilation")
    saved = _snapshot(_imported_modules(tests))
    main = types.ModuleType("__main__")
    main.__file__ = program
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [program]
    try:
        exec(cand_code, main.__dict__)
    except BaseException:
        fail("program")
    try:
        _restore(saved)
        if tests:
            namespace = dict(main.__dict__)
            namespace["__builtins__"] = dict(saved["builtins"])
            exec(test_code, namespace)
    except BaseException:
        fail("tests")
    flush()
    if getpid() == main_pid:   # a forked child that ran on to here proves nothing: only the program's process
        write(result_fd, token)
    _exit(0)


def _imported_modules(tests: str) -> list:
    """Absolute module names the test code imports (``import a.b`` -> a, a.b; ``from a import b`` -> a)."""
    try:
        tree = ast.parse(tests)
    except SyntaxError:
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return sorted({".".join(n.split(".")[:i + 1]) for n in names for i in range(n.count(".") + 1)})


def _snapshot(modules: list) -> dict:
    saved = {"builtins": dict(builtins.__dict__), "meta_path": list(sys.meta_path),
             "path_hooks": list(sys.path_hooks), "modules": {}}
    for name in modules:
        try:
            __import__(name)
            module = sys.modules[name]
            saved["modules"][name] = (module, dict(module.__dict__))
        except BaseException:
            continue
    return saved


def _restore(saved: dict) -> None:
    """Undo the candidate's changes to the builtins, the modules the tests import and the import machinery;
    remove trace / profile functions (they could skip the tests' lines)."""
    missing = object()
    targets = [(builtins.__dict__, saved["builtins"])]
    for name, (module, attrs) in saved["modules"].items():
        sys.modules[name] = module
        targets.append((module.__dict__, attrs))
    for current, original in targets:
        for key, value in original.items():
            if current.get(key, missing) is not value:
                current[key] = value
    sys.meta_path[:] = saved["meta_path"]
    sys.path_hooks[:] = saved["path_hooks"]
    sys.settrace(None)
    sys.setprofile(None)
    threading = sys.modules.get("threading")
    if threading is not None:
        threading.settrace(None)
        threading.setprofile(None)


def _install_audit_hook(policy: dict) -> None:
    """Always: no new audit hooks (they cannot be removed), no scans of the heap (where the token lives).
    Where the kernel does not contain the run (``guard_files``, ``block_sockets``): defence-in-depth checks
    on files, /proc, other runs, signals, sockets, ctypes and starting programs."""
    work = os.path.realpath(os.getcwd())
    runs_prefix, own_run = policy.get("runs_prefix"), policy.get("own_run")
    pgid = os.getpgid(0)
    guard_files, block_sockets = policy["guard_files"], policy["block_sockets"]
    denied_always = {"gc.get_objects", "gc.get_referrers", "gc.get_referents"}

    def inside(path):
        try:
            p = os.path.realpath(os.fsdecode(path))
        except Exception:
            return False
        return p == work or p.startswith(work + os.sep)

    def other_run(path):
        if not runs_prefix:
            return False
        try:
            p = os.path.realpath(os.fsdecode(path))
        except Exception:
            return True
        return p.startswith(runs_prefix) and not (p == own_run or p.startswith(own_run + os.sep))

    def own_group(pid):
        try:
            return pid > 0 and os.getpgid(pid) == pgid
        except OSError:
            return False

    def hook(event, args):
        if event == "sys.addaudithook":
            raise RuntimeError("sandbox: no new audit hooks")   # RuntimeError: refused silently by CPython
        if event in denied_always:
            raise PermissionError(f"sandbox: {event} is disabled")
        if event == "socket.__new__" and block_sockets:
            raise PermissionError("sandbox: network access is disabled")
        if event in ("os.kill", "os.killpg"):
            pid = args[0]
            if event == "os.killpg" and pid != pgid or event == "os.kill" and pid != 0 and not own_group(pid):
                raise PermissionError("sandbox: signals only to processes of the sandbox")
        if not guard_files:
            return
        if event == "open":
            path, mode = args[0], args[1] or "r"
            if isinstance(path, int):
                return
            writes = any(c in str(mode) for c in "wax+") or (isinstance(args[2], int) and args[2] & 3)
            p = os.fsdecode(path)
            if (writes and not inside(path)) or (p.startswith("/proc/") and not p.startswith("/proc/self")) \
                    or other_run(path):
                raise PermissionError(f"sandbox: access to {p!r} denied")
        elif event in ("os.listdir", "os.scandir"):
            if args and args[0] is not None and not isinstance(args[0], int) and other_run(args[0]):
                raise PermissionError("sandbox: access to other runs denied")
        elif event in ("os.remove", "os.rmdir", "os.rename", "os.chmod", "os.chown", "shutil.rmtree",
                       "os.truncate", "os.mkdir", "os.symlink", "os.link", "os.mkfifo", "os.mknod"):
            if args and not isinstance(args[0], int) and not inside(args[0]):
                raise PermissionError(f"sandbox: {event} outside the working directory denied")
        elif event in ("ctypes.dlopen", "ctypes.dlsym"):
            raise PermissionError("sandbox: ctypes is disabled")
        elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn"):
            raise PermissionError("sandbox: starting other programs is disabled")

    sys.addaudithook(hook)


_harness()
