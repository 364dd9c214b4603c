"""jaxoverlap/lm_eval_model.py: lm-evaluation-harness requests on the LLM API, with
duck-typed requests (objects with `.args`, as lm-eval's Instance), so that lm-eval need not
be installed; where it is, the model is registered under "jaxoverlap" and is an lm-eval LM."""
from __future__ import annotations

import dataclasses

import pytest

from jaxoverlap import LLM, SamplingParams
from jaxoverlap.lm_eval_model import JaxOverlapLM, _temperature


@dataclasses.dataclass
class Request:  # what lm-eval's Instance hands a model: the request's arguments
    args: tuple


@pytest.fixture(scope="module")
def lm():
    return JaxOverlapLM(llm=LLM(None, max_running_requests=4, max_context_len=64, kv_cache_tokens=1024,
                                page_size=8))


def test_loglikelihood_splits_pairs_as_lm_eval(lm):
    tok = lm.tokenizer
    pairs = [("The little dog", " ran home"), ("The little dog ", "ran home"), ("", "Once upon a time")]
    got = lm.loglikelihood([Request(p) for p in pairs], disable_tqdm=True)
    # A trailing space moves to the continuation: the same split as the pair without it.
    ctx = tok.encode("The little dog")
    cont = tok.encode("The little dog ran home")[len(ctx):]
    want = lm.llm.loglikelihood([(ctx, cont), ([lm.llm.prefix_token_id], tok.encode(
        "Once upon a time", add_special_tokens=False))])
    assert got[0] == got[1] == pytest.approx(want[0], abs=1e-5)
    assert got[2] == pytest.approx(want[1], abs=1e-5)
    assert all(lp < 0 for lp, _ in got)
    # Any trailing whitespace moves, as lm-eval's context.rstrip(): newlines and tabs too.
    for context, continuation in [("Once upon a time\n", "There was a dog"), ("The end.\n\n", "Once upon"),
                                  ("Tab\t", "x"), ("Mixed \t\n ", "y")]:
        stripped = context.rstrip()
        ctx = tok.encode(stripped)
        cont = tok.encode(context + continuation)[len(ctx):]
        [(lp, _)] = lm.loglikelihood([Request((context, continuation))], disable_tqdm=True)
        [(want_lp, _)] = lm.llm.loglikelihood([(ctx, cont)])
        assert lp == pytest.approx(want_lp, abs=1e-5), (context, continuation)
    # A context of spaces only: its spaces join the continuation, conditioned on the prefix token.
    [(lp, _)] = lm.loglikelihood([Request(("  ", "Hello"))], disable_tqdm=True)
    [(want_lp, _)] = lm.llm.loglikelihood([([lm.llm.prefix_token_id], tok.encode("  Hello"))])
    assert lp == pytest.approx(want_lp, abs=1e-5)
    # A pair longer than the context keeps its last tokens instead of failing.
    [(lp, _)] = lm.loglikelihood([Request(("word " * 200, "end"))], disable_tqdm=True)
    assert lp < 0


def test_loglikelihood_rolling_is_the_llms(lm):
    text = "Once upon a time there was a little dog who liked to run in the park every day."
    [got] = lm.loglikelihood_rolling([Request((text,))], disable_tqdm=True)
    assert got == pytest.approx(lm.llm.loglikelihood_rolling([text])[0], abs=1e-5) and got < 0


def test_generate_until_stops_and_truncates(lm):
    context = "Once upon a time"
    [plain] = lm.llm.generate([context], SamplingParams(max_new_tokens=12, temperature=0.0))
    assert len(plain.text) > 4
    stop = plain.text[2:4]  # a stop string the greedy text contains
    got = lm.generate_until([
        Request((context, {"until": [stop], "max_gen_toks": 12, "do_sample": False, "temperature": 0.7})),
        Request((context, {"until": "\n\n\n", "max_gen_toks": 12})),
        Request(("word " * 200, {"until": ["\n"], "max_gen_toks": 5})),  # longer than the context: left-truncated
        Request(("", {"max_gen_toks": 3})),
    ], disable_tqdm=True)
    assert got[0] == plain.text.split(stop)[0]  # greedy: do_sample False overrides the temperature
    assert got[1] == plain.text.split("\n\n\n")[0]
    assert isinstance(got[2], str) and isinstance(got[3], str)


def test_registered_with_lm_eval_where_installed(lm):
    api = pytest.importorskip("lm_eval.api")
    from lm_eval.api.registry import get_model

    assert get_model("jaxoverlap") is JaxOverlapLM and isinstance(lm, api.model.LM)


def test_generate_until_samples_when_the_task_asks(lm):
    """do_sample=True with no temperature samples (at 1.0); a temperature alone is kept."""
    assert [_temperature(*a) for a in [(None, None), (False, 0.7), (True, None), (True, 0.5), (None, 0.8)]] == [
        0.0, 0.0, 1.0, 0.5, 0.8]
    got = lm.generate_until([Request(("Once upon a time", {"max_gen_toks": 12, "do_sample": True, "seed": s}))
                             for s in range(4)], disable_tqdm=True)
    assert len(set(got)) > 1


def _spy_prompts(llm, monkeypatch) -> list:
    """The prompts the adapter hands llm.generate."""
    sent, generate = [], llm.generate

    def spy(prompts, params=None, **kw):
        sent.extend(prompts)
        return generate(prompts, params, **kw)

    monkeypatch.setattr(llm, "generate", spy)
    return sent


def test_windows_use_the_whole_context(lm, monkeypatch):
    """At max_context_len 64: a pair's prompt is 63 tokens (62 scored, as a rolling window),
    a generation's prompt and new tokens 64; a continuation past the window is an error,
    as in lm-eval, not a silently shorter score."""
    from jaxoverlap.errors import InvalidRequestError

    long_pair = ("word " * 200, " and the end of the story")
    ctx, cont = lm._encode_pair(*long_pair)
    [(lp, _)] = lm.loglikelihood([Request(long_pair)], disable_tqdm=True)
    [(want, _)] = lm.llm.loglikelihood([(ctx[-(63 - len(cont)):], cont)])
    assert lp == pytest.approx(want, abs=1e-5)
    with pytest.raises(InvalidRequestError, match="longer than the window of 62"):
        lm.loglikelihood([Request(("Hi", " word" * 63))], disable_tqdm=True)
    sent = _spy_prompts(lm.llm, monkeypatch)
    lm.generate_until([Request(("word " * 200, {"max_gen_toks": 4}))], disable_tqdm=True)
    assert len(sent[0]) == 60
    # lm-eval's max_length: the pair's and the generation's window.
    short = JaxOverlapLM(llm=lm.llm, max_length=16)
    [(lp, _)] = short.loglikelihood([Request(long_pair)], disable_tqdm=True)
    [(want, _)] = lm.llm.loglikelihood([(ctx[-(17 - len(cont)):], cont)])
    assert lp == pytest.approx(want, abs=1e-5)
    short.generate_until([Request(("word " * 200, {"max_gen_toks": 4}))], disable_tqdm=True)
    assert len(sent[-1]) == 12  # (the pair before went through generate too: 17 tokens)
    with pytest.raises(InvalidRequestError, match="max_length"):
        JaxOverlapLM(llm=lm.llm, max_length=63)


def test_no_second_bos_after_a_chat_template(lm, monkeypatch):
    """A tokenizer that adds BOS (Llama's) and a chat template that writes it: lm-eval's
    `apply_chat_template` text is encoded with the one BOS (lm-eval's add_bos_token=None)."""
    import tokenizers

    from jaxoverlap.models.tokenizer import Tokenizer

    base = lm.tokenizer
    bos = base.token_to_id("<|im_start|>")
    copy = tokenizers.Tokenizer.from_str(base.hf_tokenizer.to_str())
    copy.post_processor = tokenizers.processors.TemplateProcessing(single="<|im_start|> $A",
                                                                   special_tokens=[("<|im_start|>", bos)])
    with_bos = Tokenizer(copy, eos_token_ids=base.eos_token_ids, bos_token_id=bos)
    monkeypatch.setattr(JaxOverlapLM, "tokenizer", property(lambda self: with_bos))
    text = "<|im_start|>user: What do bees make?\nassistant:"
    assert lm._encode("Hi") == [bos] + base.encode("Hi", add_special_tokens=False)
    assert lm._encode(text) == base.encode(text, add_special_tokens=False)
    assert lm._encode(text)[:2].count(bos) == 1
    ctx, cont = lm._encode_pair(text, " Honey")
    assert ctx[:2].count(bos) == 1 and cont == base.encode(text + " Honey", add_special_tokens=False)[len(ctx):]
    sent = _spy_prompts(lm.llm, monkeypatch)
    lm.generate_until([Request((text, {"max_gen_toks": 2}))], disable_tqdm=True)
    assert sent[0] == base.encode(text, add_special_tokens=False)


def test_a_task_prefix_continues_the_assistant_turn(lm, monkeypatch):
    """lm-eval asks for no generation prompt when the last message is a prefix of the
    answer (a task's gen_prefix): the turn stays open after it, as lm-eval's HF model has it."""
    from jaxoverlap.models.chat_template import ChatTemplate
    from jaxoverlap.models.tokenizer import Tokenizer

    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with_template = Tokenizer(lm.tokenizer.hf_tokenizer, chat_template=ChatTemplate(chatml))
    monkeypatch.setattr(JaxOverlapLM, "tokenizer", property(lambda self: with_template))
    question = [{"role": "user", "content": "2 + 2?"}]
    assert lm.apply_chat_template(question).endswith("<|im_start|>assistant\n")
    prefixed = lm.apply_chat_template(question + [{"role": "assistant", "content": "The answer is"}],
                                      add_generation_prompt=False)
    assert prefixed == "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\nThe answer is"
