"""Counter-based random numbers for sampling: the same bits on every device.

A seeded request must sample the same tokens whatever its batch, its row, a preemption on the
way, or the device. A stateful generator (one reseeded per row) cannot run as one batched
expression, and CPU and CUDA generators give different streams for the same seed. So the noise
for a token is a pure function of (seed, output position, token index): a hash built from plain
integer operations, which torch defines identically on every device.

The rule. Every value is an int64 holding a 32-bit lane (0 <= x < 2^32); every multiplier is odd
and below 2^31, so a product stays below 2^63 and never overflows before the mask.

    mix(x)   = x ^= x >> 16;  x = (x * 0x7FEB352D) & 0xFFFFFFFF;
               x ^= x >> 15;  x = (x * 0x2C1B3C6D) & 0xFFFFFFFF;  x ^= x >> 16
    seed     = the request's seed modulo 2^64, as lanes lo (low 32 bits) and hi (high 32 bits)
    key      = mix(mix(mix(lo ^ 0x3C6EF372) ^ hi) ^ (position mod 2^32))   one per row
    term[t]  = mix(t ^ 0x5BD1E995)                                          one per token index
    x        = key ^ term[t]
    x        = (x * 0x7FEB352D) & 0xFFFFFFFF;  x ^= x >> 15;  x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    u        = ((x >> 9) + 0.5) / 2^23        23 bits, exact in fp32, strictly inside (0, 1)

`position` is the index of the output token being sampled (0 for the first): a count the host
always knows, even while the tokens themselves are still on the device. The row key is a few
operations on Python ints per row; the [rows, vocab] block is one broadcast expression, so a
batch costs a handful of elementwise passes, with no per-row generator. The sampler turns u into
Exp(1) noise, E = -log(u), for the exponential race.
"""

from __future__ import annotations

from typing import TypeVar

import torch

_LANE = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x2C1B3C6D
_SEED_SALT = 0x3C6EF372
_TOKEN_SALT = 0x5BD1E995
_UNIFORM_BITS = 23
_SCALE = 2.0 ** -_UNIFORM_BITS

Lanes = TypeVar("Lanes", int, torch.Tensor)


def mix32(x: Lanes) -> Lanes:
    """A 32-bit finaliser (multiply, xor-shift) on a Python int or an int64 tensor of lanes."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _LANE
    x = x ^ (x >> 15)
    x = (x * _M2) & _LANE
    return x ^ (x >> 16)


def row_key(seed: int, position: int) -> int:
    """The 32-bit key of a request's `position`-th output token under `seed` (any Python int)."""
    seed &= (1 << 64) - 1
    key = mix32(mix32((seed & _LANE) ^ _SEED_SALT) ^ (seed >> 32))
    return mix32(key ^ (position & _LANE))


_token_terms: dict[tuple[int, torch.device], torch.Tensor] = {}


def _token_term(vocab: int, device: torch.device) -> torch.Tensor:
    """term[t] for t < vocab, built once per vocabulary size and device."""
    key = (vocab, device)
    if key not in _token_terms:
        tokens = torch.arange(vocab, dtype=torch.int64, device=device)
        _token_terms[key] = mix32(tokens ^ _TOKEN_SALT)
    return _token_terms[key]


def uniform_bits(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The 23-bit integers behind u, [rows, vocab] int64, for the row keys `keys` ([rows])."""
    x = _token_term(vocab, keys.device) ^ keys[:, None]
    x.mul_(_M1).bitwise_and_(_LANE)
    x ^= x >> 15
    x.mul_(_M2).bitwise_and_(_LANE)
    return x.bitwise_right_shift_(32 - _UNIFORM_BITS)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """E = -log(u) ~ Exp(1), fp32 [rows, vocab], one independent draw per (row key, token)."""
    # (k + 0.5) / 2^23 is exact in fp32; the log of u itself, not 23 log 2 - log(k + 0.5), keeps
    # E accurate near u = 1, where the race is decided.
    u = uniform_bits(keys, vocab).float().add_(0.5).mul_(_SCALE)
    return u.log_().neg_()
