"""Collectives: what ``ctx.ccl`` runs, and what plugins extend.

This package's own names are the algorithm records and registries a plugin algorithm is written
against (:mod:`iris.collectives.algorithms`). Beside them:

- :mod:`~iris.collectives.workspaces`: the named heap buffers the protocols share, grown collectively;
- :mod:`~iris.collectives.groups`: sub-groups of a context's ranks (``group=``);
- :mod:`~iris.collectives.uneven`: the host side of the uneven all-to-alls;
- :mod:`~iris.collectives.hierarchical`: collectives over several nodes.
"""

from iris.collectives.algorithms import (
    COLLECTIVES, MOVED_ONLY_DTYPES, POINT_TO_POINT, REDUCE_OPS, REDUCIBLE_DTYPES, REDUCING, ROOT_ONLY,
    SAME_SIZE_INTEGER, SUPPORTED_DTYPES, UNEVEN, Algorithm, CallShape, CollectiveCall, algorithm_registry,
    choose, reduce_op_name, register_algorithm, signature_of,
)

__all__ = [
    "COLLECTIVES", "MOVED_ONLY_DTYPES", "POINT_TO_POINT", "REDUCE_OPS", "REDUCIBLE_DTYPES", "REDUCING",
    "ROOT_ONLY", "SAME_SIZE_INTEGER", "SUPPORTED_DTYPES", "UNEVEN", "Algorithm", "CallShape",
    "CollectiveCall", "algorithm_registry", "choose", "reduce_op_name", "register_algorithm", "signature_of",
]
