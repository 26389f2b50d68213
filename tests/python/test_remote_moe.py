"""RemoteMoE against in-process torch MoE blocks (docs/serving.md#python).

A 2x2 local cluster (moectl cluster up) serves a 2-layer model's MoE layers
with --serve-train. A model whose MoE blocks are moed.RemoteMoE and the same
model with moed.LocalMoE blocks (the layer in PyTorch) of the same weights,
read from the job, give the same outputs and input gradients (fp32, rtol
1e-5), and after session.step()
the served weights equal torch's SGD and Adam updates of the same gradients.
Run by ctest (python_remote_moe) with /usr/bin/python3, the interpreter with
Debian's torch; MOECTL names the moectl binary, PYTHONPATH holds build/python.
"""
import copy
import unittest

import torch
import torch.nn.functional as F

import moed
from local_cluster import LocalClusterTest, moectl

SPEC = ["--mode", "serve", "--serve-train", "--experts", "8", "--top-k", "2", "--hidden", "64",
        "--ffn-hidden", "32", "--layers", "2", "--shared-experts", "1", "--shared-ffn-hidden", "16",
        "--tokens-per-rank", "64", "--serve-max-wait-ms", "1", "--seed", "5"]
LR = 0.01


class Model(torch.nn.Module):
    """Two blocks of attention then MoE, each with its residual; the MoE blocks given."""

    def __init__(self, hidden, moes):
        super().__init__()
        torch.manual_seed(0)
        self.attn = torch.nn.ModuleList([torch.nn.MultiheadAttention(hidden, 4, batch_first=True) for _ in moes])
        self.moe = torch.nn.ModuleList(moes)

    def forward(self, x):
        for attn, moe in zip(self.attn, self.moe):
            x = x + attn(x, x, x, need_weights=False)[0]
            x = x + moe(x)
        return x


class RemoteMoETest(LocalClusterTest):
    def serve(self, optimizer, wire_min_bytes=None):
        job = moectl(self.state, "job", "submit", *SPEC, "--optimizer", optimizer, "--lr", str(LR)).split()[0]
        self.addCleanup(moectl, self.state, "job", "cancel", job)
        session = moed.Session(job=job, state_dir=self.state, name="pytest-" + optimizer, wire_min_bytes=wire_min_bytes)
        self.addCleanup(session.close)
        return session

    def assert_close(self, got, want, what, rtol=1e-5):
        scale = want.abs().max().item()
        worst = (got - want).abs().max().item()
        self.assertLessEqual(worst, rtol * scale, f"{what}: off by {worst:.3g} at scale {scale:.3g}")

    def train_once(self, optimizer, wire_min_bytes=None):
        session = self.serve(optimizer, wire_min_bytes)
        steps, weights = session.weights()
        self.assertEqual(steps, 0)
        top_k = session.spec["top_k"]
        remote = Model(session.hidden, [moed.RemoteMoE(session, l) for l in range(session.layers)])
        local = Model(session.hidden, [moed.LocalMoE(w, top_k) for w in weights])
        local.attn.load_state_dict(remote.attn.state_dict())

        x = torch.randn(4, 12, session.hidden, generator=torch.Generator().manual_seed(1))
        target = torch.randn(4, 12, session.hidden, generator=torch.Generator().manual_seed(2))
        xr, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, yl = remote(xr), local(xl)
        self.assert_close(yr, yl.detach(), "outputs")
        F.mse_loss(yr, target).backward()
        F.mse_loss(yl, target).backward()
        self.assert_close(xr.grad, xl.grad, "input gradients")
        for (name, pr), pl in zip(remote.attn.named_parameters(), local.attn.parameters()):
            self.assert_close(pr.grad, pl.grad, "attention " + name)

        moe_params = [p for m in local.moe for p in m.parameters()]
        opt = torch.optim.SGD(moe_params, lr=LR) if optimizer == "sgd" else torch.optim.Adam(moe_params, lr=LR)
        before = copy.deepcopy([{k: v.detach().clone() for k, v in m.named_parameters()} for m in local.moe])
        opt.step()
        self.assertEqual(session.step(), 1)
        with self.assertRaisesRegex(RuntimeError, "nothing to apply"):
            session.step()
        steps, served = session.weights()
        self.assertEqual(steps, 1)
        for l, (m, was) in enumerate(zip(local.moe, before)):
            for name, p in m.named_parameters():
                self.assertFalse(torch.equal(p.detach(), was[name]), f"layer {l} {name} did not move")
                if optimizer == "sgd":
                    self.assert_close(served[l][name], p.detach(), f"layer {l} {name} after sgd")
                else:
                    self.assert_adam_step_close(served[l][name], p, f"layer {l} {name} after adam")

    def assert_adam_step_close(self, got, p, what, eps=1e-8):
        """Adam's first step moves a weight by lr x g / (|g| + eps): about lr
        where |g| >> eps, but steep where the gradient is near eps, so a
        gradient that differs by fp32 summation order (dg, 1e-5 of the tensor's
        largest, as the gradients are compared above) moves it by up to
        lr x dg x eps / (|g| - dg + eps)^2, and never by more than 2 lr. The
        bound per element is that plus 1e-3 lr for the update's own rounding."""
        g = p.grad.detach().abs()
        dg = 1e-5 * g.max().item()
        steep = LR * dg * eps / ((g - dg).clamp(min=0) + eps) ** 2
        bound = torch.clamp(steep, max=2 * LR) + 1e-3 * LR
        excess = ((got - p.detach()).abs() - bound).max().item()
        self.assertLessEqual(excess, 0.0, f"{what}: off by up to {excess:.3g} beyond the derived bound")
        # Where the gradient is well above eps the bound is 1e-3 lr: most of the tensor.
        self.assertGreater((g > 1e3 * eps).float().mean().item(), 0.5, f"{what}: gradients mostly near eps")

    def test_sgd(self):
        self.train_once("sgd")

    def test_adam_on_the_tensor_wire(self):
        self.train_once("adam", wire_min_bytes=0)  # every call's rows on UCX (docs/serving.md#data-path)

    def test_bf16_block_within_derived_bounds(self):
        """A bf16 job's block against the torch block in fp32 on the same bf16
        operands (weights as the job computes with them, rounded to bf16; x and
        grad_out rounded as RemoteMoE sends them). The served layer rounds its
        SwiGLU activation and its output to bf16 (and the backward its two
        gradients' operands): each rounding moves a value by at most 2^-8 of
        itself, and the bound is twice that, 2^-7 of the output's scale, as
        the EP layer's bf16 tests hold (docs/layer.md#how-tests-compare). Rows whose top-k is within 2^-6 of a tie in
        score are not compared: a bf16 router may pick the other expert."""
        job = moectl(self.state, "job", "submit", *SPEC, "--dtype", "bf16", "--optimizer", "sgd",
                     "--lr", str(LR)).split()[0]
        self.addCleanup(moectl, self.state, "job", "cancel", job)
        session = moed.Session(job=job, state_dir=self.state, name="pytest-bf16")
        self.addCleanup(session.close)
        _, weights = session.weights()
        bf = [{k: v.to(torch.bfloat16).float() for k, v in w.items()} for w in weights]
        block = moed.RemoteMoE(session, 0)
        local = moed.LocalMoE(bf[0], session.spec["top_k"])
        x = torch.randn(48, session.hidden, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).float()
        g = torch.randn(48, session.hidden, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).float()
        xr, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr = block(xr)
        self.assertEqual(yr.dtype, torch.float32)
        yl = local(xl)
        (yr * g).sum().backward()
        (yl * g).sum().backward()
        with torch.no_grad():
            scores = torch.softmax(x @ local.gate.T, dim=-1).sort(dim=-1, descending=True).values
            k = session.spec["top_k"]
            clear = (scores[:, k - 1] - scores[:, k]) > 2 ** -6
        self.assertGreater(int(clear.sum()), 24, "too few rows away from a routing tie")
        self.assert_close(yr[clear].detach(), yl[clear].detach(), "bf16 outputs", rtol=2 ** -7)
        self.assert_close(xr.grad[clear], xl.grad[clear], "bf16 input gradients", rtol=2 ** -7)

    def test_no_grad_keeps_nothing_and_async_calls_overlap(self):
        session = self.serve("sgd")
        block = moed.RemoteMoE(session, 1)
        x = torch.randn(20, session.hidden, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            y = block(x)
        futures = [session.forward_async(1, x[i:i + 5]) for i in range(0, 20, 5)]
        self.assertTrue(torch.equal(torch.cat([f.result() for f in futures]), y))
        with self.assertRaisesRegex(RuntimeError, "nothing to apply"):
            session.step()
        with self.assertRaisesRegex(ValueError, "layer: the job serves layers 0-1, got 2"):
            moed.RemoteMoE(session, 2)
        with self.assertRaisesRegex(ValueError, "x: 780 bytes are not whole rows of 64 fp32 values"):
            session.forward(0, torch.randn(3, session.hidden + 1))
        bf16_rows = torch.randn(3, session.hidden).to(torch.bfloat16).view(torch.int16).numpy()
        with self.assertRaisesRegex(RuntimeError, "dtype: the job computes in fp32, got bf16"):
            session._native.forward(0, bf16_rows, "bf16")
        self.assertTrue(torch.equal(block(x), y))  # the session serves on


if __name__ == "__main__":
    unittest.main()
