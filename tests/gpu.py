"""What `gpu` tests share.

benchmarks/gpu/check.sh runs them in several pytest-xdist workers on one GPU, so that Triton's
first compiles overlap; an engine there takes this share of the device's memory, where the
default (gpu_memory_utilization 0.9) would leave the other workers none. The tests of the
sizing itself (tests/test_memory_profile.py) set their own share and run alone."""

GPU_SHARE = 0.15
