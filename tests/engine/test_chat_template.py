"""Chat template rendering: HF-compatible jinja, family defaults, SmolLM2 equals transformers."""

from __future__ import annotations

import pytest
from tokenizer_fixtures import (
    gemma3_path,
    smollm2_path,
    tiny_byte_level_metadata,
    tiny_sentencepiece_metadata,
)

from shoal.engine.config import ModelSource
from shoal.engine.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    default_template,
)
from shoal.engine.tokenizer.gguf_vocab import build_tokenizer, tokenizer_info
from shoal.engine.tokenizer.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi there."},
    {"role": "user", "content": "What is 2+2?"},
]


def test_chatml_default_and_generation_prompt():
    template = ChatTemplate(CHATML_TEMPLATE)
    text = template.render([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not template.render([{"role": "user", "content": "Hi"}],
                               add_generation_prompt=False).endswith("assistant\n")


def test_gemma_default_format_folds_system_and_renames_assistant():
    template = ChatTemplate(default_template("gemma3"), {"bos_token": "<bos>"})
    text = template.render([{"role": "system", "content": "Be brief."}] + CONVERSATION)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHello!<end_of_turn>\n"
        "<start_of_turn>model\nHi there.<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n")


def test_hf_helpers_trim_blocks_and_tojson():
    source = (
        "{% if tools %}\n"
        "{{ tools | tojson }}\n"
        "{% endif %}\n"
        "{% for m in messages %}\n"
        "  {{ m.role }}:{{ m.content }};\n"
        "{% endfor %}\n"
        "{% generation %}{{ strftime_now('%Y') | length }}{% endgeneration %}"
    )
    tools = [{"name": "météo", "parameters": {}}]
    text = ChatTemplate(source).render([{"role": "user", "content": "x"}], tools=tools)
    assert text == '[{"name": "météo", "parameters": {}}]\n  user:x;\n4'


def test_raise_exception_and_sandbox_become_chat_template_errors():
    failing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        failing.render([{"role": "user", "content": "x"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for %}")


def test_messages_are_validated_and_text_parts_flattened():
    template = ChatTemplate(CHATML_TEMPLATE)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert "user\nab<|im_end|>" in template.render([{"role": "user", "content": parts}])
    assert "assistant\n<|im_end|>" in template.render([{"role": "assistant", "content": None}])
    with pytest.raises(ValueError):
        template.render([{"content": "no role"}])
    with pytest.raises(ValueError):
        template.render("not a list")


def test_tokenizer_uses_own_template_or_family_default():
    own = Tokenizer(build_tokenizer(tiny_byte_level_metadata()),
                    tokenizer_info(tiny_byte_level_metadata()))
    assert own.has_chat_template
    assert own.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n"
    gemma = Tokenizer(build_tokenizer(tiny_sentencepiece_metadata()),
                      tokenizer_info(tiny_sentencepiece_metadata()))
    assert not gemma.has_chat_template
    text = gemma.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert gemma.encode(text).count(gemma.bos_token_id) == 1


@pytest.mark.slow
def test_smollm2_template_equals_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = smollm2_path()
    ours = Tokenizer.load(ModelSource("smollm2", "gguf", path), cache_dir=tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    system = [{"role": "system", "content": "Be terse."}]
    for messages, generation in [(CONVERSATION, True), (system + CONVERSATION, True),
                                 (CONVERSATION, False)]:
        expected = reference.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=generation)
        assert ours.apply_chat_template(messages, add_generation_prompt=generation) == expected
    text = ours.apply_chat_template(CONVERSATION)
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_gemma3_gets_default_turn_format(tmp_path):
    tokenizer = Tokenizer.load(ModelSource("gemma3", "gguf", gemma3_path()), cache_dir=tmp_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert text == "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
    ids = tokenizer.encode(text)
    assert ids[:2] == [2, 105] and ids.count(2) == 1  # <bos> <start_of_turn>, BOS once
