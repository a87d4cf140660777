"""Upstream iris's ``iris.ccl`` module: the configuration and reduction names its collectives take.

The collectives themselves are ``ctx.ccl.<name>`` of a context made with upstream's spelling,
``iris.iris(...)`` (:mod:`iris.compat.collectives`), which take ``(output, input, ...)`` and a
:class:`Config`. Contexts from :func:`iris.create` follow torch.distributed instead.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["Config", "ReduceOp"]


class ReduceOp(enum.IntEnum):
    """Reductions, numbered as torch.distributed numbers them. Collectives run ``SUM``, ``MIN`` and
    ``MAX``; the others are refused with a ValueError."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6


def _positive(instance, attribute, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"Config.{attribute.name} must be a positive int, got {value!r}")


def _one_of(*allowed):
    def check(instance, attribute, value) -> None:
        if (value.lower() if isinstance(value, str) else value) not in allowed:
            raise ValueError(f"Config.{attribute.name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")

    return check


@attrs.define(on_setattr=attrs.setters.validate)
class Config:
    """Options of a collective, with upstream iris's fields and defaults, checked when set.

    What decides results: ``block_size_m``, ``block_size_n``, ``swizzle_size`` and
    ``all_reduce_distribution`` define which output tiles a rank owns in ``reduce_scatter``
    (upstream's full-shape form). ``all_reduce_variant`` ``"one_shot"`` / ``"two_shot"`` run
    iris's algorithm of that name; the variants of upstream's other kernels (``"atomic"``,
    ``"spinlock"``, ``"ring"``) run iris's automatic choice, with the same result. ``use_gluon``
    needs a Gluon context (``iris_gluon.iris(...)``). The launch-shape fields (``comm_sms``,
    ``num_xcds``, ``chunk_size``, ``num_stages``, ``num_warps``, ``threads_per_warp``,
    ``waves_per_eu``) are checked and otherwise not used: iris's algorithms pick their launch
    shapes from their own tables, identically on every rank.
    """

    block_size_m: int = attrs.field(default=32, validator=_positive)
    block_size_n: int = attrs.field(default=64, validator=_positive)
    swizzle_size: int = attrs.field(default=4, validator=_positive)
    comm_sms: int = attrs.field(default=64, validator=_positive)
    num_xcds: int | None = attrs.field(default=None, validator=_positive)
    """None: ``iris.hip.get_num_xcc()`` (1 on NVIDIA GPUs)."""
    chunk_size: int | None = attrs.field(default=None, validator=_positive)
    use_gluon: bool = False
    all_gather_variant: str = attrs.field(default="persistent", validator=_one_of("persistent", "partitioned"))
    all_reduce_variant: str = attrs.field(default="two_shot",
                                          validator=_one_of("atomic", "ring", "two_shot", "one_shot", "spinlock"))
    all_reduce_distribution: int = attrs.field(default=1, validator=_one_of(0, 1))
    """Which tiles a rank owns in reduce_scatter: 0 every world-size-th tile, 1 a contiguous run."""
    all_reduce_num_rings: int = attrs.field(default=1, validator=_positive)
    all_reduce_ring_slice_n: int | None = attrs.field(default=None, validator=_positive)
    reduce_scatter_variant: str = attrs.field(default="two_shot", validator=_one_of("two_shot"))
    all_to_all_variant: str = "default"
    num_stages: int = attrs.field(default=1, validator=_positive)
    num_warps: int = attrs.field(default=4, validator=_positive)
    threads_per_warp: int | None = attrs.field(default=None, validator=attrs.validators.optional(_one_of(32, 64)))
    waves_per_eu: int = 0

    def __attrs_post_init__(self) -> None:
        if self.num_xcds is None:
            self.num_xcds = 1
        if self.chunk_size is None:
            self.chunk_size = max(1, min(self.swizzle_size ** 2, self.comm_sms // self.num_xcds))
        if self.all_reduce_ring_slice_n is None:
            self.all_reduce_ring_slice_n = self.block_size_n
        slice_n = self.all_reduce_ring_slice_n
        if self.block_size_n % slice_n or slice_n & (slice_n - 1):
            raise ValueError(f"Config.all_reduce_ring_slice_n must be a power of two dividing block_size_n "
                             f"({self.block_size_n}), got {slice_n}")
