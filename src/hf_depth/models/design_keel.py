"""KEEL (DepthBench ``keel``): Post-LN with a Pre-LN branch and a large residual weight.

    h <- N_post,l(alpha * h + F_l(N_pre,l(h))),   alpha = 2L (the number of sublayers), for l >= 2;
    sublayer 0 (block 0's attention) is plain Pre-LN:   h <- h + F_0(N_pre,0(h))   (no post norm);
    sublayer 1 (block 0's FFN) is Post-LN without alpha: h <- N_post,1(h + F_1(N_pre,1(h))).

With alpha = 2L the branch is ~1/(2L) of the pre-norm sum, a few bf16 ulps: the add and the post norm run
in fp32. Extra parameters: (2L - 1) d post-norm scales (Output-Norms for IWD).
"""


import torch

from .configuration_depth import DepthConfig
from .modeling_depth import DepthForCausalLM, DepthModel
from .norms import make_norm, norm_param_count
from .olmo_rules import OlmoRules, norms_layer
from .residual import Design, SublayerConnection, register, rms_norm_saved_bytes


class KeelConfig(DepthConfig):
    """KEEL decoder.

    Args:
        keel_alpha: residual multiplier; ``None`` means 2L (the number of sublayers, as the paper's alpha = L
            counts attention and FFN separately).
    """

    model_type = "hf_depth_keel"
    design = "keel"

    keel_alpha: float | None = None

    def validate_design(self):
        v = self.keel_alpha
        if v is not None and (not isinstance(v, (int, float)) or v <= 0):
            raise ValueError(f"`keel_alpha` must be None (2L) or a positive number, got {v!r}")

    @property
    def alpha(self) -> float:
        return float(self.keel_alpha) if self.keel_alpha is not None else float(2 * self.num_hidden_layers)


class KeelConnection(SublayerConnection):
    def __init__(self, config, sublayer_idx):
        super().__init__(config, sublayer_idx)
        self.alpha = 1.0 if sublayer_idx < 2 else config.alpha
        self.post_norm = make_norm(config, role="output") if sublayer_idx > 0 else None

    def write(self, state, out, carry=None):
        if self.post_norm is None:
            return state + out
        acc = torch.promote_types(state.dtype, torch.float32)  # >= fp32: the branch is ~1/alpha of the sum
        mixed = self.alpha * state.to(acc) + out.to(acc)
        return self.post_norm(mixed).to(state.dtype)

    def extra_repr(self):
        return f"alpha={self.alpha:g}"


class KeelModel(DepthModel):  # KEEL decoder (no LM head)
    config_class = KeelConfig


class KeelForCausalLM(DepthForCausalLM):  # KEEL causal LM
    config_class, base_model_class = KeelConfig, KeelModel


#: DepthBench ``keel``: the input norms plus the post norms (block 0 has no post-attention norm, as here)
OLMO = OlmoRules("keel", layer=norms_layer({"post_attention_norm": "attn_connection.post_norm",
                                            "post_feed_forward_norm": "mlp_connection.post_norm"},
                                           absent=lambda i, olmo: i == 0 and olmo == "post_attention_norm"))

DESIGN = register(Design(
    "keel",
    KeelConfig,
    KeelModel,
    KeelForCausalLM,
    param_roles={},
    connection=KeelConnection,
    extra_params=lambda config: (config.num_sublayers - 1) * norm_param_count(config, role="output"),
    olmo=OLMO,
    # the post-norm of every sublayer but the first, on the fp32 residual alpha x + F(x)
    extra_activation_bytes=lambda config, batch, seq_len, c: (
        (config.num_sublayers - 1) * rms_norm_saved_bytes(config.hidden_size) * batch * seq_len),
    summary="h <- N_post(alpha h + F(N_pre(h))), alpha = 2L",
    paper="Chen & Wei 2026, Post-LayerNorm Is Back: Stable, ExpressivE, and Deep (arXiv 2601.19895)",
))
