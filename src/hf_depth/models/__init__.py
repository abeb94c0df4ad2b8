"""All a checkpoint needs, in one flat folder (copied next to the weights for ``trust_remote_code``)."""

from .configuration_depth import DepthConfig
from .modeling_depth import (
    MODEL_CLASSES,
    DepthForCausalLM,
    DepthModel,
    DepthPreTrainedModel,
)
from .registry import DESIGNS

__all__ = ["DESIGNS", "MODEL_CLASSES", "DepthConfig", "DepthForCausalLM", "DepthModel", "DepthPreTrainedModel"]
