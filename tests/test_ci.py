""".ci/run runs the README's install and test commands, and a failed install fails CI.

The install line pipes pip's output through ``grep -v "is ignored"`` (``{ grep ... || true; }``: grep exits 1 when
it filters every line); only ``set -o pipefail`` keeps pip's own failure the pipeline's status. The dynamic test
runs .ci/run's own lines up to the install, with a fake ``python3`` whose venv's ``pip install -e`` fails.
"""

import os
import pathlib
import re
import shlex
import stat
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()
README = (ROOT / "README.md").read_text()


def _section_bash(heading: str) -> str:
    """The first ```bash block under the README heading that starts with ``heading``."""
    part = README.split("\n## " + heading, 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)\n```", part, re.S).group(1).strip()


def _ci_line(marker: str) -> str:
    lines = CI.splitlines()
    return lines[lines.index(marker) + 1]


def _code(line: str) -> str:
    return line.split("  #", 1)[0].strip()


def test_ci_runs_the_readme_commands():
    install = _code(_ci_line("# --- the README's install command ---"))
    pipe = ' 2>&1 | { grep -v "is ignored" || true; }'
    assert install.endswith(pipe), install
    quiet = [t for t in shlex.split(install[: -len(pipe)]) if t != "-q"]  # CI only adds -q and the filter
    assert quiet == shlex.split(_section_bash("Install")), "README's install command differs from .ci/run's"
    assert _code(_ci_line("# --- the README's test command ---")) == _section_bash("Test")


def test_ci_cannot_mask_a_failed_install():
    head = CI.split("# --- the README's install command ---", 1)[0]
    assert re.search(r"^set -[a-z]*e[a-z]*u?[a-z]*o pipefail$", head, re.M), "set -euo pipefail before the install"
    for line in CI.splitlines():  # the only `|| true` allowed is grep's, inside the filter group
        code = _code(line).replace('{ grep -v "is ignored" || true; }', "")
        assert not re.search(r"\|\|\s*(true|:)\b", code), line
        assert "set +e" not in code and "set +o pipefail" not in code, line


def _run_ci_install(tmp_path, pip_fails: bool) -> int:
    fake = tmp_path / "bin"
    fake.mkdir(parents=True)
    (fake / "python3").write_text(f"""#!/bin/sh
[ "$1 $2" = "-m venv" ] || exit 3
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'EOF'
#!/bin/sh
echo "something is ignored"
case "$*" in *"-e "*) exit {1 if pip_fails else 0};; esac
exit 0
EOF
chmod +x "$3/bin/pip"
""")
    (fake / "python3").chmod((fake / "python3").stat().st_mode | stat.S_IEXEC)
    lines = CI.splitlines()
    upto = lines.index("# --- the README's install command ---") + 2
    script = "\n".join(line for line in lines[:upto] if not line.startswith("cd "))
    work = tmp_path / "clone"
    work.mkdir()
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, timeout=60).returncode


def test_a_failed_install_fails_ci(tmp_path):
    assert _run_ci_install(tmp_path / "ok", pip_fails=False) == 0
    assert _run_ci_install(tmp_path / "fail", pip_fails=True) != 0


def test_license_and_triton_marker():
    """pyproject's license metadata points at the Apache-2.0 text, and Triton is required only where it has wheels
    (Linux x86_64 / aarch64; none for macOS or Windows), so the install works there and the references run."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "Hugging Face" not in text
    (triton,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "triton"]
    env = lambda system, machine: {"platform_system": system, "platform_machine": machine}
    assert triton.marker.evaluate(env("Linux", "x86_64")) and triton.marker.evaluate(env("Linux", "aarch64"))
    for system, machine in [("Darwin", "arm64"), ("Darwin", "x86_64"), ("Windows", "AMD64"), ("Linux", "ppc64le")]:
        assert not triton.marker.evaluate(env(system, machine)), (system, machine)
