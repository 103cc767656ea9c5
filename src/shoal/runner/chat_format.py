"""How a model's chats are written and its replies read, chosen once per runner from its
tokenizer: the prompt a request renders to, the grammar and sampling its output follows,
and what reads its output back.

    TemplateChat   the chat template as is; tool calls taken out of the reply
    ThinkTagChat   a template that mentions </think> (Qwen3, QwQ, DeepSeek-R1): reasoning
                   between <think> tags, enable_thinking passed to the template
    HarmonyChat    a vocabulary with harmony's special tokens (gpt-oss): harmony_use.py

Only a chat (messages) goes through a chat format; a raw prompt is generated as written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from shoal.engine.core import PromptTokenizer
from shoal.engine.grammar_spec import GrammarSpec
from shoal.engine.sampling import InvalidParameter, SamplingParams
from shoal.protocol import GenerationRequest
from shoal.runner.harmony_stream import HarmonyStream
from shoal.runner.harmony_use import forced_reply, harmony_prompt
from shoal.runner.think_stream import ThinkStream, opens_thinking, uses_think_tags
from shoal.runner.tool_stream import ToolCallStream
from shoal.runner.tool_use import (
    TemplateToolSupport,
    chat_prompt,
    offered_tools,
    output_grammar,
)

# (messages, tools, extra template variables) -> prompt text: the engine's render_chat
RenderChat = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None,
                       dict[str, Any] | None], str]
OutputStream = ToolCallStream | ThinkStream | HarmonyStream


class TemplateChat:
    """The model's chat template; a model that cannot reason."""

    reasons = False

    def __init__(self, tokenizer: PromptTokenizer, render: RenderChat) -> None:
        template = tokenizer.chat_template
        self.tool_support = TemplateToolSupport.of(template.source, template.uses_tools)
        self._render = render

    def prompt(self, request: GenerationRequest) -> str:
        variables = self.variables(request)
        return chat_prompt(request, self.tool_support,
                           lambda messages, tools: self._render(messages, tools, variables))

    def variables(self, request: GenerationRequest) -> dict[str, Any] | None:
        return None

    def output_rules(self, request: GenerationRequest
                     ) -> tuple[GrammarSpec | None, SamplingParams]:
        return output_grammar(request, self.tool_support.call_format), request.sampling

    def output_stream(self, request: GenerationRequest) -> OutputStream | None:
        names = [tool.name for tool in offered_tools(request)]
        return ToolCallStream(names) if names else None


class ThinkTagChat(TemplateChat):
    """A template whose model reasons between <think> and </think>."""

    reasons = True

    def __init__(self, tokenizer: PromptTokenizer, render: RenderChat) -> None:
        super().__init__(tokenizer, render)
        self._opens: dict[bool | None, bool] = {}  # enable_thinking -> prompt opens <think>

    def variables(self, request: GenerationRequest) -> dict[str, Any] | None:
        if request.reasoning is None:
            return None  # the template's own default
        return {"enable_thinking": request.reasoning.enabled}

    def output_stream(self, request: GenerationRequest) -> OutputStream | None:
        names = [tool.name for tool in offered_tools(request)]
        enabled = request.reasoning is None or request.reasoning.enabled
        return ThinkStream(names, return_reasoning=enabled,
                           inside=self._prompt_opens_thinking(request))

    def _prompt_opens_thinking(self, request: GenerationRequest) -> bool:
        """Whether the template's generation prompt ends inside <think> (asked once per
        setting, on a one-message chat)."""
        variables = self.variables(request)
        key = None if variables is None else variables["enable_thinking"]
        if key not in self._opens:
            probe = self._render([{"role": "user", "content": "hi"}], None, variables)
            self._opens[key] = opens_thinking(probe)
        return self._opens[key]


class HarmonyChat:
    """OpenAI's harmony format (gpt-oss): the file's template or shoal's renderer."""

    reasons = True

    def __init__(self, tokenizer: PromptTokenizer, render: RenderChat) -> None:
        self._render = render if tokenizer.has_chat_template else None

    def prompt(self, request: GenerationRequest) -> str:
        return harmony_prompt(request, self._render)

    def output_rules(self, request: GenerationRequest
                     ) -> tuple[GrammarSpec | None, SamplingParams]:
        forced = forced_reply(request)
        # The reply's headers are special tokens: the parser must see them as text.
        sampling = dataclasses.replace(request.sampling, skip_special_tokens=False)
        return (None if forced is None else forced.grammar), sampling

    def output_stream(self, request: GenerationRequest) -> OutputStream | None:
        forced = forced_reply(request)
        enabled = request.reasoning is None or request.reasoning.enabled
        return HarmonyStream([tool.name for tool in offered_tools(request)],
                             return_reasoning=enabled,
                             prefilled_header=None if forced is None else forced.header)


ChatFormat = TemplateChat | ThinkTagChat | HarmonyChat


def choose_chat_format(tokenizer: PromptTokenizer, render: RenderChat) -> ChatFormat:
    if tokenizer.speaks_harmony:
        return HarmonyChat(tokenizer, render)
    if uses_think_tags(tokenizer.chat_template.source):
        return ThinkTagChat(tokenizer, render)
    return TemplateChat(tokenizer, render)


def check_reasoning(request: GenerationRequest, chat_format: ChatFormat,
                    model_id: str) -> None:
    """InvalidParameter when reasoning is asked of a model (or a raw prompt) that cannot
    reason."""
    reasoning = request.reasoning
    asked = reasoning is not None and (reasoning.enabled or reasoning.effort is not None)
    if not asked or (chat_format.reasons and request.messages is not None):
        return
    what = "a raw prompt" if chat_format.reasons else f"model {model_id!r}"
    raise InvalidParameter(reasoning.param, f"{what} does not support reasoning")
