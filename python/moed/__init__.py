"""moed: a serving job's MoE layers, called from a Python program (docs/serving.md#python).

    import moed
    session = moed.Session(job="job-1")           # a local cluster's state dir, or agent=, token=, tls=
    block = moed.RemoteMoE(session, layer=0)      # a torch.nn.Module; its layer runs on the cluster
    y = block(x)                                  # x [N, H]; routing on the cluster
    loss.backward()                               # grad_x from the cluster, weight gradients summed there
    session.step()                                # one optimizer step for the session's clients
    local = moed.LocalMoE(session.weights()[1][0], session.spec["top_k"])  # the same layer in PyTorch
"""
from ._client import Handle, InvalidArgument, RpcError
from .local_moe import LocalMoE
from .remote_moe import RemoteMoE, Session

__all__ = ["Handle", "InvalidArgument", "LocalMoE", "RemoteMoE", "RpcError", "Session"]
