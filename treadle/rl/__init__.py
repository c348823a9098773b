"""The trainer's side of RL with treadle: `WeightSender` streams a model's weights to a running
engine (vLLM's weight-transfer protocol; treadle/distributed/weight_transfer.py)."""

from treadle.rl.weight_sender import WeightSender

__all__ = ["WeightSender"]
