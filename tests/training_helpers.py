"""Shared fixtures of the training tests: a local json corpus and a tiny recipe that trains in seconds."""

import json
import random

WORDS = ("the model reads the residual stream and writes its update back into the stream while the norm keeps "
         "every branch input at unit scale so that depth can grow without the signal exploding or vanishing").split()


def write_corpus(folder, n_docs=240, seed=0, files=2):
    """``files`` json-lines files of short pseudo-sentences (a local stand-in for FineWeb-Edu)."""
    rng = random.Random(seed)
    paths, doc_id = [], 0
    for f in range(files):
        path = folder / f"corpus_{f}.jsonl"
        with open(path, "w") as fh:
            for _ in range(n_docs // files):
                start = rng.randrange(len(WORDS))
                n = rng.randrange(8, 60)
                text = " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n)) + f". doc {doc_id}"
                fh.write(json.dumps({"text": text, "id": doc_id}) + "\n")
                doc_id += 1
        paths.append(str(path))
    return paths


def tiny_recipe(tmp_path, files, **sections):
    """A recipe dict: hidden 32, 2 layers, seq 32, a 300-token BPE, the local json corpus."""
    d = {
        "name": "tiny",
        "run_dir": str(tmp_path / "runs" / "{name}"),
        "model": {"design": "pre_ln", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "max_position_embeddings": 64},
        "data": {"source": "hf", "path": "json", "data_files": files, "tokenizer": "embedded",
                 "tokenizer_vocab_size": 300, "seq_len": 32, "val_docs": 30, "val_sequences": 8},
        "optim": {"lr": 5e-3},
        "train": {"max_steps": 12, "micro_batch_size": 4, "eval_every": 6, "save_every": 4, "log_every": 2,
                  "progress": False},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            d[section] = {**d.get(section, {}), **values}
        else:
            d[section] = values
    return d


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def hf_depth_cache(tmp_path_factory, monkeypatch):
    """One tokenizer cache per test session (the embedded BPE is trained once, not per test)."""
    monkeypatch.setenv("HF_DEPTH_CACHE", str(tmp_path_factory.getbasetemp() / "hf_depth_cache"))
    # tiny matmuls on a shared 2-core machine: one thread avoids oversubscription stalls (80x seen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
