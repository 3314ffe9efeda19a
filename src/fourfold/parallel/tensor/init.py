"""Deterministic initialisation by element: the value of element (row, col) of a serial parameter
depends only on (seed, parameter name, row, col), never on the grid.

Each rank computes the values of exactly the elements it stores (a counter-based generator:
splitmix64 of the element's index, then Box-Muller), so a model built on any grid is the serial
model built with the same seed, and no rank ever materialises a full matrix.
"""

from __future__ import annotations

import math
import zlib

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    # int64 multiplication wraps modulo 2**64, which is what splitmix64 needs.
    z = z + _signed(0x9E3779B97F4A7C15)
    z = (z ^ _shift_right(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _shift_right(z, 31)


def _uniform(key: int, counter: torch.Tensor) -> torch.Tensor:
    """Uniform float64 in (0, 1] for each counter, from the stream `key`."""
    bits = _splitmix64(_splitmix64(counter) ^ _signed(key))
    return (_shift_right(bits, 11).double() + 1.0) * 2.0**-53


def stream_key(seed: int, name: str) -> int:
    return _signed(seed * 0x100000001B3 + zlib.crc32(name.encode()))


def normal(seed: int, name: str, index: torch.Tensor, std: float, dtype: torch.dtype) -> torch.Tensor:
    """N(0, std^2) values for the flat element indices `index` (int64) of parameter `name`."""
    key = stream_key(seed, name)
    u1 = _uniform(key, 2 * index)
    u2 = _uniform(key, 2 * index + 1)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2) * std).to(dtype)
