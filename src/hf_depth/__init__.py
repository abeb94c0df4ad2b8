"""hf_depth: depth-scaling residual and normalization designs for decoder LLMs, in the Hugging Face ecosystem.

``import hf_depth`` registers every design with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM``
(no Triton import happens here; kernels load lazily on first use).
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .models import DESIGNS, MODEL_CLASSES, DepthConfig, DepthForCausalLM, DepthModel, DepthPreTrainedModel

__version__ = "0.1.0"


def _register() -> None:
    for name, design in DESIGNS.items():
        cfg = design.config_class
        base, lm = MODEL_CLASSES[name]
        AutoConfig.register(cfg.model_type, cfg, exist_ok=True)
        AutoModel.register(cfg, base, exist_ok=True)
        AutoModelForCausalLM.register(cfg, lm, exist_ok=True)
        globals()[cfg.__name__], globals()[base.__name__], globals()[lm.__name__] = cfg, base, lm


_register()


def config_for(design: str, **kwargs) -> DepthConfig:
    """Build the config of ``design`` (a registry name such as ``"pre_ln"`` or ``"hc"``)."""
    if design not in DESIGNS:
        raise ValueError(f"`design` must be one of {sorted(DESIGNS)}, got {design!r}")
    return DESIGNS[design].config_class(**kwargs)


def model_for(design: str, **kwargs) -> DepthForCausalLM:
    """Build a randomly initialized causal LM of ``design`` from config fields."""
    config = config_for(design, **kwargs)
    return MODEL_CLASSES[config.design][1](config)


__all__ = [
    "DESIGNS", "MODEL_CLASSES", "DepthConfig", "DepthForCausalLM", "DepthModel", "DepthPreTrainedModel",
    "config_for", "model_for", "__version__",
]
