"""Container images: what a call can take as its ``/``."""

from sandbx_pool.images.image import Image

__all__ = ["Image"]
