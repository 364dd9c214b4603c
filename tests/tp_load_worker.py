"""Run in a subprocess with 4 fake CPU devices (see test_tensor_parallel.py): load each
checkpoint folder given on the command line at TP=2 and TP=4 straight onto the mesh
(load_params' `shardings`): safetensors, dummy weights, and the orbax cache written and
read back. Prints JSON: per load, whether every weight has its sharding and the values of
loading on one device and sharding after, and how the file's tensors travelled."""
import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxoverlap import parallel  # noqa: E402
from jaxoverlap.models import loader  # noqa: E402
from jaxoverlap.models.config import ModelConfig  # noqa: E402

SENT: list = []  # (target split?, sent split?, axis the mesh divides?) per tensor transfer


def recording_put(inner):
    def put(x, target, transpose):
        out = inner(x, target, transpose)
        if target is not None:
            SENT.append((not target.is_fully_replicated, not out.sharding.is_fully_replicated))
        return out

    return put


def compare(got, want, shardings) -> dict:
    leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(shardings)))
    return {
        "leaves": len(leaves),
        "misplaced": sum(not a.sharding.is_equivalent_to(s, a.ndim) for a, _, s in leaves),
        "split": sum(not s.is_fully_replicated for _, _, s in leaves),
        "max_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b, _ in leaves),
    }


def main():
    assert len(jax.devices()) == 4, jax.devices()
    loader._put_part = recording_put(loader._put_part)
    out = {}
    for path in sys.argv[1:]:
        cfg = ModelConfig.from_path(path)
        for tp in (2, 4):
            mesh = parallel.make_mesh(tp)
            shardings = parallel.param_shardings(loader.abstract_params(cfg, jnp.float32, tp), mesh)
            cache = tempfile.mkdtemp()
            for how, kwargs in (("safetensors", {}), ("dummy", {"load_format": "dummy"}),
                                ("cache-write", {"cache_dir": cache}), ("cache-read", {"cache_dir": cache})):
                want = parallel.shard_params(loader.load_params(path, cfg, jnp.float32, **kwargs), mesh, cfg)
                del SENT[:]
                got = loader.load_params(path, cfg, jnp.float32, tensor_parallel_size=tp, shardings=shardings,
                                         **kwargs)
                row = compare(got, want, shardings)
                row["sent"] = len(SENT)
                row["split_target_sent_whole"] = sum(t and not s for t, s in SENT)
                out[f"{os.path.basename(path.rstrip('/'))}-{tp}-{how}"] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()
