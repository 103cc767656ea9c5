"""Render chat templates (jinja2, sandboxed) the way Hugging Face's apply_chat_template does.

The model's own template comes from the GGUF (tokenizer.chat_template) or tokenizer_config.json;
a model without one gets its family's default format (Gemma: turns; everything else: ChatML).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shoal.engine.models.registry import find_family

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

class ChatTemplateError(ValueError):
    """The template failed to render these messages (or called raise_exception)."""


def default_template(architecture: str) -> str:
    """The chat format for a model whose checkpoint carries no template: its family's
    (models/families/), else ChatML."""
    family = find_family(architecture)
    template = family.default_chat_template if family is not None else None
    return template or CHATML_TEMPLATE


class _GenerationBlock(Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` marker and render its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson keeps non-ASCII text as is, unlike jinja's HTML-safe built-in.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template plus the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template must be a non-empty string")
        self.source = source
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        environment = _make_environment()
        try:
            self._template = environment.from_string(source)
            variables = meta.find_undeclared_variables(environment.parse(source))
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template does not compile: {error}") from error
        # Templates written for tool calling read the `tools` variable (HF convention); the
        # others never see the tool list, so callers describe tools in a system message.
        self.uses_tools = "tools" in variables

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for these messages (special tokens written out, not yet encoded)."""
        context = dict(self._special_tokens)
        context.update(extra)
        context.update(messages=normalize_messages(messages),
                       add_generation_prompt=add_generation_prompt,
                       tools=list(tools) if tools else None)
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError) as error:
            raise ChatTemplateError(f"chat template failed to render: {error}") from error


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate messages and turn text-only content part lists into plain strings.

    Most templates concatenate message['content'] as a string; OpenAI clients may send
    [{"type": "text", "text": ...}] parts, and assistant turns with tool calls send None.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError("messages must be a list of {role, content} objects")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{index}].role must be a non-empty string")
        item = dict(message)
        item["content"] = _content_text(message.get("content"), index)
        normalized.append(item)
    return normalized


def _content_text(content: Any, index: int) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = list(content)
        if all(isinstance(p, Mapping) and p.get("type") == "text" for p in parts):
            return "".join(str(p.get("text", "")) for p in parts)
        # Mixed parts (images...) stay a list for templates that understand them.
        return parts
    raise ValueError(f"messages[{index}].content must be a string or a list of parts")
