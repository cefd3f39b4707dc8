"""MoonViT-V2 (issue 16; SPEC §6, §10): the encoder, merge and projector against an explicit fp64 reference written
from the description (loops over tokens, heads, frames and positions), packing invariance, input errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from k3.config import MEDIA_TOKEN_ID, VisionConfig, preset
from k3.model.vision import VisionModel

PATCH = 3 * 14 * 14


def _config(attention: str, pos: int = 4) -> object:
    c = preset("tiny")
    c.vision = VisionConfig(num_layers=3, hidden_size=16, num_heads=2, head_dim=8, mlp_hidden=24, pos_emb_size=pos,
                            out_dim=c.hidden_size, attention=attention, max_frames=3,
                            media_token_id=MEDIA_TOKEN_ID)
    return c.validate()


def _model(attention: str, pos: int = 4, seed: int = 0) -> VisionModel:
    torch.manual_seed(seed)
    model = VisionModel(_config(attention, pos)).double()
    with torch.no_grad():  # gains away from 1 so a missing norm gain shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _rms(x, g, eps):
    return [x[i] / math.sqrt(sum(v * v for v in x) / len(x) + eps) * g[i] for i in range(len(x))]


def _bilinear(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """align_corners=False resize by hand: source = (i + ½)·in/out − ½, clamped at 0, two neighbours."""
    S = table.shape[0]
    out = torch.zeros(h, w, table.shape[-1], dtype=torch.float64)

    def taps(i, n_out):
        src = max((i + 0.5) * S / n_out - 0.5, 0.0)
        i0 = int(src)
        return i0, min(i0 + 1, S - 1), src - i0

    for y in range(h):
        y0, y1, ly = taps(y, h)
        for x in range(w):
            x0, x1, lx = taps(x, w)
            out[y, x] = ((1 - ly) * ((1 - lx) * table[y0, x0] + lx * table[y0, x1])
                         + ly * ((1 - lx) * table[y1, x0] + lx * table[y1, x1]))
    return out


def _reference(model: VisionModel, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    v = model.vision_tower.config
    D, H, hd = v.hidden_size, v.num_heads, v.qkv_head_dim
    eps = v.norm_eps
    sd = {k: t.double() for k, t in model.state_dict().items()}
    tower = "vision_tower."
    conv = sd[tower + "patch_embed.proj.weight"].reshape(D, -1)
    out_tokens = []
    start = 0
    for t, h, w in grids:
        L = t * h * w
        patches = pixels[start:start + L].double()
        start += L
        table = sd[tower + "patch_embed.pos_emb.weight"]
        pos = table if tuple(table.shape[:2]) == (h, w) else _bilinear(table, h, w)
        coords = [(f, y, x) for f in range(t) for y in range(h) for x in range(w)]
        xs = []
        for i, (f, y, x) in enumerate(coords):
            token = [sum(conv[c, j] * patches[i, j] for j in range(PATCH)) + pos[y, x, c] for c in range(D)]
            if t > 1:
                token = [token[c] + (math.sin(f / 10000 ** (c / (D / 2))) if c < D // 2 else
                                     math.cos(f / 10000 ** ((c - D // 2) / (D / 2)))) for c in range(D)]
            xs.append(token)
        for b in range(v.num_layers):
            p = f"{tower}encoder.blocks.{b}."
            mode = "joint" if v.attention == "joint" else ("spatial" if b % 2 == 0 else "temporal")
            wqkv, wo = sd[p + "wqkv.weight"], sd[p + "wo.weight"]
            qkv = []
            for i, (_, y, x) in enumerate(coords):
                normed = _rms(xs[i], sd[p + "norm0.weight"], eps)
                row = [sum(wqkv[o, c] * normed[c] for c in range(D)) for o in range(3 * H * hd)]
                q, k, val = row[:H * hd], row[H * hd:2 * H * hd], row[2 * H * hd:]
                for vec in (q, k):  # 2-D RoPE: pair 2i by column·f_i, pair 2i+1 by row·f_i
                    for head in range(H):
                        for j in range(hd // 2):
                            angle = (x if j % 2 == 0 else y) * v.rope_theta ** (-4 * (j // 2) / hd)
                            a, bb = vec[head * hd + 2 * j], vec[head * hd + 2 * j + 1]
                            vec[head * hd + 2 * j] = a * math.cos(angle) - bb * math.sin(angle)
                            vec[head * hd + 2 * j + 1] = a * math.sin(angle) + bb * math.cos(angle)
                qkv.append((q, k, val))
            attended = []
            for i, (f, y, x) in enumerate(coords):
                if mode == "joint":
                    keys = range(L)
                elif mode == "spatial":
                    keys = [j for j, c in enumerate(coords) if c[0] == f]
                else:
                    keys = [j for j, c in enumerate(coords) if c[1:] == (y, x)]
                out = []
                for head in range(H):
                    s = slice(head * hd, (head + 1) * hd)
                    scores = [sum(a * bb for a, bb in zip(qkv[i][0][s], qkv[j][1][s])) / math.sqrt(hd) for j in keys]
                    top = max(scores)
                    weights = [math.exp(z - top) for z in scores]
                    total = sum(weights)
                    out += [sum(wt / total * qkv[j][2][s][c] for wt, j in zip(weights, keys)) for c in range(hd)]
                attended.append(out)
            for i in range(L):
                xs[i] = [xs[i][c] + sum(wo[c, o] * attended[i][o] for o in range(H * hd)) for c in range(D)]
                normed = _rms(xs[i], sd[p + "norm1.weight"], eps)
                hidden = [sum(sd[p + "mlp.fc0.weight"][o, c] * normed[c] for c in range(D))
                          for o in range(v.mlp_hidden)]
                gelu = [0.5 * z * (1 + math.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))) for z in hidden]
                xs[i] = [xs[i][c] + sum(sd[p + "mlp.fc1.weight"][c, o] * gelu[o] for o in range(v.mlp_hidden))
                         for c in range(D)]
        xs = [_rms(x, sd[tower + "encoder.final_layernorm.weight"], eps) for x in xs]
        for i in range(h // 2):  # sd2_tpool: mean over frames, then [(2i,2j), (2i,2j+1), (2i+1,2j), (2i+1,2j+1)]
            for j in range(w // 2):
                merged = []
                for y, x in ((2 * i, 2 * j), (2 * i, 2 * j + 1), (2 * i + 1, 2 * j), (2 * i + 1, 2 * j + 1)):
                    merged += [sum(xs[f * h * w + y * w + x][c] for f in range(t)) / t for c in range(D)]
                hidden = [sum(sd["mm_projector.proj.0.weight"][o, c] * merged[c] for c in range(4 * D))
                          for o in range(4 * D)]
                gelu = [0.5 * z * (1 + math.erf(z / math.sqrt(2))) for z in hidden]
                y_out = [sum(sd["mm_projector.proj.2.weight"][o, c] * gelu[c] for c in range(4 * D))
                         for o in range(sd["mm_projector.proj.2.weight"].shape[0])]
                out_tokens.append(_rms(y_out, sd["mm_projector.post_norm.weight"], 1e-5))
    return torch.tensor(out_tokens, dtype=torch.float64)


GRIDS = [(1, 2, 4), (2, 4, 4), (3, 2, 2)]  # an image (table resized), a 2-frame chunk at the table's size, 3 frames


@pytest.mark.parametrize("attention", ["joint", "divided"])
def test_encoder_matches_the_explicit_reference(attention):
    model = _model(attention)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), PATCH, dtype=torch.float64)
    got = model(pixels, torch.tensor(GRIDS))
    assert got.shape == (sum(h * w // 4 for _, h, w in GRIDS), 64)
    torch.testing.assert_close(got, _reference(model, pixels, GRIDS), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("attention", ["joint", "divided"])
def test_an_image_does_not_depend_on_its_batch_neighbours(attention):
    model = _model(attention, seed=1).float()
    grids = [(1, 6, 4), (2, 2, 8), (1, 4, 4)]
    sizes = [t * h * w for t, h, w in grids]
    pixels = torch.randn(sum(sizes), PATCH)
    packed = model(pixels, grids).split([h * w // 4 for _, h, w in grids])
    for part, grid, alone in zip(pixels.split(sizes), grids, packed):
        torch.testing.assert_close(model(part, [grid]), alone, rtol=1e-5, atol=1e-6)
    reordered = model(torch.cat(pixels.split(sizes)[::-1]), grids[::-1]).split([h * w // 4 for _, h, w in grids[::-1]])
    for a, b in zip(packed, reordered[::-1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_divided_and_joint_agree_on_an_image_only_where_they_must():
    """For one frame, the temporal blocks attend each patch to itself: a one-block divided encoder (spatial only)
    equals the joint one."""
    joint, divided = _model("joint"), _model("divided")
    divided.load_state_dict(joint.state_dict())
    pixels = torch.randn(2 * 4, PATCH, dtype=torch.float64)
    for model in (joint, divided):
        model.vision_tower.encoder.blocks = model.vision_tower.encoder.blocks[:1]
    torch.testing.assert_close(joint(pixels, [(1, 2, 4)]), divided(pixels, [(1, 2, 4)]), rtol=0, atol=0)


def test_bad_inputs_are_clear_errors():
    model = _model("joint")
    pixels = torch.randn(8, PATCH, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"pixel_values: expected a float tensor \[8, 588\]"):
        model(pixels[:, :100], [(1, 2, 4)])
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \[1, 3, 4\]: rows and columns must be multiples"):
        model(torch.randn(12, PATCH, dtype=torch.float64), [(1, 3, 4)])
    with pytest.raises(ValueError, match=r"4 frames, at most vision.max_frames=3"):
        model(torch.randn(32, PATCH, dtype=torch.float64), [(4, 2, 4)])
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \[1, 0, 2\]"):
        model(pixels, [(1, 2, 4), (1, 0, 2)])
    with pytest.raises(ValueError, match=r"vision.attention = 'sideways'"):
        dataclasses.replace(_config("joint"), vision=dataclasses.replace(_config("joint").vision,
                                                                         attention="sideways")).validate()
