"""Tests of jaxkv.nn.checkpoint: safetensors reading (all dtypes incl. bf16 and
fp8), sharded checkpoints with an index, their error paths, and fine-grained
fp8 block dequantization against an independent per-block loop.

Files are written either by ``safetensors.numpy.save_file`` or by
``_write_safetensors`` below, an independent writer of the format (the numpy
backend of safetensors cannot write float8)."""

from __future__ import annotations

import json
import os
import re
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxkv import InvalidArgument
from jaxkv.nn import LlamaConfig, LlamaForCausalLM
from jaxkv.nn.checkpoint import (
    INDEX_FILE,
    dequantize_checkpoint,
    dequantize_fp8_blocks,
    load_safetensors,
    load_tensors,
    read_config,
)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448

_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64", BF16: "BF16",
          E4M3: "F8_E4M3", E5M2: "F8_E5M2", E8M0: "F8_E8M0", np.dtype(np.int32): "I32",
          np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8", np.dtype(np.bool_): "BOOL"}


def _write_safetensors(file, tensors, metadata=None, *, header_override=None):
    """The safetensors layout, written by hand: u64 LE header length, JSON
    header (8-byte aligned with spaces), then each tensor's little-endian bytes."""
    header, chunks, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if header_override:
        header.update(header_override)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(chunks))


def _write_index(path, weight_map):
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def _sharded(path, tensors, shards):
    """Write ``tensors`` as ``shards`` files plus the index; returns the weight map."""
    os.makedirs(path, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        _write_safetensors(os.path.join(path, fname), {n: tensors[n] for n in part})
        weight_map.update(dict.fromkeys(part, fname))
    _write_index(path, weight_map)
    return weight_map


def _random(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(0, 100 if dtype.kind == "u" else 2**20, size=shape).astype(dtype)
    if dtype == E8M0:
        return np.exp2(rng.integers(-10, 10, size=shape)).astype(dtype)
    return (rng.standard_normal(shape) * 3).astype(dtype)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        np.testing.assert_array_equal(_bits(got[name]), _bits(arr), err_msg=name)


def _dir_with(tmp_path, sub, files):
    path = tmp_path / sub
    path.mkdir()
    for fname, tensors in files.items():
        _write_safetensors(path / fname, tensors)
    return path


def _match(s):
    return re.escape(str(s))


# ----------------------------------------------------------------------------- reading


def test_roundtrip_all_dtypes(tmp_path):
    rng = np.random.default_rng()
    tensors = {f"t.{d.name}": _random(rng, (7, 5), d) for d in _NAMES}
    tensors["scalar"] = np.float32(rng.standard_normal()).reshape(())
    tensors["empty"] = np.zeros((0, 3), np.float32)
    for v in tensors.values():
        if v.size > 1:
            assert np.unique(_bits(v)).size > 1  # not constant: a dtype mix-up would show
    path = _dir_with(tmp_path, "ckpt", {"model.safetensors": tensors})
    got = load_tensors(path)
    _assert_same(got, tensors)
    assert all(a.flags.writeable for a in got.values())
    _assert_same(load_safetensors(path / "model.safetensors"), tensors)


def test_matches_safetensors_numpy(tmp_path):
    """Files written by safetensors itself (f32, bf16, ints, metadata) read the same as its own loader."""
    rng = np.random.default_rng()
    tensors = {"a": _random(rng, (4, 9), np.float32), "b": _random(rng, (3, 2, 5), BF16),
               "c": _random(rng, (11,), np.int64), "d": _random(rng, (2, 2), np.float16)}
    (tmp_path / "x").mkdir()
    save_file(tensors, str(tmp_path / "x" / "model.safetensors"), metadata={"format": "pt"})
    got = load_tensors(tmp_path / "x")
    _assert_same(got, load_file(str(tmp_path / "x" / "model.safetensors")))
    _assert_same(got, tensors)


def test_sharded_equals_unsharded(tmp_path):
    rng = np.random.default_rng()
    tensors = {f"model.layers.{i}.w{j}": _random(rng, (3 + i, 4), [np.float32, BF16, E4M3][j])
               for i in range(4) for j in range(3)}
    one = _dir_with(tmp_path, "one", {"model.safetensors": tensors})
    _sharded(tmp_path / "three", tensors, 3)
    # a weight file the index does not name (e.g. consolidated.safetensors) is not read
    _write_safetensors(tmp_path / "three" / "consolidated.safetensors", {"other": _random(rng, (2,), np.float32)})
    _assert_same(load_tensors(tmp_path / "three"), load_tensors(one))
    _assert_same(load_tensors(tmp_path / "three"), tensors)


def test_unindexed_multiple_files(tmp_path):
    rng = np.random.default_rng()
    a = {"x": _random(rng, (2, 3), np.float32)}
    b = {"y": _random(rng, (5,), BF16)}
    _assert_same(load_tensors(_dir_with(tmp_path, "two", {"a.safetensors": a, "b.safetensors": b})), {**a, **b})


def test_read_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_config(tmp_path) == cfg
    assert read_config(tmp_path / "config.json") == cfg
    with pytest.raises(InvalidArgument, match=_match(tmp_path / "nope" / "config.json")):
        read_config(tmp_path / "nope" / "config.json")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match=_match(tmp_path / "bad" / "config.json") + ".*JSON"):
        read_config(tmp_path / "bad")
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    with pytest.raises(InvalidArgument, match="list"):
        read_config(tmp_path / "list")


# ----------------------------------------------------------------------------- reading errors


def test_directory_errors(tmp_path):
    with pytest.raises(InvalidArgument, match=_match(tmp_path / "missing")):
        load_tensors(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(InvalidArgument, match=r"no \*\.safetensors files in " + _match(tmp_path / "empty")):
        load_tensors(tmp_path / "empty")


def test_tensor_in_two_files(tmp_path):
    rng = np.random.default_rng()
    t = _random(rng, (2, 2), np.float32)
    path = _dir_with(tmp_path, "dup", {"a.safetensors": {"x": t, "shared.w": t},
                                       "b.safetensors": {"shared.w": t + 1}})
    with pytest.raises(InvalidArgument, match=r"'shared\.w'.*more than one file.*a\.safetensors.*b\.safetensors"):
        load_tensors(path)
    # with an index too: it maps the tensor to one file, the other file has it as well
    _write_index(path, {"x": "a.safetensors", "shared.w": "b.safetensors"})
    with pytest.raises(InvalidArgument, match=r"'shared\.w'.*more than one file"):
        load_tensors(path)


def test_index_errors(tmp_path):
    rng = np.random.default_rng()
    tensors = {f"w{i}": _random(rng, (3,), np.float32) for i in range(4)}

    weight_map = _sharded(tmp_path / "gone", tensors, 2)
    os.remove(tmp_path / "gone" / "model-00002-of-00002.safetensors")
    with pytest.raises(InvalidArgument, match=r"shard 'model-00002-of-00002\.safetensors'"):
        load_tensors(tmp_path / "gone")

    _sharded(tmp_path / "lacks", tensors, 2)
    _write_index(tmp_path / "lacks", dict(weight_map, ghost="model-00001-of-00002.safetensors"))
    with pytest.raises(InvalidArgument, match=r"'ghost'.*model-00001-of-00002\.safetensors"):
        load_tensors(tmp_path / "lacks")

    _sharded(tmp_path / "moved", tensors, 2)  # w0 lives in shard 1, the index says shard 2
    _write_index(tmp_path / "moved", dict(weight_map, w0="model-00002-of-00002.safetensors"))
    with pytest.raises(InvalidArgument, match=r"'w0'"):
        load_tensors(tmp_path / "moved")

    _sharded(tmp_path / "unlisted", tensors, 2)
    _write_index(tmp_path / "unlisted", {k: v for k, v in weight_map.items() if k != "w3"})
    with pytest.raises(InvalidArgument, match=r"'w3'.*model-00002-of-00002\.safetensors.*not in the weight_map"):
        load_tensors(tmp_path / "unlisted")

    _sharded(tmp_path / "notjson", tensors, 2)
    (tmp_path / "notjson" / INDEX_FILE).write_text("{")
    with pytest.raises(InvalidArgument, match=_match(tmp_path / "notjson" / INDEX_FILE)):
        load_tensors(tmp_path / "notjson")

    _sharded(tmp_path / "nomap", tensors, 2)
    (tmp_path / "nomap" / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(InvalidArgument, match="weight_map"):
        load_tensors(tmp_path / "nomap")


def test_corrupt_files(tmp_path):
    rng = np.random.default_rng()
    tensors = {"first": _random(rng, (4, 4), np.float32), "last.weight": _random(rng, (8, 3), BF16)}
    good = tmp_path / "good.safetensors"
    _write_safetensors(good, tensors)
    raw = good.read_bytes()

    def load(data, name):
        file = tmp_path / name
        file.write_bytes(data)
        return pytest.raises(InvalidArgument, match=_match(file)), file

    ctx, file = load(raw[:-5], "truncated.safetensors")
    with pytest.raises(InvalidArgument, match=r"'last\.weight'.*truncated"):
        load_safetensors(file)
    with ctx:
        load_safetensors(file)
    ctx, file = load(raw[:5], "tiny.safetensors")
    with ctx:
        load_safetensors(file)
    ctx, file = load(struct.pack("<Q", 10**9) + raw[8:], "biglen.safetensors")
    with ctx:
        load_safetensors(file)
    n = struct.unpack("<Q", raw[:8])[0]
    ctx, file = load(raw[:8] + b"[" + raw[9:8 + n] + raw[8 + n:], "badjson.safetensors")
    with ctx:
        load_safetensors(file)

    _write_safetensors(tmp_path / "dtype.safetensors", tensors,
                       header_override={"first": {"dtype": "F4", "shape": [4, 4], "data_offsets": [0, 64]}})
    with pytest.raises(InvalidArgument, match=r"'first'.*'F4'"):
        load_safetensors(tmp_path / "dtype.safetensors")
    _write_safetensors(tmp_path / "size.safetensors", tensors,
                       header_override={"first": {"dtype": "F32", "shape": [4, 5], "data_offsets": [0, 64]}})
    with pytest.raises(InvalidArgument, match=r"'first'.*needs 80"):
        load_safetensors(tmp_path / "size.safetensors")
    # through load_tensors the message names the file and the tensor as well
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "model.safetensors").write_bytes(raw[:-1])
    with pytest.raises(InvalidArgument, match=r"'last\.weight'.*" + _match(tmp_path / "dir" / "model.safetensors")):
        load_tensors(tmp_path / "dir")


# ----------------------------------------------------------------------------- fp8 blocks


def _dequant_loop(weight, scale, bo, bi):
    """Independent reference: one block at a time."""
    w = weight.astype(np.float32)
    s = scale.astype(np.float32)
    out = np.full(w.shape, np.nan, np.float32)  # poisoned: every element must be written
    rows, cols = w.shape[-2:]
    for i in range(-(-rows // bo)):
        for j in range(-(-cols // bi)):
            blk = (..., slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi))
            out[blk] = w[blk] * s[..., i, j][..., None, None]
    return out


def _fp8_case(rng, shape, block):
    *lead, rows, cols = shape
    weight = np.clip(rng.standard_normal(shape) * 100, -FP8_MAX, FP8_MAX).astype(E4M3)  # e4m3fn overflows to NaN
    scale = rng.uniform(0.5, 2.0, (*lead, -(-rows // block[0]), -(-cols // block[1]))).astype(np.float32)
    return weight, scale


@pytest.mark.parametrize("shape,block", [((200, 130), (128, 128)), ((256, 384), (128, 128)),
                                         ((3, 200, 130), (128, 128)), ((2, 5, 96, 70), (32, 16)),
                                         ((7, 300), (8, 128))])
def test_dequantize_fp8_blocks_matches_loop(shape, block):
    rng = np.random.default_rng()
    weight, scale = _fp8_case(rng, shape, block)
    got = dequantize_fp8_blocks(weight, scale, block)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, _dequant_loop(weight, scale, *block))
    assert np.isfinite(got).all()


def test_dequantize_fp8_scale_dtypes_and_default_block():
    rng = np.random.default_rng()
    weight, scale = _fp8_case(rng, (200, 130), (128, 128))
    want = dequantize_fp8_blocks(weight, scale)  # default block (128, 128)
    np.testing.assert_array_equal(want, _dequant_loop(weight, scale, 128, 128))
    # ue8m0 scales: powers of two, as float8_e8m0fnu or as raw exponent bytes (2 ** (b - 127))
    exps = rng.integers(-6, 6, size=scale.shape)
    pow2 = np.exp2(exps).astype(np.float32)
    ref = _dequant_loop(weight, pow2, 128, 128)
    np.testing.assert_array_equal(dequantize_fp8_blocks(weight, pow2.astype(E8M0)), ref)
    np.testing.assert_array_equal(dequantize_fp8_blocks(weight, (exps + 127).astype(np.uint8)), ref)
    e5 = (rng.standard_normal((40, 20)) * 10).astype(E5M2)
    s5 = rng.uniform(0.5, 2, (2, 1)).astype(BF16)
    np.testing.assert_array_equal(dequantize_fp8_blocks(e5, s5, (32, 32)), _dequant_loop(e5, s5, 32, 32))


def test_dequantize_fp8_per_tensor():
    rng = np.random.default_rng()
    weight, _ = _fp8_case(rng, (3, 64, 48), (64, 48))
    s = np.float32(rng.uniform(0.5, 2))
    np.testing.assert_array_equal(dequantize_fp8_blocks(weight, np.array(s), None), weight.astype(np.float32) * s)
    grid = rng.uniform(0.5, 2, (3, 2, 1)).astype(np.float32)  # block grid read from the scale: (32, 48)
    np.testing.assert_array_equal(dequantize_fp8_blocks(weight, grid, None), _dequant_loop(weight, grid, 32, 48))


def test_fp8_quantize_roundtrip_is_close():
    """Quantizing per block as transformers does (inverse scale = amax / 448) and
    dequantizing gets back the float weights within fp8 e4m3 rounding."""
    rng = np.random.default_rng()
    w = rng.standard_normal((2, 200, 130)).astype(np.float32) * rng.uniform(0.01, 10, (2, 200, 1))
    bo = bi = 64
    scale = np.zeros((2, 4, 3), np.float32)
    q = np.zeros(w.shape, E4M3)
    for i in range(4):
        for j in range(3):
            blk = (..., slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi))
            scale[..., i, j] = np.abs(w[blk]).max(axis=(-2, -1)) / FP8_MAX
            q[blk] = (w[blk] / scale[..., i, j][..., None, None]).astype(E4M3)
    back = dequantize_fp8_blocks(q, scale, (bo, bi))
    # e4m3: 3 mantissa bits (relative error <= 2**-4 after rounding); below 2**-6 subnormal spacing 2**-9, in
    # units of the block's scale
    block_scale = _dequant_loop(np.ones(w.shape, E4M3), scale, bo, bi)
    assert (np.abs(back - w) <= 2**-4 * np.abs(w) + 2**-10 * block_scale).all()
    assert np.abs(back - w).max() > 0  # fp8 did round


def test_dequantize_fp8_blocks_errors():
    rng = np.random.default_rng()
    weight, scale = _fp8_case(rng, (200, 130), (128, 128))
    with pytest.raises(InvalidArgument, match=r"\(2, 1\).*\(2, 2\).*\(200, 130\)"):
        dequantize_fp8_blocks(weight, scale[:, :1])
    ew, es = _fp8_case(rng, (3, 200, 130), (128, 128))
    with pytest.raises(InvalidArgument, match=r"\(2, 2, 2\).*\(3, 2, 2\)"):
        dequantize_fp8_blocks(ew, es[:2])
    with pytest.raises(InvalidArgument, match=r"\(2, 2\).*\(3, 2, 2\)"):
        dequantize_fp8_blocks(ew, scale)
    with pytest.raises(InvalidArgument, match="float32"):
        dequantize_fp8_blocks(weight.astype(np.float32), scale)
    with pytest.raises(InvalidArgument, match=r"\(130,\)"):
        dequantize_fp8_blocks(weight[0], scale[0])
    with pytest.raises(InvalidArgument, match="int32"):
        dequantize_fp8_blocks(weight, scale.astype(np.int32))
    with pytest.raises(InvalidArgument, match="block_size"):
        dequantize_fp8_blocks(weight, scale, (0, 128))
    with pytest.raises(InvalidArgument, match=r"\(3, 1\).*\(200, 130\)"):
        dequantize_fp8_blocks(weight, np.ones((3, 1), np.float32), None)


# ----------------------------------------------------------------------------- checkpoint dequantization


FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 32]}


def _fp8_checkpoint(rng, block=(64, 32)):
    t = {}
    t["model.embed_tokens.weight"] = _random(rng, (50, 96), BF16)
    t["model.layers.0.self_attn.q_proj.weight"], t["model.layers.0.self_attn.q_proj.weight_scale_inv"] = \
        _fp8_case(rng, (100, 96), block)
    t["model.layers.0.input_layernorm.weight"] = _random(rng, (96,), np.float32)
    # fused MoE experts, no ".weight" in the names: gate_up [E, 2I, H], down [E, H, I]
    t["model.layers.0.mlp.experts.gate_up_proj"], t["model.layers.0.mlp.experts.gate_up_proj_scale_inv"] = \
        _fp8_case(rng, (4, 2 * 70, 96), block)
    t["model.layers.0.mlp.experts.down_proj"], t["model.layers.0.mlp.experts.down_proj_scale_inv"] = \
        _fp8_case(rng, (4, 96, 70), block)
    t["lm_head.weight"] = _random(rng, (50, 96), BF16)  # modules_to_not_convert: plain, no scale
    return t


def test_dequantize_checkpoint():
    rng = np.random.default_rng()
    t = _fp8_checkpoint(rng)
    before = dict(t)
    got = dequantize_checkpoint(t, FP8_CONFIG)
    assert t == before  # input not modified
    assert list(got) == [n for n in t if not n.endswith("_scale_inv")]
    for name in got:
        if t[name].dtype == E4M3:
            assert got[name].dtype == np.float32
            np.testing.assert_array_equal(got[name], _dequant_loop(t[name], t[name + "_scale_inv"], 64, 32))
        else:
            assert got[name] is t[name]


def test_dequantize_checkpoint_default_block_and_aliases():
    rng = np.random.default_rng()
    w, s = _fp8_case(rng, (200, 130), (128, 128))
    plain = _random(rng, (3,), np.float32)
    want = _dequant_loop(w, s, 128, 128)
    got = dequantize_checkpoint({"a.weight": w, "a.weight_scale_inv": s, "a.activation_scale": np.float32(1),
                                 "n.weight": plain}, {"quant_method": "fp8", "activation_scheme": "static"})
    assert list(got) == ["a.weight", "n.weight"] and got["n.weight"] is plain
    np.testing.assert_array_equal(got["a.weight"], want)
    for alias in ("a.scale", "a.qscale_weight"):  # spellings transformers renames to a.weight_scale_inv
        got = dequantize_checkpoint({"a.weight": w, alias: s}, {"quant_method": "fp8"})
        assert list(got) == ["a.weight"]
        np.testing.assert_array_equal(got["a.weight"], want)
    got = dequantize_checkpoint({"e.down_proj": w[None], "e.down_proj_scale_inv": s[None],
                                 "e.down_proj_activation_scale": np.ones(1, np.float32)}, {"quant_method": "fp8"})
    assert list(got) == ["e.down_proj"]
    np.testing.assert_array_equal(got["e.down_proj"], want[None])


def test_dequantize_checkpoint_errors():
    rng = np.random.default_rng()
    t = _fp8_checkpoint(rng)
    q = "model.layers.0.self_attn.q_proj.weight"
    gu = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(InvalidArgument, match=_match(repr(q + "_scale_inv"))):
        dequantize_checkpoint({k: v for k, v in t.items() if k != q + "_scale_inv"}, FP8_CONFIG)
    with pytest.raises(InvalidArgument, match=_match(repr(gu + "_scale_inv"))):
        dequantize_checkpoint({k: v for k, v in t.items() if k != gu + "_scale_inv"}, FP8_CONFIG)
    with pytest.raises(InvalidArgument, match=_match(repr(gu + "_scale_inv")) + ".*no tensor"):
        dequantize_checkpoint({k: v for k, v in t.items() if k != gu}, FP8_CONFIG)
    with pytest.raises(InvalidArgument, match=_match(repr(q + "_scale_inv")) + ".*not fp8"):
        dequantize_checkpoint(dict(t, **{q: t[q].astype(np.float32)}), FP8_CONFIG)
    with pytest.raises(InvalidArgument, match="'awq'"):
        dequantize_checkpoint(t, {"quant_method": "awq"})
    with pytest.raises(InvalidArgument, match=_match(repr(gu)) + r".*\(4, 3, 2\).*\(4, 3, 3\)"):
        dequantize_checkpoint(dict(t, **{gu + "_scale_inv": t[gu + "_scale_inv"][:, :, :2]}), FP8_CONFIG)
    with pytest.raises(InvalidArgument, match=_match(repr(q)) + ".*128"):  # default block (128, 128) does not fit
        dequantize_checkpoint(t, {"quant_method": "fp8"})
    with pytest.raises(InvalidArgument, match="no quantization_config"):
        dequantize_checkpoint(t, None)
    plain = {k: v for k, v in t.items() if v.dtype != E4M3 and not k.endswith("_scale_inv")}
    got = dequantize_checkpoint(plain, None)
    assert got == plain and all(got[k] is plain[k] for k in plain)


# ----------------------------------------------------------------------------- through LlamaForCausalLM


def test_llama_from_pretrained_fp8(tmp_path):
    """An fp8 Llama checkpoint (Linear weights quantized per 32x32 block, sharded
    with an index) loads as its dequantization; the same checkpoint without
    its quantization_config is refused."""
    rng = np.random.default_rng()
    cfg = {"model_type": "llama", "vocab_size": 40, "hidden_size": 64, "intermediate_size": 80,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
    model = LlamaForCausalLM(LlamaConfig.from_hf(cfg), rngs=nnx.Rngs(0))
    plain = {k: np.asarray(v) for k, v in model.hf_state_dict().items()}
    tensors, want = {}, {}
    for name, arr in plain.items():
        if name.endswith("_proj.weight"):
            w, s = _fp8_case(rng, arr.shape, (32, 32))
            tensors[name], tensors[name + "_scale_inv"] = w, s
            want[name] = _dequant_loop(w, s, 32, 32)
        else:
            tensors[name] = want[name] = (arr + rng.standard_normal(arr.shape)).astype(np.float32)
    _sharded(tmp_path, tensors, 2)
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, quantization_config=quant)))
    loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.param_dtype == jnp.float32
    _assert_same({k: np.asarray(v) for k, v in loaded.hf_state_dict().items()}, want)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidArgument, match="quantization_config"):
        LlamaForCausalLM.from_pretrained(tmp_path)
