"""A checkpoint's chat template: chat messages -> the prompt text the model was trained on.

Hugging Face checkpoints ship the template as Jinja source, in `tokenizer_config.json`
("chat_template": a string, or a list of named templates) or, in newer checkpoints, in
`chat_template.jinja`. It is rendered here with Jinja's sandbox under the conventions that
`transformers`' `apply_chat_template` sets, since the templates are written against them:
blocks trimmed and left-stripped, loop controls, a `raise_exception` global, a non-ASCII
`tojson` filter, a `strftime_now` global, the special tokens as variables, and the
`{% generation %}` tag (rendered as plain content; it only marks assistant spans for
training masks). The engine needs only `jinja2`; transformers is imported only to turn tools
given as Python functions into JSON schemas.
"""
from __future__ import annotations

import datetime
import json
import os

from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.models.config import read_tokenizer_config

# Special tokens of tokenizer_config.json that templates read as variables.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(tok) -> str | None:
    # tokenizer_config.json spells special tokens either as a string or as an AddedToken dict.
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A checkpoint's templates (one, or several by name) plus the special-token variables
    they may read. A plain template is the one named "default"; "tool_use", where a
    checkpoint names one, renders conversations given tools, as transformers picks it."""

    def __init__(self, source: "str | dict[str, str]", special_tokens: dict[str, str] | None = None):
        import jinja2

        self.templates = dict(source) if isinstance(source, dict) else {"default": source}
        self.special_tokens = dict(special_tokens or {})
        self._compiled = {}
        env = _environment()
        for name, text in self.templates.items():
            try:
                self._compiled[name] = env.from_string(text)
            except jinja2.TemplateError as e:
                raise ValueError(f"the chat template {name!r} does not compile: {e}") from e

    def __getstate__(self):
        # A compiled template does not pickle; an EngineProcess sends the tokenizer, and so
        # this, to the server's process (grpc_server._engine_tokenizer).
        return {"templates": self.templates, "special_tokens": self.special_tokens}

    def __setstate__(self, state):
        self.__init__(state["templates"], state["special_tokens"])

    @classmethod
    def from_path(cls, model_path: str) -> "ChatTemplate | None":
        """The checkpoint's templates, or None if it has none: as transformers saves them
        (`chat_template.jinja`, the default, and `additional_chat_templates/NAME.jinja`, such
        as tool_use) first, then tokenizer_config.json's "chat_template" (a string, or a
        list of named templates)."""
        config = read_tokenizer_config(model_path)
        specials = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        files = {}
        if os.path.isfile(default := os.path.join(model_path, "chat_template.jinja")):
            files["default"] = default
        if os.path.isdir(extra := os.path.join(model_path, "additional_chat_templates")):
            files.update((name[: -len(".jinja")], os.path.join(extra, name))
                         for name in sorted(os.listdir(extra)) if name.endswith(".jinja"))
        if files:
            templates = {}
            for name, path in files.items():
                with open(path, encoding="utf-8") as f:
                    templates[name] = f.read()
            return cls(templates, specials)
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            source = {t["name"]: t["template"] for t in source
                      if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        return cls(source, specials) if source and isinstance(source, (str, dict)) else None

    def render(self, messages, /, *, add_generation_prompt: bool | None = None, continue_final_message: bool = False,
               **template_kwargs) -> str:
        """The prompt text for `messages` (a list of {"role": ..., "content": ...}).
        `template_kwargs` reach the template as variables (e.g. Qwen3's `enable_thinking`,
        `tools`). As transformers does: keys set to None are dropped from each message, a
        message's reasoning given as "thinking" or "reasoning" is also passed as
        "reasoning_content", and tools given as Python functions become their JSON schemas.
        `add_generation_prompt` (opens the assistant's turn) is on unless
        `continue_final_message`: the text then ends with the last message's content, its
        turn left open for the model to continue (a prefilled answer).
        A malformed conversation, or one the template refuses, raises InvalidRequestError."""
        check_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message's turn: "
                                      "add_generation_prompt, which opens a new one, must be off")
        add_generation_prompt = not continue_final_message if add_generation_prompt is None else add_generation_prompt
        reserved = sorted({"messages", "add_generation_prompt"} & set(template_kwargs))
        if reserved:
            raise InvalidRequestError(f"chat template variables may not set {', '.join(reserved)}: "
                                      "give the conversation and add_generation_prompt themselves")
        tools = template_kwargs.get("tools")
        template = self._pick(tools is not None)
        if tools is not None:
            template_kwargs["tools"] = _tool_schemas(tools)
        # transformers always passes tools and documents (None unless given): templates that
        # test `tools is defined` render as they do there.
        variables = dict(self.special_tokens, tools=None, documents=None)
        variables.update(template_kwargs)
        variables.update(messages=[_normalized(m) for m in messages], add_generation_prompt=add_generation_prompt)
        try:
            text = template.render(variables)  # a dict, not keywords: a variable may be called "self"
        except Exception as e:  # noqa: BLE001 - raise_exception(...), or messages the template cannot read
            raise InvalidRequestError(f"the chat template refused the messages: {type(e).__name__}: {e}") from e
        return _cut_after_final_message(text, messages[-1]) if continue_final_message else text

    def _pick(self, with_tools: bool):
        if with_tools and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        names = ", ".join(repr(n) for n in sorted(self.templates))
        raise InvalidRequestError(f"this model's chat templates are named {names}: none is 'default'"
                                  + ("; 'tool_use' renders conversations given tools" if "tool_use" in self.templates else ""))


# The names a message's reasoning comes under; templates read the first.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _normalized(message: dict) -> dict:
    # OpenAI-style messages carry `"tool_calls": None` or `"content": None`; templates test
    # for the key (`'tool_calls' in message`) and then fail on the None.
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
    if reasoning is not None:  # gpt-oss templates read "thinking"; the others "reasoning_content"
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _cut_after_final_message(text: str, message: dict) -> str:
    """`text` cut after the last message's content, whatever the template writes after it
    (the end of its turn), as transformers' continue_final_message does: the content's last
    occurrence, with its trailing whitespace where the template kept it."""
    content = message.get("content")
    if isinstance(content, (list, tuple)):  # content parts: the last one with text
        content = next((p["text"] for p in reversed(content) if isinstance(p, dict) and isinstance(p.get("text"), str)),
                       None)
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError("continue_final_message needs text to continue in the last message")
    core = content.strip()
    at = text.rfind(core)
    if at < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not write the last message's "
                                  "content as given, so there is no place to continue it from")
    rest = content.lstrip()
    end = at + len(rest) if text[at : at + len(rest)] == rest else at + len(core)
    return text[:end]


def _tool_schemas(tools) -> list:
    """Tools as templates read them: JSON schemas (dicts) as given; Python functions
    converted from their signature and docstring by transformers' `get_json_schema`."""
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError(f"tools must be a list of JSON schemas or functions, got {type(tools).__name__}")
    schemas = []
    for tool in tools:
        if isinstance(tool, dict):
            schemas.append(tool)
        elif callable(tool):
            try:
                from transformers.utils import get_json_schema
            except ImportError as e:
                raise InvalidRequestError("tools given as Python functions need transformers installed "
                                          "(it converts them to JSON schemas); or give their JSON schemas") from e
            try:
                schemas.append(get_json_schema(tool))
            except Exception as e:  # noqa: BLE001 - transformers' own errors for missing hints or docstrings
                raise InvalidRequestError(f"tool {getattr(tool, '__name__', tool)!r}: {e}") from e
        else:
            raise InvalidRequestError(f"a tool must be a JSON schema (dict) or a function, got {type(tool).__name__}")
    return schemas


def check_messages(messages) -> None:
    """A conversation is a non-empty list of objects, each with a string "role"."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"message {i} must be an object with a string 'role', got {m!r}")
