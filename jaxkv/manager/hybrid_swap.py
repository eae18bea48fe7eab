"""Swapped-out requests of a :class:`~jaxkv.KVCacheManager` and the manager's
scrub-on-free calls: the host side of preemption by swap (the images
themselves are :mod:`jaxkv.manager.hybrid_host`'s) and the jitted releases
that zero what they free (:mod:`jaxkv.pool.scrub`).

:class:`RequestImages` keeps one :class:`~jaxkv.manager.hybrid_host.RequestImage`
per swapped-out request slot within a host byte budget. Invariants: a slot
with an image is held in the manager and holds no block (its blocks' data
and its state rows are in the image); swapping out is refused, changing
nothing, when the image would not fit the budget; with ``scrub`` every
block a swap-out lets go is zeroed in the call, and an image is wiped once
read back or dropped.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxkv._ops import pow2_at_least
from jaxkv.errors import BookkeepingError
from jaxkv.manager import hybrid_host
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.pool.scrub import scrub_hybrid

__all__ = ["RequestImages", "release_blocks_scrubbed", "release_scrubbed", "reset_rows", "scrub_since"]


# Scrub-on-free: the manager's releases, with every block they free zeroed
# and the snapshot rows let go reset, in the call that frees them.
@partial(jax.jit, donate_argnums=(0,))
def release_scrubbed(manager: KVCacheManager, slots):
    """``KVCacheManager.release`` of ``slots``, the freed blocks zeroed."""
    released, ok = manager.release(slots)
    return scrub_hybrid(manager, released), ok


@partial(jax.jit, donate_argnums=(0,))
def release_blocks_scrubbed(manager: KVCacheManager, blocks: dict, rows):
    """``KVCacheManager.release_blocks``, the freed blocks zeroed and the
    state ``rows`` reset."""
    released, ok = manager.release_blocks(blocks)
    return scrub_hybrid(manager, released).reset_state_rows(rows), ok


@partial(jax.jit, donate_argnums=(0,))
def reset_rows(manager: KVCacheManager, rows):
    return manager.reset_state_rows(rows)


@partial(jax.jit, donate_argnums=(0,))
def scrub_since(manager: KVCacheManager, before: dict):
    """Zero every block the allocators ``before`` held and ``manager``'s no
    longer do."""
    return scrub_hybrid(before, manager)


class RequestImages:
    """Swapped-out requests in host memory, by request slot, within
    ``capacity_bytes`` (module docstring). ``state_bytes`` and
    ``block_bytes`` (per group) size an image before it is taken."""

    def __init__(self, capacity_bytes: int, state_bytes: float, block_bytes: list[int]):
        self.capacity = int(capacity_bytes or 0)
        self._state_bytes, self._block_bytes = state_bytes, list(block_bytes)
        self._images: dict = {}  # slot -> RequestImage

    def __contains__(self, slot: int) -> bool:
        return slot in self._images

    def slots(self) -> list[int]:
        return list(self._images)

    def used(self) -> int:
        """Host bytes the images hold."""
        return sum(hybrid_host.tree_nbytes(image) for image in self._images.values())

    def swap_out(self, manager: KVCacheManager, slot: int, *, scrub: bool) -> tuple[KVCacheManager, bool]:
        """Move ``slot``'s state rows and every block of its tables to host
        memory (its slot stays held and empty, its blocks lose its
        reference); ``(manager, False)``, nothing changed, when the image
        would not fit the budget."""
        if self.capacity <= 0:
            return manager, False
        lens = jax.device_get({name: g.lens[slot] for name, g in manager.groups.items()})
        need = int(self._state_bytes) + sum(pow2_at_least(max(int(lens[name]), 1)) * per
                                            for name, per in zip(manager.groups, self._block_bytes))
        if self.used() + need > self.capacity:
            return manager, False
        # Copies: the swap donates the manager.
        before = {name: jax.tree.map(jnp.copy, group.allocator) for name, group in manager.groups.items()}
        manager, image, ok = hybrid_host.swap_out_request(manager, slot, keep_slot=True)
        if not ok:
            raise BookkeepingError(f"swapping out slot {slot} was refused: the slot is not held")
        if scrub:  # the request's blocks are on host now: those it held alone go back zeroed
            manager = scrub_since(manager, before)
        self._images[slot] = image
        return manager, True

    def swap_in(self, manager: KVCacheManager, slot: int, *, scrub: bool) -> tuple[KVCacheManager, bool]:
        """Bring ``slot``'s image back (fresh blocks in every group, all or
        nothing); ``ok`` False, the image kept, when a group is short."""
        manager, ok = hybrid_host.swap_in_request(manager, self._images[slot], slot)
        if ok:
            image = self._images.pop(slot)
            if scrub:
                jax.block_until_ready(manager)  # the image was read before it is wiped
                hybrid_host.wipe_host(image)
        return manager, ok

    def drop(self, slot: int, *, scrub: bool) -> None:
        """Forget ``slot``'s image (an aborted request), wiped with ``scrub``."""
        image = self._images.pop(slot, None)
        if image is None:
            raise BookkeepingError(f"slot {slot} is not swapped out")
        if scrub:
            hybrid_host.wipe_host(image)
