"""Load model weights into `ModelParams`: from HF safetensors, as random dummies, or from an orbax cache.

Safetensors path: tensors are read one at a time on the host (numpy, no torch), put on the
device as they are, and then cast / transposed / concatenated there by small jitted
functions. Host memory therefore peaks at about one tensor (three for q/k/v), which matters
for 16 GB checkpoints, and the host never does the slow part (strided transposes).

FP8 checkpoints (models/config.py: fp8_weight_block): each e4m3 weight travels as its 8-bit
bytes with its scale beside it, and a jitted function multiplies them out on the device
(`_read_part`), into the model's dtype like any other weight.

Dummy path: every array is generated on the device with `jax.random` inside a jitted
function (one per layer, compiled once for all layers), so an 8B-shaped model costs no
host->device traffic at all.

Tensor parallelism: with `tensor_parallel_size` N > 1, the fused wqkv / bqkv / w_gate_up
columns are stored in N per-shard blocks (models/params.py), permuted inside the same
jitted conversion (safetensors), generation (dummy: drawn in the plain order first, so
every N gives the same model for one seed) or restore (orbax: the cache holds the layout
it was written with and its key names it).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxoverlap.models import quant
from jaxoverlap.models.config import CheckpointError, ModelConfig, fp8_weight_block, read_json
from jaxoverlap.models.params import (
    LayerParams,
    ModelParams,
    gate_up_sizes,
    layout_shards,
    qkv_sizes,
    shared_gate_up_sizes,
    to_shard_blocks,
)

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")

# Bump when the converted layout changes, so stale orbax caches are not restored.
# 2: LayerParams has a `w_router` field (mixture of experts).
# 3: LayerParams has the shared-expert fields `w_shared_gate_up`, `w_shared_down`, `w_shared_gate` (Qwen2-MoE).
_CACHE_VERSION = 3

# safetensors dtype tags numpy cannot represent natively; read through ml_dtypes instead.
_ML_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}

# Tensors that some checkpoints carry but that are recomputed from the config, or that weights
# dequantized at load do not use: an FP8 checkpoint's weight scales (read with their weights),
# the activation scales of static schemes (activations stay in the model's dtype), and the
# KV-cache scales (read apart, by `kv_cache_scales`, for an 8-bit cache).
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.weight_scale_inv|\.weight_scale|\.input_scale|\.k?[kv]_scale)$")
_FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def default_model_path() -> str:
    """Folder of the tiny Qwen3-family model shipped with the package (see make_default_model.py)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


# --------------------------------------------------------------------------------------
# Reading safetensors files
# --------------------------------------------------------------------------------------


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's .safetensors files: those of the shard index, else `model.safetensors`,
    else every `*.safetensors` in the folder."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        meta = read_json(index)
        weight_map = meta.get("weight_map") if isinstance(meta, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map object (tensor name -> shard file)")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.exists(os.path.join(model_path, n))]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return [os.path.join(model_path, n) for n in names]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    if os.path.isdir(model_path):
        found = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
        if found:
            return [os.path.join(model_path, n) for n in found]
    raise FileNotFoundError(
        f"no safetensors weights in {model_path!r} (expected model.safetensors or "
        "model.safetensors.index.json); use load_format='dummy' for random weights"
    )


def _read_header(path: str) -> tuple[int, dict]:
    """(byte offset of the data section, header dict) of one safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return 8 + n, header


class SafetensorsReader:
    """Name -> host numpy array over one or more safetensors files, one tensor at a time."""

    def __init__(self, files: Iterable[str]):
        self.files = list(files)
        self._where: dict[str, str] = {}
        self._headers: dict[str, tuple[int, dict]] = {}
        for path in self.files:
            try:
                with safe_open(path, framework="numpy") as f:
                    names = list(f.keys())
            except Exception as e:  # noqa: BLE001 - safetensors' own SafetensorError, or an OSError
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
            for name in names:
                self._where[name] = path

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(self._where[name], framework="numpy") as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        path = self._where[name]
        with safe_open(path, framework="numpy") as f:
            tag = f.get_slice(name).get_dtype()
            if tag not in _ML_DTYPES:
                return f.get_tensor(name)
        # numpy has no bfloat16, so safetensors' numpy backend refuses it: map the bytes
        # ourselves and reinterpret them with ml_dtypes (bit-identical, no float32 detour).
        if path not in self._headers:
            self._headers[path] = _read_header(path)
        data_start, header = self._headers[path]
        meta = header[name]
        begin, end = meta["data_offsets"]
        raw = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start + begin, shape=(end - begin,))
        # Copy out of the mapping so the array owns its memory (the device may alias it).
        return np.array(raw.view(_ML_DTYPES[tag]).reshape(meta["shape"]))


# --------------------------------------------------------------------------------------
# Device-side conversion
# --------------------------------------------------------------------------------------


def _constrain(x: jax.Array, sharding) -> jax.Array:
    # Inside a jitted maker: the result comes out in `sharding` (None: wherever XLA puts it).
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _place(x, sharding):
    # What a maker returned, in `sharding` for sure (a no-op when the constraint held).
    return x if sharding is None or x is None else jax.device_put(x, sharding)


def _put_part(x: np.ndarray, target, transpose: bool) -> jax.Array:
    """A host tensor on the device(s), on its way to a weight of sharding `target` (None:
    the default device). Under a mesh it travels split on the axis that becomes the target's
    split one (where the mesh divides it), so that no device ever receives a whole matrix
    that the mesh splits: weights larger than one device's memory can load."""
    if target is None:
        return jax.device_put(x)
    mesh = target.mesh
    spec = tuple(target.spec) + (None,) * (x.ndim - len(target.spec))
    spec = spec[::-1] if transpose else spec  # the target is [in, out], this part [out, in]

    def size(names) -> int:
        return int(np.prod([mesh.shape[n] for n in (names if isinstance(names, tuple) else (names,))]))

    spec = tuple(n if n is not None and x.shape[i] % size(n) == 0 else None for i, n in enumerate(spec))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def _fp8_scale_tile(name: str, w_shape, s_shape, block) -> tuple[int, int] | None:
    """How the scale tensor of FP8 weight `name` ([out, in]) covers it: None for one scale, or
    one per output row; else the [b_out, b_in] tile of each of its [ceil(out / b_out),
    ceil(in / b_in)] scales, `block` being the checkpoint's (models/config.py: fp8_weight_block)."""
    out, inp = w_shape
    s_shape = tuple(s_shape)
    if int(np.prod(s_shape)) == 1 or s_shape in ((out,), (out, 1)):
        return None
    if block is not None and s_shape == (-(-out // block[0]), -(-inp // block[1])):
        return block
    raise CheckpointError(f"the scale of FP8 weight {name!r} {list(w_shape)} has shape {list(s_shape)}: neither "
                          f"one scale, one per output row, nor one per {list(block) if block else 'block'} tile")


@functools.partial(jax.jit, static_argnames=("tile", "dtype"))
def _dequantize_fp8(w: jax.Array, scale: jax.Array, *, tile, dtype) -> jax.Array:
    """An FP8 checkpoint's weight [out, in] multiplied out by its scale (`_fp8_scale_tile`
    says how it covers the weight) in float32, as transformers dequantizes, then rounded once
    to `dtype`, the weight's (a MoE layer's expert parts, all alive until their stack is made,
    then take that size, not float32's)."""
    s = scale.astype(jnp.float32)
    if tile is None:
        s = s.reshape(-1, 1) if s.size > 1 else s.reshape(())  # [out] | [out, 1] -> [out, 1]
    else:
        s = jnp.repeat(jnp.repeat(s, tile[0], axis=0), tile[1], axis=1)  # [So, Si] -> [So * b_out, Si * b_in]
        s = s[: w.shape[0], : w.shape[1]]  # -> [out, in]: the last tiles may overhang
    return (w.astype(jnp.float32) * s).astype(dtype)


def _read_part(reader: SafetensorsReader, name: str, target, transpose: bool, fp8_block, dtype) -> jax.Array:
    """Checkpoint tensor `name` on its way to a weight of sharding `target` and `dtype`, as
    `_put_part` puts it; an FP8 weight arrives multiplied out by its scale (`<name>_scale_inv`
    or `<name>_scale`), in `dtype`. The 8-bit tensor travels, and the device dequantizes it."""
    x = reader.get(name)
    if x.dtype not in _FP8_DTYPES:
        return _put_part(x, target, transpose)
    scale_name = next((name + s for s in ("_scale_inv", "_scale") if name + s in reader), None)
    if scale_name is None:
        raise CheckpointError(f"FP8 tensor {name!r} has no scale ({name}_scale_inv or {name}_scale)")
    scale = reader.get(scale_name)
    tile = _fp8_scale_tile(name, x.shape, scale.shape, fp8_block)
    # The scale goes whole to every device that holds part of the weight.
    scale = jax.device_put(scale, None if target is None else jax.sharding.NamedSharding(
        target.mesh, jax.sharding.PartitionSpec()))
    return _dequantize_fp8(_put_part(x, target, transpose), scale, tile=tile, dtype=jnp.dtype(dtype))


def scale_owner(name: str) -> str | None:
    """The weight whose scale tensor `name` is (an FP8 checkpoint's `<w>_scale_inv` or
    `<w>_scale`, a static scheme's `<module>.input_scale`, an FP8 KV cache's
    `self_attn.k_scale` / `v_scale` / `kv_scale` (`kv_cache_scales`)), or None for any other tensor."""
    for suffix, weight in ((".weight_scale_inv", ".weight"), (".weight_scale", ".weight"), (".input_scale", ".weight"),
                           (".k_proj.k_scale", ".k_proj.weight"), (".v_proj.v_scale", ".v_proj.weight"),
                           (".k_scale", ".k_proj.weight"), (".v_scale", ".v_proj.weight"),
                           (".kv_scale", ".k_proj.weight")):
        if name.endswith(suffix):
            return name[: -len(suffix)] + weight
    return None


# A layer's KV-cache scales as checkpoints name them: compressed-tensors' and ModelOpt's
# (vLLM reads the same), and the older single `kv_scale` for both.
_KV_SCALE_NAMES = {0: ("self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.kv_scale"),
                   1: ("self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.kv_scale")}


def kv_cache_scales(model_path: str, cfg: ModelConfig) -> np.ndarray | None:
    """[L, 2] float32: the checkpoint's calibrated scale of K and of V for each layer's
    8-bit KV cache (the cache then holds K / k_scale), or None where the checkpoint has none.
    A checkpoint with scales for some layers only, or a scale that is not one positive
    finite number, is refused."""
    reader = SafetensorsReader(safetensors_files(model_path))
    prefix = _name_prefix(reader)
    scales = np.ones((cfg.num_layers, 2), np.float32)
    found = np.zeros((cfg.num_layers, 2), bool)
    for i in range(cfg.num_layers):
        for j, names in _KV_SCALE_NAMES.items():
            name = next((f"{prefix}layers.{i}.{n}" for n in names if f"{prefix}layers.{i}.{n}" in reader), None)
            if name is None:
                continue
            value = np.asarray(reader.get(name), np.float32)
            if value.size != 1 or not np.isfinite(value).all() or float(value.reshape(())) <= 0:
                raise CheckpointError(f"KV-cache scale {name!r} in {model_path!r} is {value.tolist()}: "
                                      f"expected one positive number")
            scales[i, j], found[i, j] = float(value.reshape(())), True
    if not found.any():
        return None
    if not found.all():
        missing = [f"layer {i} {'kv'[j]}" for i, j in zip(*np.nonzero(~found))]
        raise CheckpointError(f"checkpoint {model_path!r} has KV-cache scales for some layers only "
                              f"(none for {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''})")
    return scales


def _quantized(layer: LayerParams, quantization: str | None) -> LayerParams:
    """A layer just loaded, quantized right away (models/quant.py) where asked: the model
    then never sits on the device in full precision, so one that fits only in 8 bits loads."""
    if quantization is None:
        return layer
    if quantization != "fp8":
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    return quant.quantize_layer(layer, delete_source=True)


def _checkpoint_fp8_block(model_path: str):
    """The scale tile of an FP8 checkpoint's weights (models/config.py: fp8_weight_block); None
    for one scale per weight or per row, and for a checkpoint that is not quantized."""
    path = os.path.join(model_path, "config.json")
    config = read_json(path).get("quantization_config") if os.path.exists(path) else None
    return fp8_weight_block(config) if config else None


@functools.partial(jax.jit, static_argnames=("transpose", "dtype", "blocks", "shards", "sharding"))
def _to_param(parts: tuple[jax.Array, ...], *, transpose: bool, dtype, blocks: tuple[int, ...] = (),
              shards: int = 1, sharding=None) -> jax.Array:
    """Concatenate HF [out, in] matrices on the output axis, cast, and optionally transpose to [in, out].

    blocks, shards: the fused output axis (last after the transpose) is made of parts of
    widths `blocks`; lay them out in `shards` per-shard blocks (models/params.py). XLA
    fuses that permutation into the transpose's copy. sharding: the weight's own (None: one
    device)."""
    x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)  # [sum(out), in]
    x = x.astype(dtype)
    x = x.T if transpose else x  # [in, sum(out)]
    return _constrain(to_shard_blocks(x, blocks, shards) if blocks else x, sharding)


@functools.partial(jax.jit, static_argnames=("dtype", "blocks", "shards", "sharding"))
def _to_expert_param(parts: tuple[tuple[jax.Array, ...], ...], *, dtype, blocks: tuple[int, ...] = (),
                     shards: int = 1, sharding=None) -> jax.Array:
    """A MoE layer's experts' HF [out, in] matrices -> one [E, in, sum(out)] weight.

    parts[j][e]: part j of expert e (gate and up for w_gate_up, down alone for w_down),
    concatenated on the output axis in the order of j; blocks, shards, sharding as
    `_to_param`'s."""
    x = jnp.concatenate([jnp.stack(experts) for experts in parts], axis=1)  # j x [E, out_j, in] -> [E, sum(out), in]
    x = jnp.swapaxes(x.astype(dtype), 1, 2)  # [E, in, sum(out)]
    return _constrain(to_shard_blocks(x, blocks, shards) if blocks else x, sharding)


def _expected_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold for `cfg`, with its HF shape."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv, HD = cfg.q_size, cfg.kv_size, cfg.head_dim
    want = {f"{prefix}embed_tokens.weight": (V, D), f"{prefix}norm.weight": (D,)}
    for i in range(cfg.num_layers):
        p = f"{prefix}layers.{i}."
        want.update({
            p + "self_attn.q_proj.weight": (q, D),
            p + "self_attn.k_proj.weight": (kv, D),
            p + "self_attn.v_proj.weight": (kv, D),
            p + "self_attn.o_proj.weight": (D, q),
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
        })
        names = _mlp_names(cfg, p)
        if cfg.is_moe:
            want[names.router] = (cfg.num_experts, D)
            for e in range(cfg.num_experts):
                want.update({names.gate(e): (F, D), names.up(e): (F, D), names.down(e): (D, F)})
            if cfg.shared_expert_intermediate_size:
                Fs = cfg.shared_expert_intermediate_size
                want.update({names.shared("gate_proj"): (Fs, D), names.shared("up_proj"): (Fs, D),
                             names.shared("down_proj"): (D, Fs), names.shared_gate: (1, D)})
        else:
            want.update({names.gate(None): (F, D), names.up(None): (F, D), names.down(None): (D, F)})
        if cfg.qkv_bias:
            want.update({
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            })
        if cfg.qk_norm:
            want.update({p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,)})
    if not cfg.tie_word_embeddings:
        want["lm_head.weight"] = (V, D)
    return want


@dataclasses.dataclass(frozen=True)
class _MlpNames:
    """Checkpoint names of one layer's MLP tensors: `gate(e)`, `up(e)`, `down(e)` of expert e
    (e None in a dense layer), the router's, and a shared expert's (Qwen2-MoE)."""
    layer: str  # "model.layers.{i}."
    mixtral: bool

    @property
    def router(self) -> str:
        return self.layer + ("block_sparse_moe.gate.weight" if self.mixtral else "mlp.gate.weight")

    def _expert(self, e: int | None, qwen: str, mixtral: str) -> str:
        if e is None:
            return self.layer + f"mlp.{qwen}.weight"
        if self.mixtral:
            return self.layer + f"block_sparse_moe.experts.{e}.{mixtral}.weight"
        return self.layer + f"mlp.experts.{e}.{qwen}.weight"

    def gate(self, e: int | None) -> str:
        return self._expert(e, "gate_proj", "w1")

    def up(self, e: int | None) -> str:
        return self._expert(e, "up_proj", "w3")

    def down(self, e: int | None) -> str:
        return self._expert(e, "down_proj", "w2")

    def shared(self, proj: str) -> str:
        """The shared expert's `proj` ("gate_proj", "up_proj" or "down_proj")."""
        return self.layer + f"mlp.shared_expert.{proj}.weight"

    @property
    def shared_gate(self) -> str:
        """The shared expert's output gate, a Linear D -> 1."""
        return self.layer + "mlp.shared_expert_gate.weight"


def _mlp_names(cfg: ModelConfig, layer_prefix: str) -> _MlpNames:
    return _MlpNames(layer_prefix, mixtral=cfg.model_type == "mixtral")


def _name_prefix(reader: SafetensorsReader) -> str:
    # CausalLM checkpoints nest the decoder under "model."; a bare base-model save does not.
    if "model.embed_tokens.weight" in reader or "embed_tokens.weight" not in reader:
        return "model."
    return ""


def _check_checkpoint(reader: SafetensorsReader, cfg: ModelConfig, prefix: str, where: str) -> None:
    """Fail before touching the device if any tensor is missing, misshapen, or unsupported."""
    want = _expected_shapes(cfg, prefix)
    missing = [n for n in want if n not in reader]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        hint = ""
        if missing == ["lm_head.weight"]:
            hint = " (config.json says tie_word_embeddings=false but the checkpoint has no lm_head)"
        raise CheckpointError(f"checkpoint {where!r} lacks tensors required by its config: {shown}{hint}")
    for name, shape in want.items():
        got = reader.shape(name)
        if got != shape:
            raise CheckpointError(
                f"tensor {name!r} in {where!r} has shape {list(got)}, but config.json implies {list(shape)}"
            )
    # Tensors the params layout cannot hold would silently change the model if dropped.
    # (The MLPs' endings cover the dense MLP's, the experts' and a shared expert's.)
    unsupported = [n for n in reader.names() if n.endswith(("o_proj.bias", "gate_proj.bias",
                                                             "up_proj.bias", "down_proj.bias"))]
    if unsupported:
        raise CheckpointError(f"checkpoint {where!r} has biases this engine does not support: {unsupported[:4]}")
    extra = [n for n in reader.names() if n not in want and not _IGNORED.match(n)
             and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if extra:
        logger.warning("ignoring %d unexpected tensors in %s, e.g. %s", len(extra), where, extra[:4])


def _load_safetensors(model_path: str, cfg: ModelConfig, dtype, tp: int = 1, shardings=None,
                      quantization: str | None = None) -> ModelParams:
    reader = SafetensorsReader(safetensors_files(model_path))
    prefix = _name_prefix(reader)
    _check_checkpoint(reader, cfg, prefix, model_path)
    qkv_shards, gate_up_shards = layout_shards(cfg, tp)
    where = _Shardings(shardings)
    fp8_block = _checkpoint_fp8_block(model_path)

    def matrix(*names: str, sharding, transpose: bool = True, blocks=(), shards: int = 1) -> jax.Array:
        # One transfer per tensor; the host copy is dropped as soon as it is on the device.
        parts = tuple(_read_part(reader, n, sharding, transpose, fp8_block, dtype) for n in names)
        return _place(_to_param(parts, transpose=transpose, dtype=dtype, blocks=blocks, shards=shards,
                                sharding=sharding), sharding)

    def stacked(fmt: str, sharding) -> jax.Array:
        # Small per-layer vectors: stack on the host (a few KB each), one transfer.
        rows = np.stack([reader.get(fmt.format(i=i)) for i in range(cfg.num_layers)])  # [L, n]
        return matrix_from_rows(rows, sharding)

    def matrix_from_rows(rows: np.ndarray, sharding, **layout) -> jax.Array:
        return _place(_to_param((_put_part(rows, sharding, False),), transpose=False, dtype=dtype,
                                sharding=sharding, **layout), sharding)

    def qkv_bias(i: int) -> np.ndarray:
        p = f"{prefix}layers.{i}.self_attn."
        return np.concatenate([reader.get(p + f"{x}_proj.bias") for x in "qkv"])  # [(H + 2KVH) * HD]

    def experts(names_of, sharding, **layout) -> jax.Array:
        # Each expert's part travels alone (a few MB), split as the [in, out] slice of the
        # [E, in, out] target that it becomes.
        part_target = None if sharding is None else jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:]))
        parts = tuple(tuple(_read_part(reader, name(e), part_target, True, fp8_block, dtype)
                            for e in range(cfg.num_experts))
                      for name in names_of)
        return _place(_to_expert_param(parts, dtype=dtype, sharding=sharding, **layout), sharding)

    layers = []
    for i in range(cfg.num_layers):
        p, s = f"{prefix}layers.{i}.", where.layer(i)
        names = _mlp_names(cfg, p)
        if cfg.is_moe:
            mlp = dict(
                w_gate_up=experts((names.gate, names.up), s.w_gate_up, blocks=gate_up_sizes(cfg),  # [E, D, 2F]
                                  shards=gate_up_shards),
                w_down=experts((names.down,), s.w_down),  # [E, F, D]
                w_router=matrix(names.router, sharding=s.w_router),  # [D, E]
            )
            if cfg.shared_expert_intermediate_size:
                mlp.update(
                    w_shared_gate_up=matrix(names.shared("gate_proj"), names.shared("up_proj"),  # [D, 2Fs]
                                            sharding=s.w_shared_gate_up, blocks=shared_gate_up_sizes(cfg),
                                            shards=gate_up_shards),
                    w_shared_down=matrix(names.shared("down_proj"), sharding=s.w_shared_down),  # [Fs, D]
                    w_shared_gate=matrix(names.shared_gate, sharding=s.w_shared_gate),  # [1, D] -> [D, 1]
                )
        else:
            mlp = dict(
                w_gate_up=matrix(names.gate(None), names.up(None),  # [D, 2F]
                                 sharding=s.w_gate_up, blocks=gate_up_sizes(cfg), shards=gate_up_shards),
                w_down=matrix(names.down(None), sharding=s.w_down),  # [F, D]
            )
        layers.append(_quantized(LayerParams(
            wqkv=matrix(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"),  # [D, (H + 2KVH) * HD]
                        sharding=s.wqkv, blocks=qkv_sizes(cfg), shards=qkv_shards),
            wo=matrix(p + "self_attn.o_proj.weight", sharding=s.wo),  # [H * HD, D]
            qkv_shards=qkv_shards, gate_up_shards=gate_up_shards, **mlp,
        ), quantization))
    bqkv = None
    if cfg.qkv_bias:
        rows = np.stack([qkv_bias(i) for i in range(cfg.num_layers)])  # [L, (H + 2KVH) * HD]
        bqkv = matrix_from_rows(rows, where.get("bqkv"), blocks=qkv_sizes(cfg), shards=qkv_shards)
    return ModelParams(
        embed=matrix(prefix + "embed_tokens.weight", sharding=where.get("embed"), transpose=False),  # [V, D]
        final_norm=matrix(prefix + "norm.weight", sharding=where.get("final_norm"), transpose=False),  # [D]
        attn_norm=stacked(prefix + "layers.{i}.input_layernorm.weight", where.get("attn_norm")),  # [L, D]
        mlp_norm=stacked(prefix + "layers.{i}.post_attention_layernorm.weight", where.get("mlp_norm")),  # [L, D]
        layers=tuple(layers),
        lm_head=None if cfg.tie_word_embeddings else matrix("lm_head.weight", sharding=where.get("lm_head")),  # [D, V]
        q_norm=stacked(prefix + "layers.{i}.self_attn.q_norm.weight", where.get("q_norm")) if cfg.qk_norm else None,
        k_norm=stacked(prefix + "layers.{i}.self_attn.k_norm.weight", where.get("k_norm")) if cfg.qk_norm else None,
        bqkv=bqkv,
    )


class _Shardings:
    """Reads load_params' `shardings` (a ModelParams of shardings, one LayerParams per
    layer) or answers None everywhere (one device)."""

    def __init__(self, shardings):
        if shardings is not None and isinstance(shardings.layers, LayerParams):
            raise ValueError("the loader makes one LayerParams per layer: pass the shardings of that form")
        self.shardings = shardings

    def get(self, name: str):
        return None if self.shardings is None else getattr(self.shardings, name)

    def layer(self, i: int) -> LayerParams:
        if self.shardings is None:
            return LayerParams(wqkv=None, wo=None, w_gate_up=None, w_down=None, w_router=None)
        return self.shardings.layers[i]


# --------------------------------------------------------------------------------------
# Dummy weights
# --------------------------------------------------------------------------------------
#
# Scales: matrices N(0, 1/fan_in) keep activations O(1) through the residual stream; the
# embedding and the LM head are N(0, 1), so logits = rmsnorm(h) @ W have std ~sqrt(D). That
# makes even a tiny random model's next-token distribution sharply peaked, so greedy output
# does not flip between implementations (bf16 vs f32, batched vs not) on near-ties.
#
# Tied models need one change: with a unit embedding shared by input and output, the
# residual stream stays close to the last token's own embedding and greedy decoding
# repeats that token forever. Drawing the layers' output projections (wo, w_down) 20x
# larger lets the layers, not the input token, decide the next token.
_TIED_RESIDUAL_GAIN = 20.0


def _normal(key, shape, std: float, dtype) -> jax.Array:
    # Draw in float32 and cast, so a bf16 dummy model is the rounding of the f32 one.
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


# The LayerParams fields that `_dummy_layer` takes shardings for, in its order.
_DUMMY_FIELDS = ("wqkv", "wo", "w_gate_up", "w_down", "w_router", "w_shared_gate_up", "w_shared_down",
                 "w_shared_gate")


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "tp", "shardings"))
def _dummy_layer(key, cfg: ModelConfig, dtype, tp: int = 1, shardings=(None,) * len(_DUMMY_FIELDS)) -> LayerParams:
    """One layer's random weights; `shardings` those of the `_DUMMY_FIELDS`."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    gain = _TIED_RESIDUAL_GAIN if cfg.tie_word_embeddings else 1.0
    qkv_shards, gate_up_shards = layout_shards(cfg, tp)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    k5 = jax.random.fold_in(key, 4)  # the router's (a split into 5 would change dense models' weights)
    # The shared expert's, folded in likewise so that the other weights stay those of its seed.
    k6, k7, k8 = (jax.random.fold_in(key, j) for j in (5, 6, 7))
    s_qkv, s_o, s_gate_up, s_down, s_router, s_shared_gate_up, s_shared_down, s_shared_gate = shardings
    experts = (cfg.num_experts,) if cfg.is_moe else ()  # a MoE layer's leading expert axis
    Fs = cfg.shared_expert_intermediate_size
    shared = {}
    if Fs:
        shared = dict(
            w_shared_gate_up=_constrain(to_shard_blocks(_normal(k6, (D, 2 * Fs), D ** -0.5, dtype),
                                                        shared_gate_up_sizes(cfg), gate_up_shards), s_shared_gate_up),
            w_shared_down=_constrain(_normal(k7, (Fs, D), gain * Fs ** -0.5, dtype), s_shared_down),
            # Gate logits of std ~1: the shared expert's weight varies from token to token.
            w_shared_gate=_constrain(_normal(k8, (D, 1), D ** -0.5, dtype), s_shared_gate),
        )
    # Drawn in the plain order and then permuted, so that a seed is one model at every tp.
    return LayerParams(
        wqkv=_constrain(to_shard_blocks(_normal(k1, (D, qkv), D ** -0.5, dtype), qkv_sizes(cfg), qkv_shards), s_qkv),
        wo=_constrain(_normal(k2, (cfg.q_size, D), gain * cfg.q_size ** -0.5, dtype), s_o),
        w_gate_up=_constrain(to_shard_blocks(_normal(k3, (*experts, D, 2 * F), D ** -0.5, dtype), gate_up_sizes(cfg),
                                             gate_up_shards), s_gate_up),
        w_down=_constrain(_normal(k4, (*experts, F, D), gain * F ** -0.5, dtype), s_down),
        # Router logits of std ~1: each token's top experts are clearly ahead of the rest.
        w_router=_constrain(_normal(k5, (D, cfg.num_experts), D ** -0.5, dtype), s_router) if cfg.is_moe else None,
        qkv_shards=qkv_shards, gate_up_shards=gate_up_shards, **shared,
    )


@functools.partial(jax.jit, static_argnames=("shape", "std", "dtype", "sharding"))
def _dummy_matrix(key, *, shape, std, dtype, sharding=None) -> jax.Array:
    return _constrain(_normal(key, shape, std, dtype), sharding)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "value", "sharding"))
def _full(*, shape, dtype, value: float, sharding=None) -> jax.Array:
    return _constrain(jnp.full(shape, value, dtype), sharding)


def dummy_params(cfg: ModelConfig, dtype, seed: int = 0, tp: int = 1, shardings=None,
                 quantization: str | None = None) -> ModelParams:
    """Random weights from the config alone, generated on the device; the same model for the
    same seed, in the fused-column layout of tensor-parallel size `tp`. shardings,
    quantization: as load_params' (each weight made in place on its devices)."""
    dtype = jnp.dtype(dtype)
    L, D, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    where = _Shardings(shardings)
    k_embed, k_head, k_layers = jax.random.split(jax.random.key(seed), 3)

    def layer(i: int) -> LayerParams:
        s = where.layer(i)
        made = _dummy_layer(jax.random.fold_in(k_layers, i), cfg, dtype, tp,
                            tuple(getattr(s, name) for name in _DUMMY_FIELDS))
        return _quantized(dataclasses.replace(made, **{name: _place(getattr(made, name), getattr(s, name))
                                                       for name in _DUMMY_FIELDS}), quantization)

    def matrix(key, shape, name: str) -> jax.Array:
        s = where.get(name)
        return _place(_dummy_matrix(key, shape=shape, std=1.0, dtype=dtype, sharding=s), s)

    def full(shape, name: str, value: float = 1.0) -> jax.Array:
        s = where.get(name)
        return _place(_full(shape=shape, dtype=dtype, value=value, sharding=s), s)

    return ModelParams(
        embed=matrix(k_embed, (V, D), "embed"),
        final_norm=full((D,), "final_norm"),
        attn_norm=full((L, D), "attn_norm"),
        mlp_norm=full((L, D), "mlp_norm"),
        layers=tuple(layer(i) for i in range(L)),
        lm_head=None if cfg.tie_word_embeddings else matrix(k_head, (D, V), "lm_head"),
        q_norm=full((L, cfg.head_dim), "q_norm") if cfg.qk_norm else None,
        k_norm=full((L, cfg.head_dim), "k_norm") if cfg.qk_norm else None,
        # Zero biases: the bias path still runs, without shifting the peaked logits (and
        # zeros need no per-shard permutation).
        bqkv=full((L, cfg.q_size + 2 * cfg.kv_size), "bqkv", 0.0) if cfg.qkv_bias else None,
    )


def abstract_params(cfg: ModelConfig, dtype, tp: int = 1) -> ModelParams:
    """The ModelParams pytree of `cfg` (layout of tensor-parallel size `tp`) with
    `jax.ShapeDtypeStruct` leaves (no memory is allocated)."""
    return jax.eval_shape(lambda: dummy_params(cfg, dtype, tp=tp))


# --------------------------------------------------------------------------------------
# Orbax cache of converted weights
# --------------------------------------------------------------------------------------


_FINGERPRINT_SAMPLES = 64  # blocks read from each weight file for its fingerprint
_FINGERPRINT_BLOCK = 4096


def _fingerprint(path: str, size: int) -> bytes:
    """A weight file's header (tensor names, dtypes, offsets) and 64 blocks of 4 KiB spread
    evenly over it: new weights of the same shapes (a retrained or re-seeded checkpoint)
    change them, even where a copy kept the file's size and mtime (cp -p, rsync -a, tar).
    256 KiB of reads per file, so a restart stays fast."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        h.update(head)
        if len(head) == 8:
            h.update(f.read(min(int.from_bytes(head, "little"), size)))
        for i in range(_FINGERPRINT_SAMPLES):
            f.seek(i * max(size - _FINGERPRINT_BLOCK, 0) // max(_FINGERPRINT_SAMPLES - 1, 1))
            h.update(f.read(_FINGERPRINT_BLOCK))
    return h.digest()


def cache_key(model_path: str, dtype, files: Iterable[str] | None = None,
              shards: tuple[int, int] = (1, 1)) -> str:
    """Hash of what determines the converted params: path, dtype, config.json, each weight
    file's name, size, mtime and sampled content (`_fingerprint`: so re-downloaded or
    replaced weights miss the cache), and the fused columns' per-shard layout `shards` =
    params.layout_shards(cfg, tp). A change that keeps all of these (one tensor edited in
    place between the sampled blocks, its mtime restored) is not seen: delete the entry."""
    h = hashlib.sha256()
    h.update(f"v{_CACHE_VERSION}\0{os.path.abspath(model_path)}\0{jnp.dtype(dtype).name}\0".encode())
    with open(os.path.join(model_path, "config.json"), "rb") as f:
        h.update(hashlib.sha256(f.read()).digest())
    if tuple(shards) != (1, 1):  # the plain layout keeps the keys that caches written before TP have
        h.update(f"shards{tuple(shards)}\0".encode())
    for path in sorted(files if files is not None else safetensors_files(model_path)):
        st = os.stat(path)
        h.update(f"{os.path.basename(path)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        h.update(_fingerprint(path, st.st_size))
    return h.hexdigest()[:32]


def cache_path(cache_dir: str, model_path: str, dtype, files: Iterable[str] | None = None,
               shards: tuple[int, int] = (1, 1)) -> str:
    name = os.path.basename(os.path.normpath(model_path)) or "model"
    key = cache_key(model_path, dtype, files, shards)
    return os.path.join(os.path.abspath(cache_dir), f"{name}-{jnp.dtype(dtype).name}-{key}")


def _restore_cached(path: str, cfg: ModelConfig, dtype, tp: int = 1, shardings=None) -> ModelParams:
    import orbax.checkpoint as ocp  # imported lazily: it is slow to import and optional here

    abstract = abstract_params(cfg, dtype, tp)
    if shardings is None:
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
    # Orbax reads each device's part of each array: nothing is gathered on one device.
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, target)


def _save_cached(path: str, params: ModelParams) -> None:
    import orbax.checkpoint as ocp

    # Orbax writes into a temporary folder and renames it on completion, so `path` only
    # ever exists complete; a concurrent writer that loses the race is harmless.
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params)
        ckptr.wait_until_finished()


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def load_params(
    model_path: str,
    cfg: ModelConfig,
    dtype,
    *,
    load_format: str = "auto",
    seed: int = 0,
    cache_dir: str | None = None,
    tensor_parallel_size: int = 1,
    shardings=None,
    quantization: str | None = None,
) -> ModelParams:
    """Weights of `cfg` as a `ModelParams`, every array of `dtype`, on the default device or
    in `shardings`.

    load_format: "auto" / "safetensors" read the HF checkpoint in `model_path`; "dummy"
    generates random weights (deterministic for `seed`) without reading any weight file.
    cache_dir: when set, converted safetensors weights are saved there with orbax and later
    loads of the same checkpoint (same path, dtype, config.json and weight files: `cache_key`)
    restore them instead of converting again.
    tensor_parallel_size: lay the fused wqkv / bqkv / w_gate_up columns out in per-shard
    blocks for this many devices (models/params.py); 1 is the plain HF order.
    shardings: a ModelParams of shardings for the weights of that layout (one LayerParams
    per layer; parallel.param_shardings), or None for the default device. Each weight is
    then made in place on its devices, read from the file in parts: no device ever holds a
    whole weight that its sharding splits, so a model larger than one device's memory loads.
    quantization: "fp8" quantizes each dense layer's matrices as soon as the layer is loaded
    (models/quant.py), so the model never sits on the device in `dtype`. With `cache_dir`
    the cache holds the `dtype` weights, which are quantized after the save or the restore.
    """
    dtype = jnp.dtype(dtype)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    tp = tensor_parallel_size
    if load_format == "dummy":
        return dummy_params(cfg, dtype, seed, tp, shardings, quantization)
    files = safetensors_files(model_path)
    cached = cache_path(cache_dir, model_path, dtype, files, layout_shards(cfg, tp)) if cache_dir else None
    if cached and os.path.isdir(cached):
        try:
            params = _restore_cached(cached, cfg, dtype, tp, shardings)
            logger.info("restored converted weights from %s", cached)
            return quant.quantize_params(params, delete_source=True) if quantization else params
        except Exception as e:  # a corrupt or incompatible cache must not block serving
            logger.warning("replacing unreadable weights cache %s: %s", cached, e)
            # Removed, so that the conversion below saves a fresh entry: kept, it would fail
            # every later load the same way and cost a conversion each time.
            shutil.rmtree(cached, ignore_errors=True)
    # A cache to write holds the weights in `dtype`: quantized after the save.
    params = _load_safetensors(model_path, cfg, dtype, tp, shardings, None if cached else quantization)
    if cached and not os.path.isdir(cached):
        try:
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            # Orbax's background save would wait 300 s for a folder it cannot make, holding
            # the process at exit: a folder that takes no file is found out here.
            with tempfile.TemporaryFile(dir=os.path.dirname(cached)):
                pass
            _save_cached(cached, params)
            logger.info("saved converted weights to %s", cached)
        except Exception as e:
            logger.warning("could not write weights cache %s: %s", cached, e)
    return quant.quantize_params(params, delete_source=True) if quantization and cached else params
