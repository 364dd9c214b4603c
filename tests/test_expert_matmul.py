"""The Pallas expert-matmul kernel's tuning arguments (interpret mode): every contraction
block, column block and K split computes the same product; settings the shapes cannot take
are refused. Its use in the MoE MLP is tested in test_moe.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxoverlap.pallas_kernels.expert_matmul import block_k, expert_matmul


@pytest.mark.parametrize("tuning", [dict(), dict(bk=256), dict(bk=128, splits=2), dict(bk=64, bn=128, splits=4),
                                    dict(bk=1024)], ids=str)
def test_every_tuning_computes_the_same_product(tuning):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(5, 512)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 512, 256)), jnp.float32)
    experts = jnp.asarray([2, 0, 2, 1, 0], jnp.int32)
    want = np.einsum("ak,akn->an", np.asarray(x), np.asarray(w)[np.asarray(experts)])
    got = expert_matmul(x, w, experts, interpret=True, **tuning)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-4)


def test_out_dtype():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(2, 256, 128)), jnp.bfloat16)
    experts = jnp.asarray([1, 0, 1], jnp.int32)
    want = np.einsum("ak,akn->an", np.asarray(x, np.float32), np.asarray(w, np.float32)[np.asarray(experts)])
    for splits in (1, 4):
        got = expert_matmul(x, w, experts, interpret=True, bk=64, splits=splits, out_dtype=jnp.float32)
        assert got.dtype == jnp.float32  # the float32 sum, not rounded to bf16
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-3)
        assert expert_matmul(x, w, experts, interpret=True, splits=splits, bk=64).dtype == jnp.bfloat16


def test_tunings_the_shapes_cannot_take():
    assert block_k(768, 512) == 256 and block_k(2048, 512) == 512 and block_k(192, 256) == 64
    x, w, experts = jnp.zeros((2, 192)), jnp.zeros((2, 192, 128)), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="split"):
        expert_matmul(x, w, experts, interpret=True, bk=64, splits=2)  # 3 blocks of 64
    with pytest.raises(ValueError, match="divisible"):
        expert_matmul(x, w, experts, interpret=True, bn=256)  # 128 columns
