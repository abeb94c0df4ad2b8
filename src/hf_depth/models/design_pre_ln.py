"""Pre-LN (the baseline; identical to Llama).

    h <- h + F_l(N_l(h))            for every sublayer l, then a final N before the LM head.

Extra parameters: none. DepthBench LR 2e-3. Equal to ``transformers.LlamaForCausalLM`` with the same weights.
"""

from .configuration_depth import DepthConfig
from .residual import Design


class PreLNConfig(DepthConfig):
    """Pre-LN decoder (Llama): ``h <- h + F(N(h))``. No fields beyond :class:`DepthConfig`."""

    model_type = "hf_depth_pre_ln"
    design = "pre_ln"


DESIGN = Design(
    "pre_ln",
    PreLNConfig,
    summary="h <- h + F(N(h))",
    paper="Xiong et al. 2020, On Layer Normalization in the Transformer Architecture (arXiv 2002.04745)",
)
