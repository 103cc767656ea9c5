"""Tools and response formats in engine terms: grammars, schemas and the rendered prompt."""

from __future__ import annotations

import json

import pytest

from shoal.engine.sampling import InvalidParameter
from shoal.engine.tokenizer.chat_template import CHATML_TEMPLATE, ChatTemplate
from shoal.protocol import (
    ChatMessage,
    ForcedTool,
    GenerationRequest,
    ResponseFormat,
    ToolCall,
    ToolSpec,
)
from shoal.runner.tool_format import (
    BARE_JSON,
    MISTRAL,
    TAGGED,
    call_schema,
    closed_schema,
    format_for_template,
)
from shoal.runner.tool_use import (
    TemplateToolSupport,
    chat_prompt,
    check_tools,
    grammar_param,
    output_grammar,
)

WEATHER = ToolSpec(name="get_weather", description="Weather in a city",
                   parameters={"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]})
ADD = ToolSpec(name="add", parameters={"type": "object",
                                       "properties": {"a": {"type": "number"}}})
USER = ChatMessage(role="user", content="Weather in Paris?")

# A minimal HF-style template that reads `tools` and renders tool turns itself.
NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}{{ m.role }}: CALLS {{ m.tool_calls | tojson }}\n"
    "{% elif m.role == 'tool' %}tool[{{ m.tool_call_id }}/{{ m.name }}]: {{ m.content }}\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{% endfor %}<tool_call> goes here")


def request(**fields) -> GenerationRequest:
    return GenerationRequest(request_id="r", model="m", messages=(USER,), **fields)


def render(template: ChatTemplate):
    return lambda messages, tools: template.render(messages, tools=tools)


def test_format_follows_the_template():
    assert format_for_template(CHATML_TEMPLATE, uses_tools=False) is TAGGED
    assert format_for_template("... <tool_call> ... tools ...", uses_tools=True) is TAGGED
    assert format_for_template("... [TOOL_CALLS] ... tools", uses_tools=True) is MISTRAL
    assert format_for_template("{{ tools }} parameters", uses_tools=True) is BARE_JSON
    assert ChatTemplate(NATIVE_TEMPLATE).uses_tools
    assert not ChatTemplate(CHATML_TEMPLATE).uses_tools


def test_response_formats_become_json_grammars():
    assert output_grammar(request(), TAGGED) is None
    assert output_grammar(request(response_format=ResponseFormat(type="text")), TAGGED) is None
    spec = output_grammar(request(response_format=ResponseFormat(type="json_object")), TAGGED)
    assert spec.json_schema == {"type": "object"}
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    spec = output_grammar(request(response_format=ResponseFormat(
        type="json_schema", json_schema=schema)), TAGGED)
    assert spec.json_schema == {**schema, "additionalProperties": False}
    with pytest.raises(InvalidParameter) as error:
        output_grammar(request(response_format=ResponseFormat(type="json_schema")), TAGGED)
    assert error.value.param == "response_format"


def test_tool_choice_decides_the_grammar():
    tools = (WEATHER, ADD)
    assert output_grammar(request(tools=tools), TAGGED) is None  # auto: free text
    assert output_grammar(request(tools=tools, tool_choice="none",
                                  response_format=ResponseFormat(type="json_object")),
                          TAGGED).json_schema == {"type": "object"}
    required = output_grammar(request(tools=tools, tool_choice="required"), TAGGED).lark
    assert required.startswith("start: call") and '"<tool_call>\\n"' in required
    assert '"const": "get_weather"' in required and '"const": "add"' in required
    forced = output_grammar(request(tools=tools, tool_choice=ForcedTool(name="add")),
                            TAGGED).lark
    assert '"const": "add"' in forced and "get_weather" not in forced
    either = output_grammar(request(tools=tools,
                                    response_format=ResponseFormat(type="json_object")),
                            TAGGED).lark
    assert either.startswith("start: call | answer")


def test_call_schema_shapes():
    one = call_schema(BARE_JSON, (WEATHER,))
    assert one["required"] == ["name", "parameters"]
    assert one["properties"]["parameters"]["additionalProperties"] is False
    listed = call_schema(MISTRAL, (WEATHER, ADD))
    assert listed["type"] == "array" and listed["maxItems"] == 1
    assert [o["properties"]["name"]["const"] for o in listed["items"]["anyOf"]] == \
        ["get_weather", "add"]


def test_closed_schema_closes_objects_but_not_allof_branches():
    schema = {"type": "object",
              "properties": {"inner": {"type": "object", "properties": {"a": {}}},
                             "free": {"type": "object", "additionalProperties": True},
                             "list": {"type": "array",
                                      "items": {"properties": {"b": {}}}}},
              "allOf": [{"properties": {"c": {}}}],
              "$defs": {"d": {"properties": {"e": {}}}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["free"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is left alone


def test_check_tools_rejects_what_cannot_be_served():
    cases = [(dict(tool_choice="required"), "tool_choice"),
             (dict(tools=(WEATHER,), tool_choice=ForcedTool(name="nope")), "tool_choice"),
             (dict(tools=(WEATHER, WEATHER)), "tools")]
    for fields, param in cases:
        with pytest.raises(InvalidParameter) as error:
            check_tools(request(**fields))
        assert error.value.param == param
    check_tools(request(tools=(WEATHER,), tool_choice=ForcedTool(name="get_weather")))
    assert grammar_param(request(tools=(WEATHER,), tool_choice="required")) == "tools"
    assert grammar_param(request(response_format=ResponseFormat(type="json_object"))) == \
        "response_format"


HISTORY = (
    ChatMessage(role="system", content="Be brief."),
    USER,
    ChatMessage(role="assistant", content="",
                tool_calls=(ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}'),)),
    ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="c1"),
    ChatMessage(role="tool", content='{"temp": 22}', tool_call_id="c1"),
)


def test_template_without_tools_gets_a_system_section_and_text_turns():
    template = ChatTemplate(CHATML_TEMPLATE)
    support = TemplateToolSupport.of(template.source, template.uses_tools)
    prompt = chat_prompt(request(tools=(WEATHER,), tool_choice="required").model_copy(
        update={"messages": HISTORY}), support, render(template))
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions")
    assert json.dumps({"name": "get_weather", "description": "Weather in a city",
                       "parameters": WEATHER.parameters}) in system
    assert "You must call one of these functions now." in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in prompt
    # Both results share one user turn; no "tool" role reaches a template that lacks it.
    assert ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
            '<tool_response>\n{"temp": 22}\n</tool_response><|im_end|>') in prompt
    assert "<|im_start|>tool" not in prompt


def test_tool_choice_none_offers_no_tools():
    template = ChatTemplate(CHATML_TEMPLATE)
    support = TemplateToolSupport.of(template.source, template.uses_tools)
    prompt = chat_prompt(request(tools=(WEATHER,), tool_choice="none"), support,
                         render(template))
    assert "get_weather" not in prompt and "system" not in prompt


def test_native_template_gets_tools_and_structured_turns():
    template = ChatTemplate(NATIVE_TEMPLATE)
    support = TemplateToolSupport.of(template.source, template.uses_tools)
    assert support.native and support.call_format is TAGGED
    prompt = chat_prompt(request(tools=(WEATHER,)).model_copy(update={"messages": HISTORY}),
                         support, render(template))
    tools_line = prompt.splitlines()[0]
    assert json.loads(tools_line[len("TOOLS:"):]) == [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "Weather in a city",
                                          "parameters": WEATHER.parameters}}]
    assert ('assistant: CALLS [{"id": "c1", "type": "function", "function": '
            '{"name": "get_weather", "arguments": {"city": "Paris"}}}]') in prompt
    assert 'tool[c1/get_weather]: {"temp": 21}' in prompt
    assert "You can call these functions" not in prompt
