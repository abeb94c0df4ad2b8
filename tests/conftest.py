import os

# Before anything imports triton / hits the Hub.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pathlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture
def shared_evals():
    p = SHARED / "data" / "evals"
    if not p.exists():
        pytest.skip("../shared/data/evals is not present")
    return p
