"""jaxtyping aliases used across jaxkv, one per kind of array.

Ids (block, page, slot, row, token indices) are int32; ``-1`` is padding and
is ignored wherever ids are taken as input.
"""

from __future__ import annotations

from jaxtyping import Array, ArrayLike, Bool, Float, Float32, Int, Shaped, UInt32

#: A scalar int32 count or id (traced or concrete).
Count = Int[ArrayLike, ""]
#: A flag returned last by every fallible op: True when the op took effect.
Ok = Bool[Array, ""]
#: Ids of any shape, int32, ``-1`` for padding.
Ids = Int[ArrayLike, "..."]

__all__ = ["Array", "ArrayLike", "Bool", "Float", "Float32", "Int", "Shaped", "UInt32", "Count", "Ok", "Ids"]
