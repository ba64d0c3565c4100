"""How the weight-only quantized matmul kernels cut their work: `Tiling` (output-column blocks,
K steps, split K, Triton's warps and stages, the one-row GEMV variants and their rounds of SMs) and
whether a tiling covers a weight exactly (`Tiling.fits`). The Triton matmul (quant_matmul_triton.py)
and the packed-half GEMV (quant_half_gemv.py) read it; the dispatcher (quant_matmul.py) picks one
from its tuned tables.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.quant_formats import BLOCK, VALUES_PER_WORD, QuantizedWeight

# The formats the packed-half GEMV (quant_half_gemv.py) decodes.
HALF_FORMATS = ("int8", "fp8", "fp8_block", "nvfp4")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pair_words(num_warps: int) -> int:
    """The fewest weight words a packed-half tile may hold: a word pair for every thread (the PTX
    takes two words a call; with fewer, Triton pairs what it has and the sums come out wrong: NaN
    on the H200 with 8-row NVFP4 tiles of 64 words under 16 warps)."""
    return 2 * 32 * num_warps


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the kernel cuts the work: block_n output columns per program, block_k of K per loop
    step, K split over split_k programs (partial sums added after), Triton's warps and stages;
    with gemv, a single activation row is contracted without a tensor-core dot on rows padded to
    16: by float32 multiply-and-sum, or with packed_halves by f16 pairs (HALF_FORMATS only, a tile of
    at least a weight-word pair a thread). A packed-half GEMV with `rounds` (the GPU's SM count) runs its
    block_n-row programs in whole rounds of one per SM and gives the rows left over to up to one
    smaller program per SM: all programs run at once, so an SM with one program more than the
    others sets the time."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False
    packed_halves: bool = False
    rounds: int = 0

    def row_blocks(self, N: int, step_words: int) -> tuple[int, int, int]:
        """(programs of block_n rows, programs of the rows left after whole rounds of those, their
        rows: a power of two, 0 where nothing is left over) for N output columns, one K range, steps
        of `step_words` weight words. A small program still gives each thread a word pair."""
        blocks = N // self.block_n
        left = blocks % self.rounds if self.rounds and self.split_k == 1 and blocks > self.rounds else 0
        if not left:
            return blocks, 0, 0
        small = next_pow2(max(-(-left * self.block_n // self.rounds), -(-pair_words(self.num_warps) // step_words)))
        return (blocks, 0, 0) if small >= self.block_n else (blocks - left, left * self.block_n // small, small)

    def fits(self, w: "QuantizedWeight") -> bool:
        """Power-of-two tiles (Triton's blocks) that divide the weight; for fp8 blocks a tile's rows
        also stay inside one 128-row scale block (its columns then span whole 128-column blocks or
        sit inside one)."""
        N, K = w.shape
        pow2 = all(b == next_pow2(b) for b in (self.block_n, self.block_k))
        rows_in_scale_block = w.format != "fp8_block" or BLOCK % self.block_n == 0
        half = not self.packed_halves or (self.gemv and w.format in HALF_FORMATS and self.block_n * self.block_k
                                          >= pair_words(self.num_warps) * VALUES_PER_WORD[w.format])
        divides = N % self.block_n == 0 and K % (self.block_k * self.split_k) == 0
        return pow2 and divides and rows_in_scale_block and half

