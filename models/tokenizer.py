"""Text <-> token ids over a HF `tokenizer.json` (the `tokenizers` library; no transformers needed).

`IncrementalDecoder` turns a growing list of generated ids into text deltas for streaming.
Decoding token by token is wrong for byte-level BPE and byte-fallback vocabularies: one
character may span several tokens (the first of which decodes to U+FFFD), and some
decoders strip a leading space from the first token of a sequence. So, like the streaming
detokenizers of vLLM and HF TGI, it decodes a short window that starts a few tokens
before the new ones, emits only the text beyond what that window's old part already
produced, and holds everything back while the text ends in an incomplete character.
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

import tokenizers

from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.models.chat_template import ChatTemplate
from jaxoverlap.models.config import CheckpointError, read_json_if_present, read_tokenizer_config, token_ids

try:  # newer tokenizers releases; the ones the engine uses take prompt ids and lists of ids
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:
    _DecodeStream = None

# Tokens of already-emitted text decoded again in front of new ones, so that the decoder
# sees their context (leading-space rules, merges across the boundary).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def _check_text(text) -> None:
    """Why the tokenizer refused `text` (it raises a bare TypeError), as InvalidRequestError."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"text to tokenize must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"text is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                                  f"{e.start}") from None


def _token_content(tok) -> str | None:
    # tokenizer_config.json spells special tokens either as a string or as an AddedToken dict.
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None




class Tokenizer:
    """A HF fast tokenizer plus the eos/bos ids that generation needs."""

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        chat_template: "ChatTemplate | None" = None,
        eos_token_id: int | None = None,
    ):
        self._tok = hf_tokenizer
        self.chat_template = chat_template
        # Every id that ends generation (generation_config's, the tokenizer's, config.json's).
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id  # the tokenizer's own EOS token (tokenizer_config.json)

    @classmethod
    def from_path(cls, model_path: str) -> "Tokenizer":
        """Read `tokenizer.json`, taking eos/bos from generation_config.json, tokenizer_config.json
        (or special_tokens_map.json) and config.json (eos ids from all three, in that order,
        deduplicated)."""
        path = os.path.join(model_path, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {model_path!r}")
        try:
            tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise CheckpointError(f"{path} is not a tokenizer the tokenizers library reads: {e}") from None
        gen = read_json_if_present(os.path.join(model_path, "generation_config.json"))
        tcfg = read_tokenizer_config(model_path)
        mcfg = read_json_if_present(os.path.join(model_path, "config.json"))

        def special_id(key: str) -> list[int]:
            content = _token_content(tcfg.get(key))
            tid = tok.token_to_id(content) if content else None
            return [] if tid is None else [tid]

        # generate() in transformers stops on generation_config's ids; chat models list
        # several there (e.g. <|im_end|> and <|endoftext|>), so take all of them.
        eos = [*token_ids(gen.get("eos_token_id"), "generation_config.json: eos_token_id"), *special_id("eos_token"),
               *token_ids(mcfg.get("eos_token_id"), "config.json: eos_token_id")]
        # BOS and the tokenizer's own EOS as transformers' tokenizer has them: from
        # tokenizer_config.json alone (Qwen's has no BOS, while its generation_config names
        # one), which is what lm-eval conditions a context-free text on.
        bos, own_eos = special_id("bos_token"), special_id("eos_token")
        return cls(tok, eos_token_ids=eos, bos_token_id=bos[0] if bos else None,
                   chat_template=ChatTemplate.from_path(model_path), eos_token_id=own_eos[0] if own_eos else None)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included. Models often pad their embedding
        beyond this (so `ModelConfig.vocab_size` may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With add_special_tokens, the tokenizer's own post-processor
        decides what to add (Llama 3 prepends <|begin_of_text|>, Qwen adds nothing);
        nothing else is ever added."""
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            _check_text(text)
            raise

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        texts = list(texts)
        try:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]
        except TypeError:
            for text in texts:
                _check_text(text)
            raise

    # `messages` positional-only: a template variable may then be called "self" or "messages"
    # (ChatTemplate.render refuses the latter with a clear error).
    def apply_chat_template(self, messages, /, *, add_generation_prompt: bool | None = None, **template_kwargs) -> str:
        """The prompt text of a conversation under the checkpoint's chat template
        (models/chat_template.py); InvalidRequestError if the model has none.
        `add_generation_prompt`: on unless `continue_final_message=True` is given."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template: give a prompt, not messages")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)

    def encode_chat(self, messages, /, *, add_generation_prompt: bool | None = None, **template_kwargs) -> list[int]:
        """Token ids of a conversation. The template writes any BOS itself, so none is added
        (as transformers' `apply_chat_template(tokenize=True)` does)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def incremental_decoder(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> "IncrementalDecoder":
        return IncrementalDecoder(self, prompt_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Streaming detokenizer for one sequence: `step(new_ids)` returns the text they complete.

    The concatenation of every `step` result and the final `flush()` equals
    `decode(generated_ids)` (given no prompt; with a prompt, the text that follows it).
    A prompt that ends inside a multi-byte character owns that character: the output's
    text is what follows it, whether the output completes the character or breaks it off
    (then none of the character's U+FFFDs are emitted either), for byte-level BPE (which
    renders the dangling bytes as one U+FFFD) and ByteFallback (one per byte token) alike.

    The work is done by the `tokenizers` library's own `DecodeStream` (the same window
    method, in Rust: 3x faster per token than two `decode` calls from Python, measured on
    the embedded model's tokenizer). The decoder keeps only the ids since the last emitted
    text and the ones before them that serve as context, never the whole sequence, so a
    step costs the same at token 10 and at token 30000. Should `DecodeStream` fail (it
    refuses a window whose text does not extend the previous window's text), or be missing
    from an older `tokenizers`, the same window method runs here in Python.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._hf = tokenizer.hf_tokenizer
        self._skip = skip_special_tokens
        # The last emitted ids (or the prompt's tail), decoded again in front of new ones
        # so that the decoder sees their context (leading-space rules, merges across the
        # boundary); then the ids whose text has not been emitted yet.
        self._context: list[int] = [int(i) for i in prompt_ids[self._context_start(prompt_ids) :]]
        self._pending: list[int] = []
        self._stream = None
        # The text that the prompt's incomplete last character renders as (see _split_dangling),
        # until the output completes or breaks it; None once it has, or with no such prompt.
        self._dangling: str | None = None
        # DecodeStream repeats part of a context that ends in an incomplete character (a
        # prompt cut inside a multi-byte character's tokens) in its first text; the window
        # method below does not.
        if self._context and self._decode(self._context).endswith(_REPLACEMENT):
            self._split_dangling()
        elif _DecodeStream is not None:
            try:
                self._stream = _DecodeStream(ids=list(self._context), skip_special_tokens=skip_special_tokens)
            except TypeError:  # a tokenizers release whose DecodeStream takes no prompt ids
                self._stream = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _context_start(self, prompt_ids: Sequence[int]) -> int:
        """Where the prompt's tail that serves as context begins: _CONTEXT_TOKENS ids from
        its end, or a few further back (at most one character's 4 bytes, a token each) while
        that id does not begin a character. ByteFallback tokenizers (Llama 2, Mistral)
        render a whole run of byte tokens as U+FFFDs when any of it is invalid, so a tail
        cut inside a character turned every byte token of the output that joined the run
        into U+FFFDs."""
        start = max(len(prompt_ids) - _CONTEXT_TOKENS, 0)
        for _ in range(4):
            if start == 0 or self._begins_character(prompt_ids[start : start + 4]):
                break
            start -= 1
        return start

    def _begins_character(self, ids: Sequence[int]) -> bool:
        """Whether the first of `ids` begins a character: one to four of them decode to a
        text that does not start with U+FFFD (the bytes of a character's middle never do)."""
        return any(not self._decode(ids[:m]).startswith(_REPLACEMENT) for m in range(1, len(ids) + 1))

    def _split_dangling(self) -> None:
        """Split a context whose text ends in an incomplete character: the shortest tail of
        ids without which the text ends in complete characters becomes pending (so the output
        is decoded after it), and what that tail renders as now is kept in `_dangling`.

        Subtracting the whole context's text instead is right for byte-level BPE, whose
        dangling bytes render as one U+FFFD just as the completed character is one character,
        but not for ByteFallback (Llama 2, Mistral, TinyLlama): one U+FFFD per byte token,
        so that the first output characters were cut off."""
        ctx = self._context
        text = self._decode(ctx)
        cut, head = 0, ""
        for n in range(len(ctx) - 1, 0, -1):  # at most _CONTEXT_TOKENS decodes, once
            head = self._decode(ctx[:n])
            # An incomplete character is at most 3 bytes, so at most 3 ids. (ByteFallback
            # renders the whole byte run it ends as U+FFFDs, complete characters of the run
            # too: there `text` does not start with the run's clean head.)
            if not head.endswith(_REPLACEMENT) and (text.startswith(head) or len(ctx) - n <= 3):
                cut = n
                break
        else:
            head = ""
        self._context, self._pending = ctx[:cut], ctx[cut:]
        self._dangling = text[len(head) :]

    def _drop_dangling(self, text: str) -> str:
        """`text` (what follows the complete context) less the prompt's cut character.

        While dangling, that character rendered as `_dangling`: complete text, then one
        U+FFFD (byte-level BPE) or several (ByteFallback). Now `text` starts with the same
        complete text, then either the completed character (one character, not U+FFFD), or
        the same U+FFFDs: the character was broken off. Either way it is the prompt's. (For
        byte-level BPE this drops exactly len(_dangling) characters, as before.)"""
        dangling, self._dangling = self._dangling, None
        common = 0
        for a, b in zip(dangling, text):
            if a != b:
                break
            common += 1
        return text[common if common == len(dangling) else common + 1 :]

    def _window_delta(self) -> str | None:
        """The text that the pending ids add to their context's, or None while there is none
        or it ends in an incomplete character (a trailing U+FFFD: the rest of its bytes are
        still to come; a shorter text means skipped special tokens)."""
        prefix_text = self._decode(self._context)
        new_text = self._decode(self._context + self._pending)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return None
        if self._dangling is not None:
            return self._drop_dangling(new_text[len(prefix_text) :])
        return new_text[len(prefix_text) :]

    def step(self, new_ids: int | Iterable[int]) -> str:
        """Append generated ids; return the newly completed text ("" while it is held back).

        One int per call is the engine's case (one call per token): it reaches DecodeStream
        as an int, which costs 0.4 us less than a one-element list."""
        if isinstance(new_ids, int):
            self._pending.append(new_ids)
        else:
            new_ids = [int(i) for i in new_ids]
            if not new_ids:
                return ""
            self._pending.extend(new_ids)
        delta = None
        if self._stream is not None:
            try:
                delta = self._stream.step(self._hf, new_ids)
            except Exception:  # noqa: BLE001 - DecodeStream's own errors: the Python window takes over
                self._stream = None
        if self._stream is None:
            delta = self._window_delta()
        if delta is None:
            return ""
        self._context, self._pending = self._pending, []
        return delta

    def flush(self) -> str:
        """At the end of the stream: the held-back text, incomplete characters included."""
        if not self._pending:
            return ""
        prefix_text = self._decode(self._context)
        delta = self._decode(self._context + self._pending)[len(prefix_text) :]
        if self._dangling is not None:
            delta = self._drop_dangling(delta)
        self._context, self._pending = self._pending, []
        return delta
