"""Sandwich-LN / Peri-LN (DepthBench ``peri_norm``).

    h <- h + N_out,l(F_l(N_in,l(h)))    a norm at both the input and the output of every branch.

Extra parameters: +2d per block (the output norms, gamma_out = 1 at init; Output-Norms for IWD). PB-Relax
(CogView) is not used, as in DepthBench.
"""

from .configuration_depth import DepthConfig
from .modeling_depth import DepthForCausalLM, DepthModel
from .norms import make_norm, norm_param_count
from .residual import Design, SublayerConnection, register


class SandwichLNConfig(DepthConfig):
    """Sandwich-LN decoder: ``h <- h + N_out(F(N_in(h)))``. No fields beyond :class:`DepthConfig`."""

    model_type = "hf_depth_sandwich_ln"
    design = "sandwich_ln"


class SandwichConnection(SublayerConnection):
    def __init__(self, config, sublayer_idx):
        super().__init__(config, sublayer_idx)
        self.output_norm = make_norm(config, role="output")

    def write(self, state, out, carry=None):
        return state + self.output_norm(out)


class SandwichLNModel(DepthModel):
    """Sandwich-LN decoder (no LM head)."""

    config_class = SandwichLNConfig


class SandwichLNForCausalLM(DepthForCausalLM):
    """Sandwich-LN causal LM."""

    config_class = SandwichLNConfig
    base_model_class = SandwichLNModel


DESIGN = register(Design(
    "sandwich_ln",
    SandwichLNConfig,
    SandwichLNModel,
    SandwichLNForCausalLM,
    param_roles={},
    connection=SandwichConnection,
    extra_params=lambda config: config.num_sublayers * norm_param_count(config, role="output"),
    summary="h <- h + N_out(F(N_in(h)))",
    paper="Ding et al. 2021, CogView (arXiv 2105.13290); Kim et al. 2025, Peri-LN (arXiv 2502.02732)",
))
