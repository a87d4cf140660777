"""Upstream iris's conventions: the contexts ``iris.iris(...)`` makes (:mod:`iris.upstream.context`),
their collectives (:mod:`iris.upstream.collectives`) and fused operations
(:mod:`iris.upstream.ops`), and the tile ownership of upstream's full-shape reduce-scatters
(:mod:`iris.upstream.tiles`)."""
