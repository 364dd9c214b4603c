"""models/tokenizer.py: encode/decode, eos/bos discovery, and streaming detokenization."""
from __future__ import annotations

import json
import os
import random

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, processors

from jaxoverlap.models.loader import default_model_path
from jaxoverlap.models.tokenizer import IncrementalDecoder, Tokenizer

# Multi-byte characters of every UTF-8 length: 2 (é, ö), 3 (中, €), 4 (emoji).
TEXTS = [
    "Hello world, this is plain ASCII.",
    "Café crème, naïve façade, smörgåsbord.",
    "中文字符和日本語のテキスト。価格は€5です。",
    "Emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷 mixed with text.",
    "  leading spaces\n\nnewlines\tand tabs  ",
]


@pytest.fixture(scope="module")
def default_tok() -> Tokenizer:
    return Tokenizer.from_path(default_model_path())


def _byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-2-style sentencepiece BPE with byte fallback, built by hand: letters and a few
    words are tokens, everything else (é, 中, emoji) falls back to <0xNN> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁"] + list("abcdefghijklmnopqrstuvwxyzHW,.") + ["▁h", "▁he", "▁hel", "▁hell", "▁hello"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                          fuse_unk=True))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return Tokenizer(tok, eos_token_ids=[2], bos_token_id=1)


@pytest.fixture(params=["library", "python"])
def backend(request) -> str:
    """IncrementalDecoder runs tokenizers' DecodeStream, or its own Python window method
    (the fallback when DecodeStream fails or is missing): both must stream the same text."""
    return request.param


def _decoder(tok: Tokenizer, prompt=(), backend: str = "library") -> IncrementalDecoder:
    dec = tok.incremental_decoder(prompt)
    if backend == "python":
        dec._stream = None
    elif not (prompt and tok.decode(prompt).endswith("\ufffd")):  # a cut prompt takes the window method
        assert dec._stream is not None, "this tokenizers release has no DecodeStream with prompt ids"
    return dec


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] = (), chunk: int = 1, backend: str = "library") -> list[str]:
    dec = _decoder(tok, prompt, backend)
    deltas = [dec.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(dec.flush())
    return deltas


def test_default_tokenizer_basics(default_tok):
    assert default_tok.vocab_size == 1024
    assert default_tok.eos_token_ids == (default_tok.token_to_id("<|endoftext|>"),)
    assert default_tok.bos_token_id is None
    ids = default_tok.encode("Once upon a time")
    assert len(ids) == 4 and default_tok.encode("Once upon a time", add_special_tokens=False) == ids
    for text in TEXTS:  # byte-level BPE is lossless, whatever the script
        assert default_tok.decode(default_tok.encode(text)) == text
    assert default_tok.encode_batch(TEXTS[:2]) == [default_tok.encode(t) for t in TEXTS[:2]]
    eos = default_tok.eos_token_ids[0]
    assert default_tok.decode([*ids, eos]) == "Once upon a time"
    assert default_tok.decode([*ids, eos], skip_special_tokens=False) == "Once upon a time<|endoftext|>"


def test_default_tokenizer_agrees_with_transformers(default_tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(default_model_path())
    for text in TEXTS:
        assert hf.encode(text) == default_tok.encode(text)
    assert hf.eos_token_id in default_tok.eos_token_ids


def test_add_special_tokens_follows_post_processor():
    tok = _byte_fallback_tokenizer()
    with_bos = tok.encode("hello world")
    assert with_bos[0] == tok.bos_token_id
    assert tok.encode("hello world", add_special_tokens=False) == with_bos[1:]
    assert tok.decode(with_bos) == "hello world"


def test_eos_and_bos_from_config_files(tmp_path):
    path = str(tmp_path)
    default_tok = Tokenizer.from_path(default_model_path())
    default_tok.hf_tokenizer.save(os.path.join(path, "tokenizer.json"))
    im_end = default_tok.token_to_id("<|im_end|>")
    im_start = default_tok.token_to_id("<|im_start|>")
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [im_end, 0], "bos_token_id": 5}, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": {"content": "<|im_end|>"}, "bos_token": "<|im_start|>"}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"eos_token_id": 7}, f)
    tok = Tokenizer.from_path(path)
    assert tok.eos_token_ids == (im_end, 0, 7)  # generation_config first, deduplicated
    assert tok.bos_token_id == im_start  # tokenizer_config wins over the id fields
    assert tok.eos_token_id == im_end  # the tokenizer's own EOS token
    # Qwen's layout: no BOS token in tokenizer_config, one id in generation_config. The
    # tokenizer has no BOS then, as in transformers (lm-eval conditions on its EOS instead).
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None}, f)
    tok = Tokenizer.from_path(path)
    assert tok.bos_token_id is None and tok.eos_token_id == im_end
    # Older checkpoints keep the special tokens in special_tokens_map.json (transformers reads
    # both files: the map's tokens win, but not over a null, nor in the newer layout).
    os.remove(os.path.join(path, "generation_config.json"))
    os.remove(os.path.join(path, "config.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}, f)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}, f)
    tok = Tokenizer.from_path(path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (im_start, im_end, (im_end,))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|endoftext|>"}, f)
    tok = Tokenizer.from_path(path)
    assert tok.bos_token_id is None and tok.eos_token_id == im_end
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "added_tokens_decoder": {}}, f)
    tok = Tokenizer.from_path(path)
    assert tok.bos_token_id is None and tok.eos_token_id == tok.token_to_id("<|endoftext|>")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_path(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_byte_level(default_tok, text, chunk, backend):
    ids = default_tok.encode(text)
    deltas = _stream(default_tok, ids, chunk=chunk, backend=backend)
    assert "".join(deltas) == text
    # Never a half character: no replacement char leaks out of a split code point.
    assert not any("\ufffd" in d for d in deltas)
    if any(ord(c) > 0x7F for c in text):
        # Some emoji/CJK tokens end mid-character, so at least one step was held back.
        assert "" in deltas[:-1] or chunk > 1


@pytest.mark.parametrize("text", ["hello world", "hello héllo 中文 🙂 world", "Hello, World."])
def test_incremental_decode_byte_fallback(text, backend):
    tok = _byte_fallback_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids) == any(ord(c) > 0x7F for c in text)
    deltas = _stream(tok, ids, backend=backend)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_decode_keeps_space_after_prompt(backend):
    """Decoded alone, a sentencepiece "▁world" loses its space; after a prompt it must not."""
    tok = _byte_fallback_tokenizer()
    full = tok.encode("hello world", add_special_tokens=False)
    prompt = tok.encode("hello", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    deltas = _stream(tok, full[len(prompt) :], prompt=prompt, backend=backend)
    assert "".join(deltas) == " world"


def test_incremental_decode_skips_special_tokens(default_tok, backend):
    eos = default_tok.eos_token_ids[0]
    ids = default_tok.encode("The sea") + [eos] + default_tok.encode(" is calm")
    assert "".join(_stream(default_tok, ids, backend=backend)) == "The sea is calm"


def test_incremental_decode_random_ids(default_tok, backend):
    """Arbitrary id sequences (as an untrained model emits) stream to exactly decode(ids),
    with and without a prompt in front."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, default_tok.vocab_size) for _ in range(rng.randint(1, 40))]
        assert "".join(_stream(default_tok, ids, backend=backend)) == default_tok.decode(ids)
        prompt = default_tok.encode("Once upon a time")
        full = default_tok.decode(prompt + ids)
        text = "".join(_stream(default_tok, ids, prompt=prompt, chunk=rng.randint(1, 3), backend=backend))
        assert default_tok.decode(prompt) + text == full


def test_a_prompt_cut_inside_a_character_adds_none_of_its_text(default_tok):
    """A token-id prompt may end inside a multi-byte character (lists cut at N tokens of
    CJK text or emoji). DecodeStream would repeat the prompt's text in its first delta; the
    decoder takes the window method for such a prompt, whose text is what follows it."""
    prompt_ids = default_tok.encode("ok 🙂")[:-1]
    assert default_tok.decode(prompt_ids).endswith("\ufffd")
    dec = default_tok.incremental_decoder(prompt_ids)
    assert dec._stream is None
    rng = random.Random(1)
    for _ in range(10):
        ids = [rng.randrange(3, default_tok.vocab_size) for _ in range(rng.randint(1, 20))]
        dec = default_tok.incremental_decoder(prompt_ids)
        text = "".join(dec.step(i) for i in ids) + dec.flush()
        full, prompt = default_tok.decode(prompt_ids + ids), default_tok.decode(prompt_ids)
        assert text == full[len(prompt):]


def test_flush_emits_incomplete_tail(default_tok, backend):
    ids = default_tok.encode("ok 🙂")
    dec = _decoder(default_tok, backend=backend)
    out = "".join(dec.step(i) for i in ids[:-1])  # the emoji's last byte never comes
    tail = dec.flush()
    assert out + tail == default_tok.decode(ids[:-1])
    assert tail.endswith("\ufffd")


def test_a_failing_decode_stream_hands_over_to_the_python_window(default_tok):
    """DecodeStream raises on windows whose text does not extend the previous one; the
    decoder then goes on with its own window method from where the stream stood."""
    text = "Café crème 中文 🙂 and more words after it."
    ids = default_tok.encode(text)

    class Failing:
        def __init__(self, inner, fail_at):
            self.inner, self.calls, self.fail_at = inner, 0, fail_at

        def step(self, tok, new_ids):
            self.calls += 1
            if self.calls == self.fail_at:
                raise Exception("InvalidPrefix")
            return self.inner.step(tok, new_ids)

    for fail_at in range(1, len(ids) + 1):
        dec = _decoder(default_tok)
        dec._stream = Failing(dec._stream, fail_at)
        out = "".join(dec.step(i) for i in ids) + dec.flush()
        assert out == text, fail_at
        assert dec._stream is None  # the Python window took over for good


def test_decoder_state_stays_small_over_a_long_stream(default_tok, backend):
    """Only the context and the not-yet-emitted ids are kept: a step at token 3000 costs
    what one at token 10 costs."""
    ids = default_tok.encode("The quick brown fox jumps over the lazy dog. 🙂 " * 100)
    assert len(ids) > 1000
    dec = _decoder(default_tok, backend=backend)
    longest = 0
    for i in ids:
        dec.step(i)
        longest = max(longest, len(dec._context) + len(dec._pending))
    assert longest <= 8


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_output_completing_a_prompts_cut_character_loses_none_of_its_text(default_tok, kind, chunk, backend):
    """A prompt cut inside a multi-byte character (3-byte 中 after 1 or 2 bytes, a 2-byte é,
    the 4-byte 🙂 after 1 to 3) owns that character: the output's text is what follows it,
    whether the output completes it or not. Byte-level BPE renders the dangling bytes as one
    U+FFFD, ByteFallback as one per byte token: the text must not depend on that (it used to
    lose one output character per extra U+FFFD)."""
    tok = default_tok if kind == "byte_level" else _byte_fallback_tokenizer()
    text = "hello 中 world 🙂 héllo 中abc"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    abc = [tok.token_to_id(c) for c in "abc"]
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    if kind == "byte_fallback":  # every byte of every multi-byte character but its last
        assert len(cuts) == 2 + 3 + 1 + 2
    for k in cuts:
        prompt, out = ids[:k], ids[k:]
        # The prompt's text, its cut character included (all trailing U+FFFDs stand for it).
        covered = len(tok.decode(prompt).rstrip("\ufffd")) + 1
        deltas = _stream(tok, out, prompt=prompt, chunk=chunk, backend=backend)
        assert "".join(deltas) == text[covered:], (k, deltas)
        assert not any("\ufffd" in d for d in deltas)
        # An output that breaks the character off adds none of its U+FFFDs either.
        assert "".join(_stream(tok, abc, prompt=prompt, chunk=chunk, backend=backend)) == "abc"
        assert _stream(tok, [], prompt=prompt, backend=backend) == [""]  # no output, no text


@pytest.mark.parametrize("chunk", [1, 2])
def test_byte_fallback_runs_of_several_characters_after_any_prompt(chunk, backend):
    """ByteFallback renders a whole run of byte tokens as U+FFFDs once any of it is invalid.
    Characters spelled in bytes back to back (🙂🙂, é🙂é, 👩‍👧é) then made two cuts go wrong:
    a prompt ending in whole characters whose 5-id context began inside one (the output's
    byte tokens joined that invalid run: 🙂 streamed as four U+FFFDs), and a prompt cut
    inside a character that follows whole ones in the run. After every cut of the ids, the
    output's text is the rest of the text (a cut character belongs to the prompt)."""
    tok = _byte_fallback_tokenizer()
    text = "ab 🙂🙂 é🙂é 👩\u200d👧é 中中 abc"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.id_to_token(ids[0]) == "▁" and all(  # a token per character or byte: bytes are easy to count
        len(t.replace("▁", " ").encode()) == 1 or t.startswith("<0x") for t in map(tok.id_to_token, ids))
    data = text.encode()
    for k in range(1, len(ids)):
        prompt_bytes = data[: k - 1]  # the first id is the space the normalizer prepends
        whole = prompt_bytes.decode("utf-8", errors="ignore")
        covered = len(whole) + (len(whole.encode()) < len(prompt_bytes))  # + the cut character
        deltas = _stream(tok, ids[k:], prompt=ids[:k], chunk=chunk, backend=backend)
        assert "".join(deltas) == text[covered:], (k, deltas)
        assert not any("\ufffd" in d for d in deltas), (k, deltas)
