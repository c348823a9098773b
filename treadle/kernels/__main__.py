"""`python -m treadle.kernels`: build the CPU kernels ahead of their first use."""

import logging

import torch

from treadle.kernels.cpu import cpu_kernels_available

logging.basicConfig(level=logging.INFO, format="%(message)s")
raise SystemExit(0 if cpu_kernels_available(torch.device("cpu")) else 1)
