"""The counter-based random rule behind seeded sampling: its documented arithmetic, its range,
and its distribution (deterministic: fixed seeds, chi-square bounds at p = 0.001)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.worker.sampling_random import exponential_noise, mix32, row_key, uniform_bits

LANE = 0xFFFFFFFF


def reference_bits(seed: int, position: int, token: int) -> int:
    """The rule in the module docstring, restated with Python ints, one value at a time."""
    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & LANE
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & LANE
        return x ^ (x >> 16)

    seed %= 1 << 64
    key = mix(mix(mix((seed & LANE) ^ 0x3C6EF372) ^ (seed >> 32)) ^ (position & LANE))
    x = key ^ mix(token ^ 0x5BD1E995)
    x = (x * 0x7FEB352D) & LANE
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & LANE
    return x >> 9


def bits(seed: int, positions: range, vocab: int, device: str = "cpu") -> torch.Tensor:
    keys = torch.tensor([row_key(seed, p) for p in positions], device=device)
    return uniform_bits(keys, vocab)


def chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


def test_bits_follow_the_documented_rule():
    for seed in (0, 1, 12345, 2**62 + 7, 2**64 + 3, -1):
        for position in (0, 1, 999, 2**32 + 5):
            got = bits(seed, range(position, position + 1), 70)[0].tolist()
            assert got == [reference_bits(seed, position, t) for t in range(70)]
    # The seed counts modulo 2^64 (a negative one as its two's complement), the position
    # modulo 2^32.
    assert row_key(-1, 3) == row_key(2**64 - 1, 3) and row_key(5, 2**32 + 3) == row_key(5, 3)
    # Products of a lane by a multiplier stay below 2^63: no signed overflow on any device.
    assert LANE * 0x7FEB352D < 2**63 and LANE * 0x2C1B3C6D < 2**63
    # The tensor and int forms of mix32 are one function.
    xs = [0, 1, 0x5BD1E995, LANE]
    assert mix32(torch.tensor(xs)).tolist() == [mix32(x) for x in xs]


def test_uniforms_lie_strictly_inside_zero_one():
    b = bits(3, range(64), 4096)
    assert 0 <= int(b.min()) and int(b.max()) < 2**23
    # The extremes of the 23-bit grid, as the sampler builds u, are exact and inside (0, 1).
    extremes = torch.tensor([0, 2**23 - 1]).float().add_(0.5).mul_(2.0**-23)
    assert extremes.tolist() == [0.5 / 2**23, 1 - 0.5 / 2**23]
    e = exponential_noise(torch.tensor([row_key(3, p) for p in range(64)]), 4096)
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all())
    assert abs(float(e.mean()) - 1.0) < 0.01   # Exp(1): mean 1, 262,144 draws


def test_uniforms_are_uniform_over_tokens_and_positions():
    """One seed, 256 positions x 4096 tokens: 64 equal bins of u."""
    b = bits(7, range(256), 4096).numpy()
    counts = np.bincount(b.ravel() >> 17, minlength=64)
    assert chi_square(counts) < 103.4, counts   # 63 degrees of freedom, p = 0.001


@pytest.mark.parametrize("pairing", ["next position", "next token", "next seed"])
def test_neighbouring_uniforms_are_independent(pairing):
    """The joint histogram (8 x 8 bins) of u and its neighbour is flat: no correlation between
    consecutive positions, tokens or seeds."""
    if pairing == "next seed":
        a, b = bits(40, range(64), 4096), bits(41, range(64), 4096)
    else:
        block = bits(11, range(129), 2048)
        a, b = ((block[:-1], block[1:]) if pairing == "next position"
                else (block[:, :-1], block[:, 1:]))
    joint = (a >> 20) * 8 + (b >> 20)
    counts = np.bincount(joint.numpy().ravel(), minlength=64)
    assert chi_square(counts) < 103.4, counts   # 63 degrees of freedom, p = 0.001


@pytest.mark.gpu
def test_cuda_gives_the_cpu_bits():
    for seed in (0, 99, 2**63 + 1):
        cpu = bits(seed, range(0, 300, 7), 49152)
        assert torch.equal(bits(seed, range(0, 300, 7), 49152, "cuda").cpu(), cpu)
