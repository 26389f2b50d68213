#!/usr/bin/python3
"""Eager PyTorch figures beside `moe-bench layer`: the same MoE layer (router in the
layer dtype, softmax top-k with normalised weights, SwiGLU experts) computed the way
Megatron-Core's SequentialMLP does it: tokens sorted by expert, then a Python loop
over experts with one matmul pair each, then a weighted scatter-add back. Prints one
JSON line with the median forward and forward+backward step times and tokens/s.

  /usr/bin/python3 daemon/bench/torch_layer.py --dtype bf16 --threads 2
  python3 daemon/bench/torch_layer.py --device cuda --tokens 16384 --hidden 4096 --ffn 1536

--params fp32 keeps the parameters (and so their gradients) in fp32 and casts them to the layer
dtype where they are used, as mixed-precision training with fp32 master weights does (PyTorch's
autocast, Megatron's fp32 main params); it is moe's bf16 recipe, where the default (parameters in
the layer dtype) is pure bf16 training with no master copy. --optimizer adam adds torch.optim.Adam's
step to each train step (its moments in the parameters' dtype), as moe-bench layer --optimizer adam.

Debian's python3-torch (1.13) runs bf16 matmuls on oneDNN and fp32 ones on OpenBLAS
or oneDNN, with its own OpenMP team of --threads threads. With --device cuda the same
layer runs on the GPU (cuBLAS matmuls), timed with the device synchronised.
"""
import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F


def make_params(args, dtype, train):
    """Parameters in `dtype` (the layer's, or fp32 for --params fp32)."""
    # gate [E, H]; per expert (own tensors, as SequentialMLP's modules) w13 [2I, H], w2 [H, I].
    g = torch.Generator(device=args.device).manual_seed(args.seed)
    H, I, E = args.hidden, args.ffn, args.experts

    def param(*shape, fan_in):
        w = torch.randn(*shape, generator=g, device=args.device) / fan_in ** 0.5
        return w.to(dtype).requires_grad_(train)

    gate = param(E, H, fan_in=H)
    w13 = [param(2 * I, H, fan_in=H) for _ in range(E)]  # gate_proj rows, then up_proj rows
    w2 = [param(H, I, fan_in=I) for _ in range(E)]
    return gate, w13, w2


def moe_layer(x, gate, w13, w2, top_k):
    """x [T, H] -> out [T, H]; per-expert loop as in Megatron's SequentialMLP."""
    num_experts = len(w13)

    def used(w):  # a parameter as the layer computes with it (a cast when it is an fp32 master)
        return w if w.dtype == x.dtype else w.to(x.dtype)

    scores = torch.softmax((x @ used(gate).t()).float(), dim=-1)
    weight, idx = torch.topk(scores, top_k, dim=-1)
    weight = weight / weight.sum(dim=-1, keepdim=True)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # permute: expert-major
    token = order // top_k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = torch.split(x.index_select(0, token), counts)  # one split (its backward is one cat)
    outs = []
    for e, r in enumerate(rows):
        g, u = (r @ used(w13[e]).t()).chunk(2, dim=-1)
        outs.append((F.silu(g) * u) @ used(w2[e]).t())
    y = torch.cat(outs) * weight.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token, y)  # unpermute: weighted sum per token


def median_seconds(step, warmup, iters, sync):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--params", choices=["dtype", "fp32"], default="dtype",
                   help="parameters in the layer dtype, or fp32 masters cast where used")
    p.add_argument("--optimizer", choices=["none", "adam"], default="none",
                   help="train: an Adam step after each backward")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator(device=args.device).manual_seed(args.seed + 1)
    x = torch.randn(args.tokens, args.hidden, generator=g, device=args.device).to(dtype)
    grad_out = torch.randn(args.tokens, args.hidden, generator=g, device=args.device).to(dtype)

    param_dtype = torch.float32 if args.params == "fp32" else dtype
    gate, w13, w2 = make_params(args, param_dtype, train=False)
    with torch.no_grad():
        fwd = median_seconds(lambda: moe_layer(x, gate, w13, w2, args.top_k), args.warmup, args.iters, sync)

    gate, w13, w2 = make_params(args, param_dtype, train=True)
    xg = x.clone().requires_grad_(True)
    adam = torch.optim.Adam([gate] + w13 + w2, lr=1e-3) if args.optimizer == "adam" else None

    def train_step():
        for t in [xg, gate] + w13 + w2:
            t.grad = None
        moe_layer(xg, gate, w13, w2, args.top_k).backward(grad_out)
        if adam:
            adam.step()

    train = median_seconds(train_step, args.warmup, args.iters, sync)

    print(json.dumps({
        "bench": "torch_layer", "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "dtype": args.dtype, "params": args.params, "optimizer": args.optimizer, "threads": args.threads, "tokens": args.tokens, "hidden": args.hidden,
        "ffn": args.ffn, "experts": args.experts, "top_k": args.top_k, "iters": args.iters,
        "forward_step_seconds_p50": fwd, "forward_tokens_per_second": args.tokens / fwd,
        "train_step_seconds_p50": train, "train_tokens_per_second": args.tokens / train,
    }))


if __name__ == "__main__":
    main()
