"""Reading Hugging Face checkpoint directories with numpy only (no torch).

What is read:

* :func:`read_config`: the ``config.json`` of a checkpoint directory, as a dict.
* :func:`load_tensors`: every tensor of a local checkpoint directory. With a
  ``model.safetensors.index.json`` the files its ``weight_map`` names are
  read, and only those (repositories often carry other weight files beside
  the shards, e.g. a ``consolidated.safetensors``); the index and the shards
  must agree exactly. Without an index, every ``*.safetensors`` file of the
  directory is read. No tensor may appear in two files.
* :func:`load_safetensors`: one ``.safetensors`` file. The format is parsed
  here rather than through ``safetensors.numpy``, whose loader (0.8.0) knows
  ``BF16`` but has no float8 dtypes: an 8-byte little-endian header length
  ``N``, ``N`` bytes of JSON mapping each tensor name to its ``dtype``,
  ``shape`` and ``data_offsets`` ``[begin, end)`` (relative to the byte after
  the header), an optional ``__metadata__`` entry of strings, then the raw
  little-endian data. ``BF16`` and the float8 types come back as the
  ``ml_dtypes`` numpy dtypes (``bfloat16``, ``float8_e4m3fn``,
  ``float8_e5m2``, ``float8_e8m0fnu``, ...). Every array is a fresh writable
  copy; the file is not kept open or mapped.

Fine-grained FP8 (``quantization_config.quant_method == "fp8"``; DeepSeek-V3
style, transformers' ``FineGrainedFP8Config``):

* A quantized weight ``W`` of shape ``[..., out, in]`` is float8 (e4m3fn in
  transformers' own quantizer) and comes with a scale of shape
  ``[..., ceil(out / bo), ceil(in / bi)]`` where ``(bo, bi)`` is the config's
  ``weight_block_size`` (transformers' default ``[128, 128]``). Element
  ``(r, c)`` dequantizes to ``float32(W[..., r, c]) * scale[..., r // bo,
  c // bi]``; edge blocks are partial. The stored scale is the *inverse* of
  the quantization scale (``amax / fp8_max`` per block), so dequantization
  multiplies. Scales are float32 (``scale_fmt "float"``) or
  ``float8_e8m0fnu`` powers of two (``scale_fmt "ue8m0"``); transformers reads
  ``uint8`` scales as raw E8M0 exponent bytes, ``2 ** (byte - 127)``, and so
  does this module.
* Naming, as transformers' FP8 quantize/dequantize ops and its ``FP8Linear``
  / ``FP8Experts`` modules use it: the scale of a tensor is the tensor's name
  with ``_scale_inv`` appended. For a ``Linear`` that gives
  ``X.weight`` -> ``X.weight_scale_inv`` (shape ``[ceil(out/bo),
  ceil(in/bi)]``); for fused MoE expert parameters, which are named without
  ``.weight``, ``X.gate_up_proj`` -> ``X.gate_up_proj_scale_inv``,
  ``X.up_proj`` -> ``X.up_proj_scale_inv`` (experts without a gate) and
  ``X.down_proj`` -> ``X.down_proj_scale_inv``, each ``[num_experts,
  ceil(out/bo), ceil(in/bi)]`` over weights ``[num_experts, out, in]``.
  With ``activation_scheme "static"`` there are also per-tensor activation
  scales, ``X.activation_scale`` and ``X.gate_up_proj_activation_scale`` /
  ``X.down_proj_activation_scale``; they only matter for fp8 matmuls and are
  dropped together with the weight scale on dequantization. transformers
  also renames two foreign spellings of a weight scale on load, ``X.scale``
  (DeepSeek-V4-Flash) and ``X.qscale_weight`` (Mistral Large 4), to
  ``X.weight_scale_inv``; here they are accepted as the scale of an fp8
  ``X.weight`` that has no ``X.weight_scale_inv``. Modules kept in full
  precision (``modules_to_not_convert``, typically ``lm_head``) have plain
  tensors and no scale.

Not supported (an ``InvalidArgument`` says so): FP4-packed experts
(``expert_dtype "fp4"``: ``int8`` weights), other quantization methods, and
the corner where transformers floors a fused ``gate_up_proj`` scale's row
count at 2 although ``ceil(2 * intermediate / bo)`` is 1 (intermediate sizes
below ``bo / 2``; the scale shape check refuses it).
"""

from __future__ import annotations

import json
import math
import os
import sys

import ml_dtypes
import numpy as np

from jaxkv.errors import InvalidArgument

__all__ = [
    "DEFAULT_FP8_BLOCK_SIZE",
    "FP8_DTYPES",
    "INDEX_FILE",
    "dequantize_checkpoint",
    "dequantize_fp8_blocks",
    "load_safetensors",
    "load_tensors",
    "read_config",
]

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_FP8_BLOCK_SIZE = (128, 128)
# The dtypes a quantized *weight* may have; float8_e8m0fnu is a scale format only.
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))

_SCALE_SUFFIX = "_scale_inv"
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
                 np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(np.uint8))

# safetensors dtype names -> numpy dtypes (the sub-byte F4/F6 types are not listed: no byte-addressable layout).
_SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}


# ----------------------------------------------------------------------------- config


def read_config(path: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of checkpoint directory ``path`` (or of the
    file ``path`` itself). Raises ``InvalidArgument`` naming the file when it
    is missing, unreadable, not JSON, or not a JSON object."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise InvalidArgument(f"no config.json at {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read config {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"config {path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"config {path} holds a JSON {type(config).__name__}, expected an object")
    return config


# ----------------------------------------------------------------------------- safetensors


def _read_header(f, file: str, file_size: int) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...], int, int]], int]:
    """Parse and validate the header of open safetensors ``file``.

    Returns ``({name: (dtype, shape, begin, end)}, data_start)`` with every
    ``[data_start + begin, data_start + end)`` inside the file and exactly
    ``prod(shape) * itemsize`` bytes long."""
    if file_size < 8:
        raise InvalidArgument(f"safetensors file {file} is {file_size} bytes, too short for its 8-byte header length")
    header_len = int.from_bytes(f.read(8), "little")
    if header_len > file_size - 8:
        raise InvalidArgument(f"safetensors file {file} declares a {header_len}-byte header but has only "
                              f"{file_size - 8} bytes after the length: truncated or not a safetensors file")
    raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"safetensors file {file} has a header that is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"safetensors file {file} has a header that is not a JSON object")
    data_start = 8 + header_len
    data_size = file_size - data_start
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name!r} in {file}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise InvalidArgument(f"{where}: header entry needs dtype, shape and data_offsets, got {info!r}")
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise InvalidArgument(f"{where} has dtype {info['dtype']!r}, which jaxkv cannot read "
                                  f"(readable: {', '.join(_SAFETENSORS_DTYPES)})")
        shape, offsets = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise InvalidArgument(f"{where} has shape {shape!r}, expected a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise InvalidArgument(f"{where} has data_offsets {offsets!r}, expected [begin, end]")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end or end - begin != nbytes:
            raise InvalidArgument(f"{where}: data_offsets [{begin}, {end}) hold {end - begin} bytes, but "
                                  f"{info['dtype']} {tuple(shape)} needs {nbytes}: corrupt header")
        if end > data_size:
            raise InvalidArgument(f"{where} needs bytes [{begin}, {end}) of the data section, which has only "
                                  f"{data_size} bytes: the file is truncated or corrupt")
        entries[name] = (dtype, tuple(shape), begin, end)
    return entries, data_start


def _read_tensor(f, file: str, name: str, entry, data_start: int) -> np.ndarray:
    dtype, shape, begin, end = entry
    buf = bytearray(end - begin)
    f.seek(data_start + begin)
    got = f.readinto(buf)
    if got != len(buf):
        raise InvalidArgument(f"tensor {name!r} in {file}: read {got} of {len(buf)} bytes: the file is truncated")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)  # a bytearray buffer: the array is writable
    if sys.byteorder == "big" and dtype.itemsize > 1:  # safetensors data is little-endian
        arr = arr.byteswap()
    return arr


def _scan(file: str):
    """(open file, entries, data_start) of safetensors ``file``; the caller closes it."""
    try:
        f = open(file, "rb")
    except OSError as e:
        raise InvalidArgument(f"cannot open safetensors file {file}: {e}") from None
    try:
        entries, data_start = _read_header(f, file, os.fstat(f.fileno()).st_size)
    except BaseException:
        f.close()
        raise
    return f, entries, data_start


def load_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file, in header order, as numpy
    arrays of the stored dtype (``bfloat16`` and float8 as ``ml_dtypes``
    dtypes). Raises ``InvalidArgument`` naming the file (and the tensor) for
    a missing, truncated or corrupt file or an unreadable dtype; the header is
    fully checked before any data is read."""
    file = os.fspath(file)
    f, entries, data_start = _scan(file)
    with f:
        return {name: _read_tensor(f, file, name, entry, data_start) for name, entry in entries.items()}


def load_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of local checkpoint directory ``path``, by name.

    With ``model.safetensors.index.json``: exactly the files its
    ``weight_map`` names, and the index must match them tensor for tensor.
    Without: every ``*.safetensors`` file of the directory (sorted by name).

    Raises ``InvalidArgument`` for: a path that is not a directory; no
    ``*.safetensors`` files (naming the directory); an index that is not JSON
    or has no ``weight_map`` object; a shard the index names that does not
    exist (naming the file); a tensor the index maps to a file that lacks it,
    or a tensor in a shard that the index does not list (naming the tensor
    and file); a tensor in two files (naming it and both files); any
    :func:`load_safetensors` error. All headers are checked before any
    tensor data is read.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise InvalidArgument(f"checkpoint directory {path} does not exist or is not a directory")
    index_file = os.path.join(path, INDEX_FILE)
    weight_map = None
    if os.path.exists(index_file):
        index = read_config(index_file)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InvalidArgument(f"index {index_file} has no weight_map object of tensor name -> file name")
        names = sorted(set(weight_map.values()))
        for name in names:
            if not os.path.isfile(os.path.join(path, name)):
                tensors_in = sorted(t for t, v in weight_map.items() if v == name)
                raise InvalidArgument(f"index {index_file} names shard {name!r} (for {len(tensors_in)} tensors, "
                                      f"e.g. {tensors_in[0]!r}), which is not in {path}")
    else:
        names = sorted(n for n in os.listdir(path)
                       if n.endswith(".safetensors") and os.path.isfile(os.path.join(path, n)))
        if not names:
            raise InvalidArgument(f"no *.safetensors files in {path}")

    opened = []
    try:
        owner: dict[str, str] = {}
        for name in names:
            file = os.path.join(path, name)
            f, entries, data_start = _scan(file)
            opened.append((f, file, entries, data_start))
            for tensor in entries:
                if tensor in owner:
                    raise InvalidArgument(f"tensor {tensor!r} appears in more than one file of {path}: "
                                          f"{owner[tensor]!r} and {name!r}")
                owner[tensor] = name
        if weight_map is not None:
            for tensor, name in sorted(owner.items()):
                if tensor not in weight_map:
                    raise InvalidArgument(f"tensor {tensor!r} is in shard {name!r} but not in the weight_map "
                                          f"of {index_file}")
            for tensor, name in sorted(weight_map.items()):
                if owner.get(tensor) != name:
                    raise InvalidArgument(f"index {index_file} maps tensor {tensor!r} to {name!r}, "
                                          f"which does not contain it")
        tensors = {}
        for f, file, entries, data_start in opened:
            for tensor, entry in entries.items():
                tensors[tensor] = _read_tensor(f, file, tensor, entry, data_start)
        return tensors
    finally:
        for f, *_ in opened:
            f.close()


# ----------------------------------------------------------------------------- fp8


def _block_size(block_size) -> tuple[int, int] | None:
    if block_size is None:
        return None
    try:
        bo, bi = (int(b) for b in block_size)
    except (TypeError, ValueError):
        raise InvalidArgument(f"block_size must be two positive integers [out, in] or None, got {block_size!r}") \
            from None
    if bo <= 0 or bi <= 0:
        raise InvalidArgument(f"block_size must be two positive integers [out, in], got {block_size!r}")
    return bo, bi


def _scales_float32(scale: np.ndarray) -> np.ndarray:
    if scale.dtype == np.uint8:  # raw E8M0 exponent bytes, as transformers reads them
        return np.exp2(scale.astype(np.float32) - 127.0)
    return scale.astype(np.float32)


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray,
                          block_size: tuple[int, int] | list[int] | None = DEFAULT_FP8_BLOCK_SIZE) -> np.ndarray:
    """Block-wise fp8 dequantization, as a new float32 array of ``weight``'s shape.

    ``weight``: ``[..., out, in]`` float8 (``float8_e4m3fn`` or
    ``float8_e5m2``); any leading dims (e.g. experts ``[E, out, in]``).
    ``scale_inv``: ``[..., ceil(out / bo), ceil(in / bi)]`` with the same
    leading dims, float32 / bfloat16 / float16 / ``float8_e8m0fnu``, or
    ``uint8`` E8M0 exponent bytes (``2 ** (b - 127)``).
    ``block_size``: ``(bo, bi)``. ``None`` means per-tensor or a block grid
    read from the scale: a scale of one element scales everything; otherwise
    the scale's ``[..., so, si]`` must divide ``[out, in]`` exactly and the
    blocks are ``(out // so, in // si)``.

    ``result[..., r, c] == float32(weight[..., r, c]) * float32(scale_inv[..., r // bo, c // bi])``
    exactly (one float32 multiply per element); partial edge blocks use their
    block's scale. Raises ``InvalidArgument`` naming both shapes when they do
    not fit, or naming a dtype that is not fp8 / not a scale dtype.
    """
    weight, scale_inv = np.asarray(weight), np.asarray(scale_inv)
    block = _block_size(block_size)
    if weight.dtype not in FP8_DTYPES:
        raise InvalidArgument(f"fp8 weight has dtype {weight.dtype}, expected one of "
                              f"{', '.join(str(d) for d in FP8_DTYPES)}")
    if scale_inv.dtype not in _SCALE_DTYPES:
        raise InvalidArgument(f"fp8 scale_inv has dtype {scale_inv.dtype}, expected one of "
                              f"{', '.join(str(d) for d in _SCALE_DTYPES)}")
    if weight.ndim < 2:
        raise InvalidArgument(f"fp8 weight has shape {weight.shape}; block dequantization needs [..., out, in]")
    *lead, out, inp = weight.shape
    scale = _scales_float32(scale_inv)
    result = weight.astype(np.float32)
    if block is None and scale.size == 1:
        result *= scale.reshape(())
        return result
    if block is None:
        if (scale.ndim == weight.ndim and scale.shape[:-2] == tuple(lead) and scale.shape[-2] > 0
                and scale.shape[-1] > 0 and out % scale.shape[-2] == 0 and inp % scale.shape[-1] == 0):
            block = (out // scale.shape[-2], inp // scale.shape[-1])
        else:
            raise InvalidArgument(f"fp8 scale_inv of shape {scale_inv.shape} is not a block grid that divides "
                                  f"weight shape {weight.shape} (block_size=None)")
    bo, bi = block
    want = (*lead, -(-out // bo), -(-inp // bi))
    if scale.shape != want:
        raise InvalidArgument(f"fp8 scale_inv has shape {scale_inv.shape}, expected {want} for weight shape "
                              f"{weight.shape} with block_size ({bo}, {bi})")
    # Expand the scales over rows only ([..., out, si], small), then scale one column block at a time in place,
    # so no second weight-sized array is made.
    row_scale = np.repeat(scale, bo, axis=-2)[..., :out, :]
    for j in range(want[-1]):
        result[..., j * bi:(j + 1) * bi] *= row_scale[..., j:j + 1]
    return result


def _activation_scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".activation_scale" if name.endswith(".weight") else name + "_activation_scale"


def dequantize_checkpoint(tensors: dict[str, np.ndarray], quantization_config: dict | None) -> dict[str, np.ndarray]:
    """``tensors`` with every fp8 weight replaced by its float32
    dequantization (:func:`dequantize_fp8_blocks`) and its scale removed.

    ``quantization_config``: the ``quantization_config`` dict of
    ``config.json``, or None. Only ``quant_method "fp8"`` is supported; its
    ``weight_block_size`` ``[bo, bi]`` defaults to ``[128, 128]`` when the key
    is absent (an explicit ``null`` means per-tensor scales). The scale of
    tensor ``N`` is ``N + "_scale_inv"`` (``X.weight_scale_inv``,
    ``X.gate_up_proj_scale_inv``); for an fp8 ``X.weight`` without one,
    ``X.scale`` or ``X.qscale_weight`` is used. A dequantized weight's static
    activation scale (``X.activation_scale``, ``X.<proj>_activation_scale``)
    is dropped too. Every other tensor is returned as the same object, in the
    same order; the input dict is not modified.

    Raises ``InvalidArgument``, naming the tensor, for: fp8 tensors with
    ``quantization_config`` None (the config has no quantization_config); an
    unsupported ``quant_method``; an fp8 tensor with no scale; a ``*_scale_inv``
    tensor with no tensor, or whose tensor is not fp8 (e.g. FP4-packed int8
    experts); a scale of the wrong shape or dtype.
    """
    fp8 = [n for n, t in tensors.items() if np.asarray(t).dtype in FP8_DTYPES]
    if quantization_config is None:
        if fp8:
            raise InvalidArgument(f"tensor {fp8[0]!r} is {np.asarray(tensors[fp8[0]]).dtype} ({len(fp8)} fp8 tensors "
                                  f"in all) but the config has no quantization_config to dequantize it with")
        return dict(tensors)
    if not isinstance(quantization_config, dict):
        raise InvalidArgument(f"quantization_config must be a dict, got {type(quantization_config).__name__}")
    method = quantization_config.get("quant_method")
    if method != "fp8":
        raise InvalidArgument(f"quant_method {method!r} is not supported; jaxkv dequantizes only 'fp8' "
                              f"(fine-grained block fp8)")
    block = _block_size(quantization_config.get("weight_block_size", DEFAULT_FP8_BLOCK_SIZE))

    scale_of: dict[str, str] = {}
    for name in fp8:
        candidates = [name + _SCALE_SUFFIX]
        if name.endswith(".weight"):  # the foreign spellings transformers renames to X.weight_scale_inv
            stem = name[: -len(".weight")]
            candidates += [stem + ".scale", stem + ".qscale_weight"]
        found = next((c for c in candidates if c in tensors), None)
        if found is None:
            raise InvalidArgument(f"fp8 tensor {name!r} has no scale {candidates[0]!r} in the checkpoint")
        scale_of[name] = found
    for name in tensors:
        if name.endswith(_SCALE_SUFFIX):
            owner = name[: -len(_SCALE_SUFFIX)]
            if owner not in tensors:
                raise InvalidArgument(f"scale {name!r} has no tensor {owner!r} in the checkpoint")
            if owner not in scale_of:
                raise InvalidArgument(f"scale {name!r} belongs to tensor {owner!r} of dtype "
                                      f"{np.asarray(tensors[owner]).dtype}, which is not fp8 (FP4-packed experts "
                                      f"and other formats are not supported)")

    dropped = set(scale_of.values()) | {_activation_scale_name(n) for n in scale_of}
    result = {}
    for name, tensor in tensors.items():
        if name in dropped:
            continue
        if name in scale_of:
            try:
                tensor = dequantize_fp8_blocks(tensor, tensors[scale_of[name]], block)
            except InvalidArgument as e:
                raise InvalidArgument(f"tensor {name!r} (scale {scale_of[name]!r}): {e}") from None
        result[name] = tensor
    return result
