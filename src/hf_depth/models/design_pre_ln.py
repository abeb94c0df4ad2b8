"""Pre-LN (the baseline; identical to Llama).

    h <- h + F_l(N_l(h))            for every sublayer l, then a final N before the LM head.

Extra parameters: none. DepthBench LR 2e-3. Equal to ``transformers.LlamaForCausalLM`` with the same weights.
"""

from .configuration_depth import DepthConfig
from .modeling_depth import DepthForCausalLM, DepthModel
from .olmo_rules import OlmoRules
from .residual import Design, register, upcycle_exact


class PreLNConfig(DepthConfig):
    """Pre-LN decoder (Llama): ``h <- h + F(N(h))``. No fields beyond :class:`DepthConfig`."""

    model_type = "hf_depth_pre_ln"
    design = "pre_ln"


class PreLNModel(DepthModel):  # Pre-LN decoder (no LM head)
    config_class = PreLNConfig


class PreLNForCausalLM(DepthForCausalLM):  # Pre-LN causal LM
    config_class, base_model_class = PreLNConfig, PreLNModel


#: DepthBench's ``default`` block: the Llama keys and the two input norms (``docs/olmo_core.md``)
OLMO = OlmoRules("default")

DESIGN = register(Design(
    "pre_ln",
    PreLNConfig,
    PreLNModel,
    PreLNForCausalLM,
    param_roles={},
    olmo=OLMO,
    upcycle_closeness=upcycle_exact,
    summary="h <- h + F(N(h))",
    paper="Xiong et al. 2020, On Layer Normalization in the Transformer Architecture (arXiv 2002.04745)",
))
