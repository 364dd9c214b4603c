"""The model "jaxoverlap" for EleutherAI's lm-evaluation-harness (lm-eval 0.4's `LM` API):
its three request types on the engine's LLM API.

    pip install lm_eval
    python -m jaxoverlap.lm_eval_model --model jaxoverlap \\
        --model_args pretrained=/path/to/Qwen3-8B,max_running_requests=64 --tasks hellaswag,gsm8k

or, from Python, `lm_eval.simple_evaluate(model=JaxOverlapLM(llm=my_llm), tasks=[...])`.
lm-eval is not a dependency of jaxoverlap: without it the class still works on any object
with an `.args` tuple (what lm-eval's Instance carries), which is how the tests use it.

How requests become engine work, as lm-eval's Hugging Face model does it:
- Text is encoded as the tokenizer does by default (Llama's BOS added, Qwen's nothing),
  except a text that starts with the BOS token's text already (a chat template wrote it):
  no second BOS, as lm-eval's `add_bos_token=None` does.
- loglikelihood (context, continuation): the pair is encoded as one text and split where the
  context's own encoding ends, a context's trailing spaces moved to the continuation; an
  empty context is the prefix token (BOS, else EOS); a pair longer than the window
  (`max_length` predicted tokens: by default the context less two, as for rolling windows)
  keeps its last tokens, and a continuation that cannot fit is an error, as in lm-eval.
  `LLM.loglikelihood`: the context's pages may come from the prefix cache, so the choices
  of one question prefill it once.
- loglikelihood_rolling (text,): `LLM.loglikelihood_rolling`, lm-eval's disjoint windows.
- generate_until (context, gen_kwargs): greedy unless do_sample or a temperature (see
  `_temperature`); `until` as stop strings
  (the text is also cut at the first of them, as lm-eval does); `max_gen_toks` (default
  256); the context left-truncated so that it and they fit `max_length` (by default the
  whole context).
"""
from __future__ import annotations

from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.llm import LLM
from jaxoverlap.sampling_params import SamplingParams

try:  # lm-eval present: a registered LM subclass, which lm-eval's checks require
    from lm_eval.api.model import LM as _LMBase
    from lm_eval.api.registry import register_model as _register_model
except ImportError:
    _LMBase, _register_model = object, None

DEFAULT_MAX_GEN_TOKS = 256


class JaxOverlapLM(_LMBase):
    """`pretrained` (a checkpoint folder; None: the embedded model) and any EngineConfig
    option as keywords, or an existing `llm`. `max_length` (lm-eval's): the window of a
    scored pair or a rolling window in predicted tokens (at most, and by default, the
    engine's context less two), and of a generation's prompt plus its new tokens (by
    default the whole context). lm-eval's batch_size / max_batch_size / device are
    accepted and ignored: the engine batches by itself."""

    def __init__(self, pretrained: str | None = None, *, llm: LLM | None = None, max_length: int | None = None,
                 batch_size=None, max_batch_size=None, device=None, **engine_options):
        if _LMBase is not object:
            super().__init__()
        self.llm = llm if llm is not None else LLM(pretrained, **engine_options)
        context = self.llm.engine.max_context_len
        if max_length is not None and not 1 <= int(max_length) <= context - 2:
            raise InvalidRequestError(f"max_length must be in [1, {context - 2}] (the engine's context less two), "
                                      f"got {max_length}")
        self.max_length = None if max_length is None else int(max_length)
        self.name = pretrained or "jaxoverlap-default-model"

    @property
    def tokenizer(self):
        tok = self.llm.tokenizer
        if tok is None:
            raise InvalidRequestError("lm-eval sends text: this model has no tokenizer")
        return tok

    @property
    def tokenizer_name(self) -> str:  # lm-eval keys its chat-template cache on it
        return self.name

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        # Without a generation prompt, lm-eval's last message is an assistant prefix (a task's
        # gen_prefix) to continue: its HF and vLLM models pass continue_final_message so.
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        """The tokenizer's own encoding (special tokens included), without a second BOS
        where the text starts with one (a chat template's)."""
        tok = self.tokenizer
        bos = None if tok.bos_token_id is None else tok.id_to_token(tok.bos_token_id)
        return tok.encode(text, add_special_tokens=not (bos and text.startswith(bos)))

    # -- loglikelihood --------------------------------------------------------------------
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split: encode context + continuation once, and cut where the context's
        own encoding ends, so that the continuation's tokens are those of the whole text."""
        if not context:
            return [self.llm.prefix_token_id], self.tokenizer.encode(continuation, add_special_tokens=False)
        # Every trailing whitespace character, as lm-eval's str.rstrip(): a context that ends
        # in "\n" or "\t" gives its newline to the continuation too.
        spaces = len(context) - len(context.rstrip())
        if spaces:  # "Question: ... Answer: " + "B" -> "... Answer:" + " B"
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self._encode(context + continuation)
        ctx = self._encode(context)
        # A context of whitespace only has gone to the continuation: condition it on the prefix
        # token, as an empty context is.
        return ctx or [self.llm.prefix_token_id], whole[len(ctx):]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # A pair's prompt: the window's predicted tokens and the context token before them.
        limit = (self.max_length or self.llm.engine.max_context_len - 2) + 1
        pairs = []
        for req in requests:
            ctx, cont = self._encode_pair(*req.args)
            if not cont:
                raise InvalidRequestError(f"continuation {req.args[1]!r} encodes to no tokens")
            if len(cont) > limit - 1:
                raise InvalidRequestError(f"continuation of {len(cont)} tokens is longer than the window of "
                                          f"{limit - 1} scored tokens")
            pairs.append((ctx[-(limit - len(cont)):], cont))  # a pair too long keeps its last tokens
        return self.llm.loglikelihood(pairs, use_tqdm=not disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self.llm.loglikelihood_rolling([req.args[0] for req in requests], max_length=self.max_length,
                                              prefix_token_id=self.llm.prefix_token_id, use_tqdm=not disable_tqdm)

    # -- generation -----------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params, stops = [], [], []
        limit = self.max_length or self.llm.engine.max_context_len  # prompt + new tokens
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else [s for s in until if s]
            max_gen = int(kw.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            temperature = _temperature(kw.pop("do_sample", None), kw.pop("temperature", None))
            sampling = {k: kw[k] for k in ("top_p", "top_k", "min_p", "seed") if k in kw}
            ids = self._encode(context) or [self.llm.prefix_token_id]
            max_gen = min(max_gen, limit - 1)  # one prompt token at least
            prompts.append(ids[-(limit - max_gen):])  # the context's end, leaving room for max_gen tokens
            params.append(SamplingParams(max_new_tokens=max_gen, temperature=temperature, stop=tuple(until),
                                         **sampling))
            stops.append(until)
        results = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        out = []
        for r, until in zip(results, stops):
            text = r.text
            for s in until:  # as lm-eval cuts: also where a stop string ends up inside the text
                text = text.split(s)[0]
            out.append(text)
        return out


def _temperature(do_sample, temperature) -> float:
    """A task's sampling temperature: do_sample=False is greedy whatever the temperature (as
    lm-eval's HF model); a temperature given otherwise is kept (as its vLLM model); sampling
    with no temperature samples at 1.0 (transformers' default), and neither is greedy."""
    if do_sample is False:
        return 0.0
    if temperature is not None:
        return float(temperature)
    return 1.0 if do_sample else 0.0


if _register_model is not None:
    _register_model("jaxoverlap")(JaxOverlapLM)


if __name__ == "__main__":  # lm-eval's command line, with this model registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
