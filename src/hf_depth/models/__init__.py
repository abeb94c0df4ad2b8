"""All a checkpoint needs, in one flat folder (copied next to the weights for ``trust_remote_code``)."""

from .configuration_depth import DepthConfig
from .modeling_depth import DepthForCausalLM, DepthModel, DepthPreTrainedModel
from .registry import DESIGNS, MODEL_CLASSES
from .residual import Design

__all__ = ["DESIGNS", "MODEL_CLASSES", "Design", "DepthConfig", "DepthForCausalLM", "DepthModel",
           "DepthPreTrainedModel"]
