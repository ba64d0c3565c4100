"""MLIR building blocks the NVFP4 Mosaic GPU kernels share (`nvfp4_gemv_mosaic`,
`nvfp4_mma_mosaic`): i32 constants and casts, inline PTX, a thread's lane and warp, and the
activation side of the f16-pair products (a row's largest |x| and its scaled f16 pairs)."""

from __future__ import annotations

from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_kernels.quant_formats import X_PAIR_VALUES, X_TOP_EXPONENT


def i32():
    return ir.IntegerType.get_signless(32)


def const(value: int):
    return mgpu_utils.c(value, i32())


def as_index(value):
    return arith.index_cast(ir.IndexType.get(), value)


def element(vec, i: int):
    return vector.extract(vec, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))


def lane_and_warp():
    t = mgpu_utils.thread_idx()
    return arith.andi(t, const(31)), arith.shrui(t, const(5))


def as_f32(bits):
    return arith.bitcast(ir.F32Type.get(), bits)


def power_of_two(e):
    """2^e as float32 from its bits, e i32 in [-126, 127]."""
    return as_f32(arith.shli(arith.addi(e, const(127)), const(23)))


def inline_asm(result_types: list, text: str, constraints: str, args: list) -> list:
    if len(result_types) == 1:
        return [llvm.inline_asm(result_types[0], args, text, constraints)]
    struct = llvm.StructType.get_literal(result_types)
    out = llvm.inline_asm(struct, args, text, constraints)
    return [llvm.extractvalue(t, out, [i]) for i, t in enumerate(result_types)]


GROUP_TOP_PTX = "{\n.reg .b32 m;\nand.b32 m, $1, 0x7FFF7FFF; max.u16x2 $0, $2, m;\n}"  # two bf16 |x| a word, apart


def x_tops(words: list) -> ir.Value:
    """The largest |x| of bf16 pair words (i32): its bf16 bits in one of the two u16 lanes of the result."""
    tops = const(0)
    for w in words:
        [tops] = inline_asm([i32()], GROUP_TOP_PTX, "=r,r,r", [w, tops])
    return tops


def scaled_pairs(words: list, tops) -> tuple[list, ir.Value]:
    """bf16 pair words (i32, 4 per weight word's 8 values) and their x_tops -> (per weight word its four
    f16 pairs of values (0, 4), (2, 6), (7, 3), (5, 1) (`X_PAIR_VALUES`); 2^-shift f32). Each value is
    scaled by 2^shift, which brings the largest |x| into [2^14, 2^15) (`X_TOP_EXPONENT`): no sum of 16
    products leaves f16's range, and small values keep their bits."""
    top = arith.maxui(arith.andi(tops, const(0xFFFF)), arith.shrui(tops, const(16)))  # the largest |x|'s bf16 bits
    biased = arith.shrui(top, const(7))  # its exponent field: |x| = m 2^(biased - 126), m in [0.5, 1)
    shift = arith.maxsi(arith.minsi(arith.subi(const(X_TOP_EXPONENT["nvfp4"] + 126), biased), const(126)), const(-126))
    scale = power_of_two(shift)
    values = []  # value 2m is word m's low half, 2m + 1 its high half
    for w in words:
        values += [arith.mulf(as_f32(bits), scale) for bits in (arith.shli(w, const(16)), arith.andi(w, const(-65536)))]
    def pair(low, high):
        return inline_asm([i32()], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [high, low])[0]  # high lane first
    pairs = [[pair(values[8 * word + low], values[8 * word + high]) for low, high in X_PAIR_VALUES["nvfp4"]]
             for word in range(len(words) // 4)]
    return pairs, power_of_two(arith.subi(const(0), shift))
