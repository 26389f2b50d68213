"""A byte-level MoE language model whose MoE blocks run on a moed serving job.

Attention, norms, embeddings and the head run here, in PyTorch; each block's
MoE layer is a moed.RemoteMoE of one serving job (--serve-train), or, with
--local, a moed.LocalMoE: the same layer in PyTorch from the same initial
weights (read from the job). --compare trains both side by side on the same
batches and prints both losses each step. The corpus is the Python standard
library's sources (/usr/lib/python3.11/*.py on Debian 12: every machine of
this kind has them), split into train and validation by file name.

    PYTHONPATH=build/python /usr/bin/python3 examples/moe_lm/moe_lm.py \\
        --state-dir STATE --job JOB --steps 300 --compare
"""
import argparse
import glob
import hashlib
import math
import os
import time

import torch
import torch.nn.functional as F

import moed

LN2 = math.log(2.0)


def corpus(root, validation_share):
    """(train, validation) byte tensors: each file goes wholly to one side, by its name's hash."""
    train, val = [], []
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        pick = int(hashlib.sha1(os.path.basename(path).encode()).hexdigest(), 16) % 1000
        (val if pick < validation_share * 1000 else train).append(data)
    if not train or not val:
        raise SystemExit(f"corpus: no Python sources to split under {root}")
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    return as_tensor(train), as_tensor(val)


def batch(data, batch_size, seq, gen):
    """batch_size windows of seq + 1 bytes at seeded offsets: (inputs, next bytes)."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch_size,), generator=gen)
    rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


class Block(torch.nn.Module):
    """Pre-norm causal self-attention, then the MoE layer, each with its residual."""

    def __init__(self, d_model, heads, moe):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(d_model)
        self.attn = torch.nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(d_model)
        self.moe = moe

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class ByteLM(torch.nn.Module):
    """Embeddings of the 256 byte values and of positions, the blocks, a norm and the head.
    Every parameter outside the MoE layers is drawn from seed 0, so two models with
    the same MoE weights start equal."""

    def __init__(self, d_model, heads, seq, moes):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(256, d_model)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(seq, d_model))
        self.blocks = torch.nn.ModuleList([Block(d_model, heads, m) for m in moes])
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, 256, bias=False)

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        h = self.embed(x) + self.pos[:n]
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.norm(h))


class Run:
    """One model and its optimizers: the served MoE layers step on the cluster
    (session.step()), everything else (and LocalMoE layers) with torch's Adam at
    the job's lr."""

    def __init__(self, session, remote, d_model, heads, seq):
        _, weights = session.weights()
        top_k = session.spec["top_k"]
        moes = [moed.RemoteMoE(session, l) if remote else moed.LocalMoE(w, top_k) for l, w in enumerate(weights)]
        self.session, self.remote = session, remote
        self.model = ByteLM(d_model, heads, seq, moes)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=session.spec["lr"])

    def train_step(self, x, y):
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        if self.remote:
            self.session.step()
        self.opt.step()
        return loss.item() / LN2

    @torch.no_grad()
    def bits_per_byte(self, data, batches, batch_size, seq, seed):
        gen = torch.Generator().manual_seed(seed)
        total = 0.0
        for _ in range(batches):
            x, y = batch(data, batch_size, seq, gen)
            total += F.cross_entropy(self.model(x).reshape(-1, 256), y.reshape(-1)).item()
        return total / batches / LN2

    @torch.no_grad()
    def generate(self, prompt, count, seq, temperature, seed):
        """count bytes after prompt, sampled one at a time (batch 1); returns (text, seconds per byte)."""
        gen = torch.Generator().manual_seed(seed)
        out = list(prompt.encode())
        t0 = time.perf_counter()
        for _ in range(count):
            ctx = torch.tensor([out[-seq:]])
            logits = self.model(ctx)[0, -1] / temperature
            out.append(int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)))
        took = (time.perf_counter() - t0) / count
        return bytes(out).decode("utf-8", errors="replace"), took


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", required=True, help="the serving job (moectl job submit --mode serve --serve-train ...)")
    p.add_argument("--state-dir", default=None, help="the local cluster's state directory")
    p.add_argument("--corpus", default="/usr/lib/python3.11")
    p.add_argument("--validation-share", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--local", action="store_true", help="the MoE layers in PyTorch only (the job gives their weights)")
    p.add_argument("--compare", action="store_true", help="train the served and the local model side by side")
    p.add_argument("--generate", type=int, default=0, help="bytes to generate after training")
    p.add_argument("--prompt", default="def ")
    args = p.parse_args()

    train, val = corpus(args.corpus, args.validation_share)
    print(f"corpus {args.corpus}: {train.numel()} train bytes, {val.numel()} validation bytes")
    session = moed.Session(job=args.job, state_dir=args.state_dir, name="moe-lm")
    d_model = session.hidden
    runs = {}
    if args.compare or not args.local:
        runs["served"] = Run(session, True, d_model, args.heads, args.seq)
    if args.compare or args.local:
        runs["local"] = Run(session, False, d_model, args.heads, args.seq)
    gen = torch.Generator().manual_seed(args.seed)
    seconds = {name: 0.0 for name in runs}
    worst = 0.0
    for step in range(args.steps):
        x, y = batch(train, args.batch, args.seq, gen)
        losses = {}
        for name, run in runs.items():
            t0 = time.perf_counter()
            losses[name] = run.train_step(x, y)
            seconds[name] += time.perf_counter() - t0
        line = f"step {step:4d} " + " ".join(f"{n} {v:.5f} bits/byte" for n, v in losses.items())
        if len(losses) == 2:
            drift = abs(losses["served"] - losses["local"]) / losses["local"]
            worst = max(worst, drift)
            line += f" drift {drift:.2e}"
        print(line, flush=True)
    for name, run in runs.items():
        bpb = run.bits_per_byte(val, args.eval_batches, args.batch, args.seq, args.seed + 1)
        print(f"{name}: validation {bpb:.4f} bits/byte, {seconds[name]:.1f} s training")
    if len(runs) == 2:
        print(f"largest per-step loss drift {worst:.2e}")
    if args.generate:
        for name, run in runs.items():
            text, per_byte = run.generate(args.prompt, args.generate, args.seq, 0.8, args.seed)
            print(f"--- {name}, {1000 * per_byte:.1f} ms a byte:\n{text}")
    session.close()


if __name__ == "__main__":
    main()
