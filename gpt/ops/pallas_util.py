"""What every Pallas (Triton) kernel of gpt/ops/ needs to be launched: Triton's settings, which the
interpreter (off a GPU) must not get, and block sizes that are powers of two (Triton's)."""
from __future__ import annotations


def triton_params(warps: int, stages: int, interpret: bool):
    """pallas_call's compiler_params: Triton's warps a program and pipeline stages, or None in
    Pallas's interpreter (imported only for Triton: the interpreter needs no Triton module)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plt
    return plt.CompilerParams(num_warps=warps, num_stages=stages)


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides n, at most cap: a block that tiles n exactly."""
    return min(n & -n, cap)


def pow2_at_most(n: int, cap: int) -> int:
    """The largest power of two at most n (>= 1) and cap: a block that fits in n."""
    return min(cap, 1 << (n.bit_length() - 1))
