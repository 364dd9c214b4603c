"""jaxoverlap/batch.py and `jaxoverlap batch`: JSONL requests in, JSONL results out. Results
equal LLM.generate's, a bad line gets an error result while the rest run, and an interrupted
run resumed gives each id exactly once with the same tokens as an uninterrupted run."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jaxoverlap import LLM, SamplingParams
from jaxoverlap.batch import run_batch
from jaxoverlap.errors import InvalidRequestError
from jaxoverlap.models.chat_template import ChatTemplate

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% if not think %}<think></think>{% endif %}{% endif %}")
DEFAULTS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_running_requests=4, max_context_len=128, kv_cache_tokens=1024, page_size=8)


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


GOOD = [
    {"id": "story", "prompt": "Once upon a time", "metadata": {"answer": [1, 2]}},
    {"prompt_token_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0.9, "seed": 7, "max_new_tokens": 9}},
    {"id": 30, "prompt": "The little dog", "sampling_params": {"logprobs": True, "top_logprobs": 2,
                                                               "repetition_penalty": 1.3, "logit_bias": {"13": -100}}},
    {"id": "30", "prompt": "The little dog"},  # "30" and 30 are different ids
]
BAD = [  # (line, id of its error result, what the error says)
    ('{"id": "x", "prompt": "hi", "sampling_params": {"temperature": -1}}', "x", "temperature must be"),
    ("not json", 7, "line 7 is not JSON"),
    ('{"id": "y", "prompt": "hi", "sampling_params": {"tempreature": 1}}', "y", "unknown field(s) 'tempreature'"),
    ('{"id": "z", "prompt": "hi", "answer": 3}', "z", "unknown field(s) 'answer'"),
    ('{"id": "w", "prompt": "hi", "prompt_token_ids": [1]}', "w", "exactly one of"),
    ('{"id": "v", "prompt_token_ids": [1, 100000]}', "v", "token id"),
    ('{"id": "u", "prompt_token_ids": ' + json.dumps(list(range(1, 200))) + "}", "u", "prompt has 199 tokens"),
    ('{"id": "t", "messages": [{"role": "user", "content": "hi"}]}', "t", "no chat template"),
    ('{"id": "story", "prompt": "again"}', "story", "used by an earlier line"),
    ('{"id": true, "prompt": "hi"}', 15, "id must be a string or an integer"),
    ("[1, 2]", 16, "must be a JSON object"),
    ('{"id": "s", "prompt": "hi", "sampling_params": {"ignore_eos": "false"}}', "s",
     "ignore_eos must be true or false"),
]


def expected(llm, line: dict):
    params = DEFAULTS if "sampling_params" not in line else SamplingParams(
        **{**{"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, **line["sampling_params"]})
    [res] = llm.generate([line.get("prompt", line.get("prompt_token_ids"))], params)
    return res


def test_results_equal_generate_and_bad_lines_get_errors(llm, tmp_path):
    lines = GOOD + [""] + [b[0] for b in BAD]  # a blank line is skipped but counted in line numbers
    out = str(tmp_path / "out.jsonl")
    summary = run_batch(llm, write_lines(tmp_path / "in.jsonl", lines), out, DEFAULTS, progress=False)
    records = read_records(out)
    assert summary.lines == len(GOOD) + len(BAD) and summary.generated == len(GOOD) and summary.errors == len(BAD)
    errors = {json.dumps(r["id"]): r["error"] for r in records if "error" in r}
    for _, rid, message in BAD:
        assert message in errors[json.dumps(rid)], (rid, errors[json.dumps(rid)])
    results = {json.dumps(r["id"]): r for r in records if "error" not in r}
    for i, line in enumerate(GOOD, start=1):
        r = results[json.dumps(line.get("id", i))]
        want = expected(llm, line)
        assert r["token_ids"] == want.token_ids and r["text"] == want.text
        assert r["finish_reason"] == "length" and r["output_tokens"] == len(want.token_ids)
        assert r["prompt_tokens"] == len(want.prompt_token_ids)
        assert ("logprobs" in r) == bool(line.get("sampling_params", {}).get("logprobs"))
        if want.top_logprobs is None:
            assert "top_logprobs" not in r
        else:  # other batch sizes than generate's: the same ids, logprobs within float rounding
            assert [[t for t, _ in alts] for alts in r["top_logprobs"]] == [[t for t, _ in a] for a in want.top_logprobs]
            np.testing.assert_allclose([[lp for _, lp in alts] for alts in r["top_logprobs"]],
                                       [[lp for _, lp in a] for a in want.top_logprobs], atol=1e-4)
        assert r.get("metadata") == line.get("metadata")
    assert results['"30"']["token_ids"] == results["30"]["token_ids"]
    assert summary.output_tokens == sum(r["output_tokens"] for r in results.values())
    llm.engine.check_integrity()


def test_a_line_that_is_not_utf8_gets_an_error_and_the_rest_run(llm, tmp_path):
    data = ("\ufeff" + json.dumps({"id": "a", "prompt": "Once"}) + "\n").encode() + b'{"id": "b", "prompt": "caf\xe9"}\n'
    data += (json.dumps({"id": "c", "prompt": "The dog"}) + "\n").encode()  # (a BOM opens the file)
    (tmp_path / "in.jsonl").write_bytes(data)
    out = str(tmp_path / "out.jsonl")
    summary = run_batch(llm, str(tmp_path / "in.jsonl"), out, DEFAULTS, progress=False)
    records = {r["id"]: r for r in read_records(out)}
    assert (summary.generated, summary.errors) == (2, 1)
    assert "line 2 is not UTF-8" in records[2]["error"]
    assert records["a"]["token_ids"] == expected(llm, {"prompt": "Once"}).token_ids and "token_ids" in records["c"]


def test_lone_surrogates_and_reserved_template_variables_get_errors(llm, tmp_path):
    """JSON may escape half a UTF-16 pair ("\\ud800"): no text, so neither tokenized nor
    written back. Template variables that would replace the conversation are refused. Each is
    the line's error; the other lines run."""
    tokenizer = llm.engine.tokenizer
    tokenizer.chat_template = ChatTemplate(CHATML)
    try:
        lines = ['{"id": "p", "prompt": "Hi \\ud800 there"}', '{"id": "i\\udfff", "prompt": "Hi"}',
                 '{"id": "m", "prompt": "Hi", "metadata": {"k": "\\ud83d"}}',
                 {"id": "kw", "messages": [{"role": "user", "content": "A fox"}],
                  "chat_template_kwargs": {"messages": []}},
                 {"id": "self", "messages": [{"role": "user", "content": "A fox"}], "chat_template_kwargs": {"self": 1}},
                 {"id": "ok", "prompt": "Once"}]
        out = str(tmp_path / "out.jsonl")
        summary = run_batch(llm, write_lines(tmp_path / "in.jsonl", lines), out, DEFAULTS, progress=False)
        records = {r["id"]: r for r in read_records(out)}
        assert (summary.generated, summary.errors) == (2, 4)
        for line_number in (1, 2, 3):
            assert "lone surrogate" in records[line_number]["error"]
        assert "may not set messages" in records["kw"]["error"]
        assert "token_ids" in records["self"] and "token_ids" in records["ok"]  # "self" is just a variable
    finally:
        tokenizer.chat_template = None
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        llm.generate("Hi \ud800")


def test_resume_drops_a_last_line_cut_inside_a_character(llm, tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Once"}, {"id": "b", "prompt": "The dog"}])
    out = tmp_path / "out.jsonl"
    run_batch(llm, inp, str(out), DEFAULTS, progress=False)
    [first, _] = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(first + '{"id": "b", "text": "café'.encode()[:-1])  # cut inside "é"
    summary = run_batch(llm, inp, str(out), DEFAULTS, progress=False, resume=True)
    assert (summary.done_before, summary.generated) == (1, 1)
    assert sorted(r["id"] for r in read_records(out)) == ["a", "b"]


def test_an_interrupted_run_resumes_to_each_id_once_with_the_same_tokens(llm, tmp_path):
    lines = [{"id": f"q{i}", "prompt": f"Story number {i} begins", "sampling_params": {
        "max_new_tokens": 4 + i % 5, "temperature": 0.0 if i % 2 else 0.8, "seed": i}} for i in range(10)]
    lines.append('{"id": "bad", "prompt": "x", "sampling_params": {"top_p": 0}}')
    inp = write_lines(tmp_path / "in.jsonl", lines)
    full = str(tmp_path / "full.jsonl")
    run_batch(llm, inp, full, DEFAULTS, progress=False)
    want = {r["id"]: r["token_ids"] for r in read_records(full) if "error" not in r}
    assert len(want) == 10

    out = str(tmp_path / "out.jsonl")
    engine, step, calls = llm.engine, llm.engine.step, []

    def interrupted_step():  # Ctrl-C part way through
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    try:
        with pytest.raises(KeyboardInterrupt):
            run_batch(llm, inp, out, DEFAULTS, progress=False)
    finally:
        del engine.step
    leftover = [o for o in engine.drain() if o.finished]
    assert all(o.finish_reason == "abort" for o in leftover) and not engine.requests
    first = read_records(out)
    finished_first = {r["id"] for r in first if "error" not in r}
    assert 0 < len(finished_first) < 10
    with open(out, "a", encoding="utf-8") as f:
        f.write('{"id": "q9", "text": "cut sh')  # a write cut short by the interruption

    with pytest.raises(FileExistsError):
        run_batch(llm, inp, out, DEFAULTS, progress=False)
    summary = run_batch(llm, inp, out, DEFAULTS, progress=False, resume=True)
    assert summary.done_before == len(finished_first) and summary.generated == 10 - len(finished_first)
    records = read_records(out)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(list(want) + ["bad"]), "each id once, the old error line dropped"
    assert {r["id"]: r["token_ids"] for r in records if "error" not in r} == want
    summary = run_batch(llm, inp, out, DEFAULTS, progress=False, overwrite=True)
    assert summary.generated == 10 and len(read_records(out)) == 11


def test_messages_use_the_chat_template(llm, tmp_path):
    tokenizer = llm.engine.tokenizer
    tokenizer.chat_template = ChatTemplate(CHATML)
    try:
        conversation = [{"role": "system", "content": "Tell tales."}, {"role": "user", "content": "A fox"}]
        lines = [{"id": "plain", "messages": conversation},
                 {"id": "think", "messages": conversation, "chat_template_kwargs": {"think": True}},
                 {"id": "bad", "messages": [{"content": "no role"}]},
                 {"id": "kw", "prompt": "x", "chat_template_kwargs": {"think": True}}]
        out = str(tmp_path / "out.jsonl")
        run_batch(llm, write_lines(tmp_path / "in.jsonl", lines), out, DEFAULTS, progress=False,
                  chat_template_kwargs={"think": False})
        records = {r["id"]: r for r in read_records(out)}
        for rid, think in (("plain", False), ("think", True)):
            [want] = llm.chat(conversation, DEFAULTS, think=think)
            assert want.prompt_token_ids == tokenizer.encode_chat(conversation, think=think)
            assert records[rid]["token_ids"] == want.token_ids
            assert records[rid]["prompt_tokens"] == len(want.prompt_token_ids)
        assert records["plain"]["prompt_tokens"] != records["think"]["prompt_tokens"]
        assert "string 'role'" in records["bad"]["error"]
        assert "for messages only" in records["kw"]["error"]
    finally:
        tokenizer.chat_template = None


def test_cli_batch(tmp_path, capsys, monkeypatch):
    from jaxoverlap.cli import EXIT_BATCH_ERRORS, main

    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": ""}])
    out = tmp_path / "out.jsonl"
    args = ["batch", inp, "-o", str(out), "--max-new-tokens", "3", "--no-progress", "--max-running-requests", "2",
            "--max-context-len", "64", "--kv-cache-tokens", "256", "--page-size", "8"]
    assert main(args) == EXIT_BATCH_ERRORS  # "b" got an error line
    records = {r["id"]: r for r in read_records(out)}
    assert len(records["a"]["token_ids"]) <= 3 and "error" in records["b"]
    assert "2 requests: 1 generated, 1 errors" in capsys.readouterr().err
    # Fixed, "b" is served on --resume and the run succeeds.
    write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "Hi"}])
    assert main(args + ["--resume"]) == 0
    records = [r for r in read_records(out)]
    assert [r["id"] for r in records] == ["a", "b"] and "error" not in records[1]
    assert "2 requests: 1 generated, 0 errors, 1 done before" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="exists"):
        main(args)
    with pytest.raises(SystemExit, match="not JSON"):
        main(args + ["--resume", "--chat-template-kwargs", "{"])

    def interrupted(*a, **kw):  # Ctrl-C part way through
        raise KeyboardInterrupt

    monkeypatch.setattr("jaxoverlap.batch.run_batch", interrupted)
    capsys.readouterr()
    assert main(args + ["--resume"]) == 130
    assert "--resume" in capsys.readouterr().err


def test_cli_chat_with_a_checkpoints_template(tmp_path, capsys):
    """A checkpoint whose tokenizer_config.json has a chat template: `generate --chat` and a
    `batch` line of messages give the same tokens for the same conversation."""
    import shutil

    from jaxoverlap.cli import main
    from jaxoverlap.models.loader import default_model_path

    model = tmp_path / "model"
    shutil.copytree(default_model_path(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    engine_args = ["--model", str(model), "--max-new-tokens", "5", "--max-running-requests", "2",
                   "--max-context-len", "64", "--kv-cache-tokens", "256", "--page-size", "8"]
    assert main(["generate", "A fox", "--chat", "--system", "Tell tales.", "--json", *engine_args]) == 0
    generated = json.loads(capsys.readouterr().out)
    messages = [{"role": "system", "content": "Tell tales."}, {"role": "user", "content": "A fox"}]
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "messages": messages}])
    out = tmp_path / "out.jsonl"
    assert main(["batch", inp, "-o", str(out), "--no-progress", *engine_args]) == 0
    [record] = read_records(out)
    assert record["token_ids"] == generated["token_ids"] and record["text"] == generated["text"]


def test_cli_mistakes_are_refused_before_the_model_loads(tmp_path):
    """"--model" names no checkpoint here: each mistake must be caught before a load is tried."""
    from jaxoverlap.cli import main

    nowhere = ["--model", str(tmp_path / "no-model")]
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello"}])
    for args, message in [
        (["generate", "a", "b", "--stream"], "give one prompt"),
        (["generate", "a", "--stream", "--json"], "prints text only"),
        (["generate", "a", "--stream", "--logprobs"], "prints text only"),
        (["generate", "a", "--temperature", "-1"], "temperature must be"),
        (["generate", "a", "--system", "x"], "--system needs --chat"),
        (["batch", inp, "-o", str(tmp_path / "no-folder" / "out.jsonl")], "no folder"),
        (["batch", inp, "-o", str(tmp_path / "out.jsonl"), "--top-p", "0"], "top_p must be"),
        (["batch", str(tmp_path), "-o", str(tmp_path / "out.jsonl")], "it is a folder"),
        (["batch", inp, "-o", str(tmp_path), "--overwrite"], "is a folder: name a file"),
        (["batch", inp, "-o", "/proc/out.jsonl"], "cannot write the output"),
        (["batch", inp, "-o", inp, "--resume"], "is the input file"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(args + nowhere)


def test_cli_says_in_one_line_why_no_engine_can_be_built(tmp_path):
    """A model folder that is not there, or engine options no engine can take, end the
    command with the reason (exit status 1, as the CLI's other refusals), not a traceback."""
    from jaxoverlap.cli import main

    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello"}])
    for command in (["generate", "hi"], ["batch", inp, "-o", str(tmp_path / "out.jsonl"), "--no-progress"]):
        for options, message in ((["--model", str(tmp_path / "no-model")], r"error: .*No such file .*no-model"),
                                 (["--page-size", "0"], "error: page_size must be >= 1, got 0"),
                                 (["--tensor-parallel-size", "64"], "error: tensor_parallel_size=64")):
            with pytest.raises(SystemExit, match=message) as e:
                main(command + options)
            assert "\n" not in str(e.value.code)
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_generate_says_why_a_prompt_is_refused():
    from jaxoverlap.cli import main

    engine = ["--max-running-requests", "2", "--max-context-len", "64", "--kv-cache-tokens", "256", "--page-size", "8"]
    with pytest.raises(SystemExit, match="empty"):
        main(["generate", "", *engine])
    with pytest.raises(SystemExit, match="prompt has"):
        main(["generate", "word " * 80, "--stream", *engine])


def test_cli_chat_needs_a_tokenizer(tmp_path):
    import shutil

    from jaxoverlap.cli import main
    from jaxoverlap.models.loader import default_model_path

    model = tmp_path / "model"
    shutil.copytree(default_model_path(), model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    with pytest.raises(SystemExit, match="--chat needs the model's tokenizer"):
        main(["generate", "A fox", "--chat", "--model", str(model), "--max-running-requests", "2",
              "--max-context-len", "64", "--kv-cache-tokens", "256", "--page-size", "8"])


def test_structured_output_lines(llm, tmp_path):
    """A line's sampling_params may carry a structured_output object; a constraint that
    cannot compile is that line's error."""
    lines = [{"id": "j", "prompt": "Once", "sampling_params": {
                 "max_new_tokens": 32, "ignore_eos": False,
                 "structured_output": {"json_schema": {"type": "object", "required": ["x"], "additionalProperties": False,
                                                       "properties": {"x": {"type": "integer", "maximum": 9}}}}}},
             {"id": "c", "prompt": "Once", "sampling_params": {"ignore_eos": False, "max_new_tokens": 8,
                                                               "structured_output": {"choice": ["yes", "no"]}}},
             {"id": "bad", "prompt": "Once", "sampling_params": {"structured_output": {"regex": "(unclosed"}}}]
    out = str(tmp_path / "out.jsonl")
    summary = run_batch(llm, write_lines(tmp_path / "in.jsonl", lines), out, DEFAULTS, progress=False)
    records = {r["id"]: r for r in read_records(out)}
    assert summary.errors == 1 and "regex" in records["bad"]["error"]
    assert list(json.loads(records["j"]["text"])) == ["x"] and records["j"]["finish_reason"] == "stop"
    assert records["c"]["text"] in ("yes", "no")


def test_cli_structured_output_options(tmp_path, capsys):
    """`jaxoverlap generate --choice / --json-schema FILE`: the printed text follows them;
    two constraints at once, or a schema that is neither JSON nor a file, stop before the
    model loads."""
    from jaxoverlap.cli import main

    engine = ["--max-running-requests", "2", "--max-context-len", "64", "--kv-cache-tokens", "256", "--page-size", "8"]
    assert main(["generate", "Once upon a time", "--choice", "red", "green", "--max-new-tokens", "8", *engine]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]  # the prompt, then the generated text
    assert out.startswith("Once upon a time") and out[len("Once upon a time"):] in ("red", "green"), out
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["k"], "additionalProperties": False,
                                  "properties": {"k": {"type": "boolean"}}}))
    assert main(["generate", "Once", "--json-schema", str(schema), "--max-new-tokens", "16", *engine]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(out[len("Once"):]) in ({"k": True}, {"k": False}), out
    with pytest.raises(SystemExit, match="one of --json-schema, --regex and --choice"):
        main(["generate", "Once", "--regex", "a+", "--choice", "x", *engine])
    with pytest.raises(SystemExit, match="neither a JSON object nor a readable file"):
        main(["generate", "Once", "--json-schema", str(tmp_path / "missing.json"), *engine])


def test_an_id_used_by_an_error_line_is_a_duplicate_too(llm, tmp_path):
    """The first line of an id decides it, whether it runs or gets an error: a later line
    with the id is a duplicate (before, an error line and a result shared one id)."""
    lines = [{"id": "a", "prompt": "Hi", "sampling_params": {"temperature": -1}},
             {"id": "a", "prompt": "Hello"},
             "not json",  # line 3: its id is its line number
             {"id": 3, "prompt": "Hello"}]
    out = str(tmp_path / "out.jsonl")
    summary = run_batch(llm, write_lines(tmp_path / "in.jsonl", lines), out, DEFAULTS, progress=False)
    records = read_records(out)
    assert summary.generated == 0 and all("error" in r for r in records) and len(records) == 4
    assert sum("used by an earlier line" in r["error"] for r in records) == 2


def test_a_request_the_engine_ends_with_an_error_gets_an_error_line(llm, tmp_path, monkeypatch):
    """A result carrying an error (a grammar the engine refused after queueing) is written as
    an error line, which --resume tries again, not as a result."""
    real = llm.generate_unordered

    def failing_first(prompts, params, **kw):
        for index, result in real(prompts, params, **kw):
            yield index, dataclasses.replace(result, error="refused" if index == 0 else None)

    monkeypatch.setattr(llm, "generate_unordered", failing_first)
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hi"}, {"id": "b", "prompt": "Hello"}])
    out = str(tmp_path / "out.jsonl")
    summary = run_batch(llm, inp, out, DEFAULTS, progress=False)
    assert summary.errors == 1 and summary.generated == 1
    assert {r["id"]: r.get("error") for r in read_records(out)} == {"a": "refused", "b": None}
    monkeypatch.undo()
    summary = run_batch(llm, inp, out, DEFAULTS, progress=False, resume=True)
    assert summary.generated == 1 and summary.done_before == 1
    assert sorted(r["id"] for r in read_records(out) if "error" not in r) == ["a", "b"]
