"""MoonViT-V2 and its projector into the language width (SPEC §6; the released encoder, SPEC §10).

Input is a packed batch of *grids* — an image is a grid ``(1, h, w)`` of 14-px patches, a video chunk ``(t, h, w)``
with ``t ≤ vision.max_frames`` frames — as ``pixel_values [L, C·p·p]`` (patches row-major over (frame, row, column),
channel-first inside a patch; `k3.tokenization.image` makes them) and ``grid_thw [N, 3]``. Nothing is padded: attention
runs within each grid only (block-diagonal), so an image's tokens never depend on its batch neighbours.

Per grid: patch embedding (a bias-free linear map of each patch), plus the learnable position table ``[S, S, D]``
resized bilinearly to ``(h, w)`` (used as is when ``(h, w) = (S, S)``), plus for ``t > 1`` a fixed sinusoidal time
embedding ``[sin(t'ω) | cos(t'ω)]``, ``ω_j = 10000^(−j/(D/2))``; then ``num_layers`` pre-norm blocks (RMSNorm,
bias-free) ``x += wo(attn(rope(wqkv(norm0 x))))``, ``x += fc1(gelu_tanh(fc0(norm1 x)))``; a final RMSNorm; the
``sd2_tpool`` merge (mean over frames, then each 2×2 neighbourhood ``[p(2i,2j), p(2i,2j+1), p(2i+1,2j),
p(2i+1,2j+1)]`` concatenated to 4·D channels, row-major over (i, j)); and the projector Linear(4D→4D) – GELU –
Linear(4D→d) – RMSNorm(d). One visual token per merged 2×2 neighbourhood.

Positions inside attention: 2-D rotary embedding over adjacent pairs of each head's channels, pair ``2i`` turned
by ``column · f_i`` and pair ``2i+1`` by ``row · f_i``, ``f_i = θ^(−4i/head_dim)``, computed in fp32.

Attention (``vision.attention``): ``"joint"`` — every patch of a grid attends to every patch of the same grid, all
frames together (the release); ``"divided"`` — blocks alternate spatial attention within each frame (even blocks)
and temporal attention across the frames at each patch position (odd blocks), SPEC §6's factorisation. For an
image (``t = 1``) the two differ only in the temporal blocks, where each patch attends to itself.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3.config import K3Config, VisionConfig
from k3.model.norm import RMSNorm

Grid = tuple[int, int, int]


def grids_of(grid_thw: Tensor | list, max_frames: int, merge: int) -> list[Grid]:
    """``grid_thw`` ``[N, 3]`` as a list of ``(t, h, w)``; each must be positive, ``t ≤ max_frames`` and ``h``,
    ``w`` multiples of ``merge`` (else a ValueError naming the grid)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, Tensor) else [list(g) for g in grid_thw]
    grids = []
    for n, row in enumerate(rows):
        if len(row) != 3 or not all(isinstance(v, int) and v > 0 for v in row):
            raise ValueError(f"grid_thw[{n}] = {row}: expected three positive integers (frames, rows, columns)")
        t, h, w = row
        if t > max_frames:
            raise ValueError(f"grid_thw[{n}] = {row}: {t} frames, at most vision.max_frames={max_frames} per chunk")
        if h % merge or w % merge:
            raise ValueError(f"grid_thw[{n}] = {row}: rows and columns must be multiples of the {merge}×{merge} merge")
        grids.append((t, h, w))
    return grids


def visual_token_count(grid: Grid, merge: int = 2) -> int:
    """Visual tokens a grid becomes: one per merged ``merge × merge`` neighbourhood (frames are averaged)."""
    _, h, w = grid
    return (h // merge) * (w // merge)


def time_embedding(frames: int, width: int, device: torch.device | None = None) -> Tensor:
    """``[frames, width]`` fp64: row t is ``[sin(t·ω) | cos(t·ω)]`` with ``ω_j = 10000^(−j/(width/2))``."""
    arange = functools.partial(torch.arange, dtype=torch.float64, device=device)
    omega = 1.0 / 10000 ** (arange(width // 2) / (width // 2))
    angle = arange(frames)[:, None] * omega
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


def rope_angles(grid: Grid, head_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """``[t·h·w, head_dim/2]`` fp64 rotation angles of a grid's patches: pair 2i by column·f_i, 2i+1 by row·f_i."""
    t, h, w = grid
    arange = functools.partial(torch.arange, dtype=torch.float64, device=device)
    freqs = theta ** (-4 * arange(head_dim // 4) / head_dim)
    row, col = torch.meshgrid(arange(h), arange(w), indexing="ij")
    angles = torch.stack([col.reshape(-1, 1) * freqs, row.reshape(-1, 1) * freqs], dim=-1).flatten(1)
    return angles.repeat(t, 1)


def apply_rope(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate adjacent channel pairs of ``x`` ``[L, H, hd]`` by ``angles`` ``[L, hd/2]``, in at least fp32."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    pairs = x.to(dtype).unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


class PositionTable(nn.Module):
    """The learnable position table ``weight [S, S, D]`` (release: ``patch_embed.pos_emb.weight``)."""

    def __init__(self, size: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, size, width))

    def forward(self, h: int, w: int) -> Tensor:
        """``[h·w, D]``: the table itself at ``(S, S)``, else resized bilinearly (half-pixel centres)."""
        width = self.weight.shape[-1]
        if tuple(self.weight.shape[:2]) == (h, w):
            return self.weight.reshape(h * w, width)
        resized = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
        return resized[0].permute(1, 2, 0).reshape(h * w, width)


class PatchEmbed(nn.Module):
    """Bias-free patch projection (stored as the release's conv weight ``[D, C, p, p]``) plus positions."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(v.in_channels, v.hidden_size, v.patch_size, v.patch_size, bias=False)
        self.pos_emb = PositionTable(v.pos_emb_size, v.hidden_size) if v.pos_emb_size else None

    def positions(self, grid: Grid) -> Tensor:
        """``[t·h·w, D]``: the position table at ``(h, w)`` repeated per frame, plus the time embedding when
        ``t > 1``."""
        t, h, w = grid
        width = self.proj.weight.shape[0]
        table = self.proj.weight.new_zeros(h * w, width) if self.pos_emb is None else self.pos_emb(h, w)
        table = table.repeat(t, 1)
        if t > 1:
            time = time_embedding(t, width, table.device)
            table = table + time.repeat_interleave(h * w, dim=0).to(table.dtype)
        return table

    def forward(self, pixel_values: Tensor, grids: list[Grid]) -> Tensor:
        x = F.linear(pixel_values.to(self.proj.weight.device, self.proj.weight.dtype), self.proj.weight.flatten(1))
        return x + torch.cat([self.positions(g) for g in grids])


class VisionMLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(width, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm block: ``x += wo(attn(norm0 x))``, ``x += mlp(norm1 x)``; attention ``joint``, ``spatial`` or
    ``temporal`` within each grid."""

    def __init__(self, v: VisionConfig, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.heads, self.head_dim = v.num_heads, v.qkv_head_dim
        inner = self.heads * self.head_dim
        self.norm0, self.norm1 = RMSNorm(v.hidden_size, v.norm_eps), RMSNorm(v.hidden_size, v.norm_eps)
        self.wqkv = nn.Linear(v.hidden_size, 3 * inner, bias=False)
        self.wo = nn.Linear(inner, v.hidden_size, bias=False)
        self.mlp = VisionMLP(v.hidden_size, v.mlp_hidden)

    def forward(self, x: Tensor, grids: list[Grid], angles: Tensor) -> Tensor:
        L = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(L, 3, self.heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        parts = list(zip(*(z.split([t * h * w for t, h, w in grids]) for z in (q, k, v))))
        out: list[Tensor] = [x] * len(grids)
        shapes: dict[Grid, list[int]] = {}
        for i, grid in enumerate(grids):  # grids of one shape attend in one call (each still only to itself)
            shapes.setdefault(grid, []).append(i)
        for grid, members in shapes.items():
            q_, k_, v_ = (parts[members[0]][j].unsqueeze(0) if len(members) == 1 else
                          torch.stack([parts[i][j] for i in members]) for j in range(3))
            for i, o in zip(members, self._attend(q_, k_, v_, grid).unbind(0)):
                out[i] = o
        x = x + self.wo(torch.cat(out).reshape(L, -1))
        return x + self.mlp(self.norm1(x))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, grid: Grid) -> Tensor:
        """Attention within each of ``n`` grids of one shape; ``q, k, v`` ``[n, t·h·w, H, hd]`` → the same shape."""
        n, (t, h, w), H, hd = q.shape[0], grid, self.heads, self.head_dim
        if self.mode == "temporal":  # [n·hw, t, H, hd]: each position across its own grid's frames
            q, k, v = (z.reshape(n, t, h * w, H, hd).transpose(1, 2).reshape(n * h * w, t, H, hd) for z in (q, k, v))
        else:  # joint: [n, thw, H, hd]; spatial: [n·t, hw, H, hd], each frame alone
            q, k, v = (z.reshape(n if self.mode == "joint" else n * t, -1, H, hd) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        if self.mode == "temporal":
            out = out.reshape(n, h * w, t, H, hd).transpose(1, 2)
        return out.reshape(n, t * h * w, H, hd)


class MoonViT(nn.Module):
    """The encoder (``vision_tower``): patches of packed grids → ``[L, D]`` features, before the merge."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.config = v
        self.patch_embed = PatchEmbed(v)
        modes = ["joint"] * v.num_layers if v.attention == "joint" else \
            ["spatial" if i % 2 == 0 else "temporal" for i in range(v.num_layers)]
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList(VisionBlock(v, mode) for mode in modes)
        self.encoder.final_layernorm = RMSNorm(v.hidden_size, v.norm_eps)

    def forward(self, pixel_values: Tensor, grids: list[Grid]) -> Tensor:
        v = self.config
        width = v.in_channels * v.patch_size**2
        total = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (total, width) or \
                not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values: expected a float tensor [{total}, {width}] (the grids' patches), got "
                             f"{pixel_values.dtype} {list(pixel_values.shape)}")
        x = self.patch_embed(pixel_values, grids)
        angles = torch.cat([rope_angles(g, v.qkv_head_dim, v.rope_theta, x.device) for g in grids])
        for block in self.encoder.blocks:
            x = block(x, grids, angles)
        return self.encoder.final_layernorm(x)


def merge_patches(x: Tensor, grids: list[Grid], merge: int) -> Tensor:
    """``sd2_tpool``: per grid, the mean over frames, then each ``merge × merge`` neighbourhood concatenated
    (row-major inside it) → ``[Σ h/m · w/m, m²·D]``, neighbourhoods row-major."""
    out = []
    for part, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids):
        D = part.shape[-1]
        grid = part.view(t, h // merge, merge, w // merge, merge, D).permute(0, 1, 3, 2, 4, 5).mean(0)
        out.append(grid.reshape((h // merge) * (w // merge), merge * merge * D))
    return torch.cat(out)


class Projector(nn.Module):
    """``mm_projector``: Linear(m²D → m²D) – GELU – Linear(m²D → d) – RMSNorm(d); keys ``proj.0``, ``proj.2``."""

    def __init__(self, merged: int, d: int, eps: float) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(merged, merged, bias=False), nn.GELU(), nn.Linear(merged, d, bias=False))
        self.post_norm = RMSNorm(d, eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.post_norm(self.proj(x))


class VisionModel(nn.Module):
    """MoonViT-V2 + merge + projector: ``(pixel_values, grid_thw)`` → visual tokens ``[Σ h/2·w/2, d]``."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        v = config.vision
        self.merge, self.max_frames = v.merge_size, v.max_frames
        self.vision_tower = MoonViT(v)
        self.mm_projector = Projector(v.merge_size**2 * v.hidden_size, v.out_dim, config.rms_norm_eps)
        self.std = config.initializer_range
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, initializer_range) for every matrix and the position table, norm gains 1."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.normal_(module.weight, std=self.std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.vision_tower.patch_embed.pos_emb is not None:
            nn.init.normal_(self.vision_tower.patch_embed.pos_emb.weight, std=self.std)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor | list) -> Tensor:
        grids = grids_of(grid_thw, self.max_frames, self.merge)
        features = self.vision_tower(pixel_values, grids)
        return self.mm_projector(merge_patches(features, grids, self.merge))

    def token_counts(self, grid_thw: Tensor | list) -> list[int]:
        return [visual_token_count(g, self.merge) for g in grids_of(grid_thw, self.max_frames, self.merge)]

