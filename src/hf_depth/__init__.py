"""hf_depth: depth-scaling residual and normalization designs for decoder LLMs, in the Hugging Face ecosystem.

``import hf_depth`` registers every design with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM``
(no Triton import happens here; kernels load lazily on first use). ``hf_depth.PreLNForCausalLM`` and the other
design classes are the ones declared in ``hf_depth/models/design_<name>.py``.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .models import DESIGNS, MODEL_CLASSES, DepthConfig, DepthForCausalLM, DepthModel, DepthPreTrainedModel, Design
from .models.residual import register

__version__ = "0.1.0"


def register_design(design: Design) -> Design:
    """Add ``design`` at run time: the registry (``DESIGNS``, ``config_for``, ``model_for``, recipes, sweeps,
    diagnostics) and the Auto classes. The design's classes subclass :class:`DepthModel` /
    :class:`DepthForCausalLM`; for ``trust_remote_code`` checkpoints its file must sit in ``hf_depth/models``."""
    register(design)
    cfg = design.config_class
    AutoConfig.register(cfg.model_type, cfg, exist_ok=True)
    AutoModel.register(cfg, design.model_class, exist_ok=True)
    AutoModelForCausalLM.register(cfg, design.causal_lm_class, exist_ok=True)
    return design


for _design in list(DESIGNS.values()):
    register_design(_design)


def __getattr__(name: str):
    """``hf_depth.<Name>Config`` / ``<Name>Model`` / ``<Name>ForCausalLM`` of every registered design."""
    for design in DESIGNS.values():
        for cls in (design.config_class, design.model_class, design.causal_lm_class):
            if cls.__name__ == name:
                return cls
    raise AttributeError(f"module 'hf_depth' has no attribute {name!r}")


def config_for(design: str, **kwargs) -> DepthConfig:
    """Build the config of ``design`` (a registry name such as ``"pre_ln"`` or ``"hc"``)."""
    if design not in DESIGNS:
        raise ValueError(f"`design` must be one of {sorted(DESIGNS)}, got {design!r}")
    return DESIGNS[design].config_class(**kwargs)


def model_for(design: str, **kwargs) -> DepthForCausalLM:
    """Build a randomly initialized causal LM of ``design`` from config fields."""
    config = config_for(design, **kwargs)
    return MODEL_CLASSES[config.design][1](config)


from .upcycling import upcycle  # noqa: E402  (needs the registry above)

__all__ = [
    "upcycle", "DESIGNS", "MODEL_CLASSES", "Design", "DepthConfig", "DepthForCausalLM", "DepthModel", "DepthPreTrainedModel",
    "config_for", "model_for", "register_design", "__version__",
]
