"""Supervised fine-tuning on the K3 chat format (SPEC §7 post-training, Appendix F): ``k3 sft --ckpt BASE --data
chats.jsonl --out DIR``.

Data: JSONL, one chat a line — ``{"messages": [...], "mode": "thinking"|"instruct", "tools"?: [...]}`` plus any
extra keys (``domain``, ``effort``, ``task``: kept, unused). Each chat is rendered by `k3.chat.native.render` and
supervised exactly on what the model produces in each assistant message (`supervised_ids`): everything after the
generation prompt (``<|assistant|><|think|>`` or ``<|assistant|><|response|>``) up to and including its ``<|end|>``.
System, user and tool messages and the role tokens only feed context.

Length cap: a chat rendered to more than ``seq_len`` tokens is *skipped*, not truncated (a truncated answer would
teach an answer that stops mid-way without ``<|end|>``); ``metrics.jsonl``'s step-0 line counts the skipped chats.

Split: a chat is held out iff ``sha256(seed, canonical JSON of the record)`` falls below ``val_fraction`` — stable
under reordering and edits elsewhere in the file; identical chats land on the same side.

Steps: step ``s`` takes the chats at positions ``s·B .. s·B+B−1`` of the concatenated per-epoch permutations of
the training chats (each epoch's permutation a function of ``seed`` and the epoch alone), right-padded to the
longest; the loss is the mean cross-entropy over the step's supervised positions (`masked_loss_sum`). Optimisers
and schedule are pre-training's (`k3.train.optim`: AdamW or Muon + AdamW, warmup then cosine decay); QK-clip and
router-bias balancing are not applied (the base's router biases stay as they are). A resumed run continues exactly:
the data order is a function of the step, and checkpoints hold optimisers, schedulers, RNG state and the data
file's sha256 (resuming on changed data is refused).

Output ``DIR``: ``step-NNNNNNN`` training checkpoints (`k3.train.checkpoint`; loadable by
`k3.model.checkpoint.load_model`, so ``k3 generate/serve --ckpt DIR`` use them), ``latest``, ``tokenizer/``,
``metrics.jsonl`` (step 0: the base's ``val_loss`` and the data counts; then per step ``loss``, ``lr``,
``grad_norm``, ``tokens``, ``supervised``, and ``val_loss`` every ``eval_every`` steps and at the end) and
``curves.png``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from k3.model import checkpoint as model_ckpt
from k3.model.lm import K3ForCausalLM
from k3.model.packed import PackedExperts
from k3.rl.policy import pad_sequences
from k3.chat.native import MODES, render
from k3.files import DATA_LIMIT, jsonl_records, read_bytes
from k3.tokenization.bpe import Tokenizer
from k3.train import checkpoint as train_ckpt
from k3.train.data import masked_loss_sum
from k3.train.driver import Loop, Stage, check_counts, drive
from k3.train.optim import OptimConfig, apply_step, build_optimizers, schedulers
from k3.train.rundir import Metrics, Panel, open_run

__all__ = ["SFTConfig", "SFTRun", "batch_indices", "batch_loss", "encode_chats", "held_out", "load_chats",
           "parse_chats", "read_chat_data", "run_sft", "supervised_ids"]

#: Config fields a resumed run may change; any other must equal the checkpoint's ``train.json``.
RESUMABLE_CHANGES = ("ckpt", "data", "out", "steps", "eval_every", "ckpt_every", "threads", "progress")

#: A chat of the data file: ``(line number, record)``.
Chat = tuple[int, dict[str, Any]]
#: A rendered chat: ``(ids, supervised flag per id)``.
Example = tuple[list[int], list[bool]]


# ---------------------------------------------------------------------- data
def _chat_fields(record: Any) -> tuple[list[dict], str, list[dict] | None]:
    """``(messages, mode, tools)`` of a record, its shape checked."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    messages, mode, tools = record.get("messages"), record.get("mode"), record.get("tools")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools: expected a list, got {type(tools).__name__}")
    return messages, mode, tools


def _prefix_length(ids: list[int], prefix: list[int], what: str) -> int:
    if ids[: len(prefix)] != prefix:
        raise ValueError(f"render({what}) is not a prefix of the whole conversation's render: the assistant tokens "
                         f"cannot be located")
    return len(prefix)


def supervised_ids(record: dict[str, Any], tokenizer: Tokenizer) -> Example:
    """``(ids, mask)``: the chat rendered without generation prompt, ``mask`` True exactly on each assistant
    message's produced tokens — after its generation prompt, up to and including its ``<|end|>``. Found by rendering
    prefixes: ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i+1])`` must be prefixes of
    the whole render. ``ValueError`` for a malformed record, an assistant message first, or none at all."""
    messages, mode, tools = _chat_fields(record)
    ids = render(messages, tokenizer, mode, tools, add_generation_prompt=False)
    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if i == 0:
            raise ValueError("messages[0]: an assistant message cannot come first (nothing prompts it)")
        start = _prefix_length(ids, render(messages[:i], tokenizer, mode, tools, add_generation_prompt=True),
                               f"messages[:{i}] + generation prompt")
        end = _prefix_length(ids, render(messages[: i + 1], tokenizer, mode, tools, add_generation_prompt=False),
                             f"messages[:{i + 1}]")
        mask[start:end] = [True] * (end - start)
    if not any(mask):
        raise ValueError("no assistant message: nothing to supervise")
    return ids, mask


def read_chat_data(path: Path) -> bytes:
    """The bytes of the chat data ``path``: a regular file of at most `DATA_LIMIT` bytes (a FIFO or /dev/zero is
    refused, not read); else a ValueError naming it."""
    try:
        return read_bytes(path, DATA_LIMIT)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read the chat data ({err})") from err


def parse_chats(raw: bytes, source: Path) -> list[Chat]:
    """The chats of the JSONL bytes ``raw`` (blank lines skipped); a malformed line is a ValueError naming ``source``
    and the line."""
    chats = []
    for number, record in jsonl_records(raw, source):
        try:
            _chat_fields(record)
        except ValueError as err:
            raise ValueError(f"{source}, line {number}: {err}") from err
        chats.append((number, record))
    if not chats:
        raise ValueError(f"{source}: no chats")
    return chats


def load_chats(path: Path) -> list[Chat]:
    """The chats of the JSONL file ``path`` (`read_chat_data`, `parse_chats`)."""
    return parse_chats(read_chat_data(path), path)


def held_out(record: dict[str, Any], val_fraction: float, seed: int) -> bool:
    """Whether ``record`` is in the validation split: ``sha256(seed, canonical JSON)`` as a number in [0, 1)."""
    text = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    digest = hashlib.sha256(f"{seed}\n{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def encode_chats(chats: list[Chat], tokenizer: Tokenizer, seq_len: int, vocab_size: int,
                 source: Path) -> tuple[list[Example], int]:
    """``(sequences, skipped)``: each chat's `supervised_ids`, those over ``seq_len`` tokens skipped and counted.
    A chat that does not render, or holds an id ≥ ``vocab_size``, is a ValueError naming ``source`` and line."""
    sequences, skipped = [], 0
    for number, record in chats:
        try:
            ids, mask = supervised_ids(record, tokenizer)
        except ValueError as err:
            raise ValueError(f"{source}, line {number}: {err}") from err
        if max(ids) >= vocab_size:
            raise ValueError(f"{source}, line {number}: token id {max(ids)} is outside the model's vocabulary "
                             f"(vocab_size {vocab_size})")
        if len(ids) > seq_len:
            skipped += 1
            continue
        sequences.append((ids, mask))
    return sequences, skipped


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """The training chats of step ``step`` (0-based): positions ``step·B ..`` of the per-epoch permutations."""
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, position = divmod(k, n)
        out.append(int(np.random.default_rng([seed, epoch]).permutation(n)[position]))
    return out


def batch_loss(model: K3ForCausalLM, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, int]:
    """``(Σ cross-entropy over the supervised positions, their count)`` of a padded ``(inputs, targets, mask)``."""
    inputs, targets, mask = batch
    logits, _ = model(inputs)
    return masked_loss_sum(logits.float(), targets, mask)


# ---------------------------------------------------------------------- config
@dataclass
class SFTConfig:
    """An SFT run (module docstring). ``seq_len``: the longest chat kept, in tokens; ``optimizer``: ``"muon"``
    (Per-Head Muon + Muon + AdamW, as pre-training) or ``"adamw"``; ``lr`` is both Muon's and AdamW's."""

    ckpt: str = ""  # the base: a checkpoint or run directory
    data: str = ""  # chats.jsonl
    out: str = "runs/sft"
    steps: int = 200
    batch_size: int = 8
    lr: float = 1e-3
    optimizer: str = "muon"
    weight_decay: float = 0.0
    warmup_frac: float = 0.05
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0
    seq_len: int = 1024
    eval_every: int = 50
    ckpt_every: int = 50
    val_fraction: float = 0.1
    seed: int = 0
    threads: int | None = None
    progress: bool = True

    def validate(self) -> SFTConfig:
        check_counts(self, "sft", ("steps", "batch_size", "seq_len", "eval_every", "ckpt_every"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"sft.seed = {self.seed!r} is invalid: must be an integer")
        for name in ("ckpt", "data", "out"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"sft.{name} is required: a path")
        if not self.lr > 0 or not self.clip_grad > 0 or not self.weight_decay >= 0:
            raise ValueError(f"sft: need lr > 0, clip_grad > 0, weight_decay >= 0; got {self.lr}, {self.clip_grad}, "
                             f"{self.weight_decay}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"sft.val_fraction = {self.val_fraction!r} is invalid: must be in (0, 1)")
        self.optim_config()
        return self

    def optim_config(self) -> OptimConfig:
        """The optimiser settings (`OptimConfig` checks ``optimizer``, ``warmup_frac`` and ``min_lr_ratio``)."""
        try:
            return OptimConfig(lr=self.lr, adam_lr=self.lr, weight_decay=self.weight_decay, optimizer=self.optimizer,
                               warmup_frac=self.warmup_frac, min_lr_ratio=self.min_lr_ratio, qk_clip=None)
        except ValueError as err:
            raise ValueError(f"sft: {err}") from err


# ---------------------------------------------------------------------- the run
class SFTRun(Stage):
    """One SFT run: the base model and tokenizer, the encoded chats, optimisers; `step()` advances one step."""

    def __init__(self, config: SFTConfig) -> None:
        self.config = config.validate()
        self.out = Path(config.out)
        self.metrics = Metrics(self.out / "metrics.jsonl")
        self.model, self.tokenizer = model_ckpt.load_model(Path(config.ckpt))
        model = self.model.config
        if any(isinstance(m, PackedExperts) for m in self.model.modules()):
            raise ValueError(f"{config.ckpt}: the routed experts are stored MXFP4-packed; SFT trains float weights")
        if self.tokenizer.vocab_size > model.vocab_size:
            raise ValueError(f"{config.ckpt}: the tokenizer has {self.tokenizer.vocab_size} tokens but the model's "
                             f"vocab_size is {model.vocab_size}")
        if config.seq_len > model.context_length:
            raise ValueError(f"sft.seq_len = {config.seq_len} is beyond the model's context_length "
                             f"{model.context_length}")
        self.step_index = 0

    @property
    def loop(self) -> Loop:
        """Every step logged."""
        cfg = self.config
        return Loop(cfg.steps, cfg.ckpt_every, eval_every=cfg.eval_every, threads=cfg.threads, progress=cfg.progress)

    def prepare(self, resume: bool) -> None:
        """Data, optimisers and schedulers; from the newest checkpoint in ``out`` with ``resume`` (a fresh start
        when there is none). Without ``resume`` an ``out`` that holds a checkpoint is refused."""
        cfg = self.config
        existing = open_run(self.out, resume)
        self._prepare_data()
        self.tok_dir = self.out / "tokenizer"
        self.tokenizer.save(self.tok_dir)
        self.optimizers = build_optimizers(self.model, self.model.config, cfg.optim_config())
        self.schedulers = schedulers(self.optimizers, cfg.steps, cfg.optim_config())
        torch.manual_seed(cfg.seed)
        if existing is not None:
            self._restore(existing)
        self.metrics.start(None if existing is None else self.step_index)

    def _prepare_data(self) -> None:
        cfg, path = self.config, Path(self.config.data)
        raw = read_chat_data(path)
        self.data_sha256 = hashlib.sha256(raw).hexdigest()  # of the bytes trained on, read once
        chats = parse_chats(raw, path)
        train = [c for c in chats if not held_out(c[1], cfg.val_fraction, cfg.seed)]
        val = [c for c in chats if held_out(c[1], cfg.val_fraction, cfg.seed)]
        vocab = self.model.config.vocab_size
        self.train_seqs, skipped_train = encode_chats(train, self.tokenizer, cfg.seq_len, vocab, path)
        self.val_seqs, skipped_val = encode_chats(val, self.tokenizer, cfg.seq_len, vocab, path)
        self.skipped = skipped_train + skipped_val
        for side, seqs, total in (("training", self.train_seqs, len(train)), ("validation", self.val_seqs, len(val))):
            if not seqs:
                raise ValueError(f"{path}: the {side} split holds no chat of at most seq_len = {cfg.seq_len} tokens "
                                 f"({total} before the length cap, {len(chats)} chats in all, val_fraction = "
                                 f"{cfg.val_fraction}): use more chats, another val_fraction or a longer seq_len")

    def _restore(self, path: Path) -> None:
        train_ckpt.check_same_config(path, model_ckpt.read_config(path), self.model.config)
        train_ckpt.check_resumable(path, asdict(self.config), RESUMABLE_CHANGES)
        if model_ckpt.read_tokenizer(path) != self.tokenizer:
            raise ValueError(f"{path / 'tokenizer.json'}: differs from the base checkpoint's tokenizer")
        state = train_ckpt.load_state(path)
        trained_on = str(state.get("data_sha256"))
        if trained_on != self.data_sha256:
            raise ValueError(f"{self.config.data}: the chat data changed since {path} (sha256 "
                             f"{self.data_sha256[:16]}…, the checkpoint trained on {trained_on[:16]}…)")
        train_ckpt.load_single(path, self.model, self.optimizers, state)
        try:
            for sched, s in zip(self.schedulers, state["schedulers"], strict=True):
                sched.load_state_dict(s)
            torch.set_rng_state(state["rng"])
            self.step_index = int(state["step"])
        except (KeyError, ValueError, TypeError, RuntimeError) as err:
            raise ValueError(f"{train_ckpt.state_file(path)}: does not match this run ({type(err).__name__}: "
                             f"{err})") from err

    def save(self) -> Path:
        """Checkpoint ``step-NNNNNNN`` (model, tokenizer, ``train.json``, state) atomically; ``latest`` names it."""
        state = {"optimizers": [o.state_dict() for o in self.optimizers],
                 "schedulers": [s.state_dict() for s in self.schedulers], "rng": torch.get_rng_state(),
                 "step": self.step_index, "data_sha256": self.data_sha256}
        return train_ckpt.save_checkpoint(self.out, self.step_index, self.model, self.model.config,
                                          asdict(self.config), self.tok_dir, state)

    def step(self) -> dict[str, Any]:
        """One optimiser step on the next batch of training chats; returns its metrics."""
        cfg = self.config
        chosen = [self.train_seqs[i] for i in batch_indices(self.step_index, cfg.batch_size, len(self.train_seqs),
                                                            cfg.seed)]
        batch = pad_sequences(chosen, self.tokenizer.pad_id)
        self.model.train()
        loss_sum, count = batch_loss(self.model, batch)
        (loss_sum / count).backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad))
        lr = apply_step(self.optimizers, self.schedulers)
        self.step_index += 1
        return {"step": self.step_index, "loss": loss_sum.item() / count, "lr": lr, "grad_norm": grad_norm,
                "tokens": sum(len(ids) for ids, _ in chosen), "supervised": count}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out loss: mean cross-entropy over every supervised position of the validation chats."""
        self.model.eval()
        total, count = 0.0, 0
        size = self.config.batch_size
        for start in range(0, len(self.val_seqs), size):
            loss_sum, n = batch_loss(self.model, pad_sequences(self.val_seqs[start: start + size],
                                                               self.tokenizer.pad_id))
            total, count = total + float(loss_sum), count + n
        return total / count

    def evaluation(self) -> dict[str, Any]:
        return {"val_loss": self.evaluate()}

    def opening(self) -> dict[str, Any]:
        """The base's held-out loss and the data's counts."""
        return {"step": 0, **self.evaluation(), "train_chats": len(self.train_seqs), "val_chats": len(self.val_seqs),
                "skipped_too_long": self.skipped}


PANELS: tuple[Panel, ...] = (("SFT loss (supervised tokens)", ("loss", "val_loss")), ("learning rate", ("lr",)))


def run_sft(config: SFTConfig, resume: bool = False) -> SFTRun:
    """Run (or continue) SFT (`k3.train.driver.drive`): the base's held-out loss first (a fresh run), then
    ``steps`` steps with evaluations every ``eval_every`` and checkpoints every ``ckpt_every`` steps and at the end;
    then ``curves.png``."""
    run = SFTRun(config)
    run.prepare(resume)
    drive(run, PANELS)
    return run
