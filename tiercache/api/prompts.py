"""Prompts as token ids: the model's chat template (or the built-in one), tokenized once, and breakpoints."""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

from tiercache.errors import InvalidArgument

# The built-in model's template: plain role markers, tools listed after the system text. Its tokens are
# the cache key, so it renders the same conversation prefix to the same text every time (no date).
DEFAULT_TEMPLATE = (
    "{%- if tools %}{{ '<|system|>' }}{% for m in messages if m.role == 'system' %}{{ m.content + '\n' }}"
    "{% endfor %}{{ '# Tools\n' }}{% for t in tools %}{{ (t | tojson) + '\n' }}{% endfor %}{% endif %}"
    "{%- for m in messages if not (tools and m.role == 'system') %}{{ '<|' + m.role + '|>' + (m.content or '') }}"
    "{% for call in m.tool_calls or [] %}"
    "{{ '<|call|>' + call.function.name + ' ' + (call.function.arguments | tojson) }}"
    "{% endfor %}{{ '\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatFormat:
    """Renders messages with a Jinja chat template and tokenizes the text exactly once.

    For a Hugging Face tokenizer the template is its own (`chat_template`), unless `template` is
    given; the rendered text already holds whatever BOS the model expects, so it is tokenized
    without adding special tokens (never a double BOS). The built-in byte tokenizer's template has
    no BOS text, and its encode adds the one BOS.
    """

    def __init__(self, tokenizer: Any, hf_tokenizer: Any | None = None, template: str | None = None) -> None:
        import jinja2.sandbox

        self.tokenizer = tokenizer
        self._hf = hf_tokenizer
        source = template or (getattr(hf_tokenizer, "chat_template", None) if hf_tokenizer is not None else None)
        self.template_source = source or DEFAULT_TEMPLATE
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["strftime_now"] = _strftime_now
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(self.template_source)

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = True) -> str:
        special = {}
        if self._hf is not None:
            special = {"bos_token": self._hf.bos_token or "", "eos_token": self._hf.eos_token or ""}
        try:
            return self._template.render(messages=list(messages), tools=list(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt, **special)
        except InvalidArgument:
            raise
        except Exception as e:  # noqa: BLE001 - a template's own error names what it did not accept
            raise InvalidArgument(f"messages: the model's chat template failed: {e}") from None

    def encode(self, text: str, *, templated: bool) -> list[int]:
        """Token ids of `text`; `templated` text from render() gets no special tokens added by HF tokenizers."""
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=not templated))
        return self.tokenizer.encode(text)

    def chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
             marks: Sequence[int] = ()) -> tuple[list[int], list[int]]:
        """(token ids of the conversation with the generation prompt, breakpoints): a breakpoint for each
        message index in `marks` (-1: after the tools alone), at the end of that message's tokens
        (where the prefix rendering stops agreeing with the whole)."""
        tokens = self.encode(self.render(messages, tools), templated=True)
        points = []
        for mark in marks:
            prefix = self.encode(self.render(messages[: mark + 1], tools, add_generation_prompt=False), templated=True)
            points.append(_common_prefix(prefix, tokens))
        return tokens, sorted({p for p in points if p > 0})


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _tojson(value: Any, indent: int | None = None) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise InvalidArgument(f"messages: {message}")


def load_chat_format(model_dir: str | None, template_file: str | None = None) -> ChatFormat:
    """The tokenizer of `model_dir` (the built-in byte tokenizer when None) and its chat template, or the
    Jinja template in `template_file`. Loads no weights."""
    template = None
    if template_file is not None:
        try:
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise InvalidArgument(f"--chat-template {template_file!r}: {e.strerror}") from None
    if model_dir is None:
        from tiercache.worker.model import ByteTokenizer

        return ChatFormat(ByteTokenizer(), None, template)
    from transformers import AutoTokenizer

    from tiercache.worker.model import ByteTokenizer, HFTokenizer

    path = os.path.abspath(model_dir)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, name)) for name in names):
        return ChatFormat(ByteTokenizer(), None, template)  # as the worker does: bytes when there is no tokenizer
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return ChatFormat(HFTokenizer(hf), hf, template)
