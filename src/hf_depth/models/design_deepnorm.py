"""DeepNorm (DepthBench ``deepnorm``), Post-LN with an up-weighted residual and a down-scaled init.

    h <- LN_l(alpha * h + F_l(h)),      alpha = (2L)^(1/4)           (decoder-only constants of DeepNet)
    init: W_v, W_o and the three SwiGLU matrices scaled by beta = (8L)^(-1/4)   (DepthBench applies it to
          w1, w2, w3; torchscale to fc1, fc2, v, o). q and k are untouched.

The norm is a LayerNorm by default, as in DeepNet and DepthBench; ``deepnorm_norm="rms"`` selects RMSNorm.
Extra parameters: the LayerNorm biases (d per sublayer), none with ``deepnorm_norm_bias=False`` (DepthBench's
LayerNorm has no bias; ``convert-olmo-core`` sets it for its checkpoints). DepthBench's swept LR: 1e-3.
"""

from .configuration_depth import DepthConfig, _choice, field_alias
from .modeling_depth import DepthForCausalLM, DepthModel
from .norms import make_norm, norm_param_count
from .olmo_rules import OlmoRules, norms_layer
from .residual import Design, SublayerConnection, register, rms_norm_saved_bytes

_BETA_SCALED = ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class DeepNormConfig(DepthConfig):
    """DeepNorm decoder.

    Args:
        deepnorm_norm: ``"layer"`` (default, DepthBench / DeepNet) or ``"rms"``.
        deepnorm_alpha: residual multiplier; ``None`` means (2L)^(1/4).
        deepnorm_beta: init multiplier of W_v, W_o and the FFN; ``None`` means (8L)^(-1/4).
        deepnorm_final_norm: kind of the final norm before the LM head, ``"layer"`` or ``"rms"``; ``None`` (default)
            means ``deepnorm_norm``. DepthBench's DeepNorm switches only the block norms to LayerNorm: its final
            norm is RMSNorm (``"rms"``, what ``convert-olmo-core`` sets for its checkpoints).
        deepnorm_norm_bias: whether the LayerNorms carry a bias (default ``True``, DeepNet); ``False`` follows
            DepthBench, whose LayerNorm is bias-free.
    """

    model_type = "hf_depth_deepnorm"
    design = "deepnorm"

    deepnorm_norm: str = "layer"
    deepnorm_alpha: float | None = None
    deepnorm_beta: float | None = None
    deepnorm_final_norm: str | None = None
    deepnorm_norm_bias: bool = True

    def validate_design(self):
        if not isinstance(self.deepnorm_norm_bias, bool):
            raise ValueError(f"`deepnorm_norm_bias` must be true or false, got {self.deepnorm_norm_bias!r}")
        _choice("deepnorm_norm", self.deepnorm_norm, ("layer", "rms"))
        _choice("deepnorm_final_norm", self.deepnorm_final_norm, (None, "layer", "rms"))
        for name in ("deepnorm_alpha", "deepnorm_beta"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"`{name}` must be None (paper value) or a positive number, got {v!r}")

    norm_kind = field_alias("deepnorm_norm")
    norm_bias = field_alias("deepnorm_norm_bias")

    @property
    def final_norm_kind(self) -> str:
        return self.deepnorm_final_norm or self.deepnorm_norm

    @property
    def alpha(self) -> float:
        return self.deepnorm_alpha if self.deepnorm_alpha is not None else (2 * self.num_hidden_layers) ** 0.25

    @property
    def beta(self) -> float:
        return self.deepnorm_beta if self.deepnorm_beta is not None else (8 * self.num_hidden_layers) ** -0.25


class DeepNormConnection(SublayerConnection):
    def __init__(self, config, sublayer_idx):
        super().__init__(config, sublayer_idx)
        self.alpha = config.alpha
        self.norm = make_norm(config, role="output")

    def write(self, state, out, carry=None):
        return self.norm(self.alpha * state + out)

    def extra_repr(self):
        return f"alpha={self.alpha:.4f}"


def deepnorm_init_scale(config, layer_idx, name):
    return config.beta if name.split(".")[-1] in _BETA_SCALED else 1.0


class DeepNormModel(DepthModel):  # DeepNorm decoder (no LM head)
    config_class = DeepNormConfig


class DeepNormForCausalLM(DepthForCausalLM):  # DeepNorm causal LM
    config_class, base_model_class = DeepNormConfig, DeepNormModel


#: DepthBench's DeepNorm block re-uses the input-norm modules as the post-add norms (``LN(alpha x + F(x))``; a block
#: LayerNorm saved without bias gets a zero bias, the same function). ``examples/pretrain_deepnorm.py`` switches
#: only the block norms to LayerNorm: without ``lm_head.norm.bias`` the final norm is an RMSNorm.
OLMO = OlmoRules("deepnorm", layer=norms_layer({"attention_norm": "attn_connection.norm",
                                                "feed_forward_norm": "mlp_connection.norm"}, inputs=False,
                                               layer_norm=lambda config: config.norm_kind == "layer" and config.norm_bias),
                 forward_fields=("deepnorm_final_norm",),
                 defaults=lambda sd, backend: {"deepnorm_final_norm": "layer" if "lm_head.norm.bias" in sd else "rms"})
def deepnorm_extra_activation_bytes(config, batch: int, seq_len: int, compute_bytes: int) -> int:
    """A LayerNorm saves its fp32 input, mean and 1/std (``(d + 2) 4`` bytes per token) where an RMSNorm saves
    ``rms_norm_saved_bytes``: the 2L post-add norms of ``deepnorm_norm`` kind and the final one of
    ``final_norm_kind`` (as many norms as Pre-LN's 2L input norms + final norm)."""
    d = config.hidden_size
    layer_norms = config.num_sublayers * (config.norm_kind == "layer") + (config.final_norm_kind == "layer")
    return layer_norms * ((d + 2) * 4 - rms_norm_saved_bytes(d)) * batch * seq_len


DESIGN = register(Design(
    "deepnorm",
    DeepNormConfig,
    DeepNormModel,
    DeepNormForCausalLM,
    param_roles={},
    lr=1e-3,  # DepthBench's swept best
    connection=DeepNormConnection,
    input_norm=lambda config, s: None,
    init_scale=deepnorm_init_scale,
    # 2L post-add Output-Norms of `deepnorm_norm` kind in place of Pre-LN's input RMSNorms; the final norm of
    # `final_norm_kind`
    extra_params=lambda config: (
        config.num_sublayers * (norm_param_count(config, role="output") - norm_param_count(config, kind="rms"))
        + norm_param_count(config, kind=config.final_norm_kind, final=True)
        - norm_param_count(config, kind="rms", final=True)
    ),
    olmo=OLMO,
    extra_activation_bytes=deepnorm_extra_activation_bytes,
    summary="h <- LN(alpha h + F(h)), alpha=(2L)^(1/4), init beta=(8L)^(-1/4)",
    paper="Wang et al. 2022, DeepNet: Scaling Transformers to 1,000 Layers (arXiv 2203.00555)",
))
