"""Speculative-decoding acceptance: greedy matching and rejection sampling.

Both have a jnp reference (the CPU path) and a Pallas kernel with one program
per batch row. Outputs are `tokens` [B, K+1] (accepted drafts, then the
target's correction / bonus token, then -1) and `num_emitted` [B] = number of
accepted drafts + 1. `num_draft` [B] (default K) limits how many of the K
draft slots of a row are real; slots past it are never accepted.

Rejection sampling (Leviathan et al. / Chen et al.): accept draft i, drawn
from q_i, with probability min(1, p_i(x) / q_i(x)); at the first rejection
sample from normalize(max(0, p_i - q_i)); if all n drafts are accepted sample
the bonus from p_n. Every emitted token is then distributed exactly as the
target p. The one extra draw per row uses the inverse CDF of a pre-drawn
uniform (`sample_uniforms` [B]), so the kernel and the reference make the same
draws; they can differ only when float summation order moves a CDF boundary
across the threshold (exact in the CPU tests; 319/320 tokens equal in one
H200 check with V = 32000).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _tile
from ._compat import masked_store, triton_params

PAD_TOKEN = -1


def _num_draft(num_draft, batch: int, k: int):
    if num_draft is None:
        return jnp.full((batch,), k, jnp.int32)
    return jnp.clip(num_draft.astype(jnp.int32), 0, k)


def _leading_true(ok):
    """[B, K] bool -> [B] length of the all-true prefix."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def _emit(accepted_tokens, accept_len, final_token):
    """[B, K] drafts, [B] accepted count, [B] final token -> [B, K+1] tokens."""
    batch, k = accepted_tokens.shape
    j = jnp.arange(k + 1)[None, :]  # [1, K+1]
    drafts = jnp.pad(accepted_tokens, ((0, 0), (0, 1)))  # [B, K+1]
    out = jnp.where(j < accept_len[:, None], drafts, PAD_TOKEN)
    return jnp.where(j == accept_len[:, None], final_token[:, None], out).astype(jnp.int32)


# ----------------------------------------------------------------- references

@jax.jit
def greedy_accept_ref(draft_tokens, target_tokens, num_draft=None):
    """draft [B, K], target argmax [B, K+1] -> (tokens [B, K+1], num_emitted [B])."""
    batch, k = draft_tokens.shape
    n = _num_draft(num_draft, batch, k)
    ok = (draft_tokens == target_tokens[:, :k]) & (jnp.arange(k)[None, :] < n[:, None])
    a = _leading_true(ok)  # [B]
    final = jnp.take_along_axis(target_tokens, a[:, None], axis=1)[:, 0]  # [B]
    return _emit(draft_tokens, a, final), a + 1


def inverse_cdf(w, u):
    """Sample index of unnormalised weights w [B, V] with uniforms u [B].

    Index = #{v : cumsum(w)[v] <= u * sum(w)}, the first v whose cumulative
    mass exceeds the threshold; clamped to the last positive weight so float
    rounding at the top can never pick a zero-probability token.
    """
    vocab = w.shape[-1]
    cum = jnp.cumsum(w, axis=-1)  # [B, V]
    thresh = u * jnp.sum(w, axis=-1)  # [B]
    idx = jnp.sum((cum <= thresh[:, None]).astype(jnp.int32), axis=-1)  # [B]
    last = jnp.max(jnp.where(w > 0, jnp.arange(vocab)[None, :], 0), axis=-1)  # [B]
    return jnp.minimum(idx, last)


def _residual_weights(p_a, q_a, bonus):
    """Weights of the final draw: p for a bonus, else max(0, p - q) (or p if that
    is all zero, which only happens when p == q and rejection was a fluke)."""
    res = jnp.maximum(p_a - q_a, 0.0)  # [B, V]
    use_p = bonus | (jnp.sum(res, axis=-1) <= 0)  # [B]
    return jnp.where(use_p[:, None], p_a, res)


@jax.jit
def rejection_sample_ref(target_probs, draft_probs, draft_tokens, uniforms,
                         sample_uniforms, num_draft=None):
    """Rejection-sampling acceptance.

    Args:
      target_probs: [B, K+1, V] target distributions at the K draft positions
        and the bonus position.
      draft_probs: [B, K, V] draft distributions the drafts were sampled from.
      draft_tokens: [B, K] int drafts.
      uniforms: [B, K] U[0, 1) for the accept tests.
      sample_uniforms: [B] U[0, 1) for the residual / bonus draw.
      num_draft: optional [B] number of real drafts per row.
    Returns:
      (tokens [B, K+1] int32, num_emitted [B] int32).
    """
    batch, k1, _ = target_probs.shape
    k = k1 - 1
    n = _num_draft(num_draft, batch, k)
    x = draft_tokens.astype(jnp.int32)
    px = jnp.take_along_axis(target_probs[:, :k], x[..., None], axis=-1)[..., 0]  # [B, K]
    qx = jnp.take_along_axis(draft_probs, x[..., None], axis=-1)[..., 0]  # [B, K]
    # u < p/q written without the division (q(x) > 0 for a token drawn from q).
    ok = (uniforms * qx < px) & (jnp.arange(k)[None, :] < n[:, None])
    a = _leading_true(ok)  # [B] accepted drafts
    bonus = a >= n
    rows = jnp.arange(batch)
    p_a = target_probs[rows, a].astype(jnp.float32)  # [B, V]
    q_a = draft_probs[rows, jnp.minimum(a, k - 1)].astype(jnp.float32)  # [B, V]
    final = inverse_cdf(_residual_weights(p_a, q_a, bonus), sample_uniforms)
    return _emit(x, a, final), a + 1


def rejection_sample_with_key(key, target_probs, draft_probs, draft_tokens,
                              num_draft=None, **kwargs):
    """rejection_sample with its uniforms drawn from `key` (one key, or [B] keys
    for per-row streams)."""
    batch, k = draft_tokens.shape
    if key.shape == ():
        ku, ks = jax.random.split(key)
        u = jax.random.uniform(ku, (batch, k))
        su = jax.random.uniform(ks, (batch,))
    else:  # per-row keys [B]
        pair = jax.vmap(jax.random.split)(key)  # [B, 2]
        u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(pair[:, 0])  # [B, K]
        su = jax.vmap(lambda kk: jax.random.uniform(kk, ()))(pair[:, 1])  # [B]
    return rejection_sample(target_probs, draft_probs, draft_tokens, u, su, num_draft,
                            **kwargs)


# -------------------------------------------------------------------- kernels

def _store_tokens(tok_ref, emit_ref, b, drafts, a, final, k: int):
    """tokens[b, j] = drafts[j] (j < a), final (j == a), -1 (j > a); j <= K."""
    lanes = drafts.shape[0]
    j = lax.iota(jnp.int32, lanes)  # [K1P]
    out = jnp.where(j < a, drafts, jnp.where(j == a, final, PAD_TOKEN))  # [K1P]
    valid = j <= k
    # Masked-off lanes go out of bounds (dropped by the interpret scatter).
    masked_store(tok_ref.at[b, jnp.where(valid, j, k + 1)], out, valid)
    emit_ref[b] = a + 1


def _greedy_kernel(dt_ref, tt_ref, nd_ref, tok_ref, emit_ref, *, k: int):
    b = pl.program_id(0)
    lanes = _tile.next_pow2(k + 1)
    j = lax.iota(jnp.int32, lanes)  # [K1P]
    jd = jnp.minimum(j, k - 1)  # clamped draft lane (loads stay in bounds)
    drafts = dt_ref[b, jd]  # [K1P]
    target = tt_ref[b, jnp.minimum(j, k)]  # [K1P]
    n = jnp.clip(nd_ref[b], 0, k)
    ok = (drafts == target) & (j < n)
    a = jnp.min(jnp.where(ok, lanes, j))  # first lane that is not accepted
    final = jnp.sum(jnp.where(j == a, target, 0))  # target token at lane a
    _store_tokens(tok_ref, emit_ref, b, drafts, a, final, k)


def _rejection_kernel(dt_ref, u_ref, su_ref, nd_ref, tp_ref, dp_ref, tok_ref, emit_ref,
                      *, k: int, chunk: int):
    b = pl.program_id(0)
    vocab = tp_ref.shape[2]
    lanes = _tile.next_pow2(k + 1)
    j = lax.iota(jnp.int32, lanes)  # [K1P]
    jd = jnp.minimum(j, k - 1)
    drafts = dt_ref[b, jd]  # [K1P]
    n = jnp.clip(nd_ref[b], 0, k)
    px = tp_ref[b, jd, drafts].astype(jnp.float32)  # [K1P] p_j(x_j)
    qx = dp_ref[b, jd, drafts].astype(jnp.float32)  # [K1P] q_j(x_j)
    ok = (u_ref[b, jd] * qx < px) & (j < n)
    a = jnp.min(jnp.where(ok, lanes, j))  # accepted drafts (first rejected lane)
    bonus = a >= n
    row_q = jnp.minimum(a, k - 1)
    num_chunks = -(-vocab // chunk)

    def load_chunk(c):
        """Vocab ids, p_a and residual max(0, p_a - q_a) of chunk c ([C] each)."""
        v = c * chunk + lax.iota(jnp.int32, chunk)  # [C] vocab ids
        in_vocab = v < vocab
        vv = v if vocab % chunk == 0 else jnp.minimum(v, vocab - 1)  # [C] in bounds
        p = jnp.where(in_vocab, tp_ref[b, a, vv].astype(jnp.float32), 0.0)  # [C]
        q = dp_ref[b, row_q, vv].astype(jnp.float32)  # [C]
        return v, p, jnp.maximum(p - q, 0.0)

    # Pass 1: masses (and last positive id) of the residual and of p.
    def pass1(c, carry):
        tot_r, tot_p, last_r, last_p = carry
        v, p, r = load_chunk(c)
        return (tot_r + jnp.sum(r), tot_p + jnp.sum(p),
                jnp.maximum(last_r, jnp.max(jnp.where(r > 0, v, 0))),
                jnp.maximum(last_p, jnp.max(jnp.where(p > 0, v, 0))))

    zero = jnp.float32(0)
    tot_r, tot_p, last_r, last_p = lax.fori_loop(
        0, num_chunks, pass1, (zero, zero, jnp.int32(0), jnp.int32(0)))
    use_p = bonus | (tot_r <= 0)
    thresh = su_ref[b] * jnp.where(use_p, tot_p, tot_r)

    # Pass 2: inverse CDF = count of ids whose cumulative mass <= thresh.
    def pass2(c, carry):
        run, count = carry
        _, p, r = load_chunk(c)
        w = jnp.where(use_p, p, r)  # [C]
        cum = run + jnp.cumsum(w)  # [C]
        return run + jnp.sum(w), count + jnp.sum((cum <= thresh).astype(jnp.int32))

    _, count = lax.fori_loop(0, num_chunks, pass2, (zero, jnp.int32(0)))
    final = jnp.minimum(count, jnp.where(use_p, last_p, last_r))
    _store_tokens(tok_ref, emit_ref, b, drafts, a, final, k)


def _out_shapes(batch: int, k: int):
    return [jax.ShapeDtypeStruct((batch, k + 1), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32)]


@functools.partial(jax.jit, static_argnames=("interpret",))
def greedy_accept_pallas(draft_tokens, target_tokens, num_draft=None, *, interpret=False):
    batch, k = draft_tokens.shape
    tok, emit = pl.pallas_call(
        functools.partial(_greedy_kernel, k=k), grid=(batch,),
        out_shape=_out_shapes(batch, k), interpret=interpret,
        compiler_params=triton_params(1, 1), name="greedy_accept",
    )(draft_tokens.astype(jnp.int32), target_tokens.astype(jnp.int32),
      _num_draft(num_draft, batch, k))
    return tok, emit


@functools.partial(jax.jit, static_argnames=("interpret", "chunk"))
def rejection_sample_pallas(target_probs, draft_probs, draft_tokens, uniforms,
                            sample_uniforms, num_draft=None, *, interpret=False,
                            chunk: int = 2048):
    batch, k1, vocab = target_probs.shape
    k = k1 - 1
    chunk = min(chunk, _tile.next_pow2(vocab))
    tok, emit = pl.pallas_call(
        functools.partial(_rejection_kernel, k=k, chunk=chunk), grid=(batch,),
        out_shape=_out_shapes(batch, k), interpret=interpret,
        compiler_params=triton_params(4, 1), name="rejection_sample",
    )(draft_tokens.astype(jnp.int32), uniforms.astype(jnp.float32),
      sample_uniforms.astype(jnp.float32), _num_draft(num_draft, batch, k),
      target_probs, draft_probs)
    return tok, emit


# ----------------------------------------------------------------- dispatchers

def greedy_accept(draft_tokens, target_tokens, num_draft=None, *, backend="xla",
                  interpret=False):
    if backend == "xla":
        return greedy_accept_ref(draft_tokens, target_tokens, num_draft)
    return greedy_accept_pallas(draft_tokens, target_tokens, num_draft, interpret=interpret)


def rejection_sample(target_probs, draft_probs, draft_tokens, uniforms, sample_uniforms,
                     num_draft=None, *, backend="xla", interpret=False):
    if backend == "xla":
        return rejection_sample_ref(target_probs, draft_probs, draft_tokens, uniforms,
                                    sample_uniforms, num_draft)
    return rejection_sample_pallas(target_probs, draft_probs, draft_tokens, uniforms,
                                   sample_uniforms, num_draft, interpret=interpret)
