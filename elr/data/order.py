"""Which item a sample reads: a seeded bijection per epoch, in O(1) memory, so ~1e9 windows need no table.

Sample i of a stream of n items reads item perm_e(i mod n) of epoch e = i // n; each epoch draws a fresh
permutation from (seed, epoch). The token windows of every source and the conversations of a chat folder
are ordered this way; a source's seed is the job's seed mixed with its name (`source_seed`), so two sources
of one mixture never walk their windows in step.
"""

from __future__ import annotations

import hashlib

_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap 64-bit hash; every output bit depends on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def source_seed(seed: int, name: str) -> int:
    """The seed of a named source of a mixture: the job's seed mixed with a stable hash of the name."""
    digest = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return mix64((seed & _MASK64) ^ digest)


class WindowPermutation:
    """A pseudo-random bijection of range(n) in O(1) memory, so ~1e9 windows need no table.

    A 4-round Feistel network permutes the 2h-bit integers (the smallest even width that holds
    n - 1), and cycle walking re-applies it until the result is below n. That stays a bijection
    of range(n), and as 2^(2h) < 4n it takes fewer than four applications on average.
    """

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        self.n, self.epoch = n, epoch
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self.half_mask = (1 << self.half_bits) - 1
        base = mix64(mix64(seed & _MASK64) ^ epoch)
        self.keys = [mix64(base ^ r) for r in range(self.ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half_bits, x & self.half_mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right ^ key) & self.half_mask)
        return (left << self.half_bits) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside range({self.n})")
        x = self._feistel(i)
        while x >= self.n:
            x = self._feistel(x)
        return x


class EpochOrder:
    """Which item sample i reads: item i mod n of epoch i // n, in a fresh WindowPermutation per epoch
    when shuffling."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perm = WindowPermutation(n, seed, epoch=0)  # of the current epoch

    def __call__(self, i: int) -> int:
        epoch, item = divmod(i, self.n)
        if not self.shuffle:
            return item
        if self._perm.epoch != epoch:
            self._perm = WindowPermutation(self.n, self.seed, epoch)
        return self._perm(item)
