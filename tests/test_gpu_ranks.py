"""A GPU per rank on CUDA (config.py, executor/mp_worker.py): `mp` gives rank r this machine's
GPU r, so it needs as many GPUs as ranks, and a device with a fixed index cannot serve several.
The GPU machines at hand have one GPU, so several ranks on CUDA never ran; what can be checked
is that they are refused where they cannot run, with the numbers."""

from __future__ import annotations

import pytest
import torch

from treadle.config import EngineArgs, ParallelConfig, _check_devices_per_rank


def test_a_fixed_device_index_cannot_serve_several_ranks():
    with pytest.raises(ValueError, match=r"device 'cuda:1' names one GPU, but 2 workers each "
                                         r"need their own: use device='cuda'"):
        _check_devices_per_rank("cuda:1", ParallelConfig(tensor_parallel_size=2,
                                                         distributed_executor_backend="mp"))


def test_one_rank_or_the_cpu_is_never_refused():
    _check_devices_per_rank("cuda:1", ParallelConfig())
    _check_devices_per_rank("cpu", ParallelConfig(pipeline_parallel_size=4,
                                                  distributed_executor_backend="mp"))


@pytest.mark.gpu
def test_more_ranks_than_gpus_are_refused_with_the_numbers(llama):
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"{n + 1} workers \(pipeline_parallel_size x "
                                         rf"tensor_parallel_size\) need {n + 1} GPUs, one each; "
                                         rf"this machine has {n}"):
        EngineArgs(model=llama, device="cuda", pipeline_parallel_size=n + 1,
                   distributed_executor_backend="mp").create_config()
