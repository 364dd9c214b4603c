"""The benchmark scripts that the GPU runs use, smoke-run on the tiny model.

A GPU session has minutes, not hours: a script that broke since its last run (an option
renamed, a field removed from the engine) costs a call. So each script that
`benchmarks/RESULTS.md` quotes runs here with its `--tiny` settings, as its own process (as
on the device), and its JSON must hold the rows and the checks it reports."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(tmp_path, name: str, *args: str, timeout: int = 300) -> dict:
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), *args, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.timeout(400)
def test_decode_bench(tmp_path):
    res = run_script(tmp_path, "decode_bench", "--tiny", "--batches", "1", "4", "--new-tokens", "8",
                     "--device-iters", "2", "--variants", "default", "group12")
    rows = res["rows"]
    assert [(r["batch"], r["variant"]) for r in rows] == [(1, "default"), (1, "group12"), (4, "default"),
                                                          (4, "group12")]
    for r in rows:
        assert r["greedy_identical"], r  # the overlap loop's tokens are the normal loop's
        assert r["tokens_as_first_variant"] == 1.0, r  # another weight layout, the same tokens
        assert r["device_step_ms"] > 0 and r["host_launch_ms"] > 0 and r["floor_ms"] > 0


@pytest.mark.timeout(400)
def test_decode_bench_moe(tmp_path):
    # The default variant only: the no_expert_kernel one is the XLA experts, whose tokens
    # test_moe compares with the kernel's.
    res = run_script(tmp_path, "decode_bench", "--tiny", "--model", "qwen3-30b-a3b", "--batches", "1", "4",
                     "--new-tokens", "8", "--device-iters", "2", "--prompt-len", "16", "--attention-backend", "pallas")
    rows = res["rows"]
    assert [(r["batch"], r["variant"]) for r in rows] == [(1, "default"), (4, "default")]
    for r in rows:
        assert r["greedy_identical"], r
    # A batch of 1 reaches 4 of the 16 experts, a batch of 4 about 11: a floor between the
    # non-expert weights' and all weights'.
    assert rows[0]["floor_ms"] < rows[1]["floor_ms"] < rows[1]["floor_all_ms"]


def test_program_compile_bench(tmp_path):
    res = run_script(tmp_path, "program_compile_bench", "--tiny", "--model", "qwen3-30b-a3b", "--batches", "1",
                     "--variants", "default", "no_expert_kernel", "--prefill", "--chunked-prefill-size", "16",
                     "--max-context-len", "64")
    got = [(r["variant"], r["program"]) for r in res["rows"]]
    # Both variants' decode program, and the prefill programs (at least one) once.
    assert got[0] == ("default", "decode") and got[-1] == ("no_expert_kernel", "decode"), got
    assert got.count(("default", "prefill")) >= 1 and ("no_expert_kernel", "prefill") not in got, got
    assert all(r["seconds"] > 0 for r in res["rows"])
    assert res["totals"]["default_prefill_s"] == pytest.approx(sum(r["seconds"] for r in res["rows"]
                                                                   if r["program"] == "prefill"))


@pytest.mark.timeout(300)
def test_moe_plan_bench(tmp_path):
    res = run_script(tmp_path, "moe_plan_bench", "--tiny", "--tokens", "1", "16", "--layers", "2", "--iters", "1",
                     "--plans", "auto", "auto-xla", "dense", "grouped1", "grouped8", "sliced", "pallas")
    rows = {(r["tokens"], r["plan"]): r for r in res["rows"]}
    # Every plan computes the same MLP as the first one timed at that token count.
    assert all(r["rel_err_vs_first"] < 1e-5 for r in rows.values()), rows
    # 16 experts, 4 per token: the kernel for 1 token (4 assignments), not 16 (64 > E).
    assert rows[(1, "auto")]["resolved"] == "pallas" and rows[(1, "auto-xla")]["resolved"] == "grouped1"
    assert rows[(16, "auto")]["resolved"] == rows[(16, "auto-xla")]["resolved"] == "dense"
    assert {(1, "sliced"), (16, "sliced"), (16, "grouped8"), (1, "pallas")} <= set(rows)
    assert (16, "pallas") not in rows  # 64 assignments > 2E: past where the kernel can win


@pytest.mark.timeout(400)
def test_spec_bench(tmp_path):
    res = run_script(tmp_path, "spec_bench", "--tiny", "--batches", "1", "--algos", "plain", "ngram_device",
                     "--device-iters", "2", "--new-tokens", "16", "--compare-single-executable")
    rows = {r["algo"]: r for r in res["rows"]}
    assert set(rows) == {"plain", "ngram_device"}
    for r in rows.values():
        assert r["greedy_identical"] and r["single_exec_identical"], r
        assert r["accept_length"] >= 1.0
    assert rows["plain"]["accept_length"] == 1.0
    # The prompts repeat a piece, so the n-gram drafter gets some drafts accepted.
    assert rows["ngram_device"]["accept_length"] > 1.0
    # Sampled with a penalty: the sampling programs, timed with and without the history;
    # 2 rows in the bucket of 4, so that the steps carry padded rows.
    res = run_script(tmp_path, "spec_bench", "--tiny", "--batches", "2", "--batch-buckets", "4", "--algos", "eagle",
                     "--device-iters", "2", "--new-tokens", "12",
                     "--sampling-params", '{"temperature": 0.8, "presence_penalty": 0.5}')
    [row] = res["rows"]
    assert row["bucket"] == 4
    assert row["sampling_program"] and row["greedy_identical"], row  # seeded: overlap on and off agree
    assert row["device_step_ms"] > 0 and row["device_no_history_ms"] > 0


@pytest.mark.timeout(400)
def test_structured_bench(tmp_path):
    res = run_script(tmp_path, "structured_bench", "--tiny", "--batches", "1", "4", "--new-tokens", "8",
                     "--repeats", "1")
    rows = {(r["batch"], r["variant"]): r for r in res["rows"]}
    assert set(rows) == {(1, "none"), (1, "all"), (4, "none"), (4, "all"), (4, "one")}
    for r in rows.values():
        assert r["not_full_length"] <= r["constrained_rows"], r  # only a constrained row may end early (EOS)
        assert r["period_ms"] > 0 and r["host_ms"] > 0 and r["launch_ms"] > 0
    assert rows[(4, "none")]["vs_unconstrained"] == 1.0


@pytest.mark.timeout(400)
def test_structured_bench_with_a_drafter(tmp_path):
    res = run_script(tmp_path, "structured_bench", "--tiny", "--batches", "2", "--new-tokens", "8", "--repeats", "1",
                     "--speculative", "ngram_device", "--calls")
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"none", "all", "one"}
    assert rows["none"]["decode_call_ms"] > 0 and "spec_verify_call_ms" not in rows["none"]
    for name in ("all", "one"):  # every constrained step: the three programs, the masks and the wait for drafts
        r = rows[name]
        assert all(r[f"{k}_ms"] > 0 for k in ("spec_draft_call", "spec_verify_call", "spec_accept_call", "masks",
                                             "wait_drafts")), r
        assert r["accept_len"] >= 1


@pytest.mark.timeout(400)
def test_structured_launch_probe(tmp_path):
    res = run_script(tmp_path, "structured_launch_probe", "--tiny", "--batches", "2", "--new-tokens", "8",
                     "--repeats", "1", "--variants", "plain", "default", "one_exe")
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"plain", "default", "one_exe"}
    assert rows["plain"]["decode_call_ms"] > 0 and rows["plain"]["forward_call_ms"] != rows["plain"]["forward_call_ms"]
    for name in ("default", "one_exe"):  # every constrained step: a forward call, masks and a sampling call
        assert rows[name]["forward_call_ms"] > 0 and rows[name]["bitmask_ms"] > 0 and rows[name]["sample_call_ms"] > 0


@pytest.mark.timeout(400)
def test_spec_divergence_probe(tmp_path):
    """On the tiny float32 model every variant gives the reference's greedy tokens, also when
    run again on the same engine; the JSON lists the differences (none) per variant."""
    res = run_script(tmp_path, "spec_divergence_probe", "--tiny", "--batch", "2", "--new-tokens", "6", "--again",
                     "--variants", "plain:xla", "ngram_device:xla:normal")
    assert set(res["summary"]) == {"plain:xla:again", "ngram_device:xla:normal", "ngram_device:xla:normal:again"}
    assert all(diffs == [] for diffs in res["summary"].values()), res["summary"]
    assert len(res["tokens"]["plain:xla"]) == 2 and res["margin_min"] > 0


@pytest.mark.timeout(400)
def test_serve_overlap_bench(tmp_path):
    res = run_script(tmp_path, "serve_overlap_bench", "--tiny", "--concurrency", "8", "--num-prompts", "16",
                     "--output-len", "16", "--rounds", "1")
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"offline", "serve", "serve_si", "serve_process"}
    for name, r in rows.items():
        assert r["output_tok_s"] > 0 and r["decode_iterations"] > 0, r
        if name != "offline":
            assert r["failed"] == 0 and r["itl_median_ms"] > 0, r


@pytest.mark.timeout(400)
def test_host_text_bench(tmp_path):
    res = run_script(tmp_path, "host_text_bench", "--batch", "8", "--new-tokens", "16", "--long-tokens", "64")
    workloads = [r["workload"] for r in res["rows"]]
    assert workloads == ["ids", "text", "text_stop", "text_off", "text_stop, 64 tokens"]
    for r in res["rows"]:
        assert r["steps"] > 0 and r["process_ms"] > 0, r
    assert res["add_request_ids_ms"] > 0 and res["add_request_text_ms"] > 0


def test_shared_prompt_bench(tmp_path):
    res = run_script(tmp_path, "shared_prompt_bench", "--tiny", "--num-requests", "4", "--prompt-len", "64",
                     "--system-len", "32", "--user-len", "8", "--new-tokens", "4", "--chunked-prefill-size", "64")
    rows = res["rows"]
    assert [(r["workload"], r["prefix_cache"]) for r in rows] == \
        [(w, c) for w in ("samples", "system") for c in ("on", "off", "off", "on")]
    # Exact token counts: with the cache off every prompt is prefilled whole; on, the first
    # request prefills its prompt and the others what follows the shared pages (page 16).
    for r in rows:
        assert r["requests"] == 4
        want = r["prompt_tokens"] if r["prefix_cache"] == "off" else {"samples": 64 + 3 * 16, "system": 40 + 3 * 8}[
            r["workload"]]
        assert r["prefilled_tokens"] == want, r


@pytest.mark.timeout(400)
def test_hf_compare(tmp_path):
    res = run_script(tmp_path, "hf_compare", "--tiny", "--batch-sizes", "2", "--new-tokens", "8", "--prompt-len", "16")
    assert not res["errors"], res["errors"]
    sides = {r["side"]: r for r in res["rows"]}
    assert set(sides) == {"jaxoverlap", "hf"}
    for r in sides.values():
        assert r["tokens"] == 2 * 8 and r["tok_s"] > 0, r
    assert res["speedup"]


@pytest.mark.timeout(400)
def test_serve_cold_start(tmp_path):
    """The real `jaxoverlap serve --precompile all`, started twice on one compilation cache:
    a mixed greedy and sampled workload, prompts of several lengths, then compiles nothing
    (the server's compiling-launch counters), and the second start finds the first one's
    programs in the cache."""
    res = run_script(tmp_path, "serve_cold_start", "--tiny", "--starts", "2", "--max-running-requests", "2",
                     "--max-prefill-requests", "2", "--chunked-prefill-size", "32", "--max-context-len", "64",
                     "--num-prompts", "6", "--max-prompt-len", "50", "--output-len", "5", "--concurrency", "2")
    first, second = res["rows"]
    for r in (first, second):
        assert r["requests"] == 6 and r["output_tokens"] == 30, r
        assert r["precompiled_programs"] > 0 and r["precompiled_programs"] == first["precompiled_programs"]
        assert r["compiling_launches_in_workload"] == 0, r
    assert first["cache_entries_before"] == 0 and second["cache_entries_before"] > 0


def test_penalty_bench(tmp_path):
    res = run_script(tmp_path, "penalty_bench", "--tiny", "--batches", "2", "--new-tokens", "8", "--device-iters", "2")
    (row,) = res["rows"]
    for name in ("greedy", "sampled", "sampled_penalties", "greedy_penalties"):
        assert row[f"{name}_period_ms"] > 0 and row[f"{name}_launch_ms"] > 0, name
    assert row["device_sampling_ms"] > 0 and row["device_sampling_no_history_ms"] > 0
    assert row["greedy_on_launch_ms"] > 0 and row["greedy_off_launch_ms"] > 0


def test_prefill_ctx_bench(tmp_path):
    res = run_script(tmp_path, "prefill_ctx_bench", "--tiny", "--shapes", "2x32", "--iters", "2")
    (row,) = res["rows"]
    assert (row["rows"], row["tokens"]) == (2, 32)
    assert all(row[f"{v}_ms"] > 0 for v in ("bucket", "table", "greedy", "logprobs"))


@pytest.mark.timeout(400)
def test_prefill_plan_bench(tmp_path):
    res = run_script(tmp_path, "prefill_plan_bench", "--tiny", "--runs", "1")
    rows = {r["workload"]: r for r in res["rows"]}
    assert [r["requests"] for r in res["rows"]] == [1, 8, 8, 16]
    for r in rows.values():  # every prompt token prefilled once, in shapes within the budget
        assert sum(int(s.split(":")[1]) for s in r["shapes"]) == r["prompt_tokens"]
        for s in r["shapes"]:
            R, T = map(int, s.split(":")[0].split("x"))
            assert R * T <= 128 or R == 1
    assert rows["single"]["shapes"] == ["1x128:68"]  # the tiny model's step cost makes one step cheaper
    assert rows["edge"]["padded_area"] < 8 * 128  # rows of several prompts share steps


@pytest.mark.timeout(400)
def test_prefill_rows_probe(tmp_path):
    res = run_script(tmp_path, "prefill_rows_probe", "--tiny", "--runs", "1", "--num-requests", "4",
                     "--system-len", "40", "--user-len", "8", "--chunked-prefill-size", "64")
    launched = [p for r in res["rows"] for p in r["launched_prefill"]]
    # Cache on: the first prompt as three rows of 16 with the second one's last 16 tokens
    # (after the two pages of 16 it shares), then the other two's; cache off: the four
    # prompts' 192 tokens in three full steps of 64, rows of several prompts together.
    assert [lens for _, lens, _ in launched[:2]] == [[16, 16, 16, 16], [16, 16]]
    assert sum(sum(lens) for _, lens, _ in launched[2:]) == 4 * 48 and len(launched[2:]) == 3
    assert all(R * T <= 64 or R == 1 for (R, T), _, _ in launched)


def test_prefill_sample_bench(tmp_path):
    res = run_script(tmp_path, "prefill_sample_bench", "--tiny", "--rows", "8", "32", "--iters", "2", "--repeats", "1")
    assert [(r["rows"], r["requests"]) for r in res["rows"]] == [(8, 8), (32, 8)]
    assert all(r["every_row_ms"] > 0 and r["one_per_request_ms"] > 0 for r in res["rows"])


def test_common_helpers(tmp_path, monkeypatch, capsys):
    """print_table of no rows prints the header; git_commit names this checkout's commit
    from any working folder."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import common
    finally:
        sys.path.pop(0)
    common.print_table([], ["phase", "seconds"])
    assert capsys.readouterr().out.split() == ["phase", "seconds"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.chdir(tmp_path)  # not a repository
    assert common.git_commit() == head


@pytest.mark.timeout(300)
def test_expert_matmul_bench(tmp_path):
    res = run_script(tmp_path, "expert_matmul_bench", "--tiny", "--rows", "4", "--bk", "64", "128", "--bn", "64",
                     "--splits", "1", "2", "--warps", "4", "--stages", "2", "--iters", "1", "--layers", "2")
    # Tiny experts: gate_up [128, 128] takes bk 64 and 128 (and splits of 2), down [64, 128] only bk 64.
    got = {(r["shape"], r["bk"], r["splits"]) for r in res["rows"]}
    assert got == {("gate_up", 64, 1), ("gate_up", 64, 2), ("gate_up", 128, 1), ("down", 64, 1)}, got
    assert all(r["rel_err_vs_first"] < 1e-5 for r in res["rows"])
    assert {(f["rows"], f["shape"]) for f in res["fastest"]} == {(4, "gate_up"), (4, "down")}


@pytest.mark.timeout(300)
def test_compile_bench_moe(tmp_path):
    res = run_script(tmp_path, "compile_bench", "--tiny", "--model", "qwen3-30b-a3b", "--max-context-len", "128",
                     "--max-running-requests", "4", "--phases", "cold", "--threads", "2")
    assert not res["errors"] and [r["phase"] for r in res["rows"]] == ["cold"]
    assert res["rows"][0]["programs"] == len(res["rows"][0]["per_program"]) > 0


def test_quant_matmul_probe(tmp_path):
    """Every 8-bit format runs the chain and stays near bf16's output (a scale on the wrong
    axis would not), and the rows say how each compares."""
    res = run_script(tmp_path, "quant_matmul_probe", "--tiny", "--batches", "1", "4", "--iters", "1", "--repeats", "1")
    rows = res["rows"]
    assert [(r["format"], r["batch"]) for r in rows] == [
        (f, b) for f in ("bf16", "fp8_channel", "fp8_kernel", "int8_channel", "fp8_block", "fp8_fp8") for b in (1, 4)]
    for r in rows:
        assert "error" not in r and r["period_ms"] > 0 and r["vs_bf16"] > 0, r
        assert r["rel_err"] < (1e-9 if r["format"] == "bf16" else 0.2), r
    # The kernel computes fp8_channel's product (to float32 rounding, then bf16's).
    err = {(r["format"], r["batch"]): r["rel_err"] for r in rows}
    assert all(abs(err["fp8_kernel", b] - err["fp8_channel", b]) < 0.01 for b in (1, 4)), err


def test_attention_bench_with_an_8bit_cache(tmp_path):
    """The kernels' timing and error rows on a bf16 cache and on its e4m3 copy: each kernel
    matches the XLA path on the same cache, and the rounding to 8 bits shows against bf16."""
    res = run_script(tmp_path, "attention_bench", "--smoke", "--quick", "--no-sweep", "--kv-dtypes", "bf16", "fp8")
    rows = [r for r in res["results"] if r.get("shape") in ("decode", "window", "prefill")]
    assert {(r["shape"], r["kv_dtype"]) for r in rows} >= {(s, d) for s in ("decode", "window", "prefill")
                                                           for d in ("bf16", "fp8")}
    for r in rows:
        assert "error" not in r and r["time_us"] > 0, r
        if r["kind"] != "xla":
            assert r["max_err"] < 0.05, r  # the kernel against the XLA path on the same cache
        if r["kv_dtype"] == "fp8":
            assert 0 < r["fp8_vs_bf16_err"] < 0.5, r
