"""What `gpu` tests share.

benchmarks/gpu/check.sh runs them in several pytest-xdist workers on one GPU, so that Triton's
first compiles overlap. An engine there takes a KV cache of a fixed size: sized by a profile
(gpu_memory_utilization), it would count what the other workers' engines take meanwhile as its
own, and the default share (0.9) would leave them nothing. The tests of that sizing
(tests/test_memory_profile.py) run alone."""

GPU_KV_BYTES = 1 << 30


def shared_gpu(device: str) -> dict:
    """Engine arguments for a test engine on `device`: a fixed KV cache on CUDA, none else."""
    return {"kv_cache_memory_bytes": GPU_KV_BYTES} if device.startswith("cuda") else {}
