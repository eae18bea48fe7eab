"""Text in, text out: the tokenizer and the chat template of a checkpoint.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (the Rust tokenizer
transformers' fast tokenizers are made of) with the chat template and the
special tokens of a checkpoint, read without transformers:

* a checkpoint **directory**: ``tokenizer.json`` (the backend, used as it is,
  post-processor included: with a ``tokenizer.json`` present transformers
  5.x drops ``add_bos_token`` / ``add_eos_token`` from the tokenizer config,
  and so does this module; only a ``tokenizer.json`` without a post-processor
  gets one built from them, as transformers' ``update_post_processor`` does),
  ``tokenizer_config.json`` (``chat_template``: a string, or a list of
  ``{"name", "template"}``; ``bos_token`` / ``eos_token`` / ``unk_token`` /
  ``sep_token`` / ``pad_token`` / ``cls_token`` / ``mask_token``, strings or
  ``{"content": ...}``; ``clean_up_tokenization_spaces``),
  ``special_tokens_map.json`` (tokens the config leaves out),
  ``chat_template.jinja`` (takes priority over the config's template, as in
  transformers) and ``chat_templates/NAME.jinja``, ``config.json`` and
  ``generation_config.json`` (``eos_token_id`` / ``bos_token_id``);
* a **GGUF file**: the ``tokenizer.ggml.*`` metadata, rebuilt as transformers'
  GGUF tokenizer converter (``integrations/gguf/gguf_tokenizer_mapping.py``)
  does for a ``gpt2`` (byte-level BPE) vocabulary: tokens respelled into the
  byte-level alphabet, BPE with the file's merges, the ByteLevel
  pre-tokenizer (or the split regex of the ``tokenizer.ggml.pre`` families
  transformers knows) and decoder, control tokens (type 3) added as special
  tokens, user-defined tokens (type 4) as plain added tokens, a BOS only
  with ``tokenizer.ggml.add_bos_token``; ``tokenizer.chat_template``;
  bos / eos / unk / pad from their ids; and Gemma 3's ``llama``
  (sentencepiece BPE) vocabulary as transformers' converter rebuilds it
  (:func:`_gguf_gemma_sentencepiece`: whitespace tokens respelled, merges
  recovered from the vocabulary in its order, byte fallback); the ``llama``
  vocabulary of every other architecture (Llama 2, Mistral, TinyLlama,
  Phi-3) as transformers' ``LlamaTokenizer`` (:func:`_gguf_llama_sentencepiece`:
  merges recovered from the scores, ``Metaspace``, byte fallback), with a BOS
  unless the file says otherwise, as llama.cpp. Other tokenizer models
  (``t5``'s unigram, ``gemma4``, ...) are refused with ``InvalidArgument``
  naming it.

**Chat templates** render in a jinja2 ``ImmutableSandboxedEnvironment`` set up
as transformers 5.24 sets it up (``utils/chat_template_utils.py``):
``trim_blocks=True``, ``lstrip_blocks=True``, the ``loopcontrols`` extension
and a ``{% generation %}`` block (rendered as its body), the filter ``tojson``
(``json.dumps`` with ``ensure_ascii=False`` and the ``indent`` /
``separators`` / ``sort_keys`` options, no HTML escaping), the globals
``raise_exception`` (raises; :meth:`Tokenizer.apply_chat_template` turns it
into :class:`ChatTemplateError`), ``strftime_now``, ``dict`` and a
``namespace`` that refuses ``_``-prefixed names. The template sees
``messages`` (keys whose value is None dropped; rebuilt from plain JSON types;
``reasoning_content`` / ``thinking`` / ``reasoning`` aliased to each other),
``tools``, ``documents``, ``add_generation_prompt``, the special tokens
(``bos_token``, ``eos_token``, ...) and any keyword argument (which win over
the special tokens). ``tokenize=True`` encodes the rendered text without
adding special tokens, as transformers does.

:class:`IncrementalDetokenizer` turns generated ids into text chunks for
streaming: each :meth:`~IncrementalDetokenizer.add` returns the new text the
ids complete and never a broken character (bytes of an incomplete UTF-8
character, which decode to U+FFFD, are held back until a later token
completes them, or :meth:`~IncrementalDetokenizer.finish` releases them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jaxkv.errors import InvalidArgument

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "bytes_to_unicode", "render_chat_template"]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# ggml token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


class ChatTemplateError(InvalidArgument):
    """A chat template refused the conversation (its ``raise_exception``) or
    could not be rendered (a template syntax or runtime error). The message is
    the template's own."""


# ----------------------------------------------------------------------------- chat templates


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE (the
    alphabet every byte-level vocabulary is written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _require_text_packages() -> None:
    """``ImportError`` naming the extra that brings them when the text
    packages (tokenizers, jinja2; the ``text`` extra) are missing."""
    import importlib.util

    missing = [name for name in ("tokenizers", "jinja2") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"jaxkv's text needs {', '.join(missing)}: pip install 'jaxkv[text]'")


@functools.lru_cache(maxsize=1)
def _environment():
    _require_text_packages()
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks the
        assistant's tokens with it); rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: jinja's own escapes HTML characters and has no separators / ensure_ascii.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys(...)`` without the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja's ``namespace`` refusing ``_``-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from None


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (transformers'
    ``_plain_template_data``): subclasses of str / int / float are stripped
    to the base type, mappings / lists / tuples are rebuilt, dataclasses and
    pydantic models become dicts, numpy scalars their Python value, anything
    else a ``"<TypeName>"`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise InvalidArgument(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise InvalidArgument("cannot apply a chat template to an empty conversation")
    out = []
    for i, message in enumerate(messages):
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        elif callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise InvalidArgument(f"message {i} must be a dict with 'role' and 'content', got {message!r}")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # the name chat templates read, and gpt-oss's
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(template: str, messages: Sequence[Mapping], *, add_generation_prompt: bool = False,
                         tools: list[dict] | None = None, documents: list[dict] | None = None,
                         special_tokens: Mapping[str, str] | None = None, **kwargs) -> str:
    """Render jinja ``template`` over ``messages`` as transformers'
    ``apply_chat_template(..., tokenize=False)`` does (see the module
    docstring for the environment and what the template sees). Raises
    :class:`ChatTemplateError` when the template raises or fails, and
    ``InvalidArgument`` for an empty conversation or a message that is not a
    dict."""
    import jinja2

    chat = _normalize_messages(messages)
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise InvalidArgument("documents must be a list of dicts (e.g. with 'title' and 'text')")
    variables = {**dict(special_tokens or {}), **kwargs}
    compiled = _compile(template)
    try:
        return compiled.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=bool(add_generation_prompt), **_plain(variables))
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(str(e)) from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------- the tokenizer


def _token_content(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read {what} {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{what} {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{what} {path} holds a JSON {type(data).__name__}, expected an object")
    return data


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _unique(ids) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (WordPiece-era spacing fixes)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


# Split regexes of the tokenizer.ggml.pre families transformers' GGUF converter knows (others keep ByteLevel's).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def _template_processing(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None,
                         add_bos: bool, add_eos: bool):
    """transformers' ``update_post_processor``: ``[bos] $A [eos]``."""
    from tokenizers import processors

    add_bos = bool(add_bos and bos is not None and bos_id is not None)
    add_eos = bool(add_eos and eos is not None and eos_id is not None)
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _gguf_byte_level(meta: dict, path: str, tokens: list):
    """A GGUF ``gpt2`` vocabulary (module docstring): ``(backend, vocab,
    whether a control token is spelled in the byte alphabet)``."""
    from tokenizers import Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise InvalidArgument(f"GGUF file {path} has a gpt2 tokenizer without tokenizer.ggml.merges")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise InvalidArgument(f"GGUF file {path}: merge {m!r} is not two tokens separated by one space")
        pairs.append(tuple(parts))
    backend = Backend(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    split = GGUF_PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # A control token spelled outside the byte alphabet is a mislabel: adding it would grow the vocabulary.
    return backend, vocab, lambda t: set(t) <= alphabet


def _merges_by_rank(vocab: dict, rank: dict) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary that lists none: every split of a
    token into two tokens of the vocabulary, the token's ``rank`` deciding
    the order (higher first), then the longer left piece, then the longer
    right one; splits of equal keys keep the vocabulary's order, each
    token's by its pieces' ids (what transformers' converter does, so the
    tokenizations agree)."""
    found = []
    for token, score in rank.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found += [(score, left, right) for left, right in splits]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _gguf_gemma_sentencepiece(meta: dict, tokens: list):
    """Gemma's sentencepiece BPE from GGUF metadata (a ``llama`` tokenizer
    model with no merges): tokens of two or more spaces respelled with
    ``\u2581`` (the file writes real spaces; the model's normalizer turns
    spaces into ``\u2581``); merges from the vocabulary, ranked by the
    tokens' order in the file (Gemma's scores do not follow its merge
    order); BPE with byte fallback and the unknown token fused; the
    normalizer ``" " -> \u2581``, no prefix space, and a decoder back."""
    from tokenizers import decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(respelled)}
    rank = {t: -i for i, t in enumerate(respelled)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else "<unk>"
    backend = Backend(BPE(vocab=vocab, merges=_merges_by_rank(vocab, rank), fuse_unk=True, unk_token=unk,
                          dropout=None, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, vocab, lambda t: True


def _gguf_llama_sentencepiece(meta: dict, path: str, tokens: list):
    """A sentencepiece BPE vocabulary from GGUF metadata outside Gemma
    (Llama 2, Mistral, TinyLlama: ``tokenizer.ggml.model`` = ``llama``), as
    transformers' ``LlamaTokenizer`` is built from it: the pieces as the file
    spells them, merges recovered from ``tokenizer.ggml.scores`` (a piece's
    score ranks its merges), BPE with byte fallback and the unknown piece
    fused, no normalizer, the ``Metaspace`` pre-tokenizer that prepends
    ``\u2581`` to the text's start only (non-legacy; a text already starting
    with a space gets none more) and a decoder that strips that one space
    back."""
    from tokenizers import decoders, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    scores = meta.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise InvalidArgument(f"GGUF file {path} has a sentencepiece ('llama') tokenizer whose "
                              f"tokenizer.ggml.scores has {len(scores or [])} entries for {len(tokens)} tokens: "
                              "the merges are recovered from the scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(BPE(vocab=vocab, merges=_merges_by_rank(vocab, dict(zip(tokens, scores))), fuse_unk=True,
                          dropout=None, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    return backend, vocab, lambda t: True


class Tokenizer:
    """A checkpoint's tokenizer and chat template.

    Build with :meth:`from_pretrained` (a checkpoint directory or a GGUF
    file), or directly from a ``tokenizers.Tokenizer``.

    Fields: ``backend`` (the ``tokenizers.Tokenizer``), ``chat_template``
    (the default template string, or None), ``chat_templates`` (name ->
    template, ``"default"`` among them when there is one),
    ``special_tokens`` (``bos_token`` etc. -> string, what a template sees),
    ``eos_token_ids`` (every id that ends generation: generation_config's,
    then config.json's, then the tokenizer's EOS; for a GGUF its EOS, EOT and
    EOM ids), ``bos_token_id`` (int or None), ``vocab_size`` (tokens the
    backend knows, added tokens included), ``clean_up_tokenization_spaces``
    (applied on decode only for non-BPE backends, as in transformers),
    ``name_or_path``; the property ``max_token_id``.
    """

    def __init__(self, backend, *, chat_template: str | Mapping[str, str] | None = None,
                 special_tokens: Mapping[str, str] | None = None, eos_token_ids: Sequence[int] = (),
                 bos_token_id: int | None = None, clean_up_tokenization_spaces: bool = False,
                 name_or_path: str = ""):
        self.backend = backend
        if isinstance(chat_template, Mapping):
            self.chat_templates = {str(k): str(v) for k, v in chat_template.items()}
        else:
            self.chat_templates = {} if chat_template is None else {"default": str(chat_template)}
        self.chat_template = self.chat_templates.get("default")
        self.special_tokens = {k: v for k, v in dict(special_tokens or {}).items() if v is not None}
        self.eos_token_ids = _unique(eos_token_ids)
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self.name_or_path = name_or_path

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest id the tokenizer has a token for (added tokens
        included; vLLM's ``max_token_id``); -1 for an empty vocabulary. Many
        checkpoints pad their embedding past it: ids above it decode to
        nothing (:meth:`decode`), and a sampler limited to ``[0,
        max_token_id]`` never draws one. Usually ``vocab_size - 1``; larger
        where the vocabulary leaves ids unused."""
        return max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (what ``skip_special_tokens``
        leaves out of a decode)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def byte_piece_ids(self) -> frozenset[int]:
        """Ids of the byte-fallback pieces (``<0x00>`` .. ``<0xFF>``) of a
        sentencepiece-style BPE with byte fallback; empty otherwise. Its
        decoder turns a run of them into one byte string, all U+FFFD when
        the run is not valid UTF-8, so a later byte piece can change the
        text of earlier ones (:class:`IncrementalDetokenizer` holds a run's
        text back until the run ends)."""
        if not getattr(self.backend.model, "byte_fallback", False):
            return frozenset()
        vocab = self.backend.get_vocab(with_added_tokens=False)
        return frozenset(i for t, i in vocab.items() if re.fullmatch(r"<0x[0-9A-F]{2}>", t))

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={self.eos_token_ids}, chat_template={'yes' if self.chat_template else 'no'})")

    # ------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer of checkpoint directory ``path`` (needs its
        ``tokenizer.json``) or of GGUF file ``path`` (see the module
        docstring for what is read). Raises ``InvalidArgument`` naming the
        path for a missing path, a directory without ``tokenizer.json``, an
        unreadable or invalid file, and a GGUF tokenizer model other than
        ``gpt2``."""
        path = os.fspath(path)
        _require_text_packages()
        if os.path.isdir(path):
            return cls._from_directory(path)
        if os.path.isfile(path):
            return cls._from_gguf(path)
        raise InvalidArgument(f"tokenizer path {path} does not exist (a checkpoint directory or a .gguf file)")

    @classmethod
    def _from_directory(cls, path: str) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise InvalidArgument(f"no tokenizer.json in {path} (jaxkv reads the fast-tokenizer file, not "
                                  f"sentencepiece / vocab.json files)")
        try:
            backend = Backend.from_file(file)
        except Exception as e:  # noqa: BLE001 -- the Rust side raises a bare Exception
            raise InvalidArgument(f"tokenizer {file} cannot be loaded: {e}") from None

        def optional(name):
            p = os.path.join(path, name)
            return _read_json(p, name) if os.path.isfile(p) else {}

        tok_config, special_map = optional("tokenizer_config.json"), optional("special_tokens_map.json")
        config, gen_config = optional("config.json"), optional("generation_config.json")

        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _token_content(tok_config.get(name))
            if value is None:
                value = _token_content(special_map.get(name))
            if value is not None:
                special[name] = value

        templates: dict[str, str] = {}
        raw = tok_config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            for entry in raw:
                if isinstance(entry, Mapping) and isinstance(entry.get("name"), str) \
                        and isinstance(entry.get("template"), str):
                    templates[entry["name"]] = entry["template"]
        files: dict[str, str] = {}
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            files["default"] = _read_text(jinja)
        folder = os.path.join(path, "chat_templates")
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".jinja"):
                    files[name[: -len(".jinja")]] = _read_text(os.path.join(folder, name))
        if files:  # separate template files take priority over the config's entries (transformers)
            templates = files

        if backend.post_processor is None and (tok_config.get("add_bos_token") or tok_config.get("add_eos_token")):
            bos, eos = special.get("bos_token"), special.get("eos_token")
            backend.post_processor = _template_processing(
                bos, None if bos is None else backend.token_to_id(bos), eos,
                None if eos is None else backend.token_to_id(eos),
                tok_config.get("add_bos_token", False), tok_config.get("add_eos_token", False))

        eos_tok = special.get("eos_token")
        eos_tok_id = None if eos_tok is None else backend.token_to_id(eos_tok)
        eos_ids = _ids(gen_config.get("eos_token_id")) + _ids(config.get("eos_token_id")) + _ids(eos_tok_id)
        bos_tok = special.get("bos_token")
        bos_id = None if bos_tok is None else backend.token_to_id(bos_tok)
        if bos_id is None:
            bos_id = next(iter(_ids(config.get("bos_token_id")) or _ids(gen_config.get("bos_token_id"))), None)
        return cls(backend, chat_template=templates or None, special_tokens=special, eos_token_ids=eos_ids,
                   bos_token_id=bos_id,
                   clean_up_tokenization_spaces=bool(tok_config.get("clean_up_tokenization_spaces", False)),
                   name_or_path=path)

    @classmethod
    def _from_gguf(cls, path: str) -> Tokenizer:
        from tokenizers import AddedToken

        from jaxkv.nn.gguf import read_gguf

        g = read_gguf(path)
        meta = g.metadata
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise InvalidArgument(f"GGUF file {path} has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
        types = meta.get("tokenizer.ggml.token_type") or []
        if kind == "gpt2":
            backend, vocab, spelled = _gguf_byte_level(meta, path, tokens)
        elif kind == "llama" and g.architecture in ("gemma", "gemma2", "gemma3"):
            backend, vocab, spelled = _gguf_gemma_sentencepiece(meta, tokens)
        elif kind == "llama":
            backend, vocab, spelled = _gguf_llama_sentencepiece(meta, path, tokens)
            if g.architecture == "phi3":  # Phi-3's prefix space comes from a normalizer (transformers' phi3 builder)
                from tokenizers import normalizers

                backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                           normalizers.Replace(" ", "\u2581")])
                backend.pre_tokenizer = None
        else:
            raise InvalidArgument(f"GGUF file {path} has tokenizer model {kind!r} (architecture {g.architecture!r}); "
                                  "jaxkv builds 'gpt2' (byte-level BPE) and 'llama' (sentencepiece BPE) "
                                  "tokenizers from GGUF metadata")

        def token_of(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return (tokens[i], int(i)) if isinstance(i, int) and 0 <= i < len(tokens) else (None, None)

        bos, bos_id = token_of("bos_token_id")
        eos, eos_id = token_of("eos_token_id")
        # llama.cpp adds a BOS to a sentencepiece vocabulary whose file does not say otherwise (older files carry
        # no flag); transformers' GGUF loader follows it.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        backend.post_processor = _template_processing(bos, bos_id, eos, eos_id, bool(add_bos),
                                                      bool(meta.get("tokenizer.ggml.add_eos_token", False)))
        # Control tokens, and the tokens the file names BOS / EOS / unknown (a sentencepiece <unk> has its own
        # type), are special: matched whole in a text, skipped on decode.
        named = {t for t in (bos, eos, token_of("unknown_token_id")[0]) if t is not None}
        control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                   if (ty == _CONTROL or t in named) and spelled(t)]
        if control:
            backend.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                if ty == _USER_DEFINED and t in vocab]
        if user:
            backend.add_tokens(user)
        special = {"bos_token": bos, "eos_token": eos, "unk_token": token_of("unknown_token_id")[0],
                   "pad_token": token_of("padding_token_id")[0]}
        eos_ids = [i for i in (eos_id, token_of("eot_token_id")[1], token_of("eom_token_id")[1]) if i is not None]
        template = meta.get("tokenizer.chat_template")
        return cls(backend, chat_template=template if isinstance(template, str) else None, special_tokens=special,
                   eos_token_ids=eos_ids, bos_token_id=bos_id, name_or_path=path)

    # ------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the
        post-processor (e.g. a BOS where the checkpoint adds one)."""
        if not isinstance(text, str):
            raise InvalidArgument(f"encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=bool(add_special_tokens)).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of token ids ``ids`` (special tokens left out with
        ``skip_special_tokens``); bytes of an incomplete UTF-8 character
        decode to U+FFFD.

        An integer id the tokenizer has no token for (negative, above
        :attr:`max_token_id`, or unused) decodes to nothing, never an error:
        a model whose embedding is padded past the vocabulary can sample
        such an id, and one request's stray token must not fail the serving
        step. Nothing rather than U+FFFD, as the ``tokenizers`` backend
        itself skips ids it does not know, vLLM's detokenizer turns their
        missing token into "", and llama.cpp's converters pad such a
        vocabulary with unused tokens whose piece is empty; a U+FFFD would
        also read as a broken UTF-8 character (which the incremental
        detokenizer holds back) and could not be told from real ones."""
        top = self.max_token_id
        ids = [i for i in map(int, ids) if 0 <= i <= top]  # the backend's u32 conversion would raise on the rest
        text = self.backend.decode(ids, skip_special_tokens=bool(skip_special_tokens))
        if self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    # ------------------------------------------------------- chat template

    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        """The template to render: ``chat_template`` (a template, or the name
        of one of ``chat_templates``), else ``"tool_use"`` when tools are
        given and there is one, else the default. Raises ``InvalidArgument``
        when there is none."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None:
            named = f" (named templates: {', '.join(sorted(self.chat_templates))})" if self.chat_templates else ""
            raise InvalidArgument(f"tokenizer {self.name_or_path or ''} has no default chat template{named}; "
                                  f"pass chat_template=")
        return self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            *, tools: list[dict] | None = None, documents: list[dict] | None = None,
                            chat_template: str | None = None, **kwargs) -> str | list[int]:
        """Render the conversation ``messages`` (dicts with ``role`` and
        ``content``, ...) with the chat template, as transformers'
        ``apply_chat_template`` does; with ``tokenize`` return the ids of the
        rendered text (no special tokens added: the template writes them).
        ``add_generation_prompt`` ends with the header of the assistant's
        turn (default True here; transformers' default is False). Keyword
        arguments reach the template (e.g. ``enable_thinking=False``). Raises
        :class:`ChatTemplateError` when the template refuses the
        conversation."""
        template = self.get_chat_template(chat_template, tools)
        text = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    documents=documents, special_tokens=self.special_tokens, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read chat template {path}: {e}") from None


# ----------------------------------------------------------------------------- streaming


class IncrementalDetokenizer:
    """Streams the text of generated token ids, one chunk per :meth:`add`.

    Exact: the chunks of :meth:`add`, then :meth:`finish`, concatenate to
    the **continuation** of the prompt by the ids, whatever the ids and
    however they are split into calls; ``text`` is what was returned so
    far. With ``P = decode(prompt_ids)`` and ``F = decode(prompt_ids +
    ids)``, the continuation is ``F`` after the longest common prefix of
    ``P`` and ``F``:

    * with no prompt, ``decode(ids)``; with a prompt that ends on a whole
      character, ``F`` starts with ``P`` and it is ``F[len(P):]``;
    * with a prompt that ends inside a UTF-8 character (``P`` ends in the
      U+FFFD of its incomplete bytes): if the ids complete the character,
      the whole character is the continuation's first (prompt bytes
      ``F0 9F``, then ``98 80``: "😀"); if they never do, the U+FFFD stays
      the prompt's (``F0``, then "a": "a", not "\\ufffda");
    * the definition reads text: ids that complete a character which is
      itself U+FFFD (prompt bytes ``EF BF``, then ``BD``) add nothing, their
      U+FFFD counted as the prompt's.

    Ids the tokenizer has no token for (an embedding padded past the
    vocabulary) decode to nothing in :meth:`Tokenizer.decode`, so they add
    nothing here either, and never raise.

    A run of byte-fallback pieces (:attr:`Tokenizer.byte_piece_ids`) at the
    end of the ids is held back whole until a piece of another kind follows
    (or :meth:`finish`): the decoder turns an invalid run into U+FFFD only,
    so a later byte can change the text of earlier ones (``<0x00>`` is
    "\x00", ``<0x00><0x80>`` is two U+FFFD).

    Never splits a character: a trailing U+FFFD in the decoded window (the
    bytes of an incomplete UTF-8 character, or one that may still complete)
    is held back until a later token completes it; :meth:`finish` returns
    whatever is still held back (the U+FFFD that ``decode`` gives for bytes
    that never completed).

    How: the window of ids from ``prefix_offset`` is decoded and compared
    with the window's text before the new ids (``ids[prefix_offset:
    read_offset]``), as vLLM does, so decoders that change the first token
    of a window (sentencepiece's leading space) still diff correctly; the
    window moves on whenever its text ends on a complete character, so each
    step decodes a few tokens, not the whole sequence. The first window
    starts a few tokens before the prompt's end, on a whole character, and
    keeps the prompt's trailing U+FFFD: the new text starts after the
    common prefix of that text and the window's, as the definition says.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = bool(skip_special_tokens)
        self.ids: list[int] = [int(i) for i in prompt_ids]
        self.prefix_offset = self._first_window_start()
        self.read_offset = len(self.ids)
        # The window's text before the new ids. The prompt's keeps its trailing U+FFFD (see _start).
        self._base = self._decode(self.ids[self.prefix_offset:self.read_offset])
        self._released = 0  # characters of the current window's new text already returned
        self._prompt_len = len(self.ids)
        self._prompt_text: str | None = None  # decode of the prompt, only if the fallback needs it
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    @staticmethod
    def _stable(text: str) -> str:
        return text.rstrip("\ufffd")

    def _first_window_start(self) -> int:
        """Five tokens before the prompt's end (the first new token decodes
        in context), or further back (doubling) until the window's text
        starts with a character other than U+FFFD, i.e. the window starts on
        a whole character. One starting inside a character decodes its
        continuation bytes as U+FFFD of their own; harmless while the
        character ends inside the prompt, but if its bytes reached the
        prompt's end (tokens that decode to nothing between them), the ids
        completing it would complete nothing in the window."""
        back = 5 + len(self.ids) - self._cut()  # and before a trailing run of byte pieces
        while True:
            start = max(len(self.ids) - back, 0)
            head = self._decode(self.ids[start:]) if start else ""
            if start == 0 or (head and not head.startswith("\ufffd")):
                return start
            back *= 2

    def _cut(self) -> int:
        """The start of the ids' trailing run of byte pieces (``len(ids)``
        when they end otherwise). Ids that decode to nothing (skipped
        special tokens, ids with no token) inside or after the run do not
        end it: the decoder joins the bytes around them."""
        byte = getattr(self.tokenizer, "byte_piece_ids", ())  # (a tokenizer-like object may have none)
        if not byte:
            return len(self.ids)
        end = first = len(self.ids)
        while end and (self.ids[end - 1] in byte or self._silent(self.ids[end - 1])):
            end -= 1
            if self.ids[end] in byte:
                first = end
        return first

    def _silent(self, token_id: int) -> bool:
        if not 0 <= token_id <= self.tokenizer.max_token_id:
            return True
        return self.skip_special_tokens and token_id in self.tokenizer.special_ids

    def _start(self, window: str) -> int | None:
        """Where the new text starts in ``window`` (the decode of
        ``ids[prefix_offset:]``): after the longest common prefix of the
        base and ``window``. Past the first window the base ends on a
        complete character and ``window`` starts with it; the prompt's may
        end in U+FFFD, which counts as the base's only while ``window`` still
        has it there (a character the ids complete is new text). None when
        ``window`` does not start with the base's text before that U+FFFD
        (a decoder that rewrote earlier text: :meth:`_fallback`)."""
        common = len(os.path.commonprefix([self._base, window]))
        return common if common >= len(self._stable(self._base)) else None

    def _emit(self, new: str) -> str:
        self.text += new
        return new

    def add(self, token_ids: Sequence[int] | int) -> str:
        """Append ``token_ids`` (a list or one id) and return the new text
        they complete ("" when they only add bytes of an unfinished
        character, or ids that decode to nothing)."""
        if isinstance(token_ids, numbers.Integral):
            token_ids = [token_ids]
        token_ids = [int(i) for i in token_ids]
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        cut = self._cut()
        window = self._decode(self.ids[self.prefix_offset:cut])
        start = self._start(window)
        if start is None:
            return self._emit(self._fallback(final=False))
        # Released text ends before a stable character, and what precedes one never changes:
        # neither `start` nor the released text can move once something is released.
        stable = self._stable(window[start:])
        new = stable[self._released:]
        if window.endswith("\ufffd") or cut < len(self.ids):
            # a character (or a run of byte pieces) may still be completing: keep the window, hold it back
            self._released = len(stable)
        else:  # ends on a complete character: move the window on
            base = self._decode(self.ids[self.read_offset:])
            if base:
                self.prefix_offset = self.read_offset
            else:  # a window of ids that decode to nothing (skipped special tokens) would let a sentencepiece
                # decoder strip the next piece's space as if it began the text: keep the window's start
                base = window
            self.read_offset, self._base, self._released = len(self.ids), base, 0
        return self._emit(new)

    def finish(self) -> str:
        """Release what is held back (U+FFFD of bytes that never completed);
        after it, ``text`` is the whole continuation."""
        window = self._decode(self.ids[self.prefix_offset:])
        start = self._start(window)
        if start is None:
            return self._emit(self._fallback(final=True))
        new = window[start:][self._released:]
        self.prefix_offset = self.read_offset = len(self.ids)
        self._base, self._released = "", 0
        return self._emit(new)

    def _fallback(self, *, final: bool) -> str:
        """A decoder that rewrote text already released (not byte-level BPE):
        take the continuation from the decode of everything and the
        prompt's instead; nothing is returned twice (if released text itself
        changed, only what follows it is returned)."""
        if self._prompt_text is None:
            self._prompt_text = self._decode(self.ids[: self._prompt_len])
        full = self._decode(self.ids if final else self.ids[:self._cut()])
        body = full[len(os.path.commonprefix([self._prompt_text, full])):]
        if not final:
            body = self._stable(body)
        return body[len(self.text):] if body.startswith(self.text) else ""
