"""Tiny random configs of the Hub decoder families hf_depth diagnoses and upcycles (built locally, no download)."""

import torch
import transformers as tr

_COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
_GPT = dict(vocab_size=97, pad_token_id=0, eos_token_id=1, bos_token_id=1)

FAMILIES = {
    "llama": lambda: tr.LlamaConfig(**_COMMON),
    "mistral": lambda: tr.MistralConfig(**_COMMON),
    "qwen2": lambda: tr.Qwen2Config(**_COMMON),
    "qwen3": lambda: tr.Qwen3Config(**_COMMON, head_dim=8),
    "gemma2": lambda: tr.Gemma2Config(**_COMMON, head_dim=8),
    "gemma3": lambda: tr.Gemma3TextConfig(**_COMMON, head_dim=8),
    "phi3": lambda: tr.Phi3Config(**_COMMON),
    "olmo2": lambda: tr.Olmo2Config(**_COMMON),
    "gpt2": lambda: tr.GPT2Config(n_embd=32, n_layer=3, n_head=4, n_positions=64, **_GPT),
    "gpt_neox": lambda: tr.GPTNeoXConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                         intermediate_size=48, max_position_embeddings=64, **_GPT),
}


def family_model(name: str, seed: int = 0, **overrides):
    """A randomly initialized CausalLM of family ``name`` (eager attention, eval mode)."""
    config = FAMILIES[name]()
    for k, v in overrides.items():
        setattr(config, k, v)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tr.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # random norms and biases, so that a readout that skips one of them is caught
        for name_, p in model.named_parameters():
            if "norm" in name_ or "ln" in name_.split(".")[-2] or name_.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model
