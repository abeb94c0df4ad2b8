"""Validation loss / perplexity: evaluate_loss against the model's own loss, and the val-loss command."""

import json
import math

import pytest
import torch
from helpers import tiny_model

from hf_depth.evaluation.perplexity import evaluate_loss, main, read_documents, token_blocks


def test_evaluate_loss_matches_model_loss_and_restores_mode():
    model = tiny_model("pre_ln").train()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, 97, (3, 12), generator=g) for _ in range(2)]
    out = evaluate_loss(model, batches)
    assert model.training
    model.eval()
    with torch.no_grad():   # equal-sized batches: the token-weighted mean is the mean of the per-batch losses
        ref = sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)
    assert out["loss"] == pytest.approx(ref, rel=1e-5)
    assert out["tokens"] == 2 * 3 * 11 and out["perplexity"] == pytest.approx(math.exp(ref), rel=1e-5)


def test_padding_is_ignored():
    model = tiny_model("pre_ln")
    ids = torch.randint(2, 97, (1, 10), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], 1).long()
    a = evaluate_loss(model, [ids])
    b = evaluate_loss(model, [{"input_ids": padded, "attention_mask": mask}])
    assert a["tokens"] == b["tokens"] == 9 and a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_val_loss_command(tmp_path, capsys):
    from eval_helpers import gpt2_tokenizer, tiny_hf_depth

    model_dir = tmp_path / "run" / "final"
    tiny_hf_depth().save_pretrained(model_dir)
    gpt2_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": f"Held-out document number {i}. " * 5}) + "\n" for i in range(6)))
    out = tmp_path / "val.json"
    assert main([str(tmp_path / "run"), "--data", str(data), "--seq-len", "32", "--batch-size", "2",
                 "--device", "cpu", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    tok = gpt2_tokenizer()
    blocks = token_blocks(tok, read_documents(data), 32, 2)
    assert res["tokens"] == sum(b.shape[0] * (b.shape[1] - 1) for b in blocks)
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]))
    assert "perplexity" in capsys.readouterr().out
    txt = tmp_path / "heldout.txt"
    txt.write_text("first paragraph\n\nsecond one\n")
    assert read_documents(txt) == ["first paragraph", "second one"]
    with pytest.raises(ValueError, match="--data"):
        read_documents(tmp_path / "x.csv")
