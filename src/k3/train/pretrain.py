"""Pretraining (SPEC §5, §7): curriculum, accumulation, clipping, balancing, validation, checkpoints.

`train(config)` runs (or resumes) a run in ``config.out`` (`k3.train.driver`, `k3.train.rundir`) and writes there
``metrics.jsonl`` (one JSON object per logged step), ``curves.png`` and checkpoints. A resumed run continues exactly:
the loss sequence equals the uninterrupted run's (the data-loader position, optimiser, scheduler, balancing
biases and RNG states are all in the checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from k3.config import K3Config, MXConfig, preset
from k3.model.lm import K3ForCausalLM
from k3.sizing.memory import check_fits
from k3.model.sequence.mla import GatedMLA
from k3.train import checkpoint as ckpt
from k3.train import multimodal, sharded
from k3.model import checkpoint as model_ckpt
from k3.train.balance import QuantileBalancer
from k3.train.bpb import ByteTally, Validation
from k3.train.driver import Loop, Stage, check_counts, drive
from k3.train.data import (
    PackedLoader,
    eval_batches,
    load_corpus,
    masked_loss_sum,
    split_documents,
    tokenize_documents,
)
from k3.train.optim import OptimConfig, apply_step, build_optimizers, qk_clip_mla, schedulers
from k3.train.rundir import Metrics, Panel, open_run
from k3.tokenization.bpe import Tokenizer


#: The paper's context curriculum (SPEC §7; report §§3.3–3.4): pre-training at 8K then 64K, cooldown at
#: 256K then 1M, as (fraction of the steps where a stage starts, its length ÷ the first stage's). The
#: length ratios 1 : 8 : 32 : 128 are the paper's; it gives no stage durations, only that the 64K stage
#: comes later in pre-training and that the two cooldown stages are a small fraction of training. Our
#: choice: the two pre-training lengths share the first 90% of the steps equally, the cooldown is the
#: last 10% (256K for 7%, 1M for the final 3%, the costliest length for the shortest time).
PAPER_CURRICULUM = ((0.0, 1), (0.5, 8), (0.9, 32), (0.97, 128))

#: ``k3 train --qat mx`` (SPEC §7): routed-expert weights MXFP4 and their inputs MXFP8 E4M3, fake-quantized in the
#: forward pass with a straight-through estimator; everything else stays in high precision.
QAT_MX = MXConfig(enabled=True, weight_format="mxfp4", activation_format="mxfp8_e4m3", block_size=32)

#: The paper's first stage length (8K tokens).
PAPER_BASE = 8192

#: The default run's first stage length: the largest for which the paper's 128× top stage (4096) fits the
#: context of both the tiny (4096) and small (8192) presets and divides the default tokens_per_step.
DEFAULT_BASE = 32

#: The default batch: tokens per step for each data-parallel rank (`TrainConfig.tokens_per_step` None), as
#: torchtitan's per-rank batch — the step grows with the data ranks, so a default run works on any layout.
DEFAULT_TOKENS_PER_RANK = 4096


def tokens_per_step_for(curriculum: list[list[float]], grad_accum: int, data_ranks: int, at_least: int) -> int:
    """The smallest step of at least ``at_least`` tokens that every stage of ``curriculum`` cuts into whole
    sequences, ``grad_accum`` micro-batches of them, each split evenly over ``data_ranks`` (a multiple of
    lcm(lengths) × grad_accum × data_ranks)."""
    unit = math.lcm(*(int(length) for _, length in curriculum)) * grad_accum * data_ranks
    return unit * max(1, math.ceil(at_least / unit))


def paper_curriculum(base: int = PAPER_BASE) -> list[list[float]]:
    """`PAPER_CURRICULUM` with first length ``base``: stages ``[fraction, base·ratio]``, lengths ``base ×
    (1, 8, 32, 128)`` (8×, 4×, 4×); ``base = 8192`` gives the paper's 8K → 64K → 256K → 1M."""
    if isinstance(base, bool) or not isinstance(base, int) or base < 1:
        raise ValueError(f"paper curriculum base = {base!r} is invalid: must be a positive integer")
    return [[fraction, base * ratio] for fraction, ratio in PAPER_CURRICULUM]


@dataclass
class TrainConfig:
    """A training run. ``curriculum`` is the explicit list of ``[fraction of the steps where a stage
    starts, sequence length]`` (SPEC §7; by default `paper_curriculum` scaled to `DEFAULT_BASE`); each
    step sees ``tokens_per_step`` tokens at any length (None: `DEFAULT_TOKENS_PER_RANK` per data rank, see
    `resolved`)."""

    out: str = "runs/k3"
    preset: str = "small"
    steps: int = 1000
    tokens_per_step: int | None = None
    grad_accum: int = 1
    curriculum: list[list[float]] = field(default_factory=lambda: paper_curriculum(DEFAULT_BASE))
    clip_grad: float = 1.0
    bf16: bool = False
    eval_every: int = 50
    eval_batches: int = 4
    eval_seq_len: int = 256  # validation windows: one length for the whole run, whatever the curriculum stage
    ckpt_every: int = 50
    log_every: int = 1
    seed: int = 0
    val_fraction: float = 0.02
    data: list[str] = field(default_factory=list)  # empty: the Python standard library's source
    data_limit_bytes: int | None = None
    balance: str = "exact"  # "exact" | "histogram" (quantile balancing), "bias-step", "none"
    max_minutes: float | None = None  # stop (with a checkpoint) after this much wall time
    threads: int | None = None  # torch intra-op threads; None: the cores other processes leave free (`CoreShare`)
    progress: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: dict[str, Any] | None = None  # a full K3Config dict overriding ``preset`` (recipe ablations)
    qat: str | None = None  # "mx": quantization-aware training of the routed experts (`QAT_MX`, SPEC §7)
    multimodal: bool = False  # add a micro-batch of generated image–text examples to every step (SPEC §6)
    multimodal_batch: int = 8  # examples in that micro-batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(data.keys() - names)
        if unknown:
            raise ValueError(f"unknown training field {unknown[0]!r}")
        data = dict(data)
        if "optim" in data:
            data["optim"] = OptimConfig(**{k: tuple(v) if k == "betas" else v for k, v in data["optim"].items()})
        return cls(**data)

    def model_config(self) -> K3Config:
        """``model`` (every field required) if given, else the ``preset``; with ``qat = "mx"`` its routed experts
        train on MX-quantized weights and inputs (`QAT_MX`)."""
        if self.qat not in (None, "mx"):
            raise ValueError(f"train.qat = {self.qat!r} is invalid: 'mx' or null")
        if self.model is None:
            config = preset(self.preset)
        else:
            try:
                config = K3Config.from_dict(self.model, complete=True)
            except (ValueError, TypeError) as err:
                raise ValueError(f"train.model: {err}") from err
        if self.qat == "mx":
            config = dataclasses.replace(config, mx=dataclasses.replace(QAT_MX))
        try:
            return config.validate()
        except ValueError as err:
            raise ValueError(f"train.model: {err}") from err

    def resolved(self, data_ranks: int = 1) -> TrainConfig:
        """This config with ``tokens_per_step`` chosen if it is None: `DEFAULT_TOKENS_PER_RANK` per data rank,
        rounded up so that every curriculum stage's sequences split evenly over ``data_ranks`` (`tokens_per_step_for`).
        A value given is never changed (`validate` and `k3.train.distributed.check_layout` explain what is wrong)."""
        if self.tokens_per_step is not None:
            return self
        try:
            chosen = tokens_per_step_for(self.curriculum, self.grad_accum, data_ranks,
                                         DEFAULT_TOKENS_PER_RANK * data_ranks)
        except (TypeError, ValueError, ArithmeticError):  # a malformed curriculum or grad_accum: `validate` names it
            chosen = DEFAULT_TOKENS_PER_RANK * data_ranks
        return dataclasses.replace(self, tokens_per_step=chosen)

    def validate(self) -> TrainConfig:
        """Every field against its accepted range (a ValueError naming it); ``tokens_per_step`` None as `resolved`
        makes it for one process."""
        if self.tokens_per_step is None:
            self.resolved().validate()
            return self
        check_counts(self, "train", ("steps", "tokens_per_step", "grad_accum", "eval_every", "ckpt_every", "log_every",
                                     "eval_batches", "eval_seq_len", "multimodal_batch"))
        model = self.model_config()
        if self.multimodal and not model.vision.enabled:
            raise ValueError("train.multimodal needs a model with a vision encoder (vision.enabled = true)")
        context = model.context_length
        self._validate_curriculum(context)
        if self.eval_seq_len > context:
            raise ValueError(f"train.eval_seq_len = {self.eval_seq_len} is beyond the model's context_length "
                             f"{context}")
        if self.balance not in ("exact", "histogram", "bias-step", "none"):
            raise ValueError(f"train.balance = {self.balance!r} is invalid: exact / histogram / bias-step / none")
        return self

    def _validate_curriculum(self, context: int) -> None:
        fractions = [frac for frac, _ in self.curriculum]
        if not fractions or fractions[0] != 0 or fractions != sorted(set(fractions)):
            raise ValueError(f"train.curriculum = {self.curriculum!r} is invalid: must start at fraction 0 and "
                             f"its fractions must increase")
        for frac, length in self.curriculum:
            if not 0 <= frac < 1 or int(length) < 1 or self.tokens_per_step % (int(length) * self.grad_accum):
                raise ValueError(f"train.curriculum stage {[frac, length]} is invalid: fractions in [0, 1) and "
                                 f"tokens_per_step={self.tokens_per_step} divisible by length·grad_accum")
        longest = max(int(length) for _, length in self.curriculum)
        if longest > context:
            raise ValueError(f"train.curriculum (--curriculum) reaches length {longest}, beyond the model's "
                             f"context_length {context}: use shorter stages (e.g. paper:{max(1, context // 128)})")

    def stage(self, step: int) -> int:
        """Index of the curriculum stage that ``step`` (0-based) belongs to."""
        return max(i for i, (frac, _) in enumerate(self.curriculum) if step >= frac * self.steps)

    def seq_len(self, step: int) -> int:
        """The curriculum's sequence length at ``step``."""
        return int(self.curriculum[self.stage(step)][1])


def _documents(config: TrainConfig):
    docs = load_corpus(config.data, config.data_limit_bytes)
    train_docs, val_docs = split_documents(docs, config.val_fraction, config.seed)
    return train_docs, val_docs


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state()}


# Training holds the weights, their gradients and up to two optimiser moments (AdamW) per parameter.
TRAINING_COPIES = 4


class Run(Stage):
    """One training run: model, data, optimisers, balancer, logging; `step()` advances one optimiser step."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config = config.resolved().validate()
        self.out = Path(config.out)
        self.model_config = config.model_config()
        check_fits(self.model_config, copies=TRAINING_COPIES,
                   what=f"training ({TRAINING_COPIES} × its parameters: weights, gradients, two optimizer moments)")
        torch.manual_seed(config.seed)
        self.model = K3ForCausalLM(self.model_config)
        self.step_index = 0
        self.last_validation: Validation | None = None
        self.metrics = Metrics(self.out / "metrics.jsonl")
        self.device = torch.device("cpu")
        self.context = None  # context parallelism's mixers (`k3.dist.context.ContextParallel`) in a distributed run

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's files (in a distributed run, rank 0 alone)."""
        return self.metrics.writes

    @property
    def loop(self) -> Loop:
        cfg = self.config
        return Loop(cfg.steps, cfg.ckpt_every, eval_every=cfg.eval_every, log_every=cfg.log_every,
                    max_minutes=cfg.max_minutes, threads=cfg.threads, adapt_threads=True, progress=cfg.progress)

    # ---------------------------------------------------------------- setup
    def prepare(self, resume: bool) -> None:
        """Load or build tokenizer and data, optimisers; resume from the newest checkpoint if asked."""
        existing = self.prepare_data(resume)
        self.optimizers = build_optimizers(self.model, self.model_config, self.config.optim)
        self.schedulers = schedulers(self.optimizers, self.config.steps, self.config.optim)
        mode = self.config.balance
        self.balancer = None if mode == "none" else QuantileBalancer(self.model, mode=mode)
        if existing is not None:
            self._restore(existing)
        self.metrics.start(None if existing is None else self.step_index)

    def prepare_data(self, resume: bool) -> Path | None:
        """Tokenizer (the checkpoint's, the run's, or trained), tokenized data and loader; returns the checkpoint
        to resume from, if any."""
        existing = open_run(self.out, resume, sharded.verify_any)
        train_docs, val_docs = _documents(self.config)
        self.tok_dir = self.out / "tokenizer"
        if existing is not None:  # the checkpoint's own tokenizer is authoritative
            self.tokenizer = model_ckpt.read_tokenizer(existing)
            if self.writes:
                self.tokenizer.save(self.tok_dir)
        elif (self.tok_dir / "tokenizer.json").exists():
            self.tokenizer = Tokenizer.load(self.tok_dir)
        else:
            self.tokenizer = Tokenizer.train((d.text for d in train_docs), self.model_config.vocab_size)
            self.tokenizer.save(self.tok_dir)
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} tokens but config.vocab_size is "
                             f"{self.model_config.vocab_size}")
        self.train_tokens = tokenize_documents(self.tokenizer, train_docs)
        self.val_tokens = tokenize_documents(self.tokenizer, val_docs)
        self.train_loader = self._loader()
        return existing

    def prepare_evaluation(self, checkpoint: Path) -> None:
        """Load ``checkpoint`` (weights, tokenizer, step) and the validation data for `evaluate`, writing
        nothing (``k3 eval``: any checkpoint of a run, the run's files left as they are)."""
        self._check_config(checkpoint)
        if sharded.is_sharded(checkpoint):
            sharded.load(checkpoint, self.model, [])
        else:
            model_ckpt.load_weights(checkpoint, self.model)
        self.tokenizer = model_ckpt.read_tokenizer(checkpoint)
        self.step_index = int(ckpt.load_state(checkpoint).get("step", 0))
        self.val_tokens = tokenize_documents(self.tokenizer, _documents(self.config)[1])

    def _loader(self) -> PackedLoader:
        """The loader of the current curriculum stage: a fixed token budget per step, so each stage has
        its own batch size (and its own shuffle seed); its position is checkpointed."""
        self.stage = self.config.stage(self.step_index)
        length = self.config.seq_len(self.step_index)
        loader = PackedLoader(self.train_tokens, seq_len=length, batch_size=self._batch(length),
                              eos_id=self.tokenizer.eos_id, seed=self.config.seed + self.stage)
        need = self.config.grad_accum * loader.batch_size * (length + 1)  # a step's micro-batches are held at once
        if need > loader.num_tokens:
            raise ValueError(f"not enough data for one step of grad_accum={self.config.grad_accum} micro-batches of "
                             f"{loader.batch_size} × {length} tokens: the stream has {loader.num_tokens} tokens, the "
                             f"step needs at least {need} (fewer --grad-accum or --tokens-per-step, or more data)")
        return loader

    def _batch(self, length: int) -> int:
        return self.config.tokens_per_step // (length * self.config.grad_accum)

    def _check_config(self, path: Path) -> None:
        """The checkpoint's model config must be this run's, except that QAT may start on a full-precision
        checkpoint (its weights are the float weights QAT trains)."""
        saved = model_ckpt.read_config(path)
        if not saved.mx.enabled and self.model_config.mx.enabled:
            print(f"k3: continuing full-precision checkpoint {path.name} with quantization-aware training "
                  f"(routed experts {self.model_config.mx.weight_format} / {self.model_config.mx.activation_format})",
                  file=sys.stderr)
            saved = dataclasses.replace(saved, mx=self.model_config.mx)
        elif saved.mx.enabled and not self.model_config.mx.enabled:
            raise ValueError(f"{path}: this checkpoint trains with quantization-aware training (mx); pass --qat mx "
                             f"to continue it")
        ckpt.check_same_config(path, saved, self.model_config)

    def _restore(self, path: Path) -> None:
        self._check_config(path)
        state = ckpt.load_state(path)
        if sharded.is_sharded(path):
            self._load_sharded(path)
        else:
            self._load_single(path, state)
        try:
            for sched, s in zip(self.schedulers, state["schedulers"], strict=True):
                sched.load_state_dict(s)
            self.step_index = int(state["step"])
            self.train_loader = self._loader()
            if state["loader_stage"] == self.stage:  # else the next step starts the new stage's loader afresh
                self.train_loader.load_state_dict(state["loader"])
            torch.set_rng_state(state["rng"]["torch"])
        except (KeyError, ValueError, TypeError, RuntimeError) as err:
            raise ValueError(f"{ckpt.state_file(path)}: does not match this run ({type(err).__name__}: {err})") from err

    def _load_sharded(self, path: Path) -> None:
        """Weights and optimiser states from a sharded checkpoint (written by a distributed run)."""
        sharded.load(path, self.model, self.optimizers)

    def _load_single(self, path: Path, state: dict[str, Any]) -> None:
        """Weights and optimiser states from a single-process checkpoint."""
        ckpt.load_single(path, self.model, self.optimizers, state)

    def train_state(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the model and optimiser tensors: schedulers, loader position, RNG, step."""
        return {"schedulers": [s.state_dict() for s in self.schedulers], "loader": self.train_loader.state_dict(),
                "loader_stage": self.stage, "rng": _rng_state(), "step": self.step_index}

    def save(self) -> Path:
        state = {"optimizers": [o.state_dict() for o in self.optimizers], **self.train_state()}
        return ckpt.save_checkpoint(self.out, self.step_index, self.model, self.model_config,
                                    self.config.to_dict(), self.tok_dir, state)

    # ---------------------------------------------------------------- one step
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.config.bf16 else contextlib.nullcontext()

    def _mla_layers(self) -> list[GatedMLA]:
        return [m for m in self.model.modules() if isinstance(m, GatedMLA)]

    def _accumulate(self, batches: list[tuple[Tensor, Tensor, Tensor]]) -> float:
        """Forward and backward the step's micro-batches; returns the step's loss (SPEC §7).

        The objective is the mean over *all* the step's supervised positions, ``Σ loss sums / Σ counts``:
        each micro-batch backpropagates its loss sum divided by the step's total count (known from the
        masks before any forward), so splitting a batch into micro-batches never reweights a position.
        """
        supervised = sum(int(mask.sum()) for _, _, mask, *_ in batches)
        if supervised == 0:
            raise ValueError(f"step {self.step_index + 1}: its {len(batches)} micro-batch(es) have no supervised "
                             f"positions")
        self.model.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, targets, mask, *images in batches:  # a multimodal micro-batch carries (pixels, grids)
            pixels, grids = images[0] if images else (None, None)
            inputs, targets, mask = (self.share(t) for t in (inputs, targets, mask))
            with self._autocast():
                logits, _ = self.model(inputs, pixel_values=pixels, grid_thw=grids, context=self.context)
            loss_sum, _ = masked_loss_sum(logits.float(), targets, mask)
            (loss_sum / supervised).backward()
            total += loss_sum.detach().double()
        return float(self.reduce_loss(total)) / supervised

    def share(self, t: Tensor) -> Tensor:
        """This process's part of a step's ``[B, T]`` batch tensor, on its device (all of it, in one process)."""
        return t.to(self.device)

    def reduce_loss(self, total: Tensor) -> Tensor:
        """The step's loss sum over every process from this process's part (its own, in one process)."""
        return total

    def step(self) -> dict[str, Any]:
        """One optimiser step over ``grad_accum`` micro-batches; returns the step's metrics."""
        cfg, start = self.config, time.time()
        if cfg.stage(self.step_index) != self.stage:
            self.train_loader = self._loader()
        length = self.train_loader.seq_len
        clip = cfg.optim.qk_clip
        for layer in self._mla_layers():
            layer.record_max_logits, layer.max_logits = clip is not None, None
        batches: list[tuple] = [next(self.train_loader) for _ in range(cfg.grad_accum)]
        if cfg.multimodal:
            batches.append(self._multimodal_batch())
        loss = self._accumulate(batches)
        tokens = sum(inputs.numel() for inputs, *_ in batches)
        grad_norm = self.clip_gradients(cfg.clip_grad)
        lr = apply_step(self.optimizers, self.schedulers)
        record: dict[str, Any] = {"step": self.step_index + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                  "seq_len": length, "tokens": tokens}
        if self.balancer is not None:
            self.balancer.update()
            record.update(self.balancer.load_stats())
        if clip is not None:
            for layer in self._mla_layers():
                if layer.max_logits is not None:
                    if dist.is_initialized():  # the largest logit any process saw (every process runs every layer)
                        dist.all_reduce(layer.max_logits, op=dist.ReduceOp.MAX)
                    qk_clip_mla(layer, layer.max_logits, clip)
                layer.record_max_logits, layer.max_logits = False, None
        self.step_index += 1
        record["tokens_per_s"] = tokens / max(time.time() - start, 1e-9)
        return record

    def clip_gradients(self, max_norm: float) -> float:
        """Scale the gradients to global norm ``max_norm`` at most; returns the norm before."""
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def _multimodal_batch(self) -> tuple:
        """This step's generated image–text examples (a function of the seed and the step: resumes exactly)."""
        n = self.config.multimodal_batch
        examples = [multimodal.example(self.config.seed, self.step_index * n + i) for i in range(n)]
        return multimodal.batch_examples(examples, self.tokenizer, self.model_config.vision.media_token_id)

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> Validation:
        """Validation loss and bits per byte (`k3.train.bpb`) over the supervised positions of the first
        ``batches`` batches of ``eval_seq_len``-token windows of the held-out documents (the same positions at
        every evaluation, so runs with different curricula compare)."""
        self.model.eval()
        length = self.config.eval_seq_len
        tally = ByteTally(self.tokenizer.token_bytes(), self.device)
        for inputs, targets, mask in eval_batches(self.val_tokens, length,
                                                  max(1, self.config.tokens_per_step // length),
                                                  self.tokenizer.eos_id, self.tokenizer.pad_id,
                                                  max_batches=batches or self.config.eval_batches):
            inputs, targets, mask = inputs.to(self.device), targets.to(self.device), mask.to(self.device)
            with self._autocast():
                logits, _ = self.model(inputs)
            tally.add(logits, targets, mask)
        return tally.result()

    def evaluation(self) -> dict[str, Any]:
        """Validation loss, perplexity, bits per byte and its compression anchors; with ``multimodal``, the colour
        accuracy of the image examples."""
        self.last_validation = self.evaluate()
        record = self.last_validation.record()
        if self.config.multimodal:
            record["colour_accuracy"] = multimodal.colour_accuracy(self.model, self.tokenizer)
        return record

    def postfix(self, record: dict[str, Any]) -> dict[str, object]:
        return {"loss": f"{record['loss']:.3f}", "tok_s": f"{record['tokens_per_s']:.0f}", "seq": record["seq_len"],
                "threads": record["threads"]}

    def log(self, record: dict[str, Any]) -> None:
        self.metrics.log(record)


#: ``curves.png``: loss (train and validation), learning rate and expert load over steps.
PANELS: tuple[Panel, ...] = (
    ("loss", (("loss", "train"), ("val_loss", "validation"))),
    ("bits per byte (validation text)", (("val_bpb", "model"), ("zlib_bpb", "zlib -9"), ("xz_bpb", "xz -9e"))),
    ("learning rate (Muon group)", (("lr", "learning rate"),)),
    ("expert load", (("load_max_mean", "max / mean (worst layer)"), ("load_idle", "idle experts (all layers)"))))


def pinned(config: TrainConfig, checkpoint: Path) -> TrainConfig:
    """``config`` with its model taken from ``checkpoint``'s ``config.json`` when it names a preset: the checkpoint
    is the run's model, and a preset's defaults may change between versions (``vision.norm_eps`` did, issue 38). The
    routed experts' MX settings stay the preset's, so that QAT is still switched only by ``--qat``."""
    if config.model is not None:
        return config
    saved = sharded.read_sized_config(checkpoint)  # before the model it describes is built
    return dataclasses.replace(config, model=dataclasses.replace(saved, mx=preset(config.preset).mx).to_dict())


def resumed(config: TrainConfig, resume: bool) -> TrainConfig:
    """``config`` `pinned` to the checkpoint a ``resume`` continues, if there is one (a run whose config holds its
    model is pinned already: no checkpoint is looked for)."""
    pin = resume and config.model is None
    found = model_ckpt.latest_checkpoint(Path(config.out), sharded.verify_any) if pin else None
    return config if found is None else pinned(config, found)


def train(config: TrainConfig, resume: bool = False) -> Run:
    """Run (or continue) training (`k3.train.driver.drive`): evaluations every ``eval_every`` steps, checkpoints
    every ``ckpt_every`` steps, both at the end and when ``max_minutes`` runs out. Torch's thread count is
    ``config.threads`` or adapted by `CoreShare` while it runs, and restored afterwards."""
    run = Run(resumed(config, resume))
    run.prepare(resume)
    drive(run, PANELS)
    return run
