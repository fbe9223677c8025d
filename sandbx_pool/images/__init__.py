"""Container images: what a call can take as its ``/``.

    pool.image(ref) / sandbx-pool image pull REF
        |  refs.py     the reference parsed (oci:, oci-archive:, docker-archive:, a registry's)
        v
    ImageStore.image (store.py), on a thread, under the store's locks
        |  fetch.py    skopeo copies it into a staging OCI layout (the store's blobs linked in)
        |  unpack.py   each layer not yet stored: blob digest, diff_id, entries by descriptor
        v
    Image (image.py): digest, diff_ids, Env, WorkingDir, User, layer_dirs (overlay lowers)
        |  a layer over the image (sandbx_pool.image_layer) mounts layer_dirs under its own
        v  upper directory, and pins the image in the store while it is open

The store keeps every layer once, keyed by its diff_id, and evicts the least recently used
images past ``[images] max_size``; docs/design.md (Images) has the whole picture.
"""

from sandbx_pool.images.image import Image

__all__ = ["Image"]
