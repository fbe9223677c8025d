"""A compose file as the ``sandbx`` provider reads it: one service, its ``image:``.

Inspect tasks name their image in a compose file (``sandbox=("docker", "compose.yaml")``); the
same file given to ``sandbx`` (``sandbox=("sandbx", "compose.yaml")``) makes each sample a layer
over that image, as ``SandbxConfig(image=...)`` does:

    services:
      default:
        image: registry.example/team/app:v1   -> image
        working_dir: /srv/app                 -> workdir (default: the image's WorkingDir)
        environment: {KEY: value} | [K=v]     -> env, under each exec's own
        network_mode: none                    -> network false (default: the pool config's)
        x-sandbx: {pool_config: ..., workers: ..., journal: ...}   -> the provider's settings

Keys a container runtime needs and a layer does not (``command``, ``init``, ``entrypoint``,
``hostname``, ``x-*``) are read past. Anything else (``build``, ``volumes``, a second
service...) is a ValueError naming it: the sample would not be what the file says.
"""

from __future__ import annotations

import os
from typing import Any

import yaml  # type: ignore[import-untyped]  # (Inspect's dependency; no stubs here)

#: Service keys with no meaning for a layer over an image: a container's main process and
#: its name. Read past.
IGNORED = frozenset(("command", "entrypoint", "init", "hostname", "container_name", "tty"))

#: What ``x-sandbx`` may set (SandbxConfig's own fields).
OWN_SETTINGS = frozenset(("pool_config", "workers", "journal", "root", "changes", "user"))


def is_compose_file(config: str) -> bool:
    """Whether a string config names a compose file (by its extension) rather than a
    sandbx-pool TOML file."""
    return config.endswith((".yaml", ".yml"))


def read(path: str) -> dict[str, Any]:
    """SandbxConfig's fields from the compose file at ``path``; ValueError saying what in it
    cannot be honoured."""
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"sandbx: cannot read compose file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"sandbx: compose file {path} is not YAML: {exc}") from exc
    services = document.get("services") if isinstance(document, dict) else None
    if not isinstance(services, dict) or len(services) != 1:
        count = len(services) if isinstance(services, dict) else 0
        raise ValueError(
            f"sandbx: compose file {path} must have one service (it has {count}):"
            " a sample is one layer over one image"
        )
    [(name, service)] = services.items()
    if not isinstance(service, dict) or not isinstance(service.get("image"), str):
        raise ValueError(
            f"sandbx: service {name!r} of {path} names no image (build: is not supported;"
            " build the image and name it, or use pool.image's oci:DIR reference)"
        )
    unknown = sorted(
        k for k in service if k not in (*IGNORED, "image", "working_dir", "environment",
                                        "network_mode", "x-sandbx") and not k.startswith("x-")
    )  # fmt: skip
    if unknown:
        raise ValueError(
            f"sandbx: service {name!r} of {path}: {', '.join(unknown)} not supported"
            " (a sample is a layer over the image: no build, volumes, ports or limits here;"
            " limits go in the pool config)"
        )
    fields: dict[str, Any] = {"image": _image(service["image"], path)}
    if "working_dir" in service:
        fields["workdir"] = str(service["working_dir"])
    if "environment" in service:
        fields["env"] = _environment(service["environment"], name, path)
    network = service.get("network_mode")
    if network is not None:
        if network not in ("none", "bridge", "host"):
            raise ValueError(f"sandbx: service {name!r}: network_mode {network!r} not supported")
        fields["network"] = network != "none"
    own = service.get("x-sandbx") or {}
    if not isinstance(own, dict) or not set(own) <= OWN_SETTINGS:
        raise ValueError(f"sandbx: x-sandbx of {path} takes {', '.join(sorted(OWN_SETTINGS))} only")
    return {**fields, **own}


def _image(image: str, path: str) -> str:
    """An ``oci:`` reference with a relative path is the compose file's, as compose reads
    its own relative paths."""
    if image.startswith("oci:") and not image.startswith("oci:/"):
        return "oci:" + os.path.join(os.path.dirname(os.path.abspath(path)), image[4:])
    return image


def _environment(value: object, name: str, path: str) -> tuple[tuple[str, str], ...]:
    if isinstance(value, dict):
        return tuple((str(k), "" if v is None else str(v)) for k, v in value.items())
    if isinstance(value, list):
        pairs = []
        for entry in value:
            key, sep, val = str(entry).partition("=")
            if not sep:  # "KEY" alone: compose takes the caller's value; we give none
                raise ValueError(
                    f"sandbx: service {name!r} of {path}: environment entry {entry!r} has no"
                    " value (the host's environment is not passed into an image)"
                )
            pairs.append((key, val))
        return tuple(pairs)
    raise ValueError(f"sandbx: service {name!r} of {path}: environment must be a map or a list")
