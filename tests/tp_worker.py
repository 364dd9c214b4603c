"""Run in a subprocess with 4 fake CPU devices (see test_tensor_parallel.py): greedy outputs
of the same workload at TP=1, 2 and 4, plain and with one drafter, printed as JSON."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402

from engine_fixtures import make_engine, run_workload, tiny_config  # noqa: E402
from jaxoverlap.sampling_params import SamplingParams  # noqa: E402


def main():
    assert len(jax.devices()) == 4, jax.devices()
    cfg = tiny_config(num_heads=8, num_kv_heads=4, head_dim=16)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", [(7 * i + j) % 90 + 1 for j in range(5 + 3 * i)], params) for i in range(4)],
                3: [("late", [3, 1, 4, 1, 5, 9, 2, 6], params)]}
    out = {}
    for algo in (None, "ngram_device"):
        for tp in (1, 2, 4):
            opts = dict(tensor_parallel_size=tp, kv_cache_tokens=160)  # small: forces retraction
            if algo:
                opts["speculative_algorithm"] = algo
            eng = make_engine(cfg, **opts)
            finals = run_workload(eng, arrivals)
            eng.check_integrity()
            sharding = eng.runner.state.k_cache.sharding
            out[f"{algo}-{tp}"] = {
                "tokens": {k: v.token_ids for k, v in sorted(finals.items())},
                "kv_devices": len(sharding.device_set),
                "wqkv_spec": str(getattr(eng.runner.params.layers[0].wqkv.sharding, "spec", "")),
                "retractions": eng.stats()["num_retractions"],
            }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
