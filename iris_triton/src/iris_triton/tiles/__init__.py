"""Tile collectives called from inside kernels (:mod:`~iris_triton.tiles.collectives`), the tile and
matrix views they take (:mod:`~iris_triton.tiles.views`), and the kernel that runs one over every
tile of a matrix (:mod:`~iris_triton.tiles.kernel`)."""
