"""Reference layers the tests decode through the caches with, and recompute
without them: small DeepSeek-V4 SWA/CSA/HCA layers over a
:class:`~jaxkv.LayerCacheHandle` (``dsv4_reference``) and a Gated DeltaNet
layer over the :class:`~jaxkv.GDNPool` (``gated_delta_net``). Test code, not
library models: no model in ``jaxkv.nn`` uses them."""

__all__ = ["dsv4_reference", "gated_delta_net"]
