"""models/chat_template.py: chat templates render as transformers' apply_chat_template does
(text and token ids), are found where checkpoints keep them, and refuse bad conversations
with InvalidRequestError."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.models.chat_template import ChatTemplate
from jaxoverlap.models.loader import default_model_path
from jaxoverlap.models.tokenizer import Tokenizer

# A ChatML template in the style of Qwen3's: whitespace control, a default system turn, tools
# through tojson, loop controls, a template variable (enable_thinking) and raise_exception.
CHATML = """
{%- if tools %}
<|im_start|>system
{{- messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{%- elif messages[0].role != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
{%- endif %}
{% for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + message.role) }}{% endif %}
{%- if message.role == 'system' and tools %}{% continue %}{% endif %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% if loop.index > 20 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}
"""

# Llama-3 style: the BOS is the template's own, a date from strftime_now, generation tags.
LLAMA = """{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}
{%- else %}{{ message['content'] | trim }}{% endif %}
{{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\nYear ' + strftime_now('%Y') + '\\n' }}{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Bonjour, ça va ? 中文"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "  Hello!  "}, {"role": "user", "content": "Again"}],
]
# Special tokens of the embedded model's vocabulary, so that both sides encode them as one id.
SPECIALS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
TOOLS = [{"type": "function", "function": {"name": "météo", "parameters": {"city": "string"}}}]


@pytest.fixture(scope="module")
def base() -> Tokenizer:
    return Tokenizer.from_path(default_model_path())


def _hf_tokenizer(base: Tokenizer, template: str):
    import tokenizers
    import transformers

    # A copy: transformers may register the special tokens on the object it is given.
    copy = tokenizers.Tokenizer.from_str(base.hf_tokenizer.to_str())
    return transformers.PreTrainedTokenizerFast(tokenizer_object=copy, chat_template=template, **SPECIALS)


def _ids(encoded) -> list[int]:
    # transformers returns a list of ids or, in newer releases, a BatchEncoding.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.parametrize("template", [CHATML, LLAMA], ids=["chatml", "llama"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("kwargs", [{}, {"add_generation_prompt": False}, {"enable_thinking": False},
                                    {"tools": TOOLS}], ids=["plain", "no_gen_prompt", "no_thinking", "tools"])
def test_renders_as_transformers_does(base, template, conversation, kwargs):
    messages = CONVERSATIONS[conversation]
    ours = Tokenizer(base.hf_tokenizer, chat_template=ChatTemplate(template, SPECIALS))
    hf = _hf_tokenizer(base, template)
    kw = dict(kwargs)
    add = kw.pop("add_generation_prompt", True)
    want_text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, **kw)
    assert ours.apply_chat_template(messages, add_generation_prompt=add, **kw) == want_text
    want_ids = _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add, **kw))
    assert ours.encode_chat(messages, add_generation_prompt=add, **kw) == want_ids
    if "tools" in kw and template is CHATML:
        assert "météo" in want_text  # tojson keeps non-ASCII text as it is


PARTS = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
         "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}</end>{% endfor %}")


@pytest.mark.parametrize("template", [CHATML, LLAMA, PARTS], ids=["chatml", "llama", "parts"])
@pytest.mark.parametrize("answer", ["Autumn moonlight", "  spaces around  ", "ends in a newline\n"],
                         ids=["plain", "spaces", "newline"])
def test_continue_final_message_as_transformers_does(base, template, answer):
    """A prefilled assistant answer: the prompt ends with its content (the turn left open,
    trailing whitespace where the template keeps it), as transformers renders it;
    add_generation_prompt is off by default then."""
    content = [{"type": "text", "text": "x"}, {"type": "text", "text": answer}] if template is PARTS else answer
    messages = [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": content}]
    ours = Tokenizer(base.hf_tokenizer, chat_template=ChatTemplate(template, SPECIALS))
    hf = _hf_tokenizer(base, template)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    got = ours.apply_chat_template(messages, continue_final_message=True)
    assert got == want and got.rstrip().endswith(answer.strip())
    assert ours.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False) == want
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        ours.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=True)
    hidden = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}", SPECIALS)
    with pytest.raises(InvalidRequestError, match="no place to continue"):
        hidden.render(messages, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="needs text"):
        hidden.render(messages[:1] + [{"role": "assistant", "content": " "}], continue_final_message=True)


DEFINED = ("{% if tools is defined %}T({{ tools }}){% else %}t{% endif %}"
           "{% if documents is defined %}D{% else %}d{% endif %}{{ messages[0].content }}")


def test_tools_and_documents_are_defined_as_in_transformers(base):
    """transformers passes tools and documents as None when not given: `is defined` holds."""
    ours = Tokenizer(base.hf_tokenizer, chat_template=ChatTemplate(DEFINED, SPECIALS))
    hf = _hf_tokenizer(base, DEFINED)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True) == "T(None)Dhi"


def test_template_refusals_and_malformed_messages_are_invalid_requests(base):
    tok = Tokenizer(base.hf_tokenizer, chat_template=ChatTemplate(CHATML))
    with pytest.raises(InvalidRequestError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    for bad in ([], "hello", [{"content": "no role"}], [{"role": 3, "content": "x"}], ["text"]):
        with pytest.raises(InvalidRequestError, match="message"):
            tok.apply_chat_template(bad)
    # A template that cannot read what it was given says so, as a bad request.
    tok = Tokenizer(base.hf_tokenizer, chat_template=ChatTemplate("{{ messages[0].content.upper() + 1 }}"))
    with pytest.raises(InvalidRequestError, match="refused"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_a_model_without_a_template_refuses_messages(base):
    assert base.chat_template is None  # the embedded model has none
    with pytest.raises(InvalidRequestError, match="no chat template"):
        base.encode_chat([{"role": "user", "content": "hi"}])


def test_found_where_checkpoints_keep_it(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(default_model_path(), model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["bos_token"] = {"content": "<|im_start|>", "special": True}  # an AddedToken dict

    def save(**fields):
        config_path.write_text(json.dumps({**config, **fields}))
        return Tokenizer.from_path(str(model)).chat_template

    message = [{"role": "user", "content": "hi"}]
    assert save(chat_template="A{{ bos_token }}{{ messages[0].content }}").render(message) == "A<|im_start|>hi"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    assert save(chat_template=named).render(message) == "D" + config["eos_token"]
    assert save(chat_template=named).render(message, tools=TOOLS) == "T"  # given tools, as transformers picks
    (model / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert save(chat_template="ignored").render(message) == "J1"  # the .jinja file comes first
    # transformers' save_pretrained writes named templates besides it, one file each.
    os.mkdir(model / "additional_chat_templates")
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("T{{ tools | length }}")
    assert save(chat_template="ignored").render(message, tools=TOOLS) == f"T{len(TOOLS)}"
    assert save().render(message) == "J1"
    os.remove(model / "chat_template.jinja")
    shutil.rmtree(model / "additional_chat_templates")
    only_tools = save(chat_template=[{"name": "tool_use", "template": "T"}])
    assert only_tools.render(message, tools=TOOLS) == "T"
    with pytest.raises(InvalidRequestError, match="none is 'default'"):
        only_tools.render(message)
    assert save(chat_template=[]) is None


def test_templates_saved_by_transformers(tmp_path):
    """A tokenizer with a default and a tool_use template, saved by transformers itself: the
    same template renders the same conversation, with and without tools."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(default_model_path())
    hf.chat_template = {"default": "D{% for m in messages %}{{ m.content }}{% endfor %}",
                        "tool_use": "T{{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}"}
    hf.save_pretrained(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_path(str(tmp_path))
    message = [{"role": "user", "content": "hi"}]
    for kwargs in ({}, {"tools": TOOLS}):
        want = hf.apply_chat_template(message, tokenize=False, add_generation_prompt=False, **kwargs)
        assert ours.apply_chat_template(message, add_generation_prompt=False, **kwargs) == want
    assert want == f"T{len(TOOLS)}hi"


# Every key of every message, and the tools, as the template sees them.
SHOW_KEYS = ("{% for m in messages %}{{ m.role }}:{% for k, v in m | dictsort %}{{ k }}={{ v }};{% endfor %}|"
             "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}")


def get_weather(city: str, days: int = 1) -> str:
    """Gets the weather.

    Args:
        city: The city to look up.
        days: How many days ahead.
    """
    return city * days


def test_messages_and_tools_are_normalized_as_in_transformers(base):
    """OpenAI-style None fields are dropped (a Llama-3.1 template tests `'tool_calls' in
    message`), older reasoning keys also reach the template as reasoning_content, and tools
    given as Python functions become their JSON schemas."""
    ours = Tokenizer(base.hf_tokenizer, chat_template=ChatTemplate(SHOW_KEYS, SPECIALS))
    hf = _hf_tokenizer(base, SHOW_KEYS)
    messages = [{"role": "user", "content": "hi", "name": None},
                {"role": "assistant", "content": "ok", "tool_calls": None, "reasoning": "because"},
                {"role": "assistant", "content": "x", "thinking": "hmm"}]
    for tools in (None, TOOLS + [get_weather]):
        got = ours.apply_chat_template(messages, tools=tools)
        assert got == hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert "None" not in got and "reasoning_content=because" in got
    assert '"description": "The city to look up."' in got
    with pytest.raises(InvalidRequestError, match="JSON schema"):
        ours.apply_chat_template(messages, tools=[3])


def test_a_tokenizer_with_its_template_pickles(base):
    """An EngineProcess sends the engine's tokenizer to the server's process by pickling it."""
    import pickle

    tok = Tokenizer(base.hf_tokenizer, chat_template=ChatTemplate(CHATML, SPECIALS))
    copy = pickle.loads(pickle.dumps(tok))
    messages = CONVERSATIONS[1]
    assert copy.encode_chat(messages, tools=TOOLS) == tok.encode_chat(messages, tools=TOOLS)
    assert copy.chat_template.special_tokens == SPECIALS
