"""The example language model (examples/moe_lm, docs/example-lm.md), tiny, in CI.

A 1x2 local cluster serves a 2-block byte-level model's MoE layers
(--serve-train, Adam). The model with moed.RemoteMoE blocks and the same model
with moed.LocalMoE blocks train side by side on the same batches of the Python
standard library's sources: their per-step losses agree (rtol 1e-4, as the
issue holds the full run's first 50 steps). Generation with the KV cache gives
the logits of recomputing the whole context, on the served model; a checkpoint
of the program's half resumes to the same losses, and a served model's
checkpoint refuses a job at another step, naming both.
Run by ctest (python_moe_lm) with /usr/bin/python3; MOECTL names moectl,
PYTHONPATH holds build/python.
"""
import os
import shutil
import sys
import tempfile
import unittest

import torch

import moed
from local_cluster import LocalClusterTest, moectl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "moe_lm"))
import moe_lm  # noqa: E402  (the example, from the repository)

BATCH, SEQ, HEADS = 4, 32, 2
SPEC = ["--mode", "serve", "--serve-train", "--optimizer", "adam", "--lr", "0.003", "--experts", "8",
        "--top-k", "2", "--hidden", "32", "--ffn-hidden", "32", "--layers", "2", "--shared-experts", "1",
        "--shared-ffn-hidden", "32", "--tokens-per-rank", str(BATCH * SEQ // 2), "--serve-max-wait-ms", "1",
        "--seed", "3"]


class MoeLmTest(LocalClusterTest):
    NODES, DEVICES = 1, 2

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.train_bytes, cls.val_bytes = moe_lm.corpus("/usr/lib/python3.11", 0.05)

    def session(self):
        job = moectl(self.state, "job", "submit", *SPEC).split()[0]
        self.addCleanup(moectl, self.state, "job", "cancel", job)
        session = moed.Session(job=job, state_dir=self.state, name="pytest-lm")
        self.addCleanup(session.close)
        return session

    def train(self, runs, gen, steps):
        losses = []
        for _ in range(steps):
            x, y = moe_lm.batch(self.train_bytes, BATCH, SEQ, gen)
            losses.append([run.train_step(x, y) for run in runs])
        return losses

    def test_served_model_trains_as_pytorch_generates_with_its_cache_and_checks_its_checkpoint(self):
        session = self.session()
        served = moe_lm.Run(session, True, session.hidden, HEADS, SEQ)
        local = moe_lm.Run(session, False, session.hidden, HEADS, SEQ)
        gen = torch.Generator().manual_seed(1)
        losses = self.train([served, local], gen, 6)
        for step, (s, l) in enumerate(losses):
            self.assertLessEqual(abs(s - l), 1e-4 * l, f"step {step}: served {s} local {l}")
        self.assertLess(losses[-1][0], 8.0)  # below a uniform byte's 8 bits
        self.assertLess(served.bits_per_byte(self.val_bytes, 2, BATCH, SEQ, 2), 8.0)

        # The KV cache: each byte's logits against the whole context's, through the service.
        with torch.no_grad():
            out = list(b"def f(")
            caches = [[] for _ in served.model.blocks]
            logits = served.model.extend(torch.tensor([out]), caches)
            for i in range(12):
                full = served.model(torch.tensor([out]))[0, -1]
                scale = full.abs().max().item()
                self.assertLessEqual((logits - full).abs().max().item(), 1e-5 * scale, f"byte {i}")
                out.append(int(full.argmax()))
                logits = served.model.extend(torch.tensor([[out[-1]]]), caches)
        text, per_byte, made = served.generate("def ", 40, SEQ, 0.8, 5)  # past SEQ: the cache is refilled
        self.assertEqual(len(made), 44)
        self.assertGreater(per_byte, 0)

        # A served model's checkpoint names the job's step when they differ.
        ckpt = tempfile.mkdtemp(prefix="moed-lm-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        served.save(os.path.join(ckpt, "served-step-3.pt"), 3, gen)
        with self.assertRaisesRegex(SystemExit, "program's half is at step 3, the serving job at 6"):
            served.load(os.path.join(ckpt, "served-step-3.pt"), gen)

    def test_a_checkpoint_of_the_programs_half_resumes_to_the_same_losses(self):
        session = self.session()
        local = moe_lm.Run(session, False, session.hidden, HEADS, SEQ)
        gen = torch.Generator().manual_seed(7)
        self.train([local], gen, 2)
        ckpt = tempfile.mkdtemp(prefix="moed-lm-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        path = os.path.join(ckpt, "local-step-2.pt")
        local.save(path, 2, gen)
        went_on = self.train([local], gen, 2)
        resumed = moe_lm.Run(session, False, session.hidden, HEADS, SEQ)
        gen2 = torch.Generator()
        self.assertEqual(resumed.load(path, gen2), 2)
        self.assertEqual(self.train([resumed], gen2, 2), went_on)
        self.assertFalse(os.path.exists(path + ".tmp"))


if __name__ == "__main__":
    unittest.main()
