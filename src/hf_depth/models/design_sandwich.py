"""Sandwich-LN / Peri-LN (DepthBench ``peri_norm``).

    h <- h + N_out,l(F_l(N_in,l(h)))    a norm at both the input and the output of every branch.

Extra parameters: +2d per block (the output norms, gamma_out = 1 at init; Output-Norms for IWD). PB-Relax
(CogView) is not used, as in DepthBench.
"""

from .configuration_depth import DepthConfig
from .modeling_depth import DepthForCausalLM, DepthModel
from .norms import make_norm, norm_param_count
from .olmo_rules import OlmoRules, norms_layer
from .residual import Design, SublayerConnection, register, rms_norm_saved_bytes


class SandwichLNConfig(DepthConfig):
    """Sandwich-LN decoder: ``h <- h + N_out(F(N_in(h)))``. No fields beyond :class:`DepthConfig`."""

    model_type = "hf_depth_sandwich_ln"
    design = "sandwich_ln"


class SandwichConnection(SublayerConnection):
    def __init__(self, config: SandwichLNConfig, sublayer_idx: int):
        super().__init__(config, sublayer_idx)
        self.output_norm = make_norm(config, role="output")

    def write(self, state, out, carry=None):
        return state + self.output_norm(out)


class SandwichLNModel(DepthModel):  # Sandwich-LN decoder (no LM head)
    config_class = SandwichLNConfig


class SandwichLNForCausalLM(DepthForCausalLM):  # Sandwich-LN causal LM
    config_class, base_model_class = SandwichLNConfig, SandwichLNModel


#: DepthBench ``peri_norm``: the input norms plus ``post_attention_norm`` / ``post_feed_forward_norm``
OLMO = OlmoRules("peri_norm", layer=norms_layer({"post_attention_norm": "attn_connection.output_norm",
                                                 "post_feed_forward_norm": "mlp_connection.output_norm"}))

DESIGN = register(Design(
    "sandwich_ln",
    SandwichLNConfig,
    SandwichLNModel,
    SandwichLNForCausalLM,
    param_roles={},
    connection=SandwichConnection,
    extra_params=lambda config: config.num_sublayers * norm_param_count(config, role="output"),
    olmo=OLMO,
    # the output norm of every sublayer saves what an RMSNorm of the branch output (compute dtype) saves
    extra_activation_bytes=lambda config, batch, seq_len, c: (
        config.num_sublayers * rms_norm_saved_bytes(config.hidden_size, c) * batch * seq_len),
    summary="h <- h + N_out(F(N_in(h)))",
    paper="Ding et al. 2021, CogView (arXiv 2105.13290); Kim et al. 2025, Peri-LN (arXiv 2502.02732)",
))
