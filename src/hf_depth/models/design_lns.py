"""LayerNorm-Scaling, LNS (DepthBench ``default_scaled``).

    h <- h + F_l(N_l(h) / sqrt(l))     l = 1..L, the 1-based *block* index (attention and FFN share it).

Extra parameters: none. The factor is a constant of the sublayer's position, kept as a Python float (not a
buffer) so a layer-swap diagnostic that moves branch weights leaves it in place. DepthBench LR 1e-2.
"""

import math
import re

from .configuration_depth import DepthConfig
from .modeling_depth import DepthForCausalLM, DepthModel
from .olmo_rules import OlmoRules
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


class LNSModel(DepthModel):  # LayerNorm-Scaling decoder (no LM head)
    config_class = LNSConfig


class LNSForCausalLM(DepthForCausalLM):  # LayerNorm-Scaling causal LM
    config_class, base_model_class = LNSConfig, LNSModel


_LN_SCALE = re.compile(r"^blocks\.(\d+)\.ln_scale$")


def fold_ln_scale(sd: dict) -> tuple[dict, list[str]]:
    """Older DepthBench saves LNS's 1/sqrt(i+1) as a buffer ``blocks.i.ln_scale``: hf_depth keeps it a constant, so
    the buffer is checked (an inconsistency when it is not 1/sqrt(i+1)) and not stored."""
    out, bad = {}, []
    for k, v in sd.items():
        m = _LN_SCALE.match(k)
        if m is None:
            out[k] = v
            continue
        want = 1.0 / math.sqrt(int(m.group(1)) + 1)
        if v.numel() != 1 or abs(float(v) - want) > 1e-6:
            bad.append(f"{k}={v.flatten()[:1].tolist()} (LNS expects 1/sqrt({int(m.group(1)) + 1})={want:.6f})")
    return out, bad


#: DepthBench's ``default_scaled`` block: Pre-LN keys, the scale buffer folded
OLMO = OlmoRules("default_scaled", fold=fold_ln_scale)

DESIGN = register(Design(
    "lns",
    LNSConfig,
    LNSModel,
    LNSForCausalLM,
    param_roles={},
    lr=1e-2,  # DepthBench
    sweep_lrs=DEPTHBENCH_LRS + (1e-2, 2e-2),
    connection=LNSConnection,
    olmo=OLMO,
    summary="h <- h + F(N(h) / sqrt(l))",
    paper="Sun et al. 2025, The Curse of Depth in Large Language Models (arXiv 2502.05795)",
))
