"""The engine's options as one checked object: :class:`EngineOptions`
(:class:`CacheOptions`, :class:`SchedulerOptions`, :class:`TenantOptions`).

Each option is defined once, here: its default, its type rule and its
documentation (a field's ``metadata["doc"]``, which also makes the class
docstrings and the command line's ``--help``). Values are checked when an
options object is made, with a typed error naming the option: integers are
integers (not bools, floats or strings), yes/no options are bools (a string
such as ``"no"`` would be true), fractions are numbers; a value is never
coerced. Deeper checks that need the model (a ``max_model_len`` the cache
cannot hold, a ``num_blocks`` group the model lacks, a ``kv_dtype`` a pool
cannot store) are made where the cache is built, with the numbers.

**Derived defaults.** ``max_seqs`` and ``decode_chunk`` default to a
:class:`Derived` int, and ``max_num_batched_tokens`` to None: values the
engine derives for its device at start-up
(:func:`jaxkv.serve.build.resolve_options`, the rule in
:func:`jaxkv.serve.sizing.scheduler_defaults`): on an accelerator from the
KV budget and the model (up to 256 sequence rows and 8192 batched tokens,
vLLM's defaults on an H100, 16 decode steps per call), on a CPU the small
values (8 rows, a ``prefill_chunk`` of 256 tokens per iteration, 8 decode
steps). A ``Derived`` is the CPU's value as an int, so code that reads an
unresolved option gets the CPU's behaviour; a value the user gives is a
plain int and always wins, whatever it is (``max_seqs=8`` on a GPU is 8).

``Engine(model, options)`` takes one; ``Engine(model, max_seqs=16, ...)``
(flat keywords, any field of any group) is the same as
``Engine(model, EngineOptions.from_kwargs(max_seqs=16, ...))``. The server's
command line is generated from the fields that have a flag
(:func:`add_arguments` / :func:`from_cli`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import numbers
import os
import re
from collections.abc import Mapping

import numpy as np

from jaxkv import _host
from jaxkv.errors import InvalidArgument

__all__ = ["CacheOptions", "Derived", "EngineOptions", "SchedulerOptions", "TenantOptions", "add_arguments", "from_cli",
           "parse_bytes", "parse_memory", "positive_int"]


class Derived(int):
    """An option's default that the engine derives for its device at start-up
    (:func:`jaxkv.serve.build.resolve_options`); as an int it is the CPU's
    value. A value the user gives is a plain int, never a ``Derived``, so it
    always wins, even when it equals the CPU's."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Derived({int(self)})"


def is_derived(value) -> bool:
    """Whether ``value`` is a default still to be derived (a :class:`Derived`,
    or None for ``max_num_batched_tokens``)."""
    return value is None or isinstance(value, Derived)


def default_text(field) -> str:
    """A field's default in words (``--help``, docstrings, :func:`describe`)."""
    if isinstance(field.default, Derived):
        return f"derived ({int(field.default)} on a CPU)"
    if field.name == "max_num_batched_tokens":
        return "derived (None, prefill_chunk, on a CPU)"
    return repr(field.default)


def _option(default, kind: str, doc: str, *, flag: str | None = None, choices: tuple = ()):
    """A field: ``kind`` names its rule (:func:`_check`), ``doc`` is its one
    documentation, ``flag`` its command-line spelling (None: none)."""
    return dataclasses.field(default=default, metadata=dict(kind=kind, doc=doc, flag=flag, choices=choices))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _check(name: str, value, kind: str, choices: tuple, optional: bool):
    """``value`` checked by rule ``kind`` (None passes where the default is
    None: ``optional``), as a plain Python value; ``InvalidArgument`` naming
    ``name``."""
    if value is None and optional:
        return None
    if kind in ("count", "count0", "count2", "int", "bytes"):
        minimum = {"count": 1, "count0": 0, "count2": 2, "int": None, "bytes": 1}[kind]
        if minimum is None:
            return _host.int_scalar(value, name)
        return _host.int_at_least(value, name, minimum)
    if kind == "flag":
        if not isinstance(value, (bool, np.bool_)):
            raise InvalidArgument(f"{name}={_host.short_repr(value)}: give True or False")
        return bool(value)
    if kind == "fraction":
        if not _is_real(value) or not 0.0 < float(value) <= 1.0:
            raise InvalidArgument(f"{name}={_host.short_repr(value)}: a number in (0, 1]")
        return float(value)
    if kind == "memory":  # bytes (an int) or a fraction of the free device memory (a float in (0, 1])
        if _is_int(value):
            if value < 1:
                raise InvalidArgument(f"{name}={value}: bytes must be >= 1")
            return int(value)
        if _is_real(value) and 0.0 < float(value) <= 1.0:
            return float(value)
        raise InvalidArgument(f"{name}={_host.short_repr(value)}: give bytes (an int) or a fraction in (0, 1] of "
                              "the device's free memory (a float)")
    if kind == "choice":
        if value not in choices:
            raise InvalidArgument(f"{name}={_host.short_repr(value)}: choose one of {list(choices)}")
        return value
    if kind == "groups":  # checked against the model's groups where the cache is built
        if not isinstance(value, Mapping):
            raise InvalidArgument(f"{name}={_host.short_repr(value)} ({type(value).__name__}): expected None or a "
                                  "dict of block group name -> integer >= 2 (null block included), e.g. {'full': 64}")
        return dict(value)
    if kind == "path":
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise InvalidArgument(f"{name}={_host.short_repr(value)}: give a folder path")
        return os.fspath(value)
    if kind == "dtype":  # checked against what a pool stores where the cache is built
        return value
    if kind == "speculative":
        from jaxkv.nn.speculative import SpeculativeConfig  # noqa: PLC0415 (the model side; options stay light)

        try:
            return SpeculativeConfig.of(json.loads(value) if isinstance(value, str) else value)
        except json.JSONDecodeError as err:
            raise InvalidArgument(f"{name}={_host.short_repr(value)}: not JSON ({err})") from None
    raise AssertionError(kind)


class _Checked:
    """Checks every field by its rule after ``__init__`` (frozen: the
    checked value is stored in place)."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Derived):  # a default, kept as the marker (resolve_options derives it)
                continue
            if field.metadata.get("kind") is not None:
                object.__setattr__(self, field.name, _check(field.name, value, field.metadata["kind"],
                                                            field.metadata["choices"], field.default is None))

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class CacheOptions(_Checked):
    max_model_len: int | None = _option(
        None, "count2", "the longest request, prompt plus output tokens (default min(max_position_embeddings, "
        "4096), lowered to what the cache holds when the budget cannot hold it; given, a length the cache "
        "cannot hold is refused)", flag="--max-model-len")
    kv_cache_memory: int | float | None = _option(
        None, "memory", "the cache's device bytes (int), or a fraction in (0, 1] of the device's free memory "
        "(1 GiB stands for it on the CPU); default 0.8 of it, capped at every sequence row at max_model_len",
        flag="--kv-cache-memory")
    program_memory: int | None = _option(
        None, "count0", "device bytes kept for the engine's programs' temporaries beside the cache when "
        "kv_cache_memory is the default (default: on an accelerator, measured from the compiled programs "
        "before the cache is allocated, jaxkv.serve.program_memory; on a CPU none)", flag="--program-memory")
    host_kv_memory: int | None = _option(
        None, "count0", "bytes of host memory for swapped-out requests (default none: preemption by "
        "recomputation): host pages of a paged pool; a hybrid cache's request images", flag="--swap-space")
    prefix_cache: bool = _option(True, "flag", "use the prefix cache (radix tree of pages; a hybrid cache's "
                                 "snapshot records)")
    host_prefix_memory: int | None = _option(
        None, "count0", "bytes of host memory for the prefix cache's host tier, any cache: evicted prefixes are "
        "copied there and a later hit loads them back", flag="--host-prefix-memory")
    kv_disk_dir: str | None = _option(
        None, "path", "a folder for the prefix cache's disk tier: every page the prefix cache takes is written "
        "there too (write-through, on a background thread) and a later prompt, in this server or one started "
        "after it, reads its pages back through the host tier (default none; paged pools; with no host tier "
        "given, one of two max_model_len requests' pages is made)", flag="--kv-disk-dir")
    kv_disk_bytes: int = _option(
        16 * 2**30, "bytes", "the most bytes the disk tier's files take (e.g. 64GiB); past it the least recently used "
        "records are deleted", flag="--kv-disk-bytes")
    page_size: int = _option(16, "count", "(paged pool) tokens per page")
    kv_dtype: object = _option(None, "dtype", "(paged pool) the pool's storage dtype: bfloat16, float16, float32, "
                               "float8_e4m3fn or float8_e5m2 (default: the model's)")
    host_memory_kind: str = _option("auto", "choice", "(paged pool) the swap pool's memory: auto, pinned_host or "
                                    "numpy", choices=("auto", "pinned_host", "numpy"))
    num_pages: int | None = _option(None, "count2", "(paged pool, expert) device pages including the null page 0 "
                                    "(sizes the pool directly; not with kv_cache_memory)")
    max_blocks_per_seq: int | None = _option(None, "count", "(paged pool, expert) the block table's width "
                                             "(max_model_len's other spelling)")
    num_host_pages: int | None = _option(None, "count0", "(paged pool, expert) host pages for swapping (0: "
                                         "preempt by recompute; not with host_kv_memory)")
    host_prefix_pages: int | None = _option(None, "count0", "(paged pool, expert) pages of the prefix cache's "
                                            "host tier (not with host_prefix_memory)")
    max_context_tokens: int | None = _option(None, "count2", "(hybrid cache) max_model_len's other spelling")
    num_blocks: dict | None = _option(None, "groups", "(hybrid cache, expert) blocks per group, the null block "
                                      "included, e.g. {'full': 64} (groups left out: every row at max_model_len)")
    entry_format: str = _option("lossless", "choice", "(hybrid cache) DeepSeek-V4's compressed entries: lossless "
                                "or fp8", choices=("lossless", "fp8"))
    num_snapshots: int | None = _option(None, "count", "(hybrid cache) cached prefix snapshots of per-request "
                                        "state (default: min(2 * max_seqs, what a quarter of the budget holds))")
    snapshot_retention: str = _option("value", "choice", "(hybrid cache) which cached snapshot goes first when a "
                                      "new one needs its row: value or lru", choices=("value", "lru"))
    snapshot_interval: int | None = _option(None, "count", "(hybrid cache) prefill tokens between a request's "
                                            "interval snapshots (default max(page, 256))")


@dataclasses.dataclass(frozen=True)
class SchedulerOptions(_Checked):
    max_seqs: int = _option(Derived(8), "count", "sequence rows: requests running or swapped out at once "
                            "(default: on an accelerator min(256, the rows the KV budget holds 1024 tokens each, "
                            "rounded down to a multiple of 8); on a CPU 8)", flag="--max-num-seqs")
    decode_chunk: int = _option(Derived(8), "count", "decode steps per jitted call (one lax.while_loop; a "
                                "request that arrives meanwhile waits for it; default 16 on an accelerator, 8 on "
                                "a CPU)", flag="--decode-chunk")
    prefill_chunk: int = _option(Derived(256), "count", "most prompt tokens per row in one prefill call (longer "
                                 "uncached tails take several; default: on an accelerator with the packed "
                                 "scheduler max_num_batched_tokens, else 256)", flag="--prefill-chunk")
    max_num_batched_tokens: int | None = _option(
        None, "count", "the token budget of a scheduler iteration: the packed stream's tokens, decode tokens "
        "included (default: on an accelerator min(8192, the tokens the KV cache holds, max_seqs * "
        "max_model_len), at least max_seqs; on a CPU prefill_chunk); with the padded scheduler, one prefill "
        "call's prompt tokens",
        flag="--max-num-batched-tokens")
    scheduler: str = _option("packed", "choice", "packed: an iteration with prefill work is ONE jitted call over "
                             "a flat stream of decode tokens and prompt pieces; padded: a [max_seqs, "
                             "prefill_chunk] prefill call, then the decode chunk", choices=("packed", "padded"))
    speculative: object = _option(
        None, "speculative", "speculative decoding: a dict (or JSON) of jaxkv.nn.speculative.SpeculativeConfig's "
        "fields, vLLM's spelling, e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4}; every family "
        "(default: off)", flag="--speculative-config")
    seed: int = _option(0, "int", "the engine's PRNG seed (a request without its own seed samples from "
                        "fold_in(key(seed), request id))", flag="--seed")
    logprobs_mode: str = _option("processed", "choice", "where requests' log-probabilities are read: processed, "
                                 "the distribution a token is sampled from (temperature, top-k, top-p applied; a "
                                 "greedy request's is the model's softmax); raw, the model's softmax",
                                 choices=("processed", "raw"), flag="--logprobs-mode")


@dataclasses.dataclass(frozen=True)
class TenantOptions(_Checked):
    scrub_on_free: bool = _option(False, "flag", "zero every block and reset every state row in the jitted call "
                                  "that frees it (costs about the bytes it zeroes)", flag="--scrub-on-free")
    prefix_quota: float | None = _option(None, "fraction", "the most of each block group (and of the snapshot "
                                         "rows) one tenant's cached prefixes may hold, in (0, 1]; eviction takes "
                                         "from tenants over their share first (None: one LRU)",
                                         flag="--prefix-quota")
    enable_kv_events: bool = _option(False, "flag", "record the prefix cache's events for "
                                     "Engine.take_kv_events (each names its namespace)")


_GROUPS = {"cache": CacheOptions, "scheduler": SchedulerOptions, "tenants": TenantOptions}


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Every option of :class:`~jaxkv.serve.Engine`, in three groups (each
    field documented where it is defined; ``str(EngineOptions())`` is not
    the documentation: :func:`describe` is)."""

    cache: CacheOptions = dataclasses.field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = dataclasses.field(default_factory=SchedulerOptions)
    tenants: TenantOptions = dataclasses.field(default_factory=TenantOptions)

    def __post_init__(self):
        for name, cls in _GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise InvalidArgument(f"EngineOptions.{name} must be a {cls.__name__}, got "
                                      f"{_host.short_repr(getattr(self, name))}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineOptions":
        """Options from flat keywords (any field of any group)."""
        return cls().replace(**kwargs)

    def replace(self, **kwargs) -> "EngineOptions":
        """A copy with the flat keywords ``kwargs`` changed; ``TypeError``
        naming an unknown one (as a function's unexpected keyword)."""
        changes: dict = {name: {} for name in _GROUPS}
        for key, value in kwargs.items():
            group = _FIELD_GROUP.get(key)
            if group is None:
                raise TypeError(f"unknown engine option {key!r}; the options are: {', '.join(sorted(_FIELD_GROUP))}")
            changes[group][key] = value
        return dataclasses.replace(self, **{name: getattr(self, name).replace(**c)
                                            for name, c in changes.items() if c})

    def flat(self) -> dict:
        """Every option by name (the keywords :meth:`from_kwargs` takes)."""
        return {f.name: getattr(getattr(self, group), f.name)
                for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


_FIELD_GROUP = {f.name: group for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


def describe() -> str:
    """Every option with its group, default and documentation (one line each)."""
    lines = []
    for group, cls in _GROUPS.items():
        for f in dataclasses.fields(cls):
            lines.append(f"{group}.{f.name} = {default_text(f)}: {f.metadata['doc']}")
    return "\n".join(lines)


for _cls in _GROUPS.values():  # the class docstrings are the fields' documentation
    _cls.__doc__ = "Fields (each checked when made; see the module docstring):\n\n" + "\n".join(
        f"* ``{f.name}`` (default ``{default_text(f)}``): {f.metadata['doc']}." for f in dataclasses.fields(_cls))


# ------------------------------------------------------------ command line

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
          "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3}


def parse_bytes(text: str) -> int:
    """A memory size (argparse type): bytes (``1073741824``, ``512MiB``, ``2GB``); no fraction."""
    value = parse_memory(text)
    if isinstance(value, float):
        raise argparse.ArgumentTypeError(f"{text}: give bytes (e.g. 536870912, 512MiB, 2GB), not a fraction")
    return value


def parse_memory(text: str) -> int | float:
    """``--kv-cache-memory`` (argparse type): bytes (``1073741824``, ``512MiB``, ``2GB``) or
    a fraction of the device's free memory (``0.5``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes (e.g. 536870912, 512MiB, 2GB) or a fraction of "
                                         "the free device memory in (0, 1] (e.g. 0.5)")
    number, unit = match.group(1), match.group(2).lower()
    if not unit and ("." in number or "e" in number.lower()):
        value = float(number)
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"{text}: a fraction must be in (0, 1]")
        return value
    return int(float(number) * _UNITS[unit])


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return value


def _fraction(text: str) -> float:
    """A float in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction in (0, 1] (e.g. 0.25)") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a fraction must be in (0, 1]")
    return value


_ARG_TYPES = {"count": positive_int, "count2": positive_int, "count0": parse_bytes, "memory": parse_memory, "int": int,
              "fraction": _fraction, "speculative": str, "path": str, "bytes": parse_bytes}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (the fields with one), their help the fields' docs;
    unset flags leave the engine's defaults."""
    for group, cls in _GROUPS.items():
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag")
            if flag is None:
                continue
            if f.metadata["kind"] == "flag":
                parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=f.metadata["doc"])
            elif f.metadata["kind"] == "choice":
                parser.add_argument(flag, dest=f.name, choices=f.metadata["choices"], default=None,
                                    help=f"{f.metadata['doc']} (default {f.default!r})")
            else:
                default = "" if f.default is None or is_derived(f.default) else f" (default {f.default!r})"
                parser.add_argument(flag, dest=f.name, type=_ARG_TYPES[f.metadata["kind"]], default=None,
                                    metavar=flag.lstrip("-").replace("-", "_").upper(),
                                    help=f"{f.metadata['doc']}{default}")


def from_cli(args: argparse.Namespace, **overrides) -> EngineOptions:
    """The options the flags of :func:`add_arguments` gave (unset: default),
    then ``overrides``."""
    given = {name: getattr(args, name) for name in _FIELD_GROUP
             if getattr(args, name, None) is not None}
    return EngineOptions.from_kwargs(**{**given, **overrides})
