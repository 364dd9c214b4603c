"""The public Python API on the embedded default model: generate, streaming, stop strings."""
import pytest

from jaxoverlap import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_running_requests=4, max_context_len=256, kv_cache_tokens=2048, page_size=8)


def test_generate_text_and_token_ids(llm):
    [res] = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=16, temperature=0.0))
    assert len(res.token_ids) == 16 and res.finish_reason == "length"
    assert res.text == llm.tokenizer.decode(res.token_ids)
    assert res.metrics.time_to_first_token > 0 and res.metrics.tokens_per_second > 0
    # Token-id prompts give the same result as the text they encode.
    [again] = llm.generate([llm.tokenizer.encode("Once upon a time")], SamplingParams(max_new_tokens=16, temperature=0.0))
    assert again.token_ids == res.token_ids


def test_stream_concatenates_to_the_final_text(llm):
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    [full] = llm.generate(["Once upon a time"], params)
    deltas = list(llm.generate_stream(["Once upon a time"], params))
    assert deltas[-1].finished and sum(len(d.new_token_ids) for d in deltas) == 20
    assert "".join(d.new_text for d in deltas) == full.text


def test_stop_string_truncates_text(llm):
    [full] = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=24, temperature=0.0))
    words = full.text.split()
    stop = words[3]  # a word that the greedy continuation reaches
    [res] = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=24, temperature=0.0, stop=[stop]))
    assert res.finish_reason == "stop"
    assert stop not in res.text and full.text.startswith(res.text)
    assert len(res.token_ids) < len(full.token_ids)
    llm.engine.check_integrity()


def test_bad_prompt_in_a_batch_rejects_the_call_and_leaves_nothing(llm):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate(["fine", ""], SamplingParams(max_new_tokens=4))
    assert not llm.engine.has_work()
    llm.engine.check_integrity()


def test_llm_as_a_context_manager_closes_its_engine():
    from jaxoverlap.errors import EngineClosedError

    with LLM(None, max_running_requests=2, max_context_len=128, kv_cache_tokens=512, page_size=8) as llm:
        [res] = llm.generate(["Hi"], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert len(res.token_ids) == 4
    assert llm.engine.closed
    with pytest.raises(EngineClosedError):
        llm.generate(["Hi"], SamplingParams(max_new_tokens=4))
