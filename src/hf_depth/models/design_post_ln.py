"""Post-LN (the original Transformer).

    h <- N_l(h + F_l(h))            no norm in front of the branch; the norm sits on the residual path.

Extra parameters: none (the sublayer norm replaces the Pre-LN input norm). The post-add norm is an
Output-Norm for the IWD rule: its output is the residual stream itself, not the input of one linear map.
"""

from .configuration_depth import DepthConfig
from .modeling_depth import DepthForCausalLM, DepthModel
from .norms import make_norm, norm_param_count
from .residual import Design, SublayerConnection, register


class PostLNConfig(DepthConfig):
    """Post-LN decoder: ``h <- N(h + F(h))``. No fields beyond :class:`DepthConfig`."""

    model_type = "hf_depth_post_ln"
    design = "post_ln"


class PostLNConnection(SublayerConnection):
    def __init__(self, config, sublayer_idx):
        super().__init__(config, sublayer_idx)
        self.norm = make_norm(config, role="output")

    def write(self, state, out, carry=None):
        return self.norm(state + out)


class PostLNModel(DepthModel):  # Post-LN decoder (no LM head)
    config_class = PostLNConfig


class PostLNForCausalLM(DepthForCausalLM):  # Post-LN causal LM
    config_class, base_model_class = PostLNConfig, PostLNModel


DESIGN = register(Design(
    "post_ln",
    PostLNConfig,
    PostLNModel,
    PostLNForCausalLM,
    param_roles={},
    connection=PostLNConnection,
    input_norm=lambda config, s: None,
    # the post-add (Output-)norm replaces the input norm one for one (they differ only under HG/AP)
    extra_params=lambda config: config.num_sublayers * (norm_param_count(config, role="output") - norm_param_count(config)),
    summary="h <- N(h + F(h))",
    paper="Vaswani et al. 2017, Attention Is All You Need (arXiv 1706.03762)",
))
