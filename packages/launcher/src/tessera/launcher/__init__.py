"""tessera.launcher: `tessera run` over torchrun, one typed config, boost() composing dp x pp
x tp x ZeRO, the training engine and the main job (not built yet; see issue 6).
"""

__all__: list[str] = []
