"""DiskStore: the prefix cache's disk tier, records in files that outlive the
process (LMCache's local disk backend, SGLang HiCache's L3, in jaxkv's form).

A **record** is what one cached unit needs to be used again: a paged pool's
page (its K/V in every layer, :class:`~jaxkv.serve.paged_cache.PagedCache`),
or a hybrid cache's prefix snapshot (its state rows and its pages,
:class:`~jaxkv.serve.hybrid_cache.HybridCache`). Records are named by a
**chained key**: the SHA-256 of the model's identity, the namespace, the
parent record's key and this record's tokens, so a key names a whole token
prefix in one namespace of one model, and a restarted server finds the
records of a prompt by hashing it page by page (vLLM's block hashes,
LMCache's chunk hashes).

**File format** (version :data:`FORMAT_VERSION`), one record per file
``<key>.kvrec``::

    b"JAXKVREC" | u32 version | u32 header length | header (JSON) | payload | SHA-256 of all before it

The header holds the identity, the key, the parent key, the namespace, the
record's tokens, its kind and its arrays' names, dtypes, shapes and offsets
in the payload. Writes go to a temporary file in the same folder, are
flushed and ``fsync``-ed, then renamed over the final name (atomic on POSIX
file systems), so a power cut leaves either the whole record or a
temporary file, which the next start-up deletes with a warning.

**Start-up** indexes the folder by reading each file's header (not its
payload): a file of another model or format (**foreign**: another
identity, another version) is skipped with a warning and left alone; one
whose header cannot be read (**corrupt**, **truncated**) is skipped with a
warning and deleted. A record's checksum is verified when it is loaded;
one that fails is dropped (deleted, warned about) and the hit ends before
it, so a bad file is never loaded.

**Budget.** ``budget_bytes`` caps the files' bytes; a write past it deletes
the least recently used records first (used: written or loaded; at
start-up, by modification time).

**Writes run on a background thread** (:meth:`put` queues; the device
arrays are fetched and written there), so a step never waits for the disk;
:meth:`flush` waits for the queue (a server's shutdown, tests). A failed
write (disk full, permissions) is logged and its record skipped: the disk
tier is a cache, never a reason to fail a request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np

from jaxkv.errors import InvalidArgument
from jaxkv.prefix.radix import namespace_key, token_bytes

__all__ = ["FORMAT_VERSION", "DiskStats", "DiskStore", "dtype_named", "model_identity"]

logger = logging.getLogger("jaxkv.prefix.disk")

FORMAT_VERSION = 1
_MAGIC = b"JAXKVREC"
_SUFFIX = ".kvrec"
_PREAMBLE = struct.Struct("<8sII")
_DIGEST = 32


def model_identity(*parts) -> str:
    """A digest naming what a record's data depends on: the model (its
    config and a fingerprint of its parameters), the pool's layout and
    dtype, the page size. ``parts`` are JSON-able values or numpy arrays."""
    h = hashlib.sha256(f"jaxkv-disk-{FORMAT_VERSION}".encode())
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(f"{part.dtype.str}{part.shape}".encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class DiskStats:
    """``records`` / ``bytes`` on disk now (this model's); ``written`` /
    ``loaded`` records since start; ``write_bytes`` / ``load_bytes`` and the
    seconds spent (on the writer thread / in loads); ``dropped``: records
    deleted by the budget; ``rejected``: files skipped as corrupt,
    truncated or failing their checksum (foreign files are not counted)."""

    records: int
    bytes: int
    written: int
    loaded: int
    write_bytes: int
    load_bytes: int
    write_seconds: float
    load_seconds: float
    dropped: int
    rejected: int


class DiskStore:
    """Records of one model in ``directory`` (created if missing), at most
    ``budget_bytes`` of them (module docstring)."""

    def __init__(self, directory: str | os.PathLike, *, budget_bytes: int, identity: str):
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 1:
            raise InvalidArgument(f"budget_bytes={budget_bytes!r}: a disk tier needs a byte budget >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as error:
            raise InvalidArgument(f"kv disk folder {self.directory}: cannot be made ({error})") from None
        if not os.access(self.directory, os.W_OK):
            raise InvalidArgument(f"kv disk folder {self.directory}: not writable")
        self.budget_bytes = budget_bytes
        self.identity = identity
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._bytes = 0  # sum of the index's bytes
        self._prefixes: dict[str, tuple] = {}  # key -> (namespace, tokens) of whole-prefix ("snapshot") records
        self._pending: set[str] = set()  # queued, not yet on disk
        self._counts = dict(written=0, loaded=0, write_bytes=0, load_bytes=0, write_seconds=0.0, load_seconds=0.0,
                            dropped=0, rejected=0)
        self._scan()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="jaxkv-disk-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ keys

    def key(self, parent: str | None, tokens, namespace=None) -> str:
        """The chained key of a record holding ``tokens`` after the record
        ``parent`` (None: the first of a prompt) in ``namespace``."""
        h = hashlib.sha256(self.identity.encode())
        h.update(json.dumps(namespace_key(namespace), default=str).encode())
        h.update((parent or "").encode())
        h.update(token_bytes(tokens))
        return h.hexdigest()

    def chain(self, tokens, unit: int, namespace=None, *, start_key: str | None = None) -> list[str]:
        """Keys of the records of ``tokens`` cut in pieces of ``unit``
        tokens (whole pieces only), each chained to the one before."""
        tokens = np.asarray(tokens)
        keys, parent = [], start_key
        for i in range(len(tokens) // unit):
            parent = self.key(parent, tokens[i * unit:(i + 1) * unit], namespace)
            keys.append(parent)
        return keys

    # ------------------------------------------------------------------ index

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def longest_prefix(self, tokens, namespace, *, limit: int, longer_than: int) -> str | None:
        """The key of the longest whole-prefix record (kind ``"snapshot"``)
        on disk whose tokens begin ``tokens``, at most ``limit`` and more
        than ``longer_than`` of them, in ``namespace``; None if there is
        none. A scan of those records' index (the host tier's way)."""
        wanted = json.dumps(namespace_key(namespace), default=str)
        best, best_len = None, longer_than
        with self._lock:
            candidates = [(k, ns, prefix) for k, (ns, prefix) in self._prefixes.items() if k in self._index]
        for key, ns, prefix in candidates:
            if ns == wanted and best_len < len(prefix) <= limit and tuple(tokens[: len(prefix)]) == prefix:
                best, best_len = key, len(prefix)
        return best

    def has(self, key: str) -> bool:
        """Whether ``key``'s record is on disk (written, not only queued)."""
        with self._lock:
            return key in self._index

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + _SUFFIX)

    def _scan(self) -> None:
        """Index the folder (module docstring: start-up)."""
        found = []
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.endswith(".tmp"):
                logger.warning("kv disk: deleting %s, a record whose write never finished", path)
                _remove(path)
                continue
            if not name.endswith(_SUFFIX):
                continue
            try:
                header, size = _read_header(path)
            except (OSError, ValueError) as error:
                logger.warning("kv disk: skipping and deleting %s: %s", path, error)
                self._counts["rejected"] += 1
                _remove(path)
                continue
            if header.get("identity") != self.identity:
                logger.warning("kv disk: skipping %s: a record of another model or pool layout", path)
                continue
            if header.get("key") + _SUFFIX != name:
                logger.warning("kv disk: skipping and deleting %s: its header names key %s", path, header.get("key"))
                self._counts["rejected"] += 1
                _remove(path)
                continue
            found.append((os.path.getmtime(path), header["key"], size))
            if header.get("kind") == "snapshot":
                self._prefixes[header["key"]] = (header["namespace"], tuple(header["tokens"]))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size

    # ------------------------------------------------------------------ write

    def put(self, key: str, parent: str | None, tokens, namespace, kind: str,
            arrays: Callable[[], Mapping[str, np.ndarray]] | Mapping[str, np.ndarray], meta: dict | None = None
            ) -> bool:
        """Queue a record (``arrays``: name -> array, or a function giving
        them, called on the writer thread: it may fetch device arrays;
        ``meta``: JSON-able facts kept in its header). False when ``key``
        is already on disk or queued (nothing queued)."""
        with self._lock:
            if key in self._index or key in self._pending:
                return False
            self._pending.add(key)
        self._queue.put((key, parent, np.asarray(tokens, np.int64).tolist(), namespace, kind, arrays, meta or {}))
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued record is written (or failed)."""
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            raise TimeoutError(f"kv disk: {self._queue.qsize()} records still queued after {timeout} s")

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            key = item[0]
            try:
                self._write(*item)
            except Exception as error:  # noqa: BLE001 - a cache write never fails serving
                logger.warning("kv disk: record %s not written: %s", key, error)
            finally:
                with self._lock:
                    self._pending.discard(key)

    def _write(self, key, parent, tokens, namespace, kind, arrays, meta) -> None:
        began = time.perf_counter()
        arrays = {name: np.ascontiguousarray(np.asarray(a)) for name, a in (arrays() if callable(arrays)
                                                                                 else arrays).items()}
        specs, offset = [], 0
        for name, a in arrays.items():
            specs.append({"name": name, "dtype": a.dtype.str if a.dtype.kind != "V" else str(a.dtype),
                          "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes})
            offset += a.nbytes
        header = json.dumps({"identity": self.identity, "key": key, "parent": parent, "kind": kind,
                             "namespace": json.dumps(namespace_key(namespace), default=str), "tokens": tokens,
                             "arrays": specs, "payload_bytes": offset, "meta": meta, "written": time.time()}).encode()
        size = _PREAMBLE.size + len(header) + offset + _DIGEST
        self._make_room(size)
        digest = hashlib.sha256()
        tmp = os.path.join(self.directory, f".{key}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as f:
                for chunk in [_PREAMBLE.pack(_MAGIC, FORMAT_VERSION, len(header)), header,
                              *(a.tobytes() for a in arrays.values())]:
                    f.write(chunk)
                    digest.update(chunk)
                f.write(digest.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
        except BaseException:
            _remove(tmp)
            raise
        _fsync_dir(self.directory)
        with self._lock:
            self._bytes += size - self._index.get(key, 0)
            self._index[key] = size
            self._index.move_to_end(key)
            if kind == "snapshot":
                self._prefixes[key] = (json.dumps(namespace_key(namespace), default=str), tuple(tokens))
            self._counts["written"] += 1
            self._counts["write_bytes"] += size
            self._counts["write_seconds"] += time.perf_counter() - began

    def _make_room(self, size: int) -> None:
        """Delete least recently used records until ``size`` more bytes fit."""
        while True:
            with self._lock:
                if not self._index or self._bytes + size <= self.budget_bytes:
                    return
                victim, freed = self._index.popitem(last=False)
                self._prefixes.pop(victim, None)
                self._bytes -= freed
                self._counts["dropped"] += 1
            _remove(self._path(victim))

    # ------------------------------------------------------------------ read

    def get(self, key: str, kind: str) -> tuple[dict, dict[str, np.ndarray]] | None:
        """``(header, arrays)`` of ``key``'s record, its checksum verified;
        None (the record dropped, with a warning, when it was bad) when it
        is missing, corrupt, truncated or not a ``kind`` record."""
        with self._lock:
            if key not in self._index:
                return None
        began = time.perf_counter()
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            header, arrays = _parse(data, self.identity, key, kind)
        except (OSError, ValueError) as error:
            logger.warning("kv disk: dropping %s: %s", path, error)
            with self._lock:
                self._bytes -= self._index.pop(key, 0)
                self._prefixes.pop(key, None)
                self._counts["rejected"] += 1
            _remove(path)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self._counts["loaded"] += 1
            self._counts["load_bytes"] += len(data)
            self._counts["load_seconds"] += time.perf_counter() - began
        return header, arrays

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(records=len(self._index), bytes=self._bytes, **self._counts)

    def clear(self) -> None:
        """Delete every record of this model (after the queue is written)."""
        self.flush()
        with self._lock:
            keys, self._index, self._bytes, self._prefixes = list(self._index), OrderedDict(), 0, {}
        for key in keys:
            _remove(self._path(key))


def _read_header(path: str) -> tuple[dict, int]:
    """A record file's header and size, without reading its payload;
    ``ValueError`` when the file is not a whole record of this format."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        preamble = f.read(_PREAMBLE.size)
        if len(preamble) < _PREAMBLE.size:
            raise ValueError(f"truncated: {size} bytes")
        magic, version, length = _PREAMBLE.unpack(preamble)
        if magic != _MAGIC:
            raise ValueError("not a jaxkv kv record")
        if version != FORMAT_VERSION:
            return {"identity": None, "version": version}, size  # foreign: another format
        raw = f.read(length)
    if len(raw) < length:
        raise ValueError(f"truncated: {size} bytes")
    header = json.loads(raw)
    want = _PREAMBLE.size + length + int(header["payload_bytes"]) + _DIGEST
    if size != want:
        raise ValueError(f"truncated or grown: {size} bytes, its header says {want}")
    return header, size


def _parse(data: bytes, identity: str, key: str, kind: str) -> tuple[dict, dict[str, np.ndarray]]:
    if len(data) < _PREAMBLE.size + _DIGEST:
        raise ValueError(f"truncated: {len(data)} bytes")
    if hashlib.sha256(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise ValueError("checksum mismatch (a damaged or partly written record)")
    magic, version, length = _PREAMBLE.unpack_from(data)
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise ValueError(f"format {version}, not {FORMAT_VERSION}")
    header = json.loads(data[_PREAMBLE.size:_PREAMBLE.size + length])
    if header.get("identity") != identity or header.get("key") != key or header.get("kind") != kind:
        raise ValueError("a record of another model, key or kind")
    base = _PREAMBLE.size + length
    arrays = {}
    for spec in header["arrays"]:
        start = base + spec["offset"]
        dtype = dtype_named(spec["dtype"])
        arrays[spec["name"]] = np.frombuffer(data, dtype, count=int(np.prod(spec["shape"], dtype=np.int64)),
                                             offset=start).reshape(spec["shape"])
    return header, arrays


def dtype_named(name: str) -> np.dtype:
    """numpy's dtype of that name, or ml_dtypes' (bfloat16, float8_*)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("kv disk: cannot delete %s: %s", path, error)


def _fsync_dir(directory: str) -> None:
    """Make a rename durable (POSIX: the folder's entry)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
