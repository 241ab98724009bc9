"""The embedded default model, local-directory loading, weights digests and namespaces."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tiercache.errors import InvalidArgument
from tiercache.worker.kvcache import prefill
from tiercache.worker.model import (
    ByteTokenizer,
    HFTokenizer,
    default_digest_cache,
    default_model_config,
    load_default_model,
    load_model,
    namespace_for,
    weights_digest,
)


@pytest.fixture(autouse=True)
def private_cache_home(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """Digest memos go to a temp XDG_CACHE_HOME, never the user's."""
    home = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("text", ["", "hello, world", "naïve café — 東京 🚀", "line\nbreak\ttab\0nul"])
def test_byte_tokenizer_round_trip(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len(text.encode("utf-8"))
    assert all(tokenizer.offset <= i < tokenizer.vocab_size for i in ids[1:])
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_bos=False) == ids[1:]


def test_byte_tokenizer_decode_edge_cases() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == 259
    assert tokenizer.decode([tokenizer.bos_token_id, 0xFF + tokenizer.offset, tokenizer.eos_token_id]) == "\ufffd"
    with pytest.raises(InvalidArgument, match="token id 259 at position 1"):
        tokenizer.decode([5, 259])


def test_default_model_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = load_default_model()
    assert torch.equal(torch.rand(1), before)  # loading used its own seeded RNG, not the caller's
    second = load_default_model()
    assert first.weights == second.weights == weights_digest(second.model)
    ids = ByteTokenizer().encode("determinism")
    assert torch.equal(prefill(first.model, ids, None)[0], prefill(second.model, ids, None)[0])
    assert load_default_model(seed=1).weights != first.weights


def test_default_model_shape_and_namespace() -> None:
    config = default_model_config()
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.max_position_embeddings) == (4, 256, 4, 2, 64, 512, 8192)
    assert config.vocab_size == ByteTokenizer.vocab_size
    loaded = load_model(None)
    assert isinstance(loaded.tokenizer, ByteTokenizer) and not loaded.model.training
    assert loaded.model.config._attn_implementation == "eager"
    ns = namespace_for(loaded, block_tokens=16, adapter="lora-a", salt="user-1")
    assert (ns.model, ns.weights, ns.dtype) == (loaded.name, loaded.weights, "float32")
    assert (ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.block_tokens) == (4, 2, 64, 16)
    assert (ns.adapter, ns.salt) == ("lora-a", "user-1")
    assert namespace_for(loaded, block_tokens=16, salt="user-2").digest() != ns.digest()
    half = load_default_model(dtype=torch.bfloat16)
    assert half.dtype == "bfloat16" and half.weights != loaded.weights
    assert namespace_for(half, block_tokens=16).digest() != namespace_for(loaded, block_tokens=16).digest()


def test_load_model_from_directory_without_tokenizer(tmp_path: pathlib.Path, private_cache_home: pathlib.Path) -> None:
    original = _tiny_llama()
    model_dir = tmp_path / "tiny-llama"
    original.save_pretrained(model_dir)
    assert (model_dir / "model.safetensors").is_file()

    loaded = load_model(model_dir)
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.name == "llama/tiny-llama" and (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (2, 2, 16)
    ids = ByteTokenizer().encode("same weights")
    assert torch.allclose(prefill(loaded.model, ids, None)[0], prefill(original, ids, None)[0], atol=1e-5)

    memo = default_digest_cache()
    assert memo.is_relative_to(private_cache_home)
    entries = json.loads(memo.read_text())["files"]
    assert set(map(pathlib.Path, entries)) == {model_dir / "model.safetensors", model_dir / "config.json"}
    assert load_model(model_dir).weights == loaded.weights


def test_weights_digest_trusts_memo_only_while_size_and_mtime_match(tmp_path: pathlib.Path) -> None:
    model_dir = tmp_path / "m"
    _tiny_llama().save_pretrained(model_dir)
    memo = tmp_path / "memo.json"
    digest = weights_digest(model_dir, cache_file=memo)
    weights_file = str((model_dir / "model.safetensors").resolve())

    # A memo entry with the file's size and mtime is believed (that is the point: no rehash).
    data = json.loads(memo.read_text())
    data["files"][weights_file]["blake2b"] = "0" * 64
    memo.write_text(json.dumps(data))
    assert weights_digest(model_dir, cache_file=memo) != digest

    # Different weights saved over the same path change the mtime, so the memo is bypassed.
    _tiny_llama(seed=1).save_pretrained(model_dir)
    stat = os.stat(weights_file)
    os.utime(weights_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    changed = weights_digest(model_dir, cache_file=memo)
    assert changed == weights_digest(model_dir, cache_file=tmp_path / "fresh.json") != digest

    memo.write_text("{not json")  # a damaged memo costs a rehash, never an error
    assert weights_digest(model_dir, cache_file=memo) == changed


def test_load_model_uses_directory_tokenizer(tmp_path: pathlib.Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    model_dir = tmp_path / "with-tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(model_dir)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    LlamaForCausalLM(config).save_pretrained(model_dir)

    loaded = load_model(model_dir)
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.tokenizer.encode("hello world") == [3, 4]
    assert loaded.tokenizer.decode([1, 3, 4, 2]) == "hello world"
    assert (loaded.tokenizer.vocab_size, loaded.tokenizer.eos_token_id) == (5, 2)


def test_load_gpt2_directory_in_bfloat16(tmp_path: pathlib.Path) -> None:
    model_dir = tmp_path / "tiny-gpt2"
    config = GPT2Config(vocab_size=ByteTokenizer.vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                        bos_token_id=1, eos_token_id=2)
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    loaded = load_model(model_dir, dtype=torch.bfloat16)
    ns = namespace_for(loaded, block_tokens=8)
    assert (ns.model, ns.dtype, ns.num_layers, ns.num_kv_heads, ns.head_dim) == ("gpt2/tiny-gpt2", "bfloat16", 2, 4, 16)
    assert loaded.model.dtype == torch.bfloat16


def test_load_model_rejects_bad_directories(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument, match="config.json and \\*.safetensors"):
        load_model(tmp_path / "empty")
    with pytest.raises(InvalidArgument, match="no \\*.safetensors"):
        weights_digest(tmp_path / "empty")
