"""Check the Triton gated DeltaProduct against the fp32 token-loop oracle on a real device.

    python scripts/check_gdp_triton.py                    # CUDA, bf16 inputs, D = 128
    TRITON_INTERPRET=1 python scripts/check_gdp_triton.py --tiny --dtype float32   # CPU dry run

The inputs are drawn in fp32, rounded to --dtype, and both implementations see the same rounded
values; the oracle then runs in fp32. Reported per tensor: the relative error |a - e| / |e| in the
Frobenius norm, against a bound of 1e-2 for 16-bit inputs (the outputs and gradients are stored in
bf16, whose rounding alone is ~4e-3 relative; the kernels' fp32 products may run as TF32) and 1e-4
for fp32. Exits 1 if any tensor is off. scripts/gpu_check.sh runs it.
"""

import argparse
import sys

from elr.cli import HelpFormatter

NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]


def make_inputs(B, T, H, D, n_h, dtype, device, seed=0):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(randn(B, T, H, D), dim=-1)
    k = F.normalize(randn(B, T * n_h, H, D), dim=-1)
    v = randn(B, T * n_h, H, D)
    g = F.logsigmoid(randn(B, T, H) + 3)  # decays near 0.95, as trained layers have
    beta = 2 * torch.sigmoid(randn(B, T * n_h, H))
    state = randn(B, H, D, D)
    # q, k, v in the test dtype; g, beta and the state stay fp32, as the GDP layer passes them
    return [x.to(dtype).to(device) for x in (q, k, v)] + [x.to(device) for x in (g, beta, state)]


def run(impl, inputs, n_h, use_state, upcast):
    import torch

    from elr_kernels.gated_delta_product import gated_delta_product

    inputs = [x.detach().clone() for x in inputs]
    if upcast:
        inputs = [x.float() for x in inputs]
    inputs = [x.requires_grad_() for x in (inputs if use_state else inputs[:5])]
    q, k, v, g, beta, *state = inputs
    o, final = gated_delta_product(
        q,
        k,
        v,
        g,
        beta,
        num_householder=n_h,
        initial_state=state[0] if state else None,
        output_final_state=True,
        impl=impl,
    )
    gen = torch.Generator().manual_seed(1)
    loss = (o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() + (
        final * torch.randn(final.shape, generator=gen).to(o.device)
    ).sum()
    return [o, final, *torch.autograd.grad(loss, inputs)]


def relative_error(a, e):
    return ((a.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="B=1, T=37, H=2, D=16 (interpreter)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the Triton run, compared with the fp32 naive op",
    )
    args = parser.parse_args()

    import torch

    from elr_kernels.gated_delta_product import gated_delta_product, gated_delta_product_step

    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, T, H, D = (1, 37, 2, 16) if args.tiny else (2, 300, 4, 128)
    bound = 1e-4 if dtype == torch.float32 else 1e-2
    print(
        f"triton vs fp32 naive: B={B} T={T} H={H} D={D}, {args.dtype} inputs, {device}, "
        f"bound {bound:g} on |a - e| / |e|"
    )
    worst = 0.0
    for n_h in (1, 2, 3):
        inputs = make_inputs(B, T, H, D, n_h, dtype, device)
        for use_state in (False, True):
            expected = run("naive", inputs, n_h, use_state, upcast=True)
            actual = run("triton", inputs, n_h, use_state, upcast=False)
            names = NAMES if use_state else NAMES[:-1]
            errors = {n: relative_error(a, e) for n, a, e in zip(names, actual, expected)}
            worst = max(worst, *errors.values())
            print(
                f"n_h={n_h} initial_state={use_state!s:5}  " + "  ".join(f"{n} {err:.1e}" for n, err in errors.items())
            )
        # decoding: the one-token kernel, token by token, against the oracle's outputs
        q, k, v, g, beta, state = inputs
        o_ref, _ = gated_delta_product(
            *(x.float() for x in (q, k, v, g, beta)), num_householder=n_h, initial_state=state, impl="naive"
        )
        S, outputs = state, []
        for t in range(min(T, 64)):
            sub = slice(t * n_h, (t + 1) * n_h)
            o_t, S = gated_delta_product_step(
                q[:, t : t + 1],
                k[:, sub],
                v[:, sub],
                g[:, t : t + 1],
                beta[:, sub],
                S,
                num_householder=n_h,
                impl="triton",
            )
            outputs.append(o_t)
        err = relative_error(torch.cat(outputs, 1), o_ref[:, : len(outputs)])
        worst = max(worst, err)
        print(f"n_h={n_h} decode, {len(outputs)} tokens  o {err:.1e}")
    print(f"worst {worst:.1e}: {'ok' if worst <= bound else 'FAILED'}")
    sys.exit(0 if worst <= bound else 1)


if __name__ == "__main__":
    main()
