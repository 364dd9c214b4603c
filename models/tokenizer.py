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

import json
import os
from typing import Iterable, Sequence

import tokenizers

# Tokens of already-emitted text decoded again in front of new ones, so that the decoder
# sees their context (leading-space rules, merges across the boundary).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(tok) -> str | None:
    # tokenizer_config.json spells special tokens either as a string or as an AddedToken dict.
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    """A HF fast tokenizer plus the eos/bos ids that generation needs."""

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
    ):
        self._tok = hf_tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id

    @classmethod
    def from_path(cls, model_path: str) -> "Tokenizer":
        """Read `tokenizer.json`, taking eos/bos from generation_config.json, tokenizer_config.json
        and config.json (eos ids from all three, in that order, deduplicated)."""
        path = os.path.join(model_path, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {model_path!r}")
        tok = tokenizers.Tokenizer.from_file(path)
        gen = _read_json(os.path.join(model_path, "generation_config.json"))
        tcfg = _read_json(os.path.join(model_path, "tokenizer_config.json"))
        mcfg = _read_json(os.path.join(model_path, "config.json"))

        def special_id(key: str) -> list[int]:
            content = _token_content(tcfg.get(key))
            tid = tok.token_to_id(content) if content else None
            return [] if tid is None else [tid]

        # generate() in transformers stops on generation_config's ids; chat models list
        # several there (e.g. <|im_end|> and <|endoftext|>), so take all of them.
        eos = _as_ids(gen.get("eos_token_id")) + special_id("eos_token") + _as_ids(mcfg.get("eos_token_id"))
        bos = special_id("bos_token") or _as_ids(gen.get("bos_token_id")) or _as_ids(mcfg.get("bos_token_id"))
        return cls(tok, eos_token_ids=eos, bos_token_id=bos[0] if bos else None)

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
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

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
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        # ids[prefix:read] is the context window whose text was already emitted (or belongs
        # to the prompt); ids[read:] are tokens whose text is not emitted yet.
        self._read = len(self._ids)
        self._prefix = max(self._read - _CONTEXT_TOKENS, 0)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, new_ids: int | Iterable[int]) -> str:
        """Append generated ids; return the newly completed text ("" while it is held back)."""
        if isinstance(new_ids, int):
            self._ids.append(new_ids)
        else:
            self._ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        # A trailing U+FFFD means the last bytes are the start of a multi-byte character
        # whose rest is still to come; a shorter text means skipped (special) tokens.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: the held-back text, incomplete characters included."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    @property
    def token_ids(self) -> list[int]:
        """Prompt and generated ids seen so far."""
        return list(self._ids)
