"""Benchmarks of the paged-attention kernels (kvshare_kernels) on the GPU."""
