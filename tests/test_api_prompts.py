"""Prompts as token ids: a Hugging Face tokenizer's own chat template gives the ids its apply_chat_template
gives (one BOS, never two), breakpoints land at the end of the marked message, and text deltas hold back
incomplete characters and possible stop strings."""

from __future__ import annotations

import pytest

from tiercache.api.generate import TextStream
from tiercache.api.prompts import ChatFormat, load_chat_format
from tiercache.errors import InvalidArgument
from tiercache.worker.model import ByteTokenizer, HFTokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.role }} : {{ m.content }} {{ eos_token }} {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


@pytest.fixture(scope="module")
def hf():
    """A word-level tokenizer built here (nothing downloaded) that adds BOS like Llama's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "system", "user", "assistant", ":", "be", "brief", "lights", "on", "off"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def test_the_models_own_template_gives_apply_chat_templates_ids_with_one_bos(hf) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "lights on"}]
    chat = ChatFormat(HFTokenizer(hf), hf)
    tokens, _ = chat.chat(messages)
    assert tokens == list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    assert tokens.count(hf.bos_token_id) == 1 and tokens[0] == hf.bos_token_id
    assert chat.encode("lights on", templated=False)[0] == hf.bos_token_id  # raw text gets its BOS


def test_a_breakpoint_falls_at_the_end_of_the_marked_message(hf) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "lights off"}]
    tokens, points = ChatFormat(HFTokenizer(hf), hf).chat(messages, marks=[0])
    # <s> system : be brief </s> | user : lights off </s> assistant :
    assert points == [6] and tokens[5] == hf.eos_token_id and tokens[6] == hf.convert_tokens_to_ids("user")
    byte_tokens, byte_points = load_chat_format(None).chat(messages, marks=[0, 1])
    assert byte_points[0] == len(ByteTokenizer().encode("<|system|>be brief\n"))
    assert byte_points[1] == len(byte_tokens) - len("<|assistant|>")


def test_a_template_error_is_a_400_naming_it() -> None:
    chat = ChatFormat(ByteTokenizer(), None, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidArgument, match="messages: roles must alternate"):
        chat.chat([{"role": "user", "content": "hi"}])


def test_text_deltas_hold_back_incomplete_characters_and_stop_strings() -> None:
    stream = TextStream(ByteTokenizer(), ["STOP"])
    out = [stream.feed(b + 3) for b in "é ok ST".encode()]
    assert "".join(out) == "é ok"  # the last 3 characters may begin the stop string: held
    assert out[0] == ""  # half of é
    assert stream.feed(ord("O") + 3) == " "  # " ST" + "O": the space cannot begin "STOP"
    assert stream.feed(ord("P") + 3) == "" and stream.stopped == "STOP"
    assert stream.text == "é ok "
    loose = TextStream(ByteTokenizer(), [])
    assert [loose.feed(b + 3) for b in b"\xff\xfeA"] == ["", "", "\ufffd\ufffdA"]  # bytes that never make one
