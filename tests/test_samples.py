"""SamplingParams.n: n independent samples of a prompt, queued as n requests of their own
(SamplingParams.samples) that share the prompt's prefill through the prefix cache. Each
sample equals a single request with its own seed; results come prompt by prompt; the
engine itself refuses n > 1; `jaxoverlap batch` writes a line per sample and resumes the
missing ones; `jaxoverlap generate --n`."""
from __future__ import annotations

import dataclasses
import json

import pytest

from jaxoverlap import LLM, SamplingParams
from jaxoverlap.batch import run_batch
from jaxoverlap.errors import InvalidRequestError

SAMPLED = SamplingParams(n=3, seed=11, temperature=1.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_running_requests=4, max_context_len=128, kv_cache_tokens=1024, page_size=8)


def test_samples_split_a_request_into_n_with_consecutive_seeds():
    p = SamplingParams(n=3, seed=2**32 - 1, temperature=0.7, top_k=5, stop=("x",))
    samples = p.samples()
    assert [s.seed for s in samples] == [2**32 - 1, 0, 1]  # wraps inside the seed range
    assert all(dataclasses.replace(s, seed=p.seed) == dataclasses.replace(p, n=1) for s in samples)
    assert [s.seed for s in SamplingParams(n=2).samples()] == [None, None]  # the engine draws each one
    one = SamplingParams(seed=4)
    assert one.samples() == (one,)
    for bad in (0, 129, True, 1.5, "2"):
        with pytest.raises(InvalidRequestError, match="n must be an integer in"):
            SamplingParams(n=bad)


def test_each_sample_equals_a_request_with_its_seed(llm):
    prompts = ["Once upon a time there was a little dog who", [5, 6, 7, 8, 9]]
    results = llm.generate(prompts, SAMPLED)
    assert len(results) == 6 and [r.sample_index for r in results] == [0, 1, 2, 0, 1, 2]
    for i, prompt in enumerate(prompts):
        for k in range(3):
            [alone] = llm.generate(prompt, dataclasses.replace(SAMPLED, n=1, seed=11 + k))
            r = results[3 * i + k]
            assert r.prompt_token_ids == alone.prompt_token_ids
            assert r.token_ids == alone.token_ids, (i, k)
    for i in range(2):  # different seeds, different samples
        assert len({tuple(r.token_ids) for r in results[3 * i: 3 * i + 3]}) > 1
    assert len({r.request_id for r in results}) == 6
    llm.engine.check_integrity()


def test_samples_share_the_prompts_prefill(llm):
    """The n requests of one prompt arrive together: one prefills the prompt, the others take
    its pages from the prefix cache (all but the page the last prompt token is on)."""
    prompt = list(range(200, 241))  # 41 tokens that no earlier test sent
    results = llm.generate([prompt], SamplingParams(n=4, temperature=0.9, seed=3, max_new_tokens=4, ignore_eos=True))
    cached = sorted(r.metrics.cached_prompt_tokens for r in results)
    assert cached[0] == 0 and cached[1:] == [40, 40, 40], cached


def test_a_list_of_params_with_different_n_and_unordered_results(llm):
    params = [dataclasses.replace(SAMPLED, n=2), SamplingParams(max_new_tokens=3, temperature=0.0),
              dataclasses.replace(SAMPLED, n=3, seed=None)]
    prompts = ["The little dog", "Hello", [7, 8, 9]]
    got = [(i, r.sample_index) for i, r in llm.generate_unordered(prompts, params)]
    assert sorted(got) == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    results = llm.generate(prompts, params)
    first, second = len(results[0].prompt_token_ids), len(results[2].prompt_token_ids)
    assert [(len(r.prompt_token_ids), r.sample_index) for r in results] == [
        (first, 0), (first, 1), (second, 0), (3, 0), (3, 1), (3, 2)]
    greedy = llm.generate("Hello", SamplingParams(n=2, max_new_tokens=3, temperature=0.0))
    assert greedy[0].token_ids == greedy[1].token_ids == results[2].token_ids


def test_the_engine_refuses_n_above_one_and_serves_on(llm):
    engine = llm.engine
    assert engine.check_request([1, 2, 3], SamplingParams(n=2)) == [1, 2, 3]  # what each sample needs
    with pytest.raises(InvalidRequestError, match="one sequence per request"):
        engine.add_request("two", [1, 2, 3], SamplingParams(n=2))
    assert "two" not in engine.requests
    with pytest.raises(InvalidRequestError, match="prompt has 199 tokens"):  # a bad prompt rejects the whole call
        llm.generate([[1, 2, 3], list(range(1, 200))], SamplingParams(n=2))
    assert not engine.requests
    [r] = llm.generate("Hello", SamplingParams(max_new_tokens=2))
    assert len(r.token_ids) == 2


def test_batch_writes_a_line_per_sample_and_resumes_the_missing_ones(llm, tmp_path):
    lines = [{"id": "p", "prompt": "Once upon a time", "sampling_params": {"n": 3, "seed": 5, "temperature": 0.9}},
             {"id": "q", "prompt": "Hello"}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    defaults = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    summary = run_batch(llm, str(inp), str(out), defaults, progress=False)
    records = [json.loads(line) for line in open(out)]
    assert summary.generated == 4 and summary.lines == 2
    by_key = {(r["id"], r.get("sample_index")): r for r in records}
    assert sorted(by_key, key=str) == sorted([("p", 0), ("p", 1), ("p", 2), ("q", None)], key=str)
    want = llm.generate("Once upon a time", SamplingParams(n=3, seed=5, temperature=0.9, max_new_tokens=6,
                                                           ignore_eos=True))
    assert [by_key["p", k]["token_ids"] for k in range(3)] == [w.token_ids for w in want]

    # An interrupted run lost sample 1 of "p": a resumed run generates it alone.
    out.write_text("".join(json.dumps(r) + "\n" for r in records if (r["id"], r.get("sample_index")) != ("p", 1)))
    summary = run_batch(llm, str(inp), str(out), defaults, progress=False, resume=True)
    assert summary.generated == 1 and summary.done_before == 1
    resumed = {(r["id"], r.get("sample_index")): r["token_ids"] for r in (json.loads(line) for line in open(out))}
    assert resumed == {key: r["token_ids"] for key, r in by_key.items()}


def test_cli_generate_n(capsys):
    from jaxoverlap.cli import main

    args = ["generate", "Hello", "Once upon a time", "--n", "2", "--temperature", "0.9", "--sampling-seed", "1",
            "--max-new-tokens", "3", "--json", "--max-running-requests", "4", "--max-context-len", "64",
            "--kv-cache-tokens", "256", "--page-size", "8"]
    assert main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt"], r["sample_index"]) for r in rows] == [("Hello", 0), ("Hello", 1), ("Once upon a time", 0),
                                                                ("Once upon a time", 1)]
    with pytest.raises(SystemExit, match="leave --n at 1"):
        main(args + ["--stream"])
