"""Tensor parallelism on 4 fake CPU devices: TP=2 and TP=4 give the greedy outputs of TP=1.

The devices must be requested before JAX starts, so the comparison runs in a subprocess."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_tp_greedy_matches_single_device():
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "tp_worker.py")], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for algo in ("None", "ngram_device"):
        ref = out[f"{algo}-1"]
        assert ref["kv_devices"] == 1
        for tp in (2, 4):
            got = out[f"{algo}-{tp}"]
            assert got["kv_devices"] == tp, "the KV cache is not sharded"
            assert "tp" in got["wqkv_spec"], "the weights are not sharded"
            assert got["tokens"] == ref["tokens"], f"{algo} TP={tp} differs from TP=1"
    assert out["None-1"]["retractions"] > 0, "the workload should force retraction"
