"""Typed training recipes: dataclasses loaded from YAML, with validated dotted overrides.

    recipe = load_recipe("recipes/train/tiny_cpu.yaml", ["model.hidden_size=256", "optim.lr=1e-3"])

Every key of the YAML must be a field of the dataclasses below and every value must have the field's type
(or one of its allowed values); anything else is a ``ValueError`` naming the dotted key and what is allowed,
raised before any model is built. The model part is then checked by building the design's config (which
validates design names and design fields), so a recipe that loads is a recipe that runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


@dataclass
class ModelRecipe:
    """The architecture: a registered design and its shape (``hf_depth.config_for(design, **fields)``)."""

    design: str = "pre_ln"
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    #: ``None``: the tokenizer's vocabulary size (DepthBench: 50280 for GPT-NeoX)
    vocab_size: int | None = None
    max_position_embeddings: int = 4096
    scale_vector: str = "standard"
    #: design-specific config fields, e.g. ``{hc_streams: 4}`` (validated by the design's config)
    fields: dict = field(default_factory=dict)
    #: start from a ``save_pretrained`` folder (e.g. ``hf-depth upcycle``'s output, or a Pre-LN ``RUN/final``):
    #: every weight it has is loaded; the design's parameters it lacks stay at their init (``hf_depth.training.init_from``)
    init_from: str | None = None


@dataclass
class DataRecipe:
    """Where tokens come from. ``embedded``: the Python stdlib's own sources (no download); ``hf``: a
    ``datasets`` name or builder (``HuggingFaceFW/fineweb-edu``/``sample-10BT``, or ``json``/``parquet`` with
    ``data_files``), streamed and tokenized on the fly; ``memmap``: pre-tokenized ``.bin``/``.npy`` files."""

    source: Literal["embedded", "hf", "memmap"] = "embedded"
    path: str | None = None
    name: str | None = None
    data_files: list[str] | None = None
    split: str = "train"
    text_field: str = "text"
    #: held-out validation files (hf: same builder; memmap: token files); ``None``: the first ``val_docs``
    #: documents of the stream (hf/embedded) or the last ``val_sequences`` sequences (memmap) are held out
    val_data_files: list[str] | None = None
    val_docs: int = 200
    val_sequences: int = 32
    #: ``embedded`` trains a byte-level BPE on the embedded corpus (cached); otherwise a tokenizer name/path
    tokenizer: str = "embedded"
    tokenizer_vocab_size: int = 4096
    #: memmap token dtype (``.bin`` files); ``.npy`` files carry their own
    token_dtype: Literal["uint16", "uint32", "int32", "int64"] = "uint16"
    seq_len: int = 2048
    shuffle_seed: int = 0


@dataclass
class OptimRecipe:
    """AdamW (or Muon + AdamW) with a weight-decay policy (``hf_depth.training.optim``) and a warmup + cosine or
    warmup-stable-decay (``wsd``: peak until the last ``decay_frac`` of the steps, then linear) schedule."""

    lr: float = 2e-3
    weight_decay: float = 0.1
    policy: Literal["depthbench", "iwd", "no_norm_decay", "output_norm_only"] = "depthbench"
    optimizer: Literal["adamw", "muon"] = "adamw"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    schedule: Literal["cosine", "wsd"] = "cosine"
    warmup_frac: float = 0.1
    decay_frac: float = 0.2
    final_lr_frac: float = 0.1
    #: with ``model.init_from``: learning-rate multiplier of the newly initialized parameters only (the design's
    #: own, absent from the folder or listed new in its ``upcycle.json``)
    new_param_lr_mult: float = 1.0
    #: with ``model.init_from``: the warmup ramps the new parameters only; the loaded ones start at the schedule's
    #: post-warmup value
    warmup_new_params_only: bool = False


@dataclass
class TrainRecipe:
    """Budget, batch, precision and bookkeeping of one run."""

    #: token budget in tokens per parameter (DepthBench: ~20); ``max_tokens`` / ``max_steps`` override it
    tokens_per_param: float = 20.0
    max_tokens: int | None = None
    max_steps: int | None = None
    micro_batch_size: int = 8
    """Sequences per process per micro-step; the global batch is ``micro_batch_size x grad_accum x processes``
    (``hf-depth launch-commands`` prints it for a cluster)."""
    grad_accum: int = 1
    seed: int = 42
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = "auto"
    compile: bool = False
    #: ``ddp``: accelerate's data parallelism (one process: plain); ``fsdp2``: torch's ``fully_shard`` per decoder
    #: layer and root, with ``torch.distributed.checkpoint`` checkpoints that resume at any world size
    parallel: Literal["ddp", "fsdp2"] = "ddp"
    eval_every: int = 100
    eval_batches: int | None = None
    save_every: int = 100
    keep_last: int = 2
    log_every: int = 10
    trackers: list[str] = field(default_factory=list)
    progress: bool = True


@dataclass
class Recipe:
    name: str = "run"
    #: run folder; ``{name}`` is replaced by the recipe name
    run_dir: str = "runs/{name}"
    model: ModelRecipe = field(default_factory=ModelRecipe)
    data: DataRecipe = field(default_factory=DataRecipe)
    optim: OptimRecipe = field(default_factory=OptimRecipe)
    train: TrainRecipe = field(default_factory=TrainRecipe)

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir.format(name=self.name))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


POSITIVE = {
    "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads", "model.max_position_embeddings",
    "data.seq_len", "data.tokenizer_vocab_size", "train.micro_batch_size", "train.grad_accum", "train.eval_every",
    "train.save_every", "train.keep_last", "train.log_every", "optim.lr", "data.val_sequences",
}
NON_NEGATIVE = {"data.val_docs", "data.shuffle_seed", "train.seed"}
FRACTIONS = {"optim.warmup_frac", "optim.final_lr_frac", "optim.beta1", "optim.beta2", "optim.decay_frac"}
TRACKERS = ("tensorboard", "wandb")


# ---------------------------------------------------------------------------------------------- type checking
def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return f"one of {list(typing.get_args(tp))}"
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


#: annotations checked as they are (no conversion), and how a wrong value is described
_PLAIN = {bool: "true or false", str: "a string"}


def _coerce(key: str, value: Any, tp) -> Any:
    """Return ``value`` checked against the annotation ``tp`` (ints accepted for floats); else ValueError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"`{key}` must be {_type_name(tp)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"`{key}` must be {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is not None:
            raise ValueError(f"`{key}` must be null, got {value!r}")
        return None
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"`{key}` must be a list, got {value!r}")
        (arg,) = typing.get_args(tp) or (Any,)
        return [value_i if arg is Any else _coerce(f"{key}[{i}]", value_i, arg) for i, value_i in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"`{key}` must be a mapping, got {value!r}")
        return dict(value)
    if tp in _PLAIN:
        if not isinstance(value, tp):
            raise ValueError(f"`{key}` must be {_PLAIN[tp]}, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)  # 8e9 tokens written in scientific notation
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"`{key}` must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)  # YAML 1.1 reads "1e-3" as a string
            except ValueError:
                pass
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"`{key}` must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"`{key}` must be a finite number, got {value!r}")
        return float(value)
    raise TypeError(f"unsupported recipe annotation {tp!r} for `{key}`")


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ValueError(f"`{prefix or 'recipe'}` must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ValueError(f"unknown recipe key `{dotted}`{_did_you_mean(key, names)}; allowed keys under "
                             f"`{prefix[:-1] or 'recipe'}`: {names}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{dotted}.")
        else:
            kwargs[key] = _coerce(dotted, value, tp)
    return cls(**kwargs)


def _did_you_mean(key, names) -> str:
    close = difflib.get_close_matches(str(key), list(names), n=1, cutoff=0.7)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _check_values(recipe: Recipe) -> None:
    if not recipe.name.strip():
        raise ValueError("`name` must be a non-empty run name (it names the run folder), got ''")
    try:
        run_dir = str(recipe.resolved_run_dir)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"`run_dir` {recipe.run_dir!r} may only use the placeholder {{name}} ({type(e).__name__}: "
                         f"{e})") from None
    if not recipe.run_dir.strip() or run_dir in (".", ""):
        raise ValueError(f"`run_dir` must name a run folder (default 'runs/{{name}}'), got {recipe.run_dir!r}")
    for section in ("model", "data", "optim", "train"):
        for f in dataclasses.fields(getattr(recipe, section)):
            key, value = f"{section}.{f.name}", getattr(getattr(recipe, section), f.name)
            if key in POSITIVE and value is not None and value <= 0:
                raise ValueError(f"`{key}` must be positive, got {value!r}")
            if key in NON_NEGATIVE and value < 0:
                raise ValueError(f"`{key}` must be >= 0, got {value!r}")
            if key in FRACTIONS and not 0 <= value < 1:
                raise ValueError(f"`{key}` must be in [0, 1), got {value!r}")
    for key in ("train.max_tokens", "train.max_steps", "model.vocab_size", "train.eval_batches"):
        section, name = key.split(".")
        value = getattr(getattr(recipe, section), name)
        if value is not None and value <= 0:
            raise ValueError(f"`{key}` must be a positive integer or null, got {value!r}")
    for t in recipe.train.trackers:
        if t not in TRACKERS:
            raise ValueError(f"`train.trackers` entries must be in {list(TRACKERS)}, got {t!r}")
    d = recipe.data
    if d.source == "hf" and not d.path:
        raise ValueError("`data.path` is required when `data.source` is 'hf' (a dataset name, or json/parquet)")
    for key, files in (("data.data_files", d.data_files), ("data.val_data_files", d.val_data_files)):
        if files is not None and len(files) == 0:
            raise ValueError(f"`{key}` is an empty list: list at least one file, or leave it null")
    for key, value in (("data.split", d.split), ("data.text_field", d.text_field), ("data.tokenizer", d.tokenizer),
                       ("model.design", recipe.model.design)):
        if not value.strip():
            raise ValueError(f"`{key}` must be a non-empty string, got {value!r}")
    if d.seq_len < 2:
        raise ValueError(f"`data.seq_len` must be >= 2 (a token and the next one to predict), got {d.seq_len}")
    if d.source == "memmap" and not d.data_files:
        raise ValueError("`data.data_files` is required when `data.source` is 'memmap' (.bin/.npy token files)")
    if d.tokenizer == "embedded" and d.tokenizer_vocab_size < 260:
        raise ValueError(f"`data.tokenizer_vocab_size` must be >= 260 (256 bytes + specials), got {d.tokenizer_vocab_size}")
    if recipe.optim.optimizer == "muon" and recipe.train.parallel == "fsdp2":
        raise ValueError("`optim.optimizer` 'muon' needs `train.parallel` 'ddp' (Muon's orthogonalization works on "
                         "whole matrices, not FSDP2 shards); allowed with fsdp2: 'adamw'")
    if recipe.optim.weight_decay < 0 or recipe.optim.grad_clip < 0 or recipe.optim.eps <= 0:
        raise ValueError("`optim.weight_decay` and `optim.grad_clip` must be >= 0 and `optim.eps` > 0")
    o = recipe.optim
    if o.new_param_lr_mult <= 0:
        raise ValueError(f"`optim.new_param_lr_mult` must be positive, got {o.new_param_lr_mult!r}")
    if recipe.model.init_from is None and (o.new_param_lr_mult != 1.0 or o.warmup_new_params_only):
        key = "optim.new_param_lr_mult" if o.new_param_lr_mult != 1.0 else "optim.warmup_new_params_only"
        raise ValueError(f"`{key}` acts on the parameters `model.init_from` does not provide: set `model.init_from` "
                         "(a save_pretrained folder) or leave it at its default")
    if recipe.model.init_from is not None:
        from .init_from import check_folder

        check_folder(recipe.model.init_from)
    if recipe.train.tokens_per_param <= 0:
        raise ValueError(f"`train.tokens_per_param` must be positive, got {recipe.train.tokens_per_param!r}")
    # the model: building the config validates the design name and every design field
    model_config(recipe, vocab_size=recipe.model.vocab_size or 512)


def model_config(recipe: Recipe, vocab_size: int | None = None):
    """The design's config for this recipe (``vocab_size`` defaults to the recipe's)."""
    import hf_depth
    from hf_depth.models.configuration_depth import depth_fields, transformers_names

    m = recipe.model
    if m.design in hf_depth.DESIGNS:  # a design field must exist: a typo would otherwise be silently ignored
        known = depth_fields(hf_depth.DESIGNS[m.design].config_class)
        shaped = {f.name for f in dataclasses.fields(ModelRecipe)}
        for key in m.fields:
            if (key not in known and key not in transformers_names()) or key in shaped:
                why = "is set by `model.` itself" if key in shaped else f"is not a field of design {m.design!r}"
                design_only = sorted(set(known) - set(depth_fields(hf_depth.DepthConfig)))
                raise ValueError(f"`model.fields.{key}` {why}{_did_you_mean(key, known)}; the design's own fields: "
                                 f"{design_only}")
    fields = dict(
        hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, intermediate_size=m.intermediate_size,
        vocab_size=m.vocab_size or vocab_size, max_position_embeddings=max(m.max_position_embeddings, recipe.data.seq_len),
        scale_vector=m.scale_vector, **m.fields,
    )
    try:
        return hf_depth.config_for(m.design, **fields)
    except ValueError as e:
        msg = str(e)
        raise ValueError(f"`model.{msg[1:]}" if msg.startswith("`") else f"model: {msg}") from e
    except TypeError as e:  # an unknown design field
        raise ValueError(f"`model.fields` has a key the design {m.design!r} does not take: {e}") from e


# ---------------------------------------------------------------------------------------------- loading
def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=1e-3"`` -> (["optim", "lr"], 0.001): the value is read as YAML (numbers, bools, lists, null)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like `section.key=value` (e.g. `optim.lr=1e-3`)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(f"override `{text}`: the value is not valid YAML ({_yaml_problem(e)})") from None
    if not key.strip() or any(not k for k in key.strip().split(".")):
        raise ValueError(f"override {text!r} must look like `section.key=value` (e.g. `optim.lr=1e-3`)")
    return key.strip().split("."), value


def _yaml_problem(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or type(e).__name__}{where}"


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for i, k in enumerate(keys[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"override `{text}`: `{'.'.join(keys[: i + 1])}` is not a section")
        node[keys[-1]] = value
    return data


def recipe_from_dict(data: dict, overrides: list[str] | None = None) -> Recipe:
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"a recipe must be a mapping of sections, got {type(data).__name__}")
    data = apply_overrides(yaml.safe_load(yaml.safe_dump(data or {})), list(overrides or []))
    recipe = _build(Recipe, data, "")
    _check_values(recipe)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe YAML and apply dotted ``overrides`` (``["model.hidden_size=256", ...]``), validated."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe file {str(path)!r} does not exist")
    try:
        from ..errors import yaml_load

        data = yaml_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"recipe file {str(path)!r} is not valid YAML ({_yaml_problem(e)}): fix the syntax") from None
    if data is None:
        raise ValueError(f"recipe file {str(path)!r} is empty: a recipe needs at least `model:` and `data:` sections "
                         "(see recipes/train/)")
    if not isinstance(data, dict):
        raise ValueError(f"recipe file {str(path)!r} must hold a mapping (`model:`, `data:`, `optim:`, `train:` "
                         f"sections), got a {type(data).__name__} at the top level")
    if "name" not in data:
        data["name"] = path.stem
    recipe = recipe_from_dict(data, overrides)
    fit = recipe_fit(recipe)
    if not fit["fits"]:
        from ..diagnostics.cost import fit_line

        warnings.warn(f"recipe {str(path)!r}: {fit_line(recipe.name, fit)}", UserWarning, stacklevel=2)
    return recipe


#: the vocabulary a recipe without ``model.vocab_size`` is costed with, unless it trains the embedded tokenizer
FIT_VOCAB = 50280  # GPT-NeoX, DepthBench's tokenizer


def recipe_fit(recipe: Recipe, world_size: int | None = None, device_gb: float | None = None) -> dict:
    """Analytic memory of one device for this recipe at its micro-batch x ``data.seq_len``
    (``hf_depth.diagnostics.cost.fit_check``: bf16 autocast activations + fp32 parameters, gradients and AdamW
    moments, sharded over ``world_size`` -- default ``$WORLD_SIZE`` or 1 -- under ``train.parallel: fsdp2``)."""
    import os

    from ..diagnostics.cost import fit_check

    vocab = recipe.model.vocab_size or (recipe.data.tokenizer_vocab_size if recipe.data.tokenizer == "embedded"
                                        else FIT_VOCAB)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    precision = "fp32" if recipe.train.mixed_precision == "no" else "bf16"
    return fit_check(model_config(recipe, vocab_size=vocab), recipe.train.micro_batch_size, recipe.data.seq_len,
                     recipe.train.parallel, world_size, precision, device_gb)
