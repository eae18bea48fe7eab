"""Integer arithmetic shared by the kernels' planners (this package's copy of
``jaxkv._ops.ceil_div``: the kernels import nothing from jaxkv)."""

__all__ = ["ceil_div"]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)
