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
import subprocess
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

    def extend(self, x, cache):
        """forward() of new positions x [B, n, D] after the cached ones: their keys and
        values join cache ([keys, values], empty at first). The decode path."""
        x = x + self.attend(self.norm1(x), cache)
        return x + self.moe(self.norm2(x))

    def attend(self, h, cache):
        """The attention's math (MultiheadAttention's in and out projections) for the
        new positions over the cached ones and themselves, causal."""
        a = self.attn
        b, n, d = h.shape
        q, k, v = F.linear(h, a.in_proj_weight, a.in_proj_bias).chunk(3, dim=-1)
        if cache:
            k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
        cache[:] = [k, v]
        heads = a.num_heads
        split = lambda t: t.reshape(b, -1, heads, d // heads).transpose(1, 2)
        mask = torch.triu(torch.full((n, k.shape[1]), float("-inf")), diagonal=k.shape[1] - n + 1)
        w = torch.softmax(split(q) @ split(k).transpose(-1, -2) / math.sqrt(d // heads) + mask, dim=-1)
        return a.out_proj((w @ split(v)).transpose(1, 2).reshape(b, n, d))


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

    def extend(self, x, caches):
        """The next byte's logits after x [1, n], which follows the bytes the
        blocks' caches hold (a list per block, empty at first)."""
        start = caches[0][0].shape[1] if caches[0] else 0
        h = self.embed(x) + self.pos[start:start + x.shape[1]]
        for block, cache in zip(self.blocks, caches):
            h = block.extend(h, cache)
        return self.head(self.norm(h))[0, -1]


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
    def generate(self, prompt, count, seq, temperature, seed, cached=True):
        """count bytes after prompt, sampled one at a time (batch 1); returns (text,
        seconds per byte, bytes). cached: each byte runs through the blocks alone,
        against the keys and values kept (a forward call of 1 row a layer); when
        the context fills the model's seq positions, its last half is run again
        into fresh caches. Else every byte recomputes its context (up to seq)."""
        gen = torch.Generator().manual_seed(seed)
        out = list(prompt.encode())[-seq:]
        t0 = time.perf_counter()
        caches, logits = None, None
        for _ in range(count):
            if not cached:
                logits = self.model(torch.tensor([out[-seq:]]))[0, -1]
            elif caches is None or caches[0][0].shape[1] == seq:
                caches = [[] for _ in self.model.blocks]
                logits = self.model.extend(torch.tensor([out[-(seq // 2):] if len(out) >= seq else out]), caches)
            out.append(int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen)))
            if cached and caches[0][0].shape[1] < seq:
                logits = self.model.extend(torch.tensor([[out[-1]]]), caches)
        took = (time.perf_counter() - t0) / count
        return bytes(out).decode("utf-8", errors="replace"), took, out

    def save(self, path, step, gen):
        """The program's half at `step` (the served layers are the job's: its own
        checkpoints), written whole or not at all: a new file, fsync, rename."""
        state = {"step": step, "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                 "data_rng": gen.get_state()}
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def load(self, path, gen):
        """The step a checkpoint of save() was taken at, its state restored. A served
        model's job must be at the same step (resumed from its checkpoint of it)."""
        state = torch.load(path)
        if self.remote and self.session.steps != state["step"]:
            raise SystemExit(f"{path}: the program's half is at step {state['step']}, the serving job at "
                             f"{self.session.steps}: resume the job from its checkpoint step-{state['step']}")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        gen.set_state(state["data_rng"])
        return state["step"]


def rebalance(args):
    """A live rebalance of the serving job's placement from the load its calls measured."""
    cmd = [os.environ.get("MOECTL", "moectl")] + (["--state-dir", args.state_dir] if args.state_dir else [])
    cmd += ["placement", "rebalance", *args.rebalance_args.split()]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(f"rebalance ({time.perf_counter() - t0:.1f} s, exit {out.returncode}):\n{out.stdout}{out.stderr}", flush=True)
    if out.returncode != 0:
        raise SystemExit("the rebalance failed")


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
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--no-cache", action="store_true", help="generate recomputing the context for every byte")
    p.add_argument("--rebalance-at", type=int, default=-1, metavar="STEP",
                   help="before this step, rebalance the job's placement from its measured load, live "
                        "(moectl placement rebalance; MOECTL names moectl)")
    p.add_argument("--rebalance-args", default="--redundant-experts 4",
                   help="more flags of moectl placement rebalance")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save the program's half here (NAME-step-N.pt per model), as the job saves the served half")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    p.add_argument("--resume", default=None, metavar="STEP",
                   help="resume from --checkpoint-dir's files of step STEP (the job resumed from its step-STEP)")
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
    first = 0
    ckpt = lambda name, step: os.path.join(args.checkpoint_dir, f"{name}-step-{step}.pt")
    if args.resume is not None:
        for name, run in runs.items():
            first = run.load(ckpt(name, int(args.resume)), gen)
        print(f"resumed at step {first}")
    seconds = {name: 0.0 for name in runs}
    worst = 0.0
    for step in range(first, args.steps):
        if step == args.rebalance_at:
            rebalance(args)
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
        done = step + 1
        if args.checkpoint_dir and (done == args.steps or (args.checkpoint_every and done % args.checkpoint_every == 0)):
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            for name, run in runs.items():
                run.save(ckpt(name, done), done, gen)
    for name, run in runs.items():
        bpb = run.bits_per_byte(val, args.eval_batches, args.batch, args.seq, args.seed + 1)
        print(f"{name}: validation {bpb:.4f} bits/byte, {seconds[name]:.1f} s training")
    if len(runs) == 2:
        print(f"largest per-step loss drift {worst:.2e}")
    if args.generate:
        for name, run in runs.items():
            text, per_byte, _ = run.generate(args.prompt, args.generate, args.seq, args.temperature, args.seed,
                                            not args.no_cache)
            how = "recomputing the context" if args.no_cache else "with a KV cache"
            print(f"--- {name}, {1000 * per_byte:.1f} ms a byte {how}:\n{text}")
    session.close()


if __name__ == "__main__":
    main()
