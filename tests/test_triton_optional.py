"""Triton is optional: where it has no wheel (pyproject's marker installs it on Linux x86_64 / aarch64 only),
``import hf_depth`` and every module of the package work, every design builds, runs forward and backward on the PyTorch references with the
same numbers, and the kernel report says the kernels are unavailable and why.

"Triton missing" is simulated in a fresh interpreter by a meta-path finder placed first on ``sys.meta_path``
that reports ``triton`` and its submodules as not found (what Python does when the package is absent).
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import torch
from helpers import TINY, batch, tiny_model

import hf_depth
from hf_depth.models import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]

NO_TRITON = textwrap.dedent("""
    import importlib.abc, sys
    class NoTriton(importlib.abc.MetaPathFinder):
        asked = 0
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                NoTriton.asked += 1
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, NoTriton())
    try:
        import triton  # noqa: F401
        raise SystemExit("the finder did not hide triton")
    except ModuleNotFoundError:
        pass
""")

BODY = textwrap.dedent("""
    import importlib, json, pkgutil, torch
    import hf_depth
    from hf_depth.models import dispatch
    for m in pkgutil.walk_packages(hf_depth.__path__, "hf_depth."):  # every module imports (the CLI's too)
        if not m.name.startswith("hf_depth.kernels") and m.name != "hf_depth.evaluation._sandbox_harness":
            importlib.import_module(m.name)  # (the harness is a script run by the sandbox, not a module)
    TINY = json.loads(sys.argv[1])
    out = {}
    for design in sorted(hf_depth.DESIGNS):
        torch.manual_seed(0)
        model = hf_depth.model_for(design, **TINY).eval()
        x = torch.tensor(json.loads(sys.argv[2]))
        loss = model(x, labels=x).loss
        loss.backward()
        grad = sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None).sqrt()
        out[design] = [loss.item(), grad.item()]
    report = dispatch.kernel_report()
    import os
    os.environ["HF_DEPTH_KERNELS"] = "triton"
    try:
        model(x)
        forced = None
    except RuntimeError as e:
        forced = str(e)
    print(json.dumps({"runs": out, "report": report, "forced": forced, "asked": NoTriton.asked,
                      "triton_loaded": any(m == "triton" or m.startswith("triton.") for m in sys.modules)}))
""")


def _without_triton():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_DEPTH_KERNELS": "auto", "TRITON_INTERPRET": "1"}
    x, _ = batch()
    proc = subprocess.run([sys.executable, "-c", NO_TRITON + BODY, json.dumps(TINY), json.dumps(x.tolist())],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), x


def test_every_design_runs_on_the_references_without_triton(monkeypatch):
    got, x = _without_triton()
    assert sorted(got["runs"]) == sorted(hf_depth.DESIGNS)
    assert not got["triton_loaded"] and got["asked"] > 0  # something tried to import it, and went on without it

    monkeypatch.setenv("HF_DEPTH_KERNELS", "torch")
    for design, (loss, grad) in got["runs"].items():  # the same numbers as with Triton installed, references forced
        model = tiny_model(design)
        ref = model(x, labels=x).loss
        ref.backward()
        ref_grad = sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None).sqrt()
        assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item()), design
        assert abs(grad - ref_grad.item()) <= 1e-5 * ref_grad.item(), design

    report = got["report"]
    assert report["triton"] is None and "No module named 'triton'" in report["unavailable"]
    assert report["ops"].keys() == dispatch.kernel_report()["ops"].keys()
    assert all(o == {"kernel": False, "cuda": "reference", "cpu": "reference"} for o in report["ops"].values())
    assert "HF_DEPTH_KERNELS=triton" in got["forced"] and "No module named 'triton'" in got["forced"]


def test_kernel_report_with_triton(monkeypatch):
    """With Triton importable (the test environment), the report names its version and which ops have kernels;
    each mode maps to what ``dispatch.op`` actually does."""
    monkeypatch.setenv("HF_DEPTH_KERNELS", "auto")
    r = dispatch.kernel_report()
    if not dispatch._kernels():  # a platform without a Triton wheel: covered by the test above
        assert r["triton"] is None and r["unavailable"]
        return
    import hf_depth.kernels as K

    assert r["triton"] and r["unavailable"] is None
    assert {n for n, o in r["ops"].items() if o["kernel"]} == set(K.OPS)
    assert r["ops"]["rms_norm"] == {"kernel": True, "cuda": "triton", "cpu": "reference"}
    assert r["ops"]["moda_attention"] == {"kernel": False, "cuda": "reference", "cpu": "reference"}
    monkeypatch.setenv("HF_DEPTH_KERNELS", "torch")
    assert {o["cuda"] for o in dispatch.kernel_report()["ops"].values()} == {"reference"}
    monkeypatch.setenv("HF_DEPTH_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    r = dispatch.kernel_report()
    assert r["ops"]["rms_norm"]["cpu"] == "triton" and r["ops"]["moda_attention"]["cpu"] == "error"
    x = torch.randn(3, 8)  # the report's "triton" on CPU is what dispatch runs
    assert torch.allclose(dispatch.rms_norm(x, None, 1e-6), dispatch.REFERENCES["rms_norm"](x, None, 1e-6),
                          atol=1e-5)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dispatch.kernel_report()["ops"]["rms_norm"]["cpu"] == "error"


def test_hf_depth_kernels_cli():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "HF_DEPTH_KERNELS": "torch"}
    proc = subprocess.run([sys.executable, "-m", "hf_depth.cli", "kernels", "--json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["mode"] == "torch" and {o["cpu"] for o in r["ops"].values()} == {"reference"}
