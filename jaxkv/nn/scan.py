"""Decoder layers under one ``lax.scan``: compile time that does not grow with depth.

A model unrolled in Python hands XLA one copy of the layer per layer: an
80-layer program is 80 times the HLO of one, and compile time follows. A
:class:`DecoderStack` keeps the layers of one structure *stacked* (every
parameter with a leading axis, one entry per repetition) and runs them under
one :func:`jax.lax.scan`, so the program holds the layer once.

Layers need not all be alike. Each layer has a *signature* (whatever makes
its structure or its static configuration differ: a sliding window, a dense
or MoE MLP, a layer kind); the stack finds the plan that leaves the fewest
layers outside the scan:

* ``head``: leading layers that break the pattern (DeepSeek's first dense
  layers), unrolled;
* ``period`` x ``reps``: the repeating pattern (one layer for a uniform
  model; six for Gemma 3's five window layers and one global), scanned
  ``reps`` times, the scan's body running the ``period`` layers in order;
* ``tail``: what is left when the pattern does not divide the rest,
  unrolled.

Within the pattern, consecutive layers of one signature form a *run*
(Gemma 3's period is a run of five window layers and a run of one global
layer), and a run longer than one layer is an inner ``lax.scan`` in the
outer scan's body: the program holds one layer per run, not per period
position, so a long period costs no more compile time than a short one.

Invariants: layer ``i`` of the model is ``head[i]`` for ``i < len(head)``,
row ``r * n + k`` of ``stacked[u]`` for ``i = len(head) + r * period +
start + k`` (run ``u`` covering period positions ``start .. start + n - 1``,
repetition ``r``, ``0 <= k < n``), and ``tail[k]`` for the rest; every
layer of one ``stacked[u]`` has the signature of the others; the parameters
are exactly those of the unrolled layers (built in layer order from the
same ``rngs``, so a model built with ``scan=False`` from the same seed has
equal weights).

Checkpoints keep naming layers one by one: :func:`layer_paths` maps a
stacked parameter's path to the per-layer paths of its rows (loaders stack
them, savers split them), and sharding rules apply to a stacked parameter
with its leading axis left whole (:func:`is_stacked`).

The layer index a layer's step receives is a Python int outside the scan
and a traced int32 inside it: whatever it indexes (a KV pool's layer axis,
a hybrid cache's layer) must accept a traced index.

**Stacked on a CPU or TPU, per layer on a GPU** (``scan=None``, every
model's ``scan_layers=None`` default; :func:`default_scan_layers`). XLA:GPU
hands a matmul whose weight is one row of a stacked parameter a copy of
that row: the matmul libraries it calls (cuBLAS, which its autotuner picks
for a decode step's shapes on a real device) take a whole buffer, and a
slice, dynamic under the scan or static when unrolled, is materialized
into one first. A decode step is bound by reading the weights, and the copy
reads and writes them once more: about three times the bytes. Measured on
an H200 (Llama-3.1-8B shapes, jax 0.11.2, 2026-11-28): a decode step of
the stacked model took 12.4-12.5 ms at batch 1 (scanned, and walked in a
Python loop over static rows alike), against 6.1 ms with a parameter per
layer; a deviceless H100 compile with cuBLAS matmuls shows a temporary of
one layer's weight for either stacked form and none per layer. So a GPU
model keeps a parameter per layer and unrolls them (compile time grows
with depth there: 2-3 s per program of a 32-layer model on the H200's
host), and the scan stays where compile time is the cost and the copy
is not (the CPU) or is fused (TPU).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.errors import InvalidArgument

__all__ = ["DecoderStack", "default_scan_layers", "is_stacked", "layer_paths", "pattern_runs", "scan_plan"]

#: The attribute under which a stack keeps its stacked layers (a path
#: component that marks a stacked parameter).
STACKED = "stacked"
#: Longest repeating pattern searched for.
MAX_PERIOD = 16


def scan_plan(signatures: Sequence[Hashable], *, max_period: int = MAX_PERIOD) -> tuple[int, int, int]:
    """``(head, period, reps)`` for layers of these signatures: the plan
    leaving the fewest layers unrolled (``head`` plus the tail), then the
    shortest period; ``reps >= 2`` or no scan at all (``(len, 0, 0)``)."""
    n = len(signatures)
    best = (n, 0, 0)
    best_key = (n, 0)
    for head in range(n):
        rest = n - head
        for period in range(1, min(max_period, rest // 2) + 1):
            reps = 1
            while head + (reps + 1) * period <= n and all(
                    signatures[head + reps * period + j] == signatures[head + j] for j in range(period)):
                reps += 1
            if reps < 2:
                continue
            key = (n - reps * period, period)
            if key < best_key:
                best, best_key = (head, period, reps), key
        if best_key[0] <= head:  # no later head can leave fewer layers out
            break
    return best


def _stack(modules: list) -> nnx.Module:
    """One module whose every variable stacks those of ``modules`` (alike)
    on a new leading axis."""
    parts = [nnx.split(m) for m in modules]
    graphdef = parts[0][0]
    if any(p[0] != graphdef for p in parts):
        raise InvalidArgument("layers of one signature must have the same structure to be stacked")
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(p[1] for p in parts))
    return nnx.merge(graphdef, stacked)


def pattern_runs(signatures: Sequence[Hashable]) -> tuple[tuple[int, int], ...]:
    """``((start, length), ...)``: the runs of consecutive equal signatures
    of one period, in order."""
    runs, start = [], 0
    for j in range(1, len(signatures) + 1):
        if j == len(signatures) or signatures[j] != signatures[start]:
            runs.append((start, j - start))
            start = j
    return tuple(runs)


class DecoderStack(nnx.Module):
    """The decoder layers of a model: ``make(i, rngs)`` builds layer ``i``,
    ``signature(i)`` tells which layers are alike (module docstring).
    ``scan=False`` unrolls every layer (``head`` holds them all); ``None``:
    :func:`default_scan_layers` (stacked unless the default backend is a GPU)."""

    def __init__(self, num_layers: int, make: Callable[[int, nnx.Rngs], nnx.Module],
                 signature: Callable[[int], Hashable], *, rngs: nnx.Rngs, scan: bool | None = None):
        if scan is None:
            scan = default_scan_layers()
        layers = [make(i, rngs) for i in range(num_layers)]  # in layer order: the same draws as unrolled
        signatures = [signature(i) for i in range(num_layers)]
        head, period, reps = scan_plan(signatures) if scan else (num_layers, 0, 0)
        self.num_layers, self.head_len, self.period, self.reps = num_layers, head, period, reps
        self.runs = pattern_runs(signatures[head: head + period]) if reps else ()
        self.head = nnx.List(layers[:head])
        self.stacked = nnx.List([
            _stack([layers[head + r * period + start + k] for r in range(reps) for k in range(length)])
            for start, length in self.runs])
        self.tail = nnx.List(layers[head + period * reps:])

    def __len__(self) -> int:
        return self.num_layers

    @property
    def layers_in_program(self) -> int:
        """Layers the program holds: the head, one per run, the tail."""
        return self.head_len + len(self.runs) + len(self.tail)

    def run(self, step: Callable, carry, *, with_like: bool = False):
        """``carry = step(layer, i, carry)`` for every layer ``i`` in order
        (``i`` traced inside the scan).

        ``with_like``: ``step(layer, i, like, carry)``, where ``like`` is a
        static layer index whose layer has the signature of layer ``i``
        (``i`` itself outside the scan, the run's first layer inside):
        what a step needs to look up static facts of a traced layer (its
        cache's kind, :meth:`jaxkv.KVCacheManager.acquire`'s ``like``)."""
        def call(layer, i, like, carry):
            return step(layer, i, like, carry) if with_like else step(layer, i, carry)

        for i, layer in enumerate(self.head):
            carry = call(layer, i, i, carry)
        if self.reps:
            parts = [nnx.split(block) for block in self.stacked]
            graphdefs = [graphdef for graphdef, _ in parts]
            # Rows r * n + k as [reps, n, ...]: the outer scan takes a repetition, an inner one its run.
            states = [jax.tree.map(lambda a, n=length: a.reshape((self.reps, n) + a.shape[1:]), state)
                      for (_, state), (_, length) in zip(parts, self.runs)]
            first = self.head_len

            def body(carry, xs):
                rep, states = xs
                base = first + rep * self.period
                for graphdef, state, (start, length) in zip(graphdefs, states, self.runs):
                    like = first + start
                    if length == 1:
                        carry = call(nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state)), base + start, like,
                                     carry)
                        continue

                    def inner(carry, xs, graphdef=graphdef, start=start, like=like):
                        k, layer_state = xs
                        return call(nnx.merge(graphdef, layer_state), base + start + k, like, carry), None

                    carry, _ = jax.lax.scan(inner, carry, (jnp.arange(length, dtype=jnp.int32), state))
                return carry, None

            carry, _ = jax.lax.scan(body, carry, (jnp.arange(self.reps, dtype=jnp.int32), states))
        start = self.head_len + self.period * self.reps
        for k, layer in enumerate(self.tail):
            carry = call(layer, start + k, start + k, carry)
        return carry

    def _row(self, i: int) -> tuple[int, int]:
        """``(run, row)`` of a layer ``i`` inside the scan."""
        rep, j = divmod(i - self.head_len, self.period)
        for u, (start, length) in enumerate(self.runs):
            if start <= j < start + length:
                return u, rep * length + j - start
        raise AssertionError("the runs cover the period")

    def layer(self, i: int) -> nnx.Module:
        """Layer ``i`` as a module of its own. A stacked layer's row is a
        copy, for reading: writes to it are lost (write through :meth:`parts`)."""
        if not 0 <= i < self.num_layers:
            raise InvalidArgument(f"layer {i} out of range: the model has {self.num_layers} layers")
        if i < self.head_len:
            return self.head[i]
        start = self.head_len + self.period * self.reps
        if i >= start:
            return self.tail[i - start]
        u, row = self._row(i)
        graphdef, state = nnx.split(self.stacked[u])
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[row], state))

    __getitem__ = layer

    def parts(self) -> list[nnx.Module]:
        """The modules as stored: the head layers, each stacked run (its
        variables with a leading rows axis), the tail layers. Write
        through these (a stacked row from :meth:`layer` is a copy)."""
        return [*self.head, *self.stacked, *self.tail]

    def __iter__(self):
        return (self.layer(i) for i in range(self.num_layers))

    def layer_of(self, rest: tuple) -> tuple[tuple, ...] | list[tuple]:
        """``rest``: a parameter path below the stack (``("stacked", u,
        ...)``, ``("head", k, ...)``, ``("tail", k, ...)``) -> its per-layer
        path ``(i, ...)``, or for a stacked parameter the list of them, one
        per row."""
        part, index, *below = rest
        index = int(index)
        if part == STACKED:
            start, length = self.runs[index]
            return [(self.head_len + r * self.period + start + k, *below)
                    for r in range(self.reps) for k in range(length)]
        if part == "head":
            return (index, *below)
        return (self.head_len + self.period * self.reps + index, *below)


def default_scan_layers(backend: str | None = None) -> bool:
    """Whether a model built on ``backend`` (default ``jax.default_backend()``)
    stacks its layers under a scan: yes on a CPU or TPU, no on a GPU, where
    XLA copies a stacked layer's weights before each matmul (module
    docstring)."""
    return (backend or jax.default_backend()) not in ("gpu", "cuda", "rocm")


def is_stacked(path: Sequence[str]) -> bool:
    """Whether a parameter path (module names as strings) is a stacked
    parameter of a :class:`DecoderStack` (its leading axis: the repetitions)."""
    return STACKED in tuple(str(p) for p in path)


def layer_paths(model: nnx.Module) -> Callable[[tuple], tuple | list[tuple]]:
    """A function mapping a variable path of ``model`` (the keys of
    ``flatten_dict(to_pure_dict(nnx.state(model)))``) to the path it has
    with its layers unrolled (``(..., "layers", i, ...)``), or, for a
    stacked parameter of a :class:`DecoderStack`, to the list of those of
    its rows. Paths outside a stack map to themselves."""
    stacks = {tuple(path): node for path, node in nnx.iter_graph(model) if isinstance(node, DecoderStack)}

    def paths(path: tuple) -> tuple | list[tuple]:
        for prefix, stack in stacks.items():
            if path[: len(prefix)] == prefix and len(path) > len(prefix) + 1:
                found = stack.layer_of(path[len(prefix):])
                return [prefix + rest for rest in found] if isinstance(found, list) else prefix + found
        return path

    return paths
