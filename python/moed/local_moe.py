"""LocalMoE: a served layer's math in PyTorch, from the weights a job reads back.

The same block as RemoteMoE computes on the cluster (docs/layer.md): a softmax
router over the experts, the top-k scores renormalised, SwiGLU experts (w13
holds gate_proj's rows, then up_proj's) and an always-on shared SwiGLU expert;
no residual. A program builds it from Session.weights() to run the same model
in-process (to compare, or without a cluster).
"""
import torch
import torch.nn.functional as F


class LocalMoE(torch.nn.Module):
    """One MoE layer in PyTorch. weights: one layer of Session.weights()."""

    def __init__(self, weights, top_k):
        super().__init__()
        self.top_k = top_k
        self.gate = torch.nn.Parameter(weights["gate"].clone())
        self.w13 = torch.nn.Parameter(weights["w13"].clone())
        self.w2 = torch.nn.Parameter(weights["w2"].clone())
        self.shared_w13 = torch.nn.Parameter(weights["shared_w13"].clone()) if "shared_w13" in weights else None
        self.shared_w2 = torch.nn.Parameter(weights["shared_w2"].clone()) if "shared_w2" in weights else None

    @staticmethod
    def swiglu(x, w13, w2):
        g, u = (x @ w13.T).chunk(2, dim=-1)
        return (F.silu(g) * u) @ w2.T

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = torch.softmax(x @ self.gate.T, dim=-1)
        top_w, top_i = scores.topk(self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.swiglu(x, self.shared_w13, self.shared_w2) if self.shared_w13 is not None else torch.zeros_like(x)
        for e in range(self.gate.shape[0]):
            pick = top_i == e
            rows = pick.any(dim=-1).nonzero().flatten()
            if rows.numel():
                weight = (top_w * pick).sum(dim=-1)[rows]
                out = out.index_add(0, rows, weight[:, None] * self.swiglu(x[rows], self.w13[e], self.w2[e]))
        return out.reshape(shape)
