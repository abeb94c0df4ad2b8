"""Upcycle a pretrained Llama / Mistral / Qwen2 / Qwen3 causal LM (or an hf_depth Pre-LN one) into a depth design.

    model, report = hf_depth.upcycle(llama, "attnres")            # a model object or a save_pretrained folder
    hf-depth upcycle SRC OUT --design hc [--set hc_streams=2 ...]

The branch weights (embedding, attention with its biases and QK-norm, SwiGLU, norms, LM head) are copied under the
same names; the design's own parameters (AttnRes queries, HC routing, Sandwich output norms...) stay at their init.
Some designs compute Pre-LN's function at that init, so the upcycled model is the source model; ``upcycle`` sets
the fields that make it so unless told otherwise (``Design.upcycle_fields``), then measures it on a fixed batch:

* ``exact``: Pre-LN, AttnRes and Block AttnRes (zero queries, ``attnres_scale_by_sources``), HC with
  ``hc_final_reduce="mean_then_norm"``: fp32 max |delta logits| <= 1e-5 (``EXACT_TOL``), checked;
* ``bounded``: mHC with ``mhc_init="identity"``: the +-8 logit biases leave a sigmoid(-8) leak, removed by the branch
  norms up to eps; checked against ``MHC_IDENTITY_BOUND``;
* ``differs``: every other design (LNS, Sandwich, KEEL, Post-LN, DeepNorm, MoDA, HiRes, or the above with other
  fields) changes the function: "differs, continue training", with the KL(source || upcycled) per token.

What the source must be, field by field (anything else is refused in one line naming the field): SiLU SwiGLU
without MLP bias; attention biases on q/k/v/o (Llama's ``attention_bias``) or on q/k/v (Qwen2, ``qkv_bias``); QK-norm
(Qwen3, ``use_qk_norm``); any GQA; default RoPE or its ``linear`` scaling (``rope_scaling_factor``; any other
``rope_parameters.rope_type`` is refused); ``rope_theta``, ``rms_norm_eps``, ``head_dim`` carried. Tied embeddings are untied (the LM head is
a copy of the embedding: exact at conversion, trained apart from then on). A sliding window shorter than the
context (``max_position_embeddings``) would change the function and is refused (``--set
max_position_embeddings=W`` upcycles for contexts up to the window W); a window at least as long has no effect
and is ignored, with a note.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Hub families ``upcycle`` reads (``model_type``), besides hf_depth's own Pre-LN."""

from .errors import command, command_parser  # noqa: E402
from .models.design_mhc import MHC_IDENTITY_BOUND  # noqa: E402,F401  (re-exported: the mHC identity bound)
from .models.residual import UPCYCLE_EXACT_TOL as EXACT_TOL  # noqa: E402
from .utils import parse_set_items  # noqa: E402


def function_preserving(design: str) -> dict:
    """Fields ``upcycle`` sets (unless given) so that ``design`` computes Pre-LN's function at its init
    (``Design.upcycle_fields``)."""
    from .models.residual import DESIGNS

    return dict(DESIGNS[design].upcycle_fields)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
"""Files copied from the source folder next to the upcycled weights."""

_INPUT_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_SHARED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "initializer_range",
           "pad_token_id", "bos_token_id", "eos_token_id")  # fmt: skip


@dataclass
class UpcycleReport:
    """How the upcycled model relates to its source (printed by ``upcycle``, saved as ``upcycle.json``)."""

    source_family: str
    source_class: str
    design: str
    fields: dict  # the design's config fields set by upcycle and by the caller
    expected: str  # "exact" | "bounded" | "differs"
    bound: float | None
    max_abs_logit_diff: float
    kl: float  # mean KL(source || upcycled) per token, nats, fp32
    sample_shape: list[int]
    copied_parameters: int
    new_parameters: int
    new_parameter_names: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        d = self.max_abs_logit_diff
        if self.expected == "exact":
            return f"exactly equal: fp32 max|dlogits| = {d:.2e} <= {self.bound:.0e}"
        if self.expected == "bounded":
            return f"within the measured bound: fp32 max|dlogits| = {d:.2e} <= {self.bound:.0e} (KL {self.kl:.2e})"
        if d <= EXACT_TOL:
            return (f"equal on the check batch (max|dlogits| = {d:.2e}), which design {self.design!r} does not "
                    "guarantee at these fields: continue training")
        return f"differs, continue training: KL(source || upcycled) = {self.kl:.4g} nats/token, max|dlogits| = {d:.3g}"

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}

    def __str__(self) -> str:
        lines = [f"[hf-depth] upcycle {self.source_class} ({self.source_family}) -> {self.design}: {self.verdict}",
                 f"[hf-depth]   {self.copied_parameters:,} parameters copied, {self.new_parameters:,} new at the "
                 f"design's init ({_patterns(self.new_parameter_names) or 'none'})"]
        if self.fields:
            lines.append("[hf-depth]   fields: " + ", ".join(f"{k}={v!r}" for k, v in self.fields.items()))
        lines += [f"[hf-depth]   note: {n}" for n in self.notes]
        return "\n".join(lines)


def _patterns(names: list[str], limit: int = 4) -> str:
    counts = Counter(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    items = [f"{k} x{v}" if v > 1 else k for k, v in counts.items()]
    return ", ".join(items[:limit]) + (f", ... (+{len(items) - limit})" if len(items) > limit else "")


# --------------------------------------------------------------------------------------------- source -> fields
def _refuse(msg: str):
    raise ValueError(f"cannot upcycle: {msg}")


def source_family(config) -> str:
    mt = getattr(config, "model_type", None)
    if mt in FAMILIES:
        return mt
    if getattr(config, "design", None) is not None and str(mt).startswith("hf_depth"):
        from .models.residual import DESIGNS, upcycle_exact

        entry = DESIGNS.get(config.design)
        if entry is None or entry.upcycle_closeness is not upcycle_exact:  # Pre-LN's function whatever its fields
            _refuse(f"the source is hf_depth design {config.design!r}; only 'pre_ln' (Llama's function) is upcycled")
        return "hf_depth_pre_ln"
    _refuse(f"unsupported source model_type {mt!r}; allowed: {list(FAMILIES)} or an hf_depth pre_ln model")


def _sliding_window(config, family: str) -> int | None:
    """The window that applies to some layer of the source, or None."""
    window = getattr(config, "sliding_window", None)
    if family == "mistral":
        return window
    if family in ("qwen2", "qwen3") and "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return window
    return None


def source_fields(config, overrides: dict | None = None) -> tuple[dict, list[str]]:
    """(DepthConfig fields that reproduce ``config``'s decoder, notes); refuses what hf_depth cannot reproduce."""
    from .models.configuration_depth import DepthConfig, depth_fields

    overrides = dict(overrides or {})
    family = source_family(config)
    notes: list[str] = []
    if family == "hf_depth_pre_ln":
        return {k: getattr(config, k) for k in depth_fields(DepthConfig) if hasattr(config, k)}, notes
    if getattr(config, "hidden_act", "silu") != "silu":
        _refuse(f"`hidden_act` is {config.hidden_act!r}; hf_depth's SwiGLU uses 'silu'")
    if getattr(config, "mlp_bias", False):
        _refuse("`mlp_bias` is True; hf_depth's SwiGLU has no biases")
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        _refuse(f"`rope_parameters.rope_type` is {rope_type!r}; hf_depth's RoPE is the default one or its 'linear' "
                "scaling, so the upcycled model would compute another function")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(f"`rope_parameters.partial_rotary_factor` is {rope['partial_rotary_factor']!r}; hf_depth rotates "
                "every head dimension (1.0)")
    fields = {k: getattr(config, k) for k in _SHARED}
    fields["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fields["rope_theta"] = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if rope_type == "linear":
        fields["rope_scaling_factor"] = float(rope["factor"])
    fields["attention_dropout"] = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if family == "qwen2":  # Qwen2Attention: bias=True on q/k/v, none on o (no config field)
        fields["qkv_bias"] = True
    else:
        fields["attention_bias"] = bool(getattr(config, "attention_bias", False))
    if family == "qwen3":  # Qwen3Attention: q_norm / k_norm per head before RoPE
        fields["use_qk_norm"] = True
    if getattr(config, "tie_word_embeddings", False):
        notes.append("`tie_word_embeddings`: untied, the LM head is a copy of the embedding (exact at conversion, "
                     "trained apart from now on)")
    window = _sliding_window(config, family)
    context = overrides.get("max_position_embeddings", fields["max_position_embeddings"])
    if window is not None:
        if window < context:
            _refuse(f"`sliding_window` ({window}) is shorter than the context `max_position_embeddings` ({context}): "
                    f"hf_depth attends to the whole context, another function beyond {window} tokens; pass "
                    f"max_position_embeddings={window} (--set) to upcycle for contexts up to the window")
        notes.append(f"`sliding_window` ({window}) >= the context ({context}): no effect, ignored")
    return fields, notes


def design_config(source_config, design: str, overrides: dict | None = None) -> tuple:
    """(config of ``design`` computing ``source_config``'s decoder, the ``Design.upcycle_fields`` fields set, notes).

    A source of the same hf_depth design keeps its own fields; any other source goes through ``source_fields``.
    ``overrides`` (design config fields) win."""
    import hf_depth

    from .models.configuration_depth import depth_fields

    overrides = dict(overrides or {})
    if design not in hf_depth.DESIGNS:
        raise ValueError(f"`design` must be one of {sorted(hf_depth.DESIGNS)}, got {design!r}")
    if getattr(source_config, "design", None) == design:
        fields = {k: getattr(source_config, k) for k in depth_fields(type(source_config)) if hasattr(source_config, k)}
        preset, notes = {}, []
    else:
        fields, notes = source_fields(source_config, overrides)
        preset = {k: v for k, v in function_preserving(design).items() if k not in overrides}
    return hf_depth.config_for(design, **{**fields, **preset, **overrides}), preset, notes


def expected_closeness(config) -> tuple[str, float | None]:
    """("exact" | "bounded" | "differs", the fp32 max |delta logits| bound) of ``config``'s design at its init, from
    ``Design.upcycle_closeness``."""
    from .models.residual import DESIGNS

    judge = DESIGNS[config.design].upcycle_closeness
    verdict = judge(config) if judge is not None else None
    return verdict if verdict is not None else ("differs", None)


# --------------------------------------------------------------------------------------------- the conversion
def _load(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from .errors import reading_model

    with reading_model(path):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def compare(source: torch.nn.Module, target: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(max |delta logits|, mean KL(source || target) per token) on ``ids``, in fp32."""
    with torch.no_grad():
        a = source(input_ids=ids, use_cache=False).logits.float()
        b = target(input_ids=ids, use_cache=False).logits.float()
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none")
    return float((a - b).abs().max()), max(0.0, float(kl.sum(-1).mean()))  # rounding can make a zero KL < 0


def carry_weights(source: torch.nn.Module, target: torch.nn.Module, notes: list[str] | None = None,
                  what: str = "the source") -> tuple[int, list[str]]:
    """Copy every weight of ``source`` into ``target`` under the same name: (parameters copied, names of the
    target's parameters and buffers left at their init). Tied embeddings are untied (a copy), a post-norm
    design drops the source's Pre-LN input norms (with a note); any other weight without a place, or with
    another shape, is refused naming it."""
    design = getattr(target.config, "design", "?")
    sd = {k: v.detach().clone() for k, v in source.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in sd or getattr(source.config, "tie_word_embeddings", False):
        sd["lm_head.weight"] = source.get_input_embeddings().weight.detach().clone()
    want = target.state_dict()
    extra = [k for k in sd if k not in want]
    norms = [k for k in extra if k.endswith(_INPUT_NORMS)]
    if norms and not any(k.endswith(_INPUT_NORMS) for k in want):  # a post-norm design: no Pre-LN input norms
        if notes is not None:
            notes.append(f"design {design!r} has no per-sublayer input norms: the {len(norms)} input-norm weights "
                         f"of {what} (input_layernorm, post_attention_layernorm) are dropped")
        sd = {k: v for k, v in sd.items() if k not in norms}
        extra = [k for k in extra if k not in norms]
    if extra:
        _refuse(f"design {design!r} has no place for weights {extra[:6]} of {what} (the design renames or drops them)")
    for k, v in sd.items():
        if tuple(want[k].shape) != tuple(v.shape):
            _refuse(f"`{k}` has shape {list(v.shape)} in {what} and {list(want[k].shape)} in design {design!r}")
    target.load_state_dict({k: v.to(want[k].dtype) for k, v in sd.items()}, strict=False)
    params = dict(target.named_parameters())
    return sum(v.numel() for k, v in sd.items() if k in params), [k for k in want if k not in sd]


def upcycle(model, design: str, *, sample: torch.Tensor | None = None, seed: int = 0, verbose: bool = True,
            **config) -> tuple[torch.nn.Module, UpcycleReport]:
    """``(upcycled causal LM of design, UpcycleReport)`` from ``model`` (a Llama / Mistral / Qwen2 / Qwen3 /
    hf_depth Pre-LN causal LM, or its save_pretrained folder) with the same weights.

    ``config``: the design's config fields (they win over the source's and over ``Design.upcycle_fields``).
    ``sample``: token ids the closeness is measured on (default: 2 x 16 random ids, seeded). The new parameters
    are drawn with ``torch.manual_seed(seed)``. An ``exact`` or ``bounded`` design that misses its bound raises
    RuntimeError (a weight the mapping missed); the report is printed when ``verbose``."""
    import hf_depth

    if isinstance(model, (str, Path)):
        model = _load(model)
    if design not in hf_depth.DESIGNS:
        raise ValueError(f"`design` must be one of {sorted(hf_depth.DESIGNS)}, got {design!r}")
    family = source_family(model.config)
    cfg, preset, notes = design_config(model.config, design, config)
    torch.manual_seed(seed)
    target = hf_depth.MODEL_CLASSES[design][1](cfg).eval()

    copied, new = carry_weights(model, target, notes)
    if sample is None:
        g = torch.Generator().manual_seed(seed)
        sample = torch.randint(0, cfg.vocab_size, (2, min(16, cfg.max_position_embeddings)), generator=g)
    dtype = next(model.parameters()).dtype
    source32 = model if dtype == torch.float32 else copy.deepcopy(model).float()
    was = model.training
    source32.eval()
    diff, kl = compare(source32, target, sample.to(next(source32.parameters()).device))
    model.train(was)
    expected, bound = expected_closeness(cfg)
    numel = dict(target.named_parameters())
    report = UpcycleReport(
        source_family=family, source_class=type(model).__name__, design=design,
        fields={k: getattr(cfg, k) for k in (*preset, *config)}, expected=expected, bound=bound,
        max_abs_logit_diff=diff, kl=kl, sample_shape=list(sample.shape),
        copied_parameters=copied, new_parameters=sum(numel[k].numel() for k in new if k in numel),
        new_parameter_names=[k for k in new if k in numel], notes=notes,
    )
    if bound is not None and not diff <= bound:
        raise RuntimeError(f"upcycle to {design!r} should be {expected} (max|dlogits| <= {bound:.0e}) but measured "
                           f"{diff:.3e}: a source weight or field was not carried over")
    if verbose:
        print(report)
    return target.to(dtype), report


# --------------------------------------------------------------------------------------------- saving, CLI
def save_upcycled(model, report: UpcycleReport, out, src=None) -> Path:
    """``save_pretrained`` folder + the source's tokenizer and generation config files + ``upcycle.json`` and a
    ``README.md`` card; loads with ``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)``."""
    out = Path(out)
    model.save_pretrained(out)
    copied = []
    if src is not None and Path(src).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(src) / name).is_file():
                shutil.copy2(Path(src) / name, out / name)
                copied.append(name)
    data = {**report.to_dict(), "source": str(src) if src is not None else None, "copied_files": copied}
    (out / "upcycle.json").write_text(json.dumps(data, indent=1, default=str))
    write_upcycle_card(out, model, data)
    return out


def write_upcycle_card(folder, model, data: dict) -> Path:
    from . import __version__
    from .models.registry import DESIGNS

    cfg, entry = model.config, DESIGNS.get(model.config.design)
    fields = "\n".join(f"| `{k}` | `{v}` |" for k, v in data["fields"].items()) or "| (none) | |"
    text = (
        "---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags: [hf_depth, "
        f"hf_depth_{cfg.design}, custom_code, upcycled]\n---\n\n"
        f"# {Path(folder).name}\n\nA **{cfg.design}** decoder ({cfg.num_hidden_layers} layers, width {cfg.hidden_size}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters) upcycled from a {data['source_class']} "
        f"(`{data.get('source')}`) by `hf-depth upcycle` (hf_depth {__version__}).\n\n"
        f"{entry.paper if entry and entry.paper else ''}\n\n```\n{entry.summary if entry else cfg.design}\n```\n\n"
        f"## At conversion\n\n**{data['verdict']}**\n\n"
        f"{data['copied_parameters']:,} parameters copied; {data['new_parameters']:,} new at the design's init.\n\n"
        f"| field | value |\n|---|---|\n{fields}\n\n"
        + "".join(f"- {n}\n" for n in data["notes"])
        + "\n## Use\n\n```\nfrom transformers import AutoModelForCausalLM\n\n"
        f"model = AutoModelForCausalLM.from_pretrained(\"{folder}\", trust_remote_code=True)\n```\n\n"
        "Continue training with a recipe: `model.init_from=<this folder>` (see docs/upcycling.md).\n"
    )
    path = Path(folder) / "README.md"
    path.write_text(text)
    return path


def _main(argv: list[str] | None = None) -> int:
    import hf_depth

    ap = command_parser("upcycle", __doc__)
    ap.add_argument("src", help="a Llama / Mistral / Qwen2 / Qwen3 (or hf_depth pre_ln) save_pretrained folder")
    ap.add_argument("out", help="output folder")
    ap.add_argument("--design", required=True, help=f"one of {sorted(hf_depth.DESIGNS)}")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a design config field (YAML value), e.g. --set hc_streams=2; repeatable")
    ap.add_argument("--seed", type=int, default=0, help="seed of the new parameters' init and of the check batch")
    a = ap.parse_args(argv)
    if a.design not in hf_depth.DESIGNS:
        raise ValueError(f"`--design` must be one of {sorted(hf_depth.DESIGNS)}, got {a.design!r}")
    from transformers import AutoConfig

    from .errors import reading_model

    with reading_model(a.src):
        dtype = getattr(AutoConfig.from_pretrained(a.src), "dtype", None)  # saved dtype: the result keeps it
    source = _load(a.src)
    model, report = upcycle(source, a.design, seed=a.seed, **parse_set_items(a.sets))
    if isinstance(dtype, torch.dtype) and dtype != torch.float32:
        model = model.to(dtype)
    out = save_upcycled(model, report, a.out, a.src)
    print(f"[hf-depth] wrote {out} (upcycle.json, README.md)")
    return 0


main = command("upcycle", _main, "exit 0 written, 2 refused (one line); usage: SRC OUT --design D [--set k=v ...]")

if __name__ == "__main__":
    sys.exit(main())

__all__ = ["upcycle", "UpcycleReport", "save_upcycled", "source_fields", "expected_closeness", "compare",
           "function_preserving", "MHC_IDENTITY_BOUND", "EXACT_TOL", "MHC_IDENTITY_BOUND"]
