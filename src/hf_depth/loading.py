"""Loading a user's model for ``hf-depth eval`` / ``val-loss`` / ``diagnose``: remote code is opt-in.

A model folder's ``config.json`` (or ``tokenizer_config.json``) may carry an ``auto_map`` naming Python files in
the folder that ``transformers`` imports -- runs -- when asked with ``trust_remote_code=True``. The rule here,
as in ``transformers`` and ``lm_eval`` (both default to ``trust_remote_code=False``):

* an **hf_depth folder** (``model_type`` one of our designs) loads with the classes of the installed package,
  which ``import hf_depth`` registers with the Auto classes. Its ``auto_map`` (written by ``save_pretrained`` so
  the folder also loads where hf_depth is not installed) is not foreign code and is never imported;
* a **standard transformers family** (llama, qwen2, gpt2, ...; no ``auto_map``) loads with transformers' classes;
* **anything else whose config asks for its own code** (an ``auto_map`` for the config, model or tokenizer) is
  refused -- :class:`~hf_depth.errors.UserError`, so ``hf-depth <cmd>: <folder> asks to run its own code
  (auto_map ...); pass --trust-remote-code if you trust it`` and exit 2 -- unless the user passes
  ``--trust-remote-code`` (``trust_remote_code=True``).
"""

from __future__ import annotations

import argparse

from .errors import UserError, reading, reading_model

FLAG = "--trust-remote-code"
FLAG_HELP = ("allow the model folder's own Python code (config.json auto_map) to run; hf_depth designs and "
             "standard transformers models never need it")
_CODE_KEYS = ("AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoTokenizer")


class RemoteCodeRefused(UserError):
    """The folder asks to run its own code and ``--trust-remote-code`` was not given."""


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """Add ``--trust-remote-code`` (off by default) to a command's parser."""
    parser.add_argument(FLAG, dest="trust_remote_code", action="store_true", help=FLAG_HELP)


def our_model_types() -> frozenset[str]:
    """The ``model_type`` of every hf_depth design (registered with the Auto classes by ``import hf_depth``)."""
    from .models import DESIGNS

    return frozenset(d.config_class.model_type for d in DESIGNS.values())


def _auto_map_text(auto_map: dict) -> str:
    parts = []
    for key, ref in auto_map.items():
        refs = [r for r in (ref if isinstance(ref, (list, tuple)) else [ref]) if r]
        parts.append(f"{key} -> {', '.join(map(str, refs))}")
    return "auto_map: " + "; ".join(parts)


def foreign_code(path: str) -> str | None:
    """What of ``path``'s own code loading it would run (``"auto_map: AutoConfig -> x.Y; ..."``), or None when
    hf_depth's or transformers' own classes load it (see the module docstring)."""
    from transformers import PretrainedConfig

    with reading_model(path):
        config, _ = PretrainedConfig.get_config_dict(path)
    wanted = {k: v for k, v in (config.get("auto_map") or {}).items() if k in _CODE_KEYS}
    if config.get("model_type") in our_model_types():
        wanted = {k: v for k, v in wanted.items() if k == "AutoTokenizer"}   # our save_pretrained's own map
    return _auto_map_text(wanted) if wanted else None


def tokenizer_foreign_code(path: str) -> str | None:
    """Like :func:`foreign_code` for a tokenizer folder: its ``tokenizer_config.json`` ``auto_map``."""
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    with reading(path, "the tokenizer", "give --tokenizer, or save one next to the model"):
        tok_config = get_tokenizer_config(path)
    auto_map = tok_config.get("auto_map") or {}
    if isinstance(auto_map, (list, tuple)):   # the old format: [slow, fast]
        auto_map = {"AutoTokenizer": auto_map}
    wanted = {k: v for k, v in auto_map.items() if k == "AutoTokenizer"}
    return _auto_map_text(wanted) if wanted else None


def check_remote_code(path: str, trust_remote_code: bool, *, tokenizer: bool = False, flag: str = FLAG) -> bool:
    """Raise :class:`UserError` when loading ``path`` would run its own code and ``trust_remote_code`` is off.
    Returns the ``trust_remote_code`` to give ``from_pretrained``: True only for a folder whose own code was
    allowed (hf_depth and standard folders load with False)."""
    code = tokenizer_foreign_code(path) if tokenizer else foreign_code(path)
    if code is None:
        return False
    if not trust_remote_code:
        raise RemoteCodeRefused(f"{path} asks to run its own code ({code}); pass {flag} if you trust it")
    return True


def load_model(path: str, *, trust_remote_code: bool = False, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` under the remote-code rule (module docstring);
    failures name the model folder."""
    from transformers import AutoModelForCausalLM

    import hf_depth  # noqa: F401  (registers the designs with the Auto classes)

    trust = check_remote_code(path, trust_remote_code)
    with reading_model(path):
        return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust, **kwargs)


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    """``AutoTokenizer.from_pretrained(path)`` under the same rule; failures name the tokenizer."""
    from transformers import AutoTokenizer

    trust = check_remote_code(path, trust_remote_code, tokenizer=True)
    with reading(path, "the tokenizer", "give --tokenizer, or save one next to the model"):
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
