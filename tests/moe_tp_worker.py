"""Run in a subprocess with 4 fake CPU devices (see test_moe.py): a tiny MoE model at TP=1
and TP=2, its greedy tokens, the TP=2 weights' shardings, the logits' difference, and the
collectives of a compiled TP=2 forward; printed as JSON, one entry per model: Qwen3-MoE's
routed experts, and Qwen2-MoE's with a shared expert beside them."""
import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from engine_fixtures import make_engine, run_workload, tiny_params  # noqa: E402
from jaxoverlap import parallel  # noqa: E402
from jaxoverlap.models import moe  # noqa: E402
from jaxoverlap.models.params import layer_at  # noqa: E402
from jaxoverlap.models.transformer import dense_logits  # noqa: E402
from jaxoverlap.sampling_params import SamplingParams  # noqa: E402
from test_moe import moe_config, qwen2_moe_config  # noqa: E402
from tp_worker import COLLECTIVE, forward_collectives  # noqa: E402


def run(cfg) -> dict:
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", [int(t) for t in rng.integers(0, cfg.vocab_size, size=n)], params)
                    for i, n in enumerate((3, 9, 30))]}
    out = {"tokens": {}}
    for tp in (1, 2):
        eng = make_engine(cfg, tensor_parallel_size=tp, attention_backend="xla")
        finals = run_workload(eng, arrivals)
        out["tokens"][tp] = {k: list(v.token_ids) for k, v in sorted(finals.items())}
        if tp == 2:
            lw = layer_at(eng.runner.params, 0)
            spec = lambda x: [None if s is None else str(s) for s in x.sharding.spec]  # noqa: E731
            out.update(w_gate_up_spec=spec(lw.w_gate_up), w_down_spec=spec(lw.w_down), w_router_spec=spec(lw.w_router))
            if lw.w_shared_gate_up is not None:
                out.update(w_shared_gate_up_spec=spec(lw.w_shared_gate_up), w_shared_down_spec=spec(lw.w_shared_down),
                           w_shared_gate_spec=spec(lw.w_shared_gate))
            out["collectives"] = forward_collectives(eng, eng.runner.params)
            # Each plan of the MoE MLP alone, on the sharded weights: only the all-reduce
            # of the down projection's partial sums crosses devices.
            h = jnp.ones((3, 5, cfg.hidden_size), jnp.float32)
            for kind, block in (("dense", 0), ("grouped", 1), ("grouped", 4)):
                fn = jax.jit(lambda h, lw: moe.moe_mlp(h, lw, top_k=cfg.experts_per_token,
                                                       normalize=cfg.norm_topk_prob, force_plan=(kind, block)))
                hlo = fn.lower(h, lw).compile().as_text()
                found = sorted({m.group(1) for m in COLLECTIVE.finditer(hlo)})
                out["collectives"][f"{kind}{block}"] = found
            ids = jnp.asarray(arrivals[0][2][1], jnp.int32)
            sharded = parallel.shard_params(tiny_params(cfg), eng.mesh, cfg)
            ref = np.asarray(dense_logits(tiny_params(cfg), cfg, ids))
            got = np.asarray(dense_logits(sharded, cfg, ids))
            out["logits_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    return out


def main():
    print(json.dumps({"qwen3_moe": run(moe_config()), "qwen2_moe": run(qwen2_moe_config())}))


if __name__ == "__main__":
    main()
