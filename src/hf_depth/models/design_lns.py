"""LayerNorm-Scaling, LNS (DepthBench ``default_scaled``).

    h <- h + F_l(N_l(h) / sqrt(l))     l = 1..L, the 1-based *block* index (attention and FFN share it).

Extra parameters: none. The factor is a constant of the sublayer's position, kept as a Python float (not a
buffer) so a layer-swap diagnostic that moves branch weights leaves it in place. DepthBench LR 1e-2.
"""

import math

from .configuration_depth import DepthConfig
from .modeling_depth import DepthForCausalLM, DepthModel
from .residual import DEPTHBENCH_LRS, Design, SublayerConnection, register


class LNSConfig(DepthConfig):
    """LayerNorm-Scaling decoder: ``h <- h + F(N(h) / sqrt(block index))``."""

    model_type = "hf_depth_lns"
    design = "lns"


class LNSConnection(SublayerConnection):
    position_scalars = ("scale",)  # DepthBench's block swap moves ``ln_scale`` with the weights

    def __init__(self, config, sublayer_idx):
        super().__init__(config, sublayer_idx)
        self.scale = 1.0 / math.sqrt(sublayer_idx // 2 + 1)

    def read(self, state, norm):
        return norm(state) * self.scale, None

    def extra_repr(self):
        return f"scale={self.scale:.4f}"


class LNSModel(DepthModel):
    """LayerNorm-Scaling decoder (no LM head)."""

    config_class = LNSConfig


class LNSForCausalLM(DepthForCausalLM):
    """LayerNorm-Scaling causal LM."""

    config_class = LNSConfig
    base_model_class = LNSModel


DESIGN = register(Design(
    "lns",
    LNSConfig,
    LNSModel,
    LNSForCausalLM,
    param_roles={},
    lr=1e-2,  # DepthBench
    sweep_lrs=DEPTHBENCH_LRS + (1e-2, 2e-2),
    connection=LNSConnection,
    summary="h <- h + F(N(h) / sqrt(l))",
    paper="Sun et al. 2025, The Curse of Depth in Large Language Models (arXiv 2502.05795)",
))
