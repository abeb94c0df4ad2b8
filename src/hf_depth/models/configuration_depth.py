"""Configuration shared by every hf_depth design.

One decoder (RoPE, RMSNorm eps 1e-6, SwiGLU with d_ff = ceil16(8d/3), untied embeddings, optional GQA)
whose only varying part is how each sublayer reads from and writes to the residual stream. Every design
subclasses :class:`DepthConfig` with its own ``model_type`` and fields, and validates them in
``validate_design``. Every bad value raises a ``ValueError`` naming the field and what is allowed, when the
config is built, not as a shape error deep in a forward pass.

This file is copied next to the weights by ``save_pretrained`` (``trust_remote_code``): it imports only
torch/transformers and siblings of this folder.
"""

from __future__ import annotations

import difflib
import functools
import math
import sys
import types
import typing
import warnings

from transformers import PretrainedConfig

SCALE_VECTORS = ("standard", "none", "HG", "AP", "DP", "DNP", "OR", "ER")
"""Components of ``scale_vector``; combine with ``+`` (e.g. ``"HG+DNP+OR"``). See ``norms.py``."""

SCALE_VECTOR_PRESETS = {"best": "HG+DNP+OR"}

ATTENTION_BACKENDS: dict[str, tuple[str, ...]] = {"moda": ("eager", "sdpa")}
"""Attention implementations a design's math supports, by design name (absent: whatever transformers allows).
MoDA's softmax spans the sequence K/V and the same-token depth K/V, which needs an explicit 4-D mask."""

UPPER_BOUNDS: dict[str, tuple[str, typing.Callable]] = {
    "attnres_block_size": ("2 * num_hidden_layers (the number of sublayers)", lambda c: 2 * c.num_hidden_layers),
}
"""Cross-field upper bounds ``{field: (description, bound(config))}``, checked for every design holding the field."""

DEPTHBENCH_EOS = 50279
"""The default ``eos_token_id`` (GPT-NeoX ``<|endoftext|>``, DepthBench's tokenizer)."""

TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
"""Special-token ids: each ``None`` or inside ``[0, vocab_size)`` (``eos_token_id`` may be a list of such ids)."""


class DefaultTokenId(int):
    """A token-id *default* (not a value the caller gave): it is kept when the vocabulary holds it and becomes
    ``None`` when it does not (a tiny vocabulary has no id 50279). An id given explicitly -- a keyword argument, a
    ``config.json`` value -- is never adjusted: outside the vocabulary it is refused."""

    def __repr__(self) -> str:
        return int.__repr__(self)


def ceil16(x: float) -> int:
    """Round up to a multiple of 16 (DepthBench's FFN width rule)."""
    return int(16 * math.ceil(x / 16))


def default_intermediate_size(hidden_size: int) -> int:
    """SwiGLU width d_ff = ceil16(8d/3)."""
    return ceil16(8 * hidden_size / 3)


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a finite number", bool: "True or False", str: "a string",
            type(None): "None"}.get(tp, "a list of integers" if origin is list else getattr(tp, "__name__", str(tp)))


def _type_ok(value, tp) -> bool | None:
    """Whether ``value`` fits the annotation ``tp``; ``None`` when the annotation is not checked here."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        results = [_type_ok(value, a) for a in typing.get_args(tp)]
        return True if any(results) else (None if None in results else False)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # bool is an int to Python, not a number here; NaN and inf are never valid
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        (arg,) = typing.get_args(tp) or (None,)
        return isinstance(value, (list, tuple)) and (arg is None or all(_type_ok(v, arg) for v in value))
    return None


@functools.cache
def depth_fields(cls) -> dict:
    """``{name: annotation}`` of the fields declared by ``DepthConfig`` and its subclasses up to ``cls``
    (not transformers' own): the table every value is type-checked against, new fields included."""
    fields = {}
    for klass in reversed(cls.__mro__):
        if isinstance(klass, type) and issubclass(klass, DepthConfig):
            module = vars(sys.modules[klass.__module__])
            for name, ann in klass.__dict__.get("__annotations__", {}).items():
                if not name.startswith("_"):
                    try:
                        fields[name] = eval(ann, module) if isinstance(ann, str) else ann  # noqa: S307 (own source)
                    except Exception:  # an annotation we cannot resolve is not type-checked
                        fields[name] = typing.Any
    return fields


@functools.cache
def transformers_names() -> frozenset:
    """Attribute and keyword names transformers itself gives every config (never flagged as typos)."""
    import dataclasses

    names = set(dir(PretrainedConfig)) | {f.name for f in dataclasses.fields(PretrainedConfig)}
    names |= {"torch_dtype", "num_labels", "name_or_path", "attn_implementation", "experts_implementation",
              "output_attentions", "per_layer_config", "rope_scaling", "rope_parameters", "model_type",
              "transformers_version", "auto_map", "architectures", "layer_types", "use_return_dict"}
    try:
        from transformers import GenerationConfig

        names |= set(GenerationConfig._get_default_generation_params())
    except (ImportError, AttributeError):
        pass
    return frozenset(names)


def _all_design_fields() -> dict[str, str]:
    """Field name -> model_type of a design that declares it (every design loaded so far)."""
    out, todo = {}, [DepthConfig]
    while todo:
        klass = todo.pop()
        todo += klass.__subclasses__()
        for name in klass.__dict__.get("__annotations__", {}):
            out.setdefault(name, getattr(klass, "design", klass.__name__))
    return out


def field_alias(field: str) -> property:
    """A read-only property that reads config field ``field``: the shared name a design's own field goes by (HC's
    ``hc_streams`` is the ``num_streams`` that the multi-stream code reads)."""
    return property(lambda self: getattr(self, field), doc=f"``{field}``")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}")


def _non_negative(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative number, got {value!r}")


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {list(allowed)}, got {value!r}")


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}")


def _eps(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1:
        raise ValueError(f"`{name}` must be a number in (0, 1), got {value!r}")


def check_fields(config, ints=(), flags=(), non_negative=(), eps=(), choices=None) -> None:
    """A config's field checks, by kind: positive ints, booleans, non-negative numbers, norm eps
    in (0, 1), and ``choices`` ``{field: allowed}``."""
    for check, names in ((_positive_int, ints), (_flag, flags), (_non_negative, non_negative), (_eps, eps)):
        for name in names:
            check(name, getattr(config, name))
    for name, allowed in (choices or {}).items():
        _choice(name, getattr(config, name), allowed)


def parse_scale_vector(value: str) -> tuple[str, ...]:
    """Split ``"HG+DNP+OR"`` into its components and check them (raises ValueError naming the field)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"`scale_vector` must be a string such as 'standard' or 'HG+DNP+OR', got {value!r}")
    value = SCALE_VECTOR_PRESETS.get(value, value)
    parts = tuple(p.strip() for p in value.split("+"))
    for p in parts:
        if p not in SCALE_VECTORS:
            raise ValueError(
                f"`scale_vector` component {p!r} is unknown; allowed components are {list(SCALE_VECTORS)} "
                f"(joined with '+') or a preset in {list(SCALE_VECTOR_PRESETS)}"
            )
    if len(set(parts)) != len(parts):
        raise ValueError(f"`scale_vector` repeats a component: {value!r}")
    if len(parts) > 1 and ({"standard", "none"} & set(parts)):
        raise ValueError(f"`scale_vector` 'standard' and 'none' cannot be combined with other components: {value!r}")
    placements = [p for p in parts if p in ("AP", "DP", "DNP")]
    if len(placements) > 1:
        raise ValueError(f"`scale_vector` takes at most one placement of AP/DP/DNP, got {placements}")
    reparams = [p for p in parts if p in ("OR", "ER")]
    if len(reparams) > 1:
        raise ValueError(f"`scale_vector` takes at most one reparameterization of OR/ER, got {reparams}")
    return parts


class DepthConfig(PretrainedConfig):
    r"""Base configuration of every hf_depth design (the shared LLaMA-like decoder).

    Args:
        vocab_size: vocabulary size (DepthBench: 50280, the GPT-NeoX/OLMo tokenizer).
        hidden_size: model width d.
        intermediate_size: SwiGLU width; ``None`` means ceil16(8d/3).
        num_hidden_layers: number of decoder blocks L (each has an attention and an FFN sublayer).
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA); ``None`` means equal to the query heads (MHA).
        head_dim: per-head width; ``None`` means hidden_size // num_attention_heads.
        max_position_embeddings: longest sequence the RoPE tables are sized for (RoPE itself extrapolates).
        rope_theta: RoPE base.
        rope_scaling_factor: linear RoPE scaling (transformers' ``rope_type="linear"``): the inverse frequencies
            divided by this factor, i.e. positions compressed by it; 1.0 (default) is plain RoPE.
        rms_norm_eps: epsilon of every RMSNorm (1e-6 as DepthBench).
        initializer_range: std of the truncated-normal init of linear and embedding weights.
        init_cutoff_factor: truncation of that init, in stds (DepthBench: 3).
        scale_vector: the RMSNorm scale-vector variant, ``standard`` (Llama), ``none`` or a ``+``-joined
            combination of HG, AP/DP/DNP, OR/ER (see ``norms.py``); ``best`` = ``HG+DNP+OR``.
        attention_bias: biases on q/k/v/o (DepthBench: False; Llama's ``attention_bias``).
        qkv_bias: biases on q/k/v only, none on o (Qwen2's attention); exclusive with ``attention_bias``.
        use_qk_norm: a per-head RMSNorm (width ``head_dim``, eps ``rms_norm_eps``, weights ``q_norm`` /
            ``k_norm``) on the queries and keys after their projection and before RoPE (Qwen3's attention).
        attention_dropout: dropout on attention probabilities.
        tie_word_embeddings: must stay False (DepthBench uses untied embeddings).
    """

    model_type = "hf_depth"
    design = "base"  # class attribute (not a field): the registry name of the design
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    _auto_class = "AutoConfig"  # save_pretrained copies this file (and its siblings) for trust_remote_code

    vocab_size: int = 50280
    hidden_size: int = 1024
    intermediate_size: int | None = None
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    init_cutoff_factor: float = 3.0
    scale_vector: str = "standard"
    attention_bias: bool = False
    qkv_bias: bool = False
    use_qk_norm: bool = False
    attention_dropout: float = 0.0
    hidden_act: str = "silu"
    use_cache: bool = True
    pad_token_id: int | None = DefaultTokenId(1)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = DefaultTokenId(DEPTHBENCH_EOS)
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        self.warn_unknown_kwargs(kwargs)
        self.resolve_default_token_ids()
        if self.intermediate_size is None and isinstance(self.hidden_size, int):
            self.intermediate_size = default_intermediate_size(self.hidden_size)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int):
            if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0:
                self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)
        self.validate_depth_config()

    def resolve_default_token_ids(self) -> None:
        """A defaulted special-token id (:class:`DefaultTokenId`) the vocabulary does not hold becomes ``None``;
        one it holds becomes a plain ``int``. Explicit ids are left to :meth:`validate_token_range`."""
        for name in TOKEN_ID_FIELDS:
            v = getattr(self, name, None)
            if type(v) is DefaultTokenId:
                fits = isinstance(self.vocab_size, int) and not isinstance(self.vocab_size, bool) and v < self.vocab_size
                setattr(self, name, int(v) if fits else None)

    def validate_token_range(self) -> None:
        """Every special-token id is ``None`` or inside the vocabulary (explicit ids are never silently dropped)."""
        for name in TOKEN_ID_FIELDS:
            v = getattr(self, name, None)
            ids = v if isinstance(v, (list, tuple)) and name == "eos_token_id" else [v]
            for i in ids:
                if i is not None and (not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size):
                    raise ValueError(f"`{name}` must be None or an integer in [0, vocab_size={self.vocab_size}) "
                                     f"(inside the vocabulary), got {v!r}")

    # ------------------------------------------------------------------ validation
    def validate_architecture(self):  # called by transformers' strict validation too
        self.validate_depth_config()

    @classmethod
    def warn_unknown_kwargs(cls, kwargs: dict) -> None:
        """Warn about a keyword that is no field of this design but looks like one (``hiden_size``) or belongs to
        another design; transformers' own keywords (``attn_implementation``, ``torch_dtype``...) pass silently."""
        ours = depth_fields(cls)
        known = transformers_names()
        others = _all_design_fields()
        for key in kwargs:
            if key.startswith("_") or key in ours or key in known:
                continue
            if key in others:
                warnings.warn(f"{cls.__name__}: `{key}` is a field of design {others[key]!r}, not of {cls.design!r}: "
                              "it is kept as an attribute but has no effect", UserWarning, stacklevel=4)
                continue
            close = difflib.get_close_matches(key, list(ours), n=1, cutoff=0.75)
            if close:
                warnings.warn(f"{cls.__name__}: unknown config field `{key}` (kept as an attribute, it has no effect): "
                              f"did you mean `{close[0]}`?", UserWarning, stacklevel=4)

    def validate_types(self) -> None:
        """Every field declared by hf_depth holds a value of its annotated type: integers are not bools, numbers
        are finite (NaN and inf are rejected everywhere), strings are strings, flags are True/False."""
        for name, tp in depth_fields(type(self)).items():
            value = getattr(self, name, None)
            if _type_ok(value, tp) is False:
                raise ValueError(f"`{name}` must be {_describe(tp)}, got {value!r}")

    def validate_depth_config(self) -> None:
        """Check every shared field, then the design's own (``validate_design``)."""
        self.validate_types()
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            _positive_int(name, getattr(self, name))
        if self.head_dim is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads}), or give `head_dim` explicitly"
            )
        _positive_int("head_dim", self.head_dim)
        if self.head_dim % 2 != 0:
            raise ValueError(f"`head_dim` must be even for RoPE, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads}); allowed values: "
                f"{[k for k in range(1, self.num_attention_heads + 1) if self.num_attention_heads % k == 0]}"
            )
        if not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 0:
            raise ValueError(f"`rope_theta` must be a positive number, got {self.rope_theta!r}")
        if not isinstance(self.rope_scaling_factor, (int, float)) or self.rope_scaling_factor <= 0:
            raise ValueError(f"`rope_scaling_factor` must be a positive number (1.0: no scaling), got "
                             f"{self.rope_scaling_factor!r}")
        if not isinstance(self.rms_norm_eps, (int, float)) or not 0 < self.rms_norm_eps < 1:
            raise ValueError(f"`rms_norm_eps` must be in (0, 1), got {self.rms_norm_eps!r}")
        _non_negative("initializer_range", self.initializer_range)
        if not isinstance(self.init_cutoff_factor, (int, float)) or self.init_cutoff_factor <= 0:
            raise ValueError(f"`init_cutoff_factor` must be a positive number, got {self.init_cutoff_factor!r}")
        if not isinstance(self.attention_dropout, (int, float)) or not 0 <= self.attention_dropout < 1:
            raise ValueError(f"`attention_dropout` must be in [0, 1), got {self.attention_dropout!r}")
        _choice("hidden_act", self.hidden_act, ("silu",))
        if self.attention_bias and self.qkv_bias:
            raise ValueError("`qkv_bias` (biases on q/k/v, Qwen2) and `attention_bias` (biases on q/k/v/o, Llama) "
                             "exclude each other: set at most one of them to True")
        if self.tie_word_embeddings:
            raise ValueError("`tie_word_embeddings` must be False: hf_depth models use untied embeddings (DepthBench)")
        parse_scale_vector(self.scale_vector)
        self.validate_token_range()
        for name, (what, bound) in UPPER_BOUNDS.items():
            v = getattr(self, name, None)
            if name in depth_fields(type(self)) and isinstance(v, (int, float)) and v > bound(self):
                raise ValueError(f"`{name}` must be at most {what} = {bound(self)}, got {v!r}")
        self.validate_attention_backend(getattr(self, "_attn_implementation_internal", None))
        self.validate_design()

    def validate_attention_backend(self, value) -> None:
        """Refuse an ``attn_implementation`` the design's attention cannot run (see ``ATTENTION_BACKENDS``)."""
        allowed = ATTENTION_BACKENDS.get(self.design)
        impl = value.get("", None) if isinstance(value, dict) else value
        if allowed is not None and impl is not None and impl not in allowed:
            raise ValueError(f"`attn_implementation` {impl!r} is not supported by design {self.design!r}: "
                             f"allowed {list(allowed)}")

    @property
    def _attn_implementation(self):
        return self._attn_implementation_internal

    @_attn_implementation.setter
    def _attn_implementation(self, value):
        # from_pretrained(..., attn_implementation=...) lands here: refuse what the design cannot run, up front
        self.validate_attention_backend(value)
        PretrainedConfig._attn_implementation.fset(self, value)

    def to_dict(self) -> dict:
        """As transformers', except that a ``head_dim`` equal to hidden_size // num_attention_heads is saved as
        ``None``: it is recomputed on load, so a ``config.json`` edited to a new width cannot keep a stale one."""
        out = super().to_dict()
        if (isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int)
                and self.num_attention_heads > 0 and self.head_dim == self.hidden_size // self.num_attention_heads
                and self.hidden_size % self.num_attention_heads == 0):
            out["head_dim"] = None
        return out

    def validate_design(self) -> None:
        """Hook for a design's own fields; raise ValueError naming the field and the allowed values."""

    # ------------------------------------------------------------------ derived quantities
    @property
    def num_sublayers(self) -> int:
        """S = 2L: every attention and every FFN counts as one sublayer."""
        return 2 * self.num_hidden_layers

    @property
    def scale_vector_parts(self) -> tuple[str, ...]:
        return parse_scale_vector(self.scale_vector)
