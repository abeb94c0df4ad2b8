"""The helpers shared across subpackages (one implementation each): atomic writes, the masked next-token loss."""

import pytest
import torch
import torch.nn.functional as F

from hf_depth.utils import atomic_path, next_token_nll, write_text_atomic


def test_atomic_path_replaces_only_on_success(tmp_path):
    out = tmp_path / "run" / "export"
    out.mkdir(parents=True)
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(out) as tmp:
            tmp.mkdir()
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("killed mid-write")
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]  # the old folder, whole
    assert sorted(p.name for p in out.parent.iterdir()) == ["export"]  # no temporary left behind
    with atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]  # a folder is replaced as a whole
    f = write_text_atomic(tmp_path / "report.json", "{}")
    assert f.read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "run"]


def test_next_token_nll_counts_real_input_and_target_pairs():
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(2, 5, 11, generator=g), torch.randint(0, 11, (2, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    total, n = next_token_nll(logits, ids, mask)
    pairs = [(b, t) for b in range(2) for t in range(4) if mask[b, t] and mask[b, t + 1]]
    want = sum(float(F.cross_entropy(logits[b, t][None], ids[b, t + 1][None])) for b, t in pairs)
    assert n == len(pairs) == 5 and total == pytest.approx(want, rel=1e-6)
    total, n = next_token_nll(logits, ids)
    assert n == 8 and total == pytest.approx(float(F.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1),
                                                                   reduction="sum")), rel=1e-6)


def test_parse_set_items_reads_json_values_else_strings():
    """One ``--set`` parser for ``upcycle`` and ``convert-olmo-core``: ``1e-5`` is a float (YAML would read it
    as a string), ``null`` is None, a bare word stays a string, a malformed item is named."""
    import pytest

    from hf_depth.utils import parse_set_items

    got = parse_set_items(["rms_norm_eps=1e-5", "attnres_block_size=null", "hc_streams=2", "mhc_init=identity",
                           "flag=true", "empty="])
    assert got == {"rms_norm_eps": 1e-5, "attnres_block_size": None, "hc_streams": 2, "mhc_init": "identity",
                   "flag": True, "empty": ""}
    assert isinstance(got["rms_norm_eps"], float)
    for bad in ("hc_streams", "=2"):
        with pytest.raises(ValueError, match="FIELD=VALUE"):
            parse_set_items([bad])


def test_attention_carry_must_implement_attend():
    import pytest

    from hf_depth.models.residual import AttentionCarry

    class Incomplete(AttentionCarry):
        pass

    with pytest.raises(TypeError, match="attend"):
        Incomplete()
