"""DepthBench / OLMo-core checkpoints <-> hf_depth: every parameter of every DepthBench block type, exactly.

OLMo-core's own HF converter maps only the Llama keys; this package maps every key by the name rules each design
declares in its own file (``Design.olmo``, :mod:`hf_depth.models.olmo_rules`) and refuses a checkpoint with a key
it does not map or without one it needs. The key tables, the config fields set to match DepthBench's forward and
the values never guessed are in ``docs/olmo_core.md``.

* :mod:`.checkpoints`: reading checkpoints (.pt, .safetensors, DCP folders) and writing converted folders;
* :mod:`.infer`: which design and config a checkpoint is (block type, shapes, OLMo-core's config.json);
* :mod:`.mapping`: state dict <-> hf_depth model by the design's rules;
* :mod:`.cli`: ``hf-depth convert-olmo-core``.

    model = olmo_core_to_hf_depth(state_dict, "default", num_attention_heads=16, rope_theta=5e5, rms_norm_eps=1e-5)
    state_dict = hf_depth_to_olmo_core(model)   # the inverse
"""

from ..models.design_hc import HC_NAMES, HC_VERSION  # noqa: F401
from ..models.design_mhc import MHC_BACKEND_FIELDS, MHC_BACKENDS, MHC_NAMES  # noqa: F401
from ..models.design_mhc import detect_backend as _detect_backend  # noqa: F401
from ..models.olmo_rules import OlmoRules, Rule  # noqa: F401
from .checkpoints import _flatten, _load_dcp, load_state_dict, save_converted, strip_prefixes  # noqa: F401
from .checkpoints import strip_prefixes as _strip  # noqa: F401
from .cli import main  # noqa: F401
from .infer import (  # noqa: F401
    OLMO_CORE_NORM_EPS,
    REQUIRED,
    TOKENIZER,
    _design_name,
    _fields_of,
    _olmo_json_fields,
    block_types,
    build_config,
    convertible,
    infer_fields,
    missing_required,
    olmo_rules,
    refuse_to_guess,
)
from .mapping import (  # noqa: F401
    _options,
    _resolve_aliases,
    forward_fields,
    hf_depth_to_olmo_core,
    olmo_core_to_hf_depth,
    olmo_core_to_hf_state_dict,
    rules_for,
    source_record,
)


def __getattr__(name: str):
    """Tables computed from the registry when read (so a design registered at run time is in them)."""
    if name == "BLOCK_TYPES":
        return block_types()
    if name == "_FORWARD_FIELDS":
        return forward_fields()
    if name == "TABLES":
        return convertible()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
