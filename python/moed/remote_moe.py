"""Session and RemoteMoE: torch tensors over the C++ client (moed._client).

A RemoteMoE's forward sends hidden states [N, H] to the serving job and returns
the layer's output (no residual); with autograd on, the rows stay on the node
that answered, under a handle, and the backward sends grad_out there for grad_x,
the layer's weight gradients adding up on the cluster until Session.step().
"""
import concurrent.futures
import json

import torch

from . import _client

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_WORDS = {"fp32": torch.int32, "bf16": torch.int16}  # numpy has no bf16: rows travel as words


def _rows(t, dtype):
    """A contiguous host tensor's values as a numpy buffer, without a copy."""
    t = t.detach().to(device="cpu", dtype=_TORCH_DTYPES[dtype]).contiguous()
    return t.view(_WORDS[dtype]).numpy()


def _tensor(raw, dtype, hidden):
    """The reply's bytes as a [rows, hidden] tensor of the dtype."""
    return torch.from_numpy(raw).view(_TORCH_DTYPES[dtype]).reshape(-1, hidden)


class Session:
    """A program's session with a serving job, found through the agent.

    job: the job's id. Without agent=, the local cluster in state_dir (default
    $MOE_STATE_DIR or ~/.local/state/moed) gives the agent, token and TLS files,
    as moectl reads them. Calls from several threads run at once. A call with at
    least wire_min_bytes of rows (default 128 KiB) sends them on the tensor wire
    (UCX, authenticated, not encrypted: docs/serving.md#data-path); 0 sends every
    call's rows there, a huge value none.
    """

    def __init__(self, job, agent=None, token=None, state_dir=None, tls=None, name="python", timeout_s=30.0,
                 max_workers=8, wire_min_bytes=None):
        self._native = _client.Session(job, agent=agent, token=token, state_dir=state_dir, tls=tls, name=name,
                                       timeout_s=timeout_s, wire_min_bytes=wire_min_bytes)
        self.spec = json.loads(self._native.spec_json())
        self.hidden = self._native.hidden
        self.layers = self._native.layers
        self.dtype = self._native.dtype
        self.torch_dtype = _TORCH_DTYPES[self.dtype]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="moed")

    @property
    def steps(self):
        """The job's optimizer steps, as this session last heard."""
        return self._native.steps

    def forward(self, layer, x):
        """The layer's output for x [N, H] (no autograd)."""
        raw = self._native.forward(layer, _rows(x, self.dtype), self.dtype)
        return _tensor(raw, self.dtype, self.hidden)

    def forward_async(self, layer, x):
        """forward() on the session's threads: a concurrent.futures.Future of the output."""
        return self._pool.submit(self.forward, layer, x)

    def forward_kept(self, layer, x):
        """(output, handle): the rows kept on the node for one backward()."""
        raw, handle = self._native.forward(layer, _rows(x, self.dtype), self.dtype, keep_for_backward=True)
        return _tensor(raw, self.dtype, self.hidden), handle

    def backward(self, handle, grad_y):
        """grad_x for the gradient of the handle's output; spends the handle."""
        raw = self._native.backward(handle, _rows(grad_y, self.dtype), self.dtype)
        return _tensor(raw, self.dtype, self.hidden)

    def step(self, clients=1, caller=""):
        """One optimizer step on the gradients summed since the last, applied once
        `clients` callers (distinct `caller` names) asked. Returns the job's steps."""
        return self._native.step(clients, caller)

    def weights(self):
        """Every layer's weights as the job computes with them, as torch tensors:
        gate [E, H], w13 [E, 2I, H], w2 [E, H, I], and shared_w13 [2Is, H],
        shared_w2 [H, Is], shared_gate [H], selection_bias [E], logit_bias [E]
        where the layer has them."""
        steps, layers = self._native.weights()
        E, H = self.spec["experts"], self.hidden
        out = []
        for w in layers:
            t = {k: torch.from_numpy(v) for k, v in w.items() if v.size}
            t["gate"] = t["gate"].reshape(E, H)
            t["w13"] = t["w13"].reshape(E, -1, H)
            t["w2"] = t["w2"].reshape(E, H, -1)
            if "shared_w13" in t:
                t["shared_w13"] = t["shared_w13"].reshape(-1, H)
                t["shared_w2"] = t["shared_w2"].reshape(H, -1)
            out.append(t)
        return steps, out

    def close(self):
        """Ends the session: its connections close, and the nodes drop the rows
        they kept for its backward calls (docs/serving.md#disconnects)."""
        self._pool.shutdown(wait=True)
        self._native = None


class _RemoteLayer(torch.autograd.Function):
    """The layer's forward and backward on the cluster. `anchor` is the module's
    empty parameter: it makes autograd call backward even when x needs no
    gradient, since the layer's own weights (on the cluster) always do."""

    @staticmethod
    def forward(ctx, x, anchor, session, layer):
        y, handle = session.forward_kept(layer, x)
        ctx.session, ctx.handle = session, handle
        return y

    @staticmethod
    def backward(ctx, grad_y):
        grad_x = ctx.session.backward(ctx.handle, grad_y)
        return grad_x, None, None, None


class RemoteMoE(torch.nn.Module):
    """A served MoE layer as a module: y = moe_layer(x) for x [N, H] (or [..., H]).

    With autograd on, backward runs on the cluster (the job must train:
    --serve-train); under torch.no_grad() the call keeps nothing.
    """

    def __init__(self, session, layer):
        super().__init__()
        if not 0 <= layer < session.layers:
            raise ValueError(f"layer: the job serves layers 0-{session.layers - 1}, got {layer}")
        self.session, self.layer = session, layer
        self.anchor = torch.nn.Parameter(torch.empty(0))

    def forward(self, x):
        shape, dtype = x.shape, x.dtype
        rows = x.reshape(-1, self.session.hidden).to(self.session.torch_dtype)
        if torch.is_grad_enabled() and self.session._native.trains:
            y = _RemoteLayer.apply(rows, self.anchor, self.session, self.layer)
        else:
            y = self.session.forward(self.layer, rows)
        return y.to(dtype).reshape(shape)

    def extra_repr(self):
        return f"layer={self.layer}, hidden={self.session.hidden}"
