import pytest
import torch
from helpers import tiny_config

import hf_depth
from hf_depth import shapes

DEPTHBENCH_TABLE = {16: 1216, 20: 1120, 24: 1024, 26: 992, 28: 960, 30: 928, 32: 896, 42: 800, 70: 640}


def built_count(config) -> int:
    with torch.device("meta"):
        model = hf_depth.MODEL_CLASSES[config.design][1](config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("design", sorted(hf_depth.DESIGNS))
@pytest.mark.parametrize("extra", [{}, {"num_key_value_heads": 4}, {"attention_bias": True}, {"scale_vector": "none"},
                                   {"qkv_bias": True}, {"use_qk_norm": True, "attention_bias": True}])
def test_count_matches_built_model(design, extra):
    cfg = tiny_config(design, **extra)
    assert shapes.count_params(cfg) == built_count(cfg)


@pytest.mark.parametrize("design", sorted(hf_depth.DESIGNS))
def test_count_matches_at_depthbench_shape(design):
    cfg = shapes.make_config(design, 1024, 24)
    assert shapes.count_params(cfg) == built_count(cfg)


def test_depthbench_spectrum_reproduced():
    table = shapes.spectrum("pre_ln")
    assert {s.num_hidden_layers: s.hidden_size for s in table} == DEPTHBENCH_TABLE
    assert all(abs(s.deviation) <= shapes.DEPTHBENCH_TOLERANCE for s in table)
    by_l = {s.num_hidden_layers: s for s in table}
    assert by_l[24].params == 405_406_720  # 2Vd + L(4d^2 + 3 d d_ff + 2d) + d
    assert by_l[16].intermediate_size == 3248 and by_l[70].intermediate_size == 1712
    assert by_l[70].aspect_ratio == pytest.approx(9.14, abs=0.01)


def test_iso_width_refuses_impossible_tolerance():
    with pytest.raises(ValueError, match="no width within"):
        shapes.iso_width("pre_ln", 406e6, 20, tolerance=0.001)
    with pytest.raises(ValueError, match="`target`"):
        shapes.iso_width("pre_ln", -5, 20)


def test_table_prints(capsys):
    shapes.main(["--depths", "16", "70"])
    out = capsys.readouterr().out
    assert "| pre_ln | 16 | 1216 | 3248 |" in out and "| pre_ln | 70 | 640 | 1712 |" in out
