"""Every ```python block of README.md and docs/**/*.md runs, so a stale claim fails CI (doctest-style).

Each block runs alone in a fresh interpreter (its own namespace), as a script file in an empty temporary folder
(the cwd), offline, with a time limit. A ```text block that follows a python block with only blank lines between is that block's
expected standard output, compared line by line (trailing spaces ignored). A block is skipped only when the line
right before its fence is ``<!-- no-run: REASON -->`` with a non-empty reason. Shell commands live in ```bash
blocks, which are not run. The README's designs table lists exactly the registered designs.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import hf_depth

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NO_RUN = re.compile(r"^<!--\s*no-run:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def blocks(path: pathlib.Path):
    """(first line number, language, code, expected output or None, skip reason or None) per fenced block."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(2):
            i += 1
            continue
        start, lang, indent = i, m.group(2), m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:j])
        skip = NO_RUN.match(lines[start - 1].strip()) if start else None
        out.append([start + 1, lang, code, None, skip.group(1).strip() if skip else None, j])
        i = j + 1
    for a, b in zip(out, out[1:]):  # python block, blank lines, text block = expected output
        if a[1] == "python" and b[1] == "text" and not any(s.strip() for s in lines[a[5] + 1:b[0] - 1]):
            a[3] = b[2]
    return [tuple(b[:5]) for b in out]


CASES = [(p, b) for p in PAGES for b in blocks(p) if b[1] == "python"]


def test_some_blocks_are_found():
    assert len(CASES) >= 5 and any(p.name == "README.md" for p, _ in CASES)


def test_every_skip_has_a_reason_and_a_python_block():
    for path in PAGES:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            m = NO_RUN.match(line.strip())
            if m or "no-run" in line:
                where = f"{path.relative_to(ROOT)}:{n + 1}"
                assert m, f"{where}: write the marker as <!-- no-run: reason -->"
                assert m.group(1).strip(), f"{where}: a no-run marker needs a reason"
                nxt = FENCE.match(lines[n + 1]) if n + 1 < len(lines) else None
                assert nxt and nxt.group(2) == "python", f"{where}: a no-run marker must sit right above a ```python fence"


@pytest.mark.parametrize("path,block", CASES, ids=[f"{p.relative_to(ROOT)}:{b[0]}" for p, b in CASES])
def test_python_block_runs(path, block, tmp_path):
    line, _, code, expected, skip = block
    if skip:
        pytest.skip(f"{path.name}:{line}: {skip}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DEPTH_CACHE": str(tmp_path / "cache"), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HF_DEPTH_KERNELS", None)  # the documented default
    script = tmp_path / "block.py"  # a file, as a user's script would be (classes defined in it have a module file)
    script.write_text(code)
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    where = f"{path.relative_to(ROOT)}:{line}"
    assert proc.returncode == 0, f"{where} failed:\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"
    if expected is not None:
        got = [s.rstrip() for s in proc.stdout.rstrip().splitlines()]
        assert got == [s.rstrip() for s in expected.rstrip().splitlines()], f"{where}: printed\n{proc.stdout}"


def test_readme_designs_table_lists_every_registered_design():
    part = (ROOT / "README.md").read_text().split("\n## Designs", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `(\w+)` \(`hf_depth_\w+`\)", part, re.M)
    assert sorted(names) == sorted(hf_depth.DESIGNS)
    for name in names:
        assert f"| `{name}` (`{hf_depth.DESIGNS[name].config_class.model_type}`)" in part
