"""The collectives' kernels and the algorithms that launch them, registered under the entry-point
groups ``iris.ccl.<collective>``: the general kernel (:mod:`~iris_triton.collectives.kernels`),
the low-latency and sentinel all_reduces, the uneven all-to-alls and send/recv."""
