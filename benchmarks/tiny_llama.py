"""A small Llama with random weights and a word-level tokenizer, saved as a local Hugging Face
directory that vLLM and the HF worker both load (no download)."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LlamaShape:
    """The geometry of the model; the defaults start fast in tests."""

    num_layers: int = 2
    hidden: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 2048


TESTS = LlamaShape()
# Blocks of real size: 128 tokens x 8 layers x 8 KV heads x 64 x 2 (K and V) x 4 bytes = 4 MiB per vLLM block.
BENCH = LlamaShape(num_layers=8, hidden=512, num_heads=8, num_kv_heads=8, head_dim=64, intermediate=1024, vocab=4096)


def save_tiny_llama(path: str | pathlib.Path, shape: LlamaShape = TESTS, seed: int = 0) -> pathlib.Path:
    """Write config.json, model.safetensors and a tokenizer into `path` (created); returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, shape.vocab)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                         num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompt_ids(num_tokens: int, seed: int, vocab: int = TESTS.vocab) -> list[int]:
    """`num_tokens` ordinary word ids (no special ones), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num_tokens,), generator=generator).tolist()
