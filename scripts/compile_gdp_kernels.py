"""Compile the GDP Triton kernels for a GPU architecture on a machine without one, and report
their shared memory, registers and spills: catches compile errors and resource overruns that the
CPU interpreter cannot, and guides block sizes before any GPU time is spent.

    python scripts/compile_gdp_kernels.py            # sm_90 (H100/H200), D = 128, chunk 64, bf16
    python scripts/compile_gdp_kernels.py --resets   # the kernels with document resets (HAS_RESETS)

Uses the ptxas and cuobjdump that ship inside the triton wheel. H100/H200 allow 227 KiB
(232448 bytes) of shared memory per program and 255 registers per thread; STACK is the spill space.
"""

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from elr.cli import HelpFormatter


def kernels(dtype, D, C, resets):
    """(kernel, argument types, constexprs, launch options) as the launchers use them."""
    from elr_kernels.gated_delta_product import triton_chunk as tc
    from elr_kernels.gated_delta_product import triton_decode as td

    x, f = f"*{dtype}", "*fp32"
    ints = dict(T="i32", H="i32", n_h="i32")
    opts = dict(num_warps=tc.NUM_WARPS)
    shape = dict(K=D, V=D, C=C, HAS_RESETS=resets)
    r = "*u8"  # the [B, T] reset flags
    return [
        (
            tc._prepare_kernel,
            dict(k=x, v=x, g=f, beta=f, resets=r, G_out=f, W_out=f, U_out=f, Tinv_out=f, **ints),
            dict(shape, STORE_INVERSE=True, NORM=True),
            opts,
        ),
        (
            tc._state_kernel,
            dict(k=x, resets=r, G_buf=f, W_buf=f, U_buf=f, initial=f, h_out=f, u_out=f, final_out=f, **ints, N="i32"),
            dict(shape, BV=tc.BLOCK_V, HAS_INITIAL=True, NORM=True),
            opts,
        ),
        (
            tc._output_kernel,
            dict(q=x, k=x, resets=r, G_buf=f, h_buf=f, u_buf=f, o=x, scale="fp32", **ints),
            dict(shape, BV=tc.BLOCK_V, NORM=True),
            opts,
        ),
        (
            tc._state_grad_kernel,
            dict(
                q=x,
                k=x,
                do=x,
                resets=r,
                G_buf=f,
                W_buf=f,
                d_final=f,
                dh_out=f,
                du_out=f,
                d_initial=f,
                scale="fp32",
                **ints,
                N="i32",
            ),
            dict(shape, BV=tc.BLOCK_V, HAS_D_FINAL=True, NORM=True),
            opts,
        ),
        (
            tc._chunk_grad_kernel,
            dict(
                q=x,
                k=x,
                v=x,
                beta=f,
                do=x,
                resets=r,
                G_buf=f,
                W_buf=f,
                Tinv_buf=f,
                h_buf=f,
                u_buf=f,
                dh_buf=f,
                du_buf=f,
                dq=x,
                dk=x,
                dv=x,
                dbeta=f,
                dg=f,
                scale="fp32",
                **ints,
            ),
            dict(shape, BV=tc.GRAD_BLOCK_V, NORM=True),
            dict(opts, num_stages=1),
        ),
        (
            td._decode_kernel,
            dict(q=x, k=x, v=x, g=f, beta=f, state=f, new_state=f, o=x, scale="fp32", H="i32", n_h="i32"),
            dict(K=D, V=D, BV=32, NORM=True),
            {},
        ),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    parser.add_argument(
        "--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="dtype the kernels are compiled for"
    )
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension K = V")
    parser.add_argument("--chunk", type=int, default=64, help="chunk size of the chunked kernels")
    parser.add_argument("--resets", action="store_true", help="the chunked kernels with document resets")
    args = parser.parse_args()

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    target = GPUTarget("cuda", args.arch, 32)
    print(f"sm_{args.arch}, {args.dtype}, D={args.head_dim}, chunk {args.chunk}, resets {args.resets}")
    for fn, signature, constexprs, options in kernels(args.dtype, args.head_dim, args.chunk, args.resets):
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target, options=options
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run(
                [str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
            ).stdout
        resources = next(line.strip() for line in usage.splitlines() if "REG:" in line)
        regs, stack = resources.split()[0], resources.split()[1]
        print(f"{fn.__name__:20s} shared {compiled.metadata.shared:7d} B  {regs}  {stack}")


if __name__ == "__main__":
    main()
