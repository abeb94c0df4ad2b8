import pytest

import hf_depth
from hf_depth.models.configuration_depth import default_intermediate_size


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(hidden_size=30, num_attention_heads=4), "hidden_size"),
        (dict(num_key_value_heads=3, num_attention_heads=4, hidden_size=32), "num_key_value_heads"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(num_hidden_layers=-1), "num_hidden_layers"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(attention_dropout=1.5), "attention_dropout"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(scale_vector="fancy"), "scale_vector"),
        (dict(scale_vector="standard+HG"), "scale_vector"),
        (dict(pad_token_id=10**9), "pad_token_id"),
        (dict(head_dim=7, hidden_size=28, num_attention_heads=4), "head_dim"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        hf_depth.config_for("pre_ln", **kwargs)


def test_unknown_design_lists_allowed():
    with pytest.raises(ValueError, match="`design` must be one of .*pre_ln"):
        hf_depth.config_for("resnet")


@pytest.mark.parametrize(
    "design, kwargs, field",
    [
        ("deepnorm", dict(deepnorm_norm="batch"), "deepnorm_norm"),
        ("deepnorm", dict(deepnorm_alpha=-1.0), "deepnorm_alpha"),
        ("keel", dict(keel_alpha=0), "keel_alpha"),
        ("block_attnres", dict(attnres_num_blocks=0), "attnres_num_blocks"),
        ("block_attnres", dict(attnres_reference_depth=2.5), "attnres_reference_depth"),
        ("hc", dict(hc_norm_eps=1.0), "hc_norm_eps"),
        ("mhc", dict(mhc_dynamic_tanh="yes"), "mhc_dynamic_tanh"),
        ("mhc", dict(mhc_sinkhorn_order="diagonal"), "mhc_sinkhorn_order"),
    ],
)
def test_design_fields_validated(design, kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        hf_depth.config_for(design, **kwargs)


def test_defaults_follow_depthbench():
    c = hf_depth.config_for("pre_ln")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (50280, 1024, 24, 16)
    assert c.intermediate_size == 2736 == default_intermediate_size(1024)
    assert c.num_key_value_heads == 16 and c.head_dim == 64 and c.rms_norm_eps == 1e-6
    assert c.eos_token_id == 50279 and c.pad_token_id == 1 and not c.tie_word_embeddings


def test_every_design_has_unique_model_type():
    types = [d.config_class.model_type for d in hf_depth.DESIGNS.values()]
    assert len(set(types)) == len(types) and all(t.startswith("hf_depth_") for t in types)
