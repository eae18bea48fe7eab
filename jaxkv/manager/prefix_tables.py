"""Old home of the prefix-cache admission ops, now
:meth:`BlockSpaceManager.admit_with_prefix` and :meth:`BlockSpaceManager.retire`;
these aliases keep the old import path working."""

from jaxkv.manager.block_space import BlockSpaceManager

__all__ = ["admit_with_prefix", "retire"]

admit_with_prefix = BlockSpaceManager.admit_with_prefix
retire = BlockSpaceManager.retire
