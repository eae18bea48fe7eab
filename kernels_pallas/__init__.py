"""Pallas GPU kernels of jaxkv with their pure-jnp references.

Empty for now: the gather and paged-attention kernels arrive with the kernels
issue (issue 6). The package exists so the distribution layout is final.
"""

__all__: list[str] = []
