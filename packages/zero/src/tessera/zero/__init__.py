"""tessera.zero: ZeRO stages 1-3 with mixed precision, loss scaling, clipping, accumulation
and CPU offload (not built yet; see issue 5).
"""

__all__: list[str] = []
