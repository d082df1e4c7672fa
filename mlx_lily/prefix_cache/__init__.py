"""Prefix reuse for hybrid (Gated DeltaNet + attention) models: snapshots of the
non-trimmable cache state so a follow-up request prefills only what is new.

mlx-lm's ``LRUPromptCache`` can reuse an entry of a hybrid model only when it is an exact
prefix of the new prompt, because an ``ArraysCache`` (GDN conv + recurrent state) cannot be
trimmed. This component stores *snapshots*: the GDN state at chosen token positions (message
starts of the rendered prompt, the thinking tail, the end of the prompt's prefill, every
``every`` tokens), without the attention KV. A later prompt restores the deepest snapshot that
is one of its prefixes and takes the KV from any stored full cache that passes through the
same tokens, trimmed to the snapshot's length (``KVCache.trim``: nothing is copied until the
new request writes).

Pure cache logic: no kernels, any backend. ``mlx_lily.patch()`` installs it into mlx-lm's
server (``install``), ``mlx_lily.unpatch()`` removes it (``uninstall``). Scripts keeping their
own cache use ``PrefixCache`` with ``prefill``. Docs: ``docs/prefix-cache.md``.
"""

from __future__ import annotations

import dataclasses


ENABLE_ENV = "MLX_LILY_PREFIX_CACHE"  # "0": not installed by patch()
EVERY_ENV = "MLX_LILY_PREFIX_CACHE_EVERY"  # tokens between periodic snapshots; "0": none
SNAPSHOTS_ENV = "MLX_LILY_PREFIX_CACHE_SNAPSHOTS"  # most snapshots held by one store
#: Default tokens between periodic snapshots of a long prefill (see docs/prefix-cache.md
#: for the measurement behind it).
DEFAULT_EVERY = 8192
#: Default most snapshots one store holds (besides its byte limit): 32 snapshots of
#: Qwen3.6-35B-A3B's 63 MB GDN state are 2 GB.
DEFAULT_MAX_SNAPSHOTS = 32


@dataclasses.dataclass(frozen=True)
class Settings:
    """The prefix cache's switches.

    Attributes:
        enabled: install into mlx-lm with ``mlx_lily.patch()`` (``MLX_LILY_PREFIX_CACHE``,
            "0" = off).
        every: tokens between periodic snapshots of a long prefill, at absolute positions
            ``every, 2*every, ...`` (``MLX_LILY_PREFIX_CACHE_EVERY``; 0 = none).
        max_snapshots: most snapshots a store keeps (``MLX_LILY_PREFIX_CACHE_SNAPSHOTS``);
            the least recently used goes first. The byte limit applies as well.
    """

    enabled: bool = True
    every: int = DEFAULT_EVERY
    max_snapshots: int = DEFAULT_MAX_SNAPSHOTS


def settings() -> Settings:
    """The switches now: ``mlx_lily.config.prefix_cache`` and the knobs
    ``mlx_lily.tuning.prefix_cache_every`` / ``prefix_cache_snapshots`` (a bad value: one
    warning naming the variable, then the default)."""
    from .. import config, tuning

    return Settings(enabled=config.prefix_cache, every=tuning.prefix_cache_every,
                    max_snapshots=tuning.prefix_cache_snapshots)


from .plan import Prefilled, message_boundaries, prefill, snapshot_points  # noqa: E402
from .server_hooks import install, install_if_enabled, installed, uninstall  # noqa: E402
from .store import PrefixCache, snapshot_capable, snapshot_nbytes  # noqa: E402

__all__ = ["Settings", "settings", "PrefixCache", "Prefilled", "prefill",
           "message_boundaries", "snapshot_points", "snapshot_capable", "snapshot_nbytes",
           "install", "install_if_enabled", "uninstall", "installed"]
