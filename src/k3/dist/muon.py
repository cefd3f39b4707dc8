"""Muon on FSDP-sharded parameters (issue 17, item 2; SPEC §7): whole matrices on one owner rank, exactly.

Per-Head Muon orthogonalises whole head blocks, which a row shard of FSDP2 does not hold. `owner_update` sends the
shards of a parameter's Nesterov direction (momentum is element-wise, so it stays sharded) to one owner rank of the
shard group (``gather``), the owner applies the single-process update to the full matrix, and sends each rank its
rows back (``scatter``). Owners rotate over the parameters, so each rank orthogonalises about 1/n of the matrices.
Communication per matrix of ``s`` bytes over a shard group of ``n`` ranks: ``(n − 1)/n · s`` into the owner and
``(n − 1)/n · s`` out of it — ``2·(n − 1)/n · s`` in all, what an all-gather of the full matrix to every rank would
cost each rank alone, without the n-fold repeated Newton–Schulz. Replicas (HSDP) repeat the same exact update.

`grad_norm` is the global gradient norm of sharded and plain parameters alike (each shard's squares summed over
its shard groups), for clipping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from k3.dist.fsdp import local_shard


def _shard_dim(t: DTensor) -> int:
    dims = [d for d, p in enumerate(t.placements) if isinstance(p, Shard)]
    if len(dims) != 1 or t.placements[dims[0]].dim != 0:
        raise ValueError(f"owner_update: expected one row shard (Shard(0)), got placements {t.placements}")
    return dims[0]


def owner_update(direction: DTensor, owner: int, update: Callable[[Tensor], Tensor]) -> Tensor:
    """This rank's rows of ``update(full direction)``, computed on rank ``owner`` of the shard group alone."""
    dim = _shard_dim(direction)
    mesh = direction.device_mesh
    group, n, me = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    owner %= n
    local = direction.to_local()
    rows = direction.shape[0]
    chunk = -(-rows // n)
    padded = local.new_zeros(chunk, *local.shape[1:])
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(n)] if me == owner else None
    dist.gather(padded, pieces, group=group, group_dst=owner)
    results = None
    if me == owner:
        full = update(torch.cat(pieces)[:rows]).to(padded.dtype)
        results = list(torch.cat([full, full.new_zeros(n * chunk - rows, *full.shape[1:])]).split(chunk))
    mine = torch.empty_like(padded)
    dist.scatter(mine, results, group=group, group_src=owner)
    return mine[: local.shape[0]]


def grad_norm(params: Iterable[Tensor], extra: dict[DeviceMesh, dist.ProcessGroup] | None = None) -> Tensor:
    """The 2-norm of all gradients (fp32) as the single process computes it, for plain and sharded parameters: each
    shard's squares are summed over the groups of its mesh's sharded dimensions (not over replicas), and over
    ``extra[mesh]`` where given (expert parallelism: the ranks holding other experts)."""
    groups: dict[tuple, list] = {}  # (mesh id, sharded dims) → [mesh, sharded dims, sum of squares]
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        mesh, dims, local = None, (), g
        if isinstance(g, DTensor):
            mesh, local = g.device_mesh, g.to_local()
            dims = tuple(d for d, placement in enumerate(g.placements) if isinstance(placement, Shard))
        entry = groups.setdefault((id(mesh), dims), [mesh, dims, 0.0])
        entry[2] = entry[2] + local.detach().float().pow(2).sum()
    totals = []
    for mesh, dims, total in groups.values():
        for d in dims:
            dist.all_reduce(total, group=mesh.get_group(d))
        if extra and mesh is not None and mesh in extra:
            dist.all_reduce(total, group=extra[mesh])
        totals.append(total)
    if not totals:  # no gradient anywhere: nothing tells the device
        return torch.zeros((), device="cpu")
    norm2 = totals[0]
    for total in totals[1:]:
        norm2 = norm2 + total.to(norm2.device)
    return norm2.sqrt()


@torch.no_grad()
def clip_grad_norm(params: list[Tensor], max_norm: float,
                   extra: dict[DeviceMesh, dist.ProcessGroup] | None = None) -> float:
    """`torch.nn.utils.clip_grad_norm_` for parameters sharded on different meshes (`grad_norm`): scale every gradient
    by ``max_norm / (norm + 1e-6)`` when the global norm exceeds ``max_norm``; returns the norm before clipping."""
    norm = grad_norm(params, extra)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            g = local_shard(p.grad)
            g.mul_(coefficient.to(g.device, g.dtype))
    return float(norm)
