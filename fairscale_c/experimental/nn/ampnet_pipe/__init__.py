"""fairscale_c.experimental.nn.ampnet_pipe — mirrors fairscale.experimental.nn.ampnet_pipe:
AMPnetPipe, asynchronous pipeline training with stale weights on AsyncPipe's stages."""

from .pipe import AMPnetPipe

__all__ = ["AMPnetPipe"]
