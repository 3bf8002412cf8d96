"""Kernel plumbing: the ``torch.ops.ple`` operator registry, the CPU GEMM with packed weights, and the C kernels (:mod:`ple.kernels.native`: sources and their build)."""
