"""Training the EAGLE-3 draft (SPEC §8): ``k3 train-draft --ckpt TARGET --out DIR``.

The target (`k3.model.checkpoint.load_model`) is frozen. Each step takes a packed batch of ``seq_len`` tokens
from the training corpus (the loader and corpus of `k3.train.pretrain`, `k3.train.data`), runs the target once under
`K3ForCausalLM.capture` for its three features and its logits, then the *training-time test*: ``unroll`` (7) draft
passes over the window (`unroll`); position i of every pass belongs to the chain the draft drafts after position i:

* step 1 reads the fused target features: position i pairs feature i with token i+1 and predicts token i+2;
* step k+1 (k ≥ 1) reads step k's output hidden states in place of the features, one token further on:
  position i pairs step k's output at i with token i+k+1 and predicts token i+k+2 — as when the draft drafts its
  (k+1)-th token from its own k-th output.

What step k+1 at position i attends to (``--mask``): **eagle3** (the default for an MLA draft; EAGLE-3's
training-time-test mask) — step 1's entries at positions ≤ i (the target's features for the accepted prefix) and
its own chain's earlier entries at i: exactly what the draft sees when it decodes after position i (tested against
drafting as the server does). **causal** (a KDA draft, whose state is recurrent; or chosen) — each pass is the
draft layer's ordinary causal forward, so the earlier positions hold the other chains' drafts where serving has the
target's features: a harder condition than serving's.

Every step's loss at a position is ``−log Σ_y min(p_y, q_y)`` (p the target's next-token distribution there, q
the draft's; ``Σ_y min(p_y, q_y)`` is the probability that the lossless rule accepts the draft token), averaged
over the positions; the loss is the weighted mean over steps with weights ``step_weight^k`` (0.8^k, k = 0..6),
as EAGLE-3. AdamW, linear warmup then cosine decay (`k3.train.optim.lr_lambda`), gradient clipping.
``metrics.jsonl`` gets per step the loss, each step's loss and its acceptance estimate (the mean of
``Σ min(p, q)``). Checkpoints ``DIR/step-NNNNNNN`` hold the draft (`EagleDraft.write`), ``train.json`` and the
training state as data (`k3.train.state_codec`: optimiser, scheduler, loader position, RNG); a resumed run
continues exactly. The loop is `k3.train.driver.drive`'s, the run directory `k3.train.rundir`'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from k3.config import K3Config
from k3.files import write_text
from k3.model import checkpoint as model_ckpt
from k3.model.checkpoint import atomic_directory, verified
from k3.model.draft import DRAFT_CONFIG, DRAFT_WEIGHTS, DraftConfig, EagleDraft
from k3.model.lm import K3ForCausalLM
from k3.train import checkpoint as train_ckpt
from k3.train.data import PackedLoader, load_corpus, split_documents, tokenize_documents
from k3.train.driver import Loop, Stage, check_counts, drive
from k3.train.optim import apply_step, lr_lambda
from k3.train.rundir import Metrics, open_run

#: The training-time test's attention (`unroll`).
MASKS = ("eagle3", "causal")


def serving_mask(layer_kind: str) -> str:
    """The unroll that drafts as the server does: ``eagle3`` for an MLA draft; a KDA draft has only ``causal``."""
    return "eagle3" if layer_kind == "mla" else "causal"


#: Fields a resumed run may change; any other must equal the checkpoint's.
RESUMABLE_CHANGES = ("ckpt", "out", "steps", "max_minutes", "ckpt_every", "log_every", "eval_batches", "threads",
                     "progress")


@dataclass
class DraftTrainConfig:
    """A draft training run (module docstring). ``data`` empty: the Python standard library's source, as
    ``k3 train``; ``draft_vocab``: a reduced draft vocabulary of the corpus's most frequent target tokens."""

    ckpt: str = ""  # the target: a checkpoint or run directory
    out: str = "runs/draft"
    steps: int = 1000
    seq_len: int = 128
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_frac: float = 0.01
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0
    unroll: int = 7
    step_weight: float = 0.8
    layer_kind: str = "mla"
    mask: str | None = None  # None: "eagle3" for an MLA draft, "causal" for a KDA one (`unroll`)
    feature_layers: list[int] | None = None
    feature_source: str | None = None
    draft_vocab: int | None = None
    seed: int = 0
    val_fraction: float = 0.02
    data: list[str] = field(default_factory=list)
    data_limit_bytes: int | None = None
    ckpt_every: int = 100
    log_every: int = 1
    eval_batches: int = 4
    max_minutes: float | None = None
    threads: int | None = None
    progress: bool = True

    def validate(self) -> DraftTrainConfig:
        check_counts(self, "train-draft", ("steps", "seq_len", "batch_size", "unroll", "ckpt_every", "log_every",
                                           "eval_batches"))
        if self.seq_len < self.unroll + 1:
            raise ValueError(f"train-draft.seq_len = {self.seq_len} is invalid: the {self.unroll}-step unroll needs "
                             f"at least {self.unroll + 1} tokens")
        if not 0 < self.step_weight <= 1 or not self.lr > 0 or not self.clip_grad > 0:
            raise ValueError(f"train-draft: need 0 < step_weight <= 1, lr > 0, clip_grad > 0; got "
                             f"{self.step_weight}, {self.lr}, {self.clip_grad}")
        if self.mask is None:  # resolved here, so a checkpoint's train.json holds the mask it trained with
            self.mask = serving_mask(self.layer_kind)
        if self.mask not in MASKS or (self.mask == "eagle3" and self.layer_kind != "mla"):
            raise ValueError(f"train-draft.mask = {self.mask!r} is invalid: 'eagle3' (MLA drafts) or 'causal'")
        return self

    def draft_config(self, target: K3Config) -> DraftConfig:
        """The draft's config for the ``target`` (checked: feature layers and source, kind, vocabulary)."""
        layers = None if self.feature_layers is None else tuple(self.feature_layers)
        return DraftConfig(layers, self.layer_kind, self.draft_vocab, self.feature_source).resolved(target)


# ---------------------------------------------------------------------- the objective
def top_tokens(token_docs: list[list[int]], vocab_size: int, n: int) -> Tensor:
    """The ``n`` most frequent target ids of the corpus (ties: the lower id), in increasing id order (``d2t``)."""
    if not 0 < n <= vocab_size:
        raise ValueError(f"draft_vocab = {n} is invalid: must be in [1, vocab_size={vocab_size}]")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for doc in token_docs:
        counts += np.bincount(np.asarray(doc, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    chosen = np.argsort(-counts, kind="stable")[:n]
    return torch.from_numpy(np.sort(chosen))


def log_overlap(log_p: Tensor, draft_logits: Tensor, d2t: Tensor | None = None) -> Tensor:
    """``log Σ_y min(p_y, q_y)`` per position: ``log_p`` ``[..., V]`` the target's log-probabilities, ``q`` the
    softmax of ``draft_logits`` ``[..., V_draft]`` over the draft ids ``d2t`` (q is 0 on other target ids).
    Computed as ``logsumexp(min(log p, log q))``, exact and finite however small the overlap."""
    log_q = draft_logits.to(log_p.dtype).log_softmax(-1)
    if d2t is not None:
        log_p = log_p.index_select(-1, d2t)
    return torch.minimum(log_p, log_q).logsumexp(-1)


@torch.no_grad()
def target_outputs(target: K3ForCausalLM, layers: tuple[int, ...], inputs: Tensor, source: str = "inputs"
                   ) -> tuple[list[Tensor], Tensor]:
    """The target's features at ``layers`` (each ``[B, T, d]``; ``source`` as `K3ForCausalLM.capture`) and its
    logits ``[B, T, V]``."""
    with target.capture(list(layers), source) as chosen:
        logits, _ = target(inputs)
        return [layer.captured for layer in chosen], logits


def unroll(draft: EagleDraft, tokens: Tensor, fused: Tensor, target_logits: Tensor, steps: int,
           mask: str = "eagle3") -> list[Tensor]:
    """The training-time test (module docstring): per step k = 0..steps−1 the log-overlaps ``[B, T−1−k]``.

    ``tokens`` ``[B, T]``, ``fused`` ``[B, T, d]`` (fused target features), ``target_logits`` ``[B, T, V]``. Step k
    reads tokens ``1+k..T−1``, the target's distributions at those positions, and as hidden states the fused
    features (k = 0) or step k−1's outputs at positions ``0..T−2−k``. Position i of every step belongs to the
    chain drafted after position i. ``mask``: ``"eagle3"`` (an MLA draft) — step k ≥ 1 sees step 0's entries ≤ i and
    its own chain's, as the draft decoding after position i does (`EagleDraft.chain_step`); ``"causal"`` — each step
    is the draft's causal forward over its own inputs, so earlier positions hold other chains' drafts.
    """
    T = tokens.shape[1]
    log_p = target_logits.to(torch.promote_types(target_logits.dtype, torch.float32)).log_softmax(-1)
    hidden = fused[:, : T - 1]
    prefix = draft.entries(tokens[:, 1:], hidden) if mask == "eagle3" else None
    chain: list = []
    overlaps = []
    for k in range(steps):
        n = T - 1 - k
        if prefix is None or k == 0:
            logits, out, _ = draft(tokens[:, 1 + k:], hidden[:, :n], None)
        else:
            logits, out, entry = draft.chain_step(tokens[:, 1 + k:], hidden[:, :n], prefix, chain)
            chain.append(entry)
        overlaps.append(log_overlap(log_p[:, 1 + k:], logits, draft.d2t))
        hidden = out[:, : n - 1]
    return overlaps


def unroll_loss(overlaps: list[Tensor], step_weight: float) -> Tensor:
    """``Σ_k w_k · mean(−log-overlap_k) / Σ_k w_k`` with ``w_k = step_weight^k``."""
    weights = [step_weight**k for k in range(len(overlaps))]
    return sum(w * -o.mean() for w, o in zip(weights, overlaps)) / sum(weights)


# ---------------------------------------------------------------------- the run
def verify_checkpoint(ckpt: Path) -> None:
    for name in (DRAFT_WEIGHTS, DRAFT_CONFIG, "train.json", train_ckpt.STATE_TENSORS, train_ckpt.STATE_JSON):
        verified(ckpt, name)


class DraftRun(Stage):
    """One draft training run: the frozen target, data, draft, optimiser; `step()` advances one optimiser step."""

    def __init__(self, config: DraftTrainConfig) -> None:
        self.config = config.validate()
        self.out = Path(config.out)
        self.metrics = Metrics(self.out / "metrics.jsonl")
        self.target, self.tokenizer = model_ckpt.load_model(Path(config.ckpt))
        self.target.requires_grad_(False)
        self.draft_config = config.draft_config(self.target.config)  # refused before any data is read
        self.step_index = 0

    @property
    def loop(self) -> Loop:
        """No evaluation inside the loop (``k3 train-draft`` reports one at the end)."""
        cfg = self.config
        return Loop(cfg.steps, cfg.ckpt_every, log_every=cfg.log_every, max_minutes=cfg.max_minutes,
                    threads=cfg.threads, progress=cfg.progress)

    def prepare(self, resume: bool) -> None:
        """Data, draft and optimiser; from the newest checkpoint in ``out`` with ``resume``."""
        cfg = self.config
        existing = open_run(self.out, resume, verify_checkpoint)
        docs = load_corpus(cfg.data, cfg.data_limit_bytes)
        train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
        train_tokens = tokenize_documents(self.tokenizer, train_docs)
        self.val_tokens = tokenize_documents(self.tokenizer, val_docs)
        eos = self.tokenizer.eos_id
        self.loader = PackedLoader(train_tokens, cfg.seq_len, cfg.batch_size, eos, seed=cfg.seed)
        torch.manual_seed(cfg.seed)
        if existing is not None:
            self.draft = EagleDraft.load(existing, self.target)
        else:
            vocab = self.target.config.vocab_size
            d2t = None if cfg.draft_vocab is None else top_tokens(train_tokens, vocab, cfg.draft_vocab)
            self.draft = EagleDraft(self.target, self.draft_config, d2t)
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_lambda(step, cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio))
        if existing is not None:
            self._restore(existing)
        self.metrics.start(None if existing is None else self.step_index)

    def _restore(self, path: Path) -> None:
        train_ckpt.check_resumable(path, asdict(self.config), RESUMABLE_CHANGES, {"mask": "causal"})  # before masks
        state = train_ckpt.load_state(path)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.loader.load_state_dict(state["loader"])
            torch.set_rng_state(state["rng"])
            self.step_index = int(state["step"])
        except (KeyError, ValueError, TypeError, RuntimeError) as err:
            raise ValueError(f"{path / train_ckpt.STATE_JSON}: does not match this run ({type(err).__name__}: "
                             f"{err})") from err

    def save(self) -> Path:
        """Checkpoint ``step-NNNNNNN`` written atomically and published (`k3.train.checkpoint.publish`: ``latest``
        names it, older ones beyond two are pruned)."""
        final = self.out / f"step-{self.step_index:07d}"
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "loader": self.loader.state_dict(), "rng": torch.get_rng_state(), "step": self.step_index}
        with atomic_directory(final) as tmp:
            self.draft.write(tmp)
            write_text(tmp / "train.json", json.dumps(asdict(self.config), indent=2))
            train_ckpt.write_state(tmp, state)
        train_ckpt.publish(self.out, final)
        return final

    def overlaps(self, inputs: Tensor, mask: str) -> list[Tensor]:
        """The unroll's per-step log-overlaps on a batch of token windows ``[B, T]``."""
        features, logits = target_outputs(self.target, self.draft.config.feature_layers, inputs,
                                          self.draft.config.feature_source)
        return unroll(self.draft, inputs, self.draft.fuse(features), logits, self.config.unroll, mask)

    def step(self) -> dict[str, Any]:
        """One optimiser step; returns its metrics."""
        cfg = self.config
        inputs, _, _ = self.loader.next_batch()
        self.draft.train()
        overlaps = self.overlaps(inputs, cfg.mask)
        loss = unroll_loss(overlaps, cfg.step_weight)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.clip_grad))
        lr = apply_step([self.optimizer], [self.scheduler])
        self.step_index += 1
        return {"step": self.step_index, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm,
                "tokens": inputs.numel(), "step_loss": [-o.mean().item() for o in overlaps],
                "acceptance": [o.exp().mean().item() for o in overlaps]}

    @torch.no_grad()
    def evaluate(self) -> list[float]:
        """Expected acceptance per draft step: the mean ``Σ min(p, q)`` over up to ``eval_batches`` batches of the
        held-out documents' windows (in order; fewer rows when the held-out text is short). An MLA draft is scored
        with the eagle3 unroll, as it drafts when serving, whatever mask it trained with."""
        cfg = self.config
        mask = serving_mask(cfg.layer_kind)
        stream = sum(len(doc) + 1 for doc in self.val_tokens)
        rows = min(cfg.batch_size, stream // (cfg.seq_len + 1))
        if rows < 1:
            raise ValueError(f"the validation documents hold {stream} tokens, fewer than one window of "
                             f"seq_len + 1 = {cfg.seq_len + 1}: use a larger --val-fraction or more data")
        loader = PackedLoader(self.val_tokens, cfg.seq_len, rows, self.tokenizer.eos_id, shuffle=False)
        self.draft.eval()
        totals = torch.zeros(cfg.unroll, dtype=torch.float64)
        batches = min(cfg.eval_batches, loader.batches_per_epoch())
        for _ in range(batches):
            inputs, _, _ = loader.next_batch()
            totals += torch.tensor([o.exp().mean().item() for o in self.overlaps(inputs, mask)], dtype=torch.float64)
        return (totals / batches).tolist()

    def postfix(self, record: dict[str, Any]) -> dict[str, object]:
        return {"loss": f"{record['loss']:.3f}", "accept1": f"{record['acceptance'][0]:.2f}"}


def expected_accepted(acceptance: list[float]) -> float:
    """Expected accepted draft tokens per round, ``Σ_k Π_{j≤k} α_j`` (the chain stops at the first rejection)."""
    total, running = 0.0, 1.0
    for alpha in acceptance:
        running *= alpha
        total += running
    return total


def train_draft(config: DraftTrainConfig, resume: bool = False) -> DraftRun:
    """Run (or continue) draft training (`k3.train.driver.drive`); checkpoints every ``ckpt_every`` steps, at the
    end and when ``max_minutes`` runs out."""
    run = DraftRun(config)
    run.prepare(resume)
    drive(run)
    return run
