"""`EngineOptions`: the engine-shaping flags of ``k3 serve``, ``k3 chat`` and ``k3 generate`` and the `Engine` they
build (as vLLM's ``EngineArgs``). One dataclass holds them; `EngineOptions.add_arguments` registers the flags,
`EngineOptions.from_args` reads them back and `EngineOptions.build` makes the engine, its prefix cache and drafter.

The commands accept different sets: ``k3 serve`` and ``k3 chat`` the engine's flags (`add_arguments`); ``k3 serve``
also ``--threads`` and ``--max-queue`` (`add_threads_argument`, `add_queue_argument`, registered where its help has
always listed them); ``k3 generate`` only ``--compile``, with its own help (`add_generate_arguments`).

This is the engine's face: it never imports the HTTP layers (`k3.serve.api`, `k3.serve.asgi`) or a web framework.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3.sizing.machine import MOST_PER_MACHINE

if TYPE_CHECKING:
    from k3.serve.engine import Engine


def positive(kind: type, zero: bool = False) -> Callable[[str], int | float]:
    """An argparse type: a positive (or, with ``zero``, non-negative) int or float; errors name the flag."""
    def parse(text: str) -> int | float:
        value = kind(text)
        if not (value >= 0 if zero else value > 0) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a {'non-negative' if zero else 'positive'} number, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def integer(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in [``low``, ``high``]; errors name the flag."""
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {text}")
        return value

    parse.__name__ = "int"
    return parse


def api_key(text: str) -> str:
    """An argparse type for ``--api-key``: a token a client can send as ``Authorization: Bearer KEY`` (visible ASCII,
    no space); an empty key would let an empty bearer token in."""
    if not text or not all("!" <= c <= "~" for c in text):
        raise argparse.ArgumentTypeError("expected a non-empty key of visible ASCII characters (no spaces)")
    return text


SEED = integer(0, 2**63 - 1)  # what torch's generators and numpy's take alike
PORT = integer(0, 65535)  # 0: any free port
THREADS = integer(1, MOST_PER_MACHINE)  # torch threads (100,000 crashed torch)
DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_LOOKUP = 32  # --prompt-lookup-max: the longest suffix the n-gram drafter may look up (its work per token)


def device_type(text: str) -> str:
    """An argparse type for ``--device``: ``auto``, or a device torch knows (``cpu``, ``cuda``, ``cuda:1``) that this
    machine has."""
    if text == "auto":
        return text
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}") from err
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise argparse.ArgumentTypeError(f"{text}: no such CUDA device here ({torch.cuda.device_count()} visible)")
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):  # one CPU
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def placement(device: str = "auto", dtype: str = "auto") -> tuple[Any, Any]:
    """The torch device and dtype of ``--device`` / ``--dtype``: ``auto`` is CUDA where there is one, else the CPU;
    bf16 on CUDA (as vLLM and the release) and fp32 on the CPU (whose kernels and tests are fp32)."""
    import torch

    where = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device)
    if dtype == "auto":
        return where, torch.bfloat16 if where.type == "cuda" else torch.float32
    return where, getattr(torch, dtype)


def load(path: str, verify: bool = True, device: str = "auto", dtype: str = "auto") -> tuple[Any, Any]:
    """(model, tokenizer) of a released Kimi K3 directory (`K3ForCausalLM.from_pretrained`, its tiktoken
    tokenizer, or ours in a ``k3 export`` directory) or of a kimi-k3 checkpoint / run directory (``verify=False``:
    without its checksums, `k3.model.checkpoint.load_model`), the model on ``device`` in ``dtype`` (`placement`;
    routers stay fp32)."""
    from k3.model.pretrained import is_release_dir

    where, dtype_ = placement(device, dtype)
    if is_release_dir(path):
        from k3.model.lm import K3ForCausalLM
        from k3.tokenization.bpe import Tokenizer
        from k3.tokenization.kimi import MODEL_FILE, KimiTokenizer

        # the release's tiktoken tokenizer, or ours where `k3 export` wrote the directory
        tokenizer = KimiTokenizer.load(path) if (Path(path) / MODEL_FILE).exists() else Tokenizer.load(path)
        return K3ForCausalLM.from_pretrained(path, dtype=dtype_).to(where), tokenizer
    from k3.model.checkpoint import load_model

    model, tokenizer = load_model(Path(path), verify)
    return model.to(device=where, dtype=dtype_), tokenizer


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` (``k3 generate``, ``k3 serve``, ``k3 chat``)."""
    parser.add_argument("--device", type=device_type, default="auto",
                        help="where the model runs: auto (CUDA when there is one, else the CPU), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="the model's floating-point type: auto (bfloat16 on CUDA, float32 on the CPU), or one")


def check_budgets(device: Any, *budgets: tuple[str, int]) -> None:
    """ValueError naming the flag of any of ``budgets`` (flag, bytes), or of their sum, that is more than the memory
    available on ``device`` (`k3.sizing.memory.available_bytes`; unknown: not checked): a cache allowed to grow past
    the machine's memory is bounded in name only."""
    from k3.sizing.memory import available_bytes

    available = available_bytes(device)
    if available is None:
        return
    for flag, size in (*budgets, (" + ".join(flag for flag, _ in budgets), sum(size for _, size in budgets))):
        if size > available:
            raise ValueError(f"{flag}: {size / 2**30:,.1f} GiB is more than the {available / 2**30:,.1f} GiB "
                             f"available on {device}")


@dataclass
class EngineOptions:
    """What shapes an `Engine` (defaults: the commands' flag defaults). ``max_waiting`` None and ``threads`` None
    keep the engine's queue (1024) and the command's thread count (``k3 serve``: all cores but one)."""

    max_model_len: int | None = None  # --max-model-len (None: the model's context length)
    max_batch: int = 32  # --max-batch
    prefill_chunk: int = 64  # --prefill-chunk
    max_waiting: int | None = None  # --max-queue (k3 serve)
    draft: str | None = None  # --draft: an EAGLE-3 draft or a small checkpoint with the target's vocabulary
    num_draft_tokens: int = 4  # --num-draft-tokens
    prompt_lookup_min: int | None = None  # --prompt-lookup-min (None: `NGramDrafter`'s default, at most the max)
    prompt_lookup_max: int | None = None  # --prompt-lookup-max (None: `NGramDrafter`'s default, at least the min)
    always_draft: bool = False  # --always-draft
    compile: bool = False  # --compile
    compile_packages: bool = False  # --compile-packages
    prefix_cache: bool = True  # not --no-prefix-cache
    prefix_cache_gb: float = 1.0  # --prefix-cache-gb
    cache_block_tokens: int = 64  # --cache-block-tokens
    cache_checkpoint_every: int = 8  # --cache-checkpoint-every
    cache_page_blocks: int = 4  # --cache-page-blocks
    threads: int | None = None  # --threads (k3 serve)
    grammar_cache_mb: float = 256.0  # --grammar-cache-mb

    def __post_init__(self) -> None:
        """Refuses ``--compile-packages`` without ``--compile``, and lookup bounds without ``--draft ngram``, out of
        order or past `MAX_LOOKUP` (before any model is loaded)."""
        if self.compile_packages and not self.compile:
            raise ValueError("--compile-packages: only with --compile")
        if self.draft != "ngram":
            if (self.prompt_lookup_min, self.prompt_lookup_max) != (None, None):
                raise ValueError("--prompt-lookup-min/--prompt-lookup-max: only with --draft ngram")
            return
        low, high = self.lookup()
        if not 1 <= low <= high:
            raise ValueError(f"--prompt-lookup-min ({low}) must be at least 1 and at most --prompt-lookup-max ({high})")
        if high > MAX_LOOKUP:  # each token indexes max − min + 1 n-grams of up to max tokens
            raise ValueError(f"--prompt-lookup-min/--prompt-lookup-max: at most {MAX_LOOKUP} tokens (got {low}-{high})")

    def lookup(self) -> tuple[int, int]:
        """(min, max) tokens of the n-gram drafter's lookup: the flags, an unset one from `NGramDrafter`'s
        defaults, moved to the other flag where it would pass it (vLLM's ``prompt_lookup_min/max``)."""
        from k3.serve.engine.ngram import NGramDrafter

        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None:
            low = NGramDrafter.MIN_N if high is None else min(NGramDrafter.MIN_N, high)
        if high is None:
            high = max(NGramDrafter.MAX_N, low)
        return low, high

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """The engine flags of ``k3 serve`` and ``k3 chat``, the prefix cache's in their own group."""
        parser.add_argument("--max-model-len", type=positive(int), help="context length, at most the model's "
                            "(default: the model's)")
        parser.add_argument("--max-batch", type=int, default=cls.max_batch, help="most requests decoded together")
        parser.add_argument("--prefill-chunk", type=int, default=cls.prefill_chunk,
                            help="prompt tokens prefilled per step while other requests decode (their latency vs "
                                 "the new prompt's time to first token)")
        parser.add_argument("--draft", help="speculative decoding: 'ngram' (prompt lookup: drafts what followed the "
                            "latest earlier occurrence of the text's last --prompt-lookup-min to -max tokens; no "
                            "model), an EAGLE-3 draft (k3 train-draft) or a small checkpoint with the same vocabulary")
        parser.add_argument("--num-draft-tokens", type=positive(int), default=cls.num_draft_tokens,
                            help="most tokens drafted per step with --draft (default %(default)s)")
        parser.add_argument("--prompt-lookup-min", type=positive(int),
                            help="with --draft ngram: the shortest suffix looked up (default 3; 2 matches more often "
                                 "and is wrong more often)")
        parser.add_argument("--prompt-lookup-max", type=positive(int),
                            help="with --draft ngram: the longest suffix looked up, tried first (default 4, at most "
                                 f"{MAX_LOOKUP})")
        parser.add_argument("--always-draft", action="store_true", help="draft --num-draft-tokens every step instead "
                            "of as many as each request's measured acceptance pays for (down to none)")
        parser.add_argument("--compile", action="store_true", help="decode and prefill-chunk steps through "
                            "torch.compile'd graphs: decode batches padded to 1, 2, 4 … 32 rows, chunks cut into "
                            "64/16/4/1-token pieces (one compilation each, kept in inductor's on-disk cache: k3 serve "
                            "builds them all in the background while it serves eagerly, for batches up to "
                            "--max-batch; k3 chat on first use)")
        parser.add_argument("--compile-packages", action="store_true", help="with --compile: the tuned decode and "
                            "verification graphs as AOTInductor packages kept in ~/.cache/k3/packages, which a later "
                            "start with the same weights loads in seconds instead of compiling (each package holds a "
                            "copy of the weights: about the checkpoint's size per graph; the least recently used are "
                            "removed beyond $K3_PACKAGES_GB GiB, default 8)")
        parser.add_argument("--grammar-cache-mb", type=positive(float, zero=True), default=cls.grammar_cache_mb,
                            help="MiB of compiled structured-output grammars kept for reuse (default %(default)s)")
        cache = parser.add_argument_group("prefix cache (README, 'Prefix cache')")
        cache.add_argument("--prefix-cache-gb", type=positive(float, zero=True), default=cls.prefix_cache_gb,
                           help="bytes for cached MLA pages and KDA checkpoints, in GiB (default: %(default)s)")
        cache.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt")
        cache.add_argument("--cache-block-tokens", type=positive(int), default=cls.cache_block_tokens,
                           help="tokens per hash block (the paper's 512; default %(default)s for small models)")
        cache.add_argument("--cache-checkpoint-every", type=positive(int), default=cls.cache_checkpoint_every,
                           help="KDA checkpoint every N hash blocks of a long prompt (default %(default)s)")
        cache.add_argument("--cache-page-blocks", type=positive(int), default=cls.cache_page_blocks,
                           help="hash blocks per physical MLA page, the unit of allocation (default %(default)s)")

    @staticmethod
    def add_threads_argument(parser: argparse.ArgumentParser) -> None:
        """``k3 serve --threads``."""
        parser.add_argument("--threads", type=THREADS, help="torch intra-op threads (default: all cores but "
                            "one, which is left to the HTTP server)")

    @staticmethod
    def add_queue_argument(group: argparse._ArgumentGroup) -> None:
        """``k3 serve --max-queue`` (in its limits group)."""
        group.add_argument("--max-queue", type=positive(int),
                           help="most generations waiting for a batch slot (default 1024; 429 with Retry-After beyond)")

    @staticmethod
    def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
        """``k3 generate --compile`` (no engine: `k3.generation.stream` through `k3.model.payoff.PayingStep`)."""
        parser.add_argument("--compile", action="store_true", help="decode through the tuned decode step as an "
                            "AOTInductor package from ~/.cache/k3/packages (1-3 min to compile and save it on a first "
                            "run; it holds a copy of the weights), loaded after the first 3 tokens where the last "
                            "load says it pays for the rest of the run, else decode eagerly; a model with packed "
                            "MXFP4 experts decodes through a precompiled graph from ~/.cache/k3/graphs instead")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options of parsed flags; one the command does not have keeps its default."""
        given = vars(args)
        values = {f.name: given[f.name] for f in fields(cls) if f.name in given}
        if "no_prefix_cache" in given:
            values["prefix_cache"] = not given["no_prefix_cache"]
        if given.get("max_queue") is not None:
            values["max_waiting"] = given["max_queue"]
        return cls(**values)

    def build(self, model: Any, tokenizer: Any) -> Engine:
        """The `Engine` over ``model`` with these options: its prefix cache, drafter and compiled graphs."""
        from k3.model.compiled import CompiledModel
        from k3.serve.engine import Engine
        from k3.serve.engine.cache import PrefixCache
        from k3.serve.engine.structured import Grammars

        cache_bytes, grammar_bytes = int(self.prefix_cache_gb * 2**30), int(self.grammar_cache_mb * 2**20)
        check_budgets(model.device, ("--prefix-cache-gb", cache_bytes if self.prefix_cache else 0),
                      ("--grammar-cache-mb", grammar_bytes))
        cache = None if not self.prefix_cache else PrefixCache.for_model(
            model, tokenizer, cache_bytes, self.cache_block_tokens, self.cache_checkpoint_every, self.cache_page_blocks)
        queue = {} if self.max_waiting is None else {"max_waiting": self.max_waiting}
        return Engine(model, tokenizer, max_model_len=self.max_model_len, max_batch=self.max_batch,
                      prefill_chunk=self.prefill_chunk, prefix_cache=cache, drafter=self.drafter(model),
                      num_draft_tokens=self.num_draft_tokens, adaptive_draft=not self.always_draft,
                      compile=CompiledModel(model, packaged=True) if self.compile_packages else self.compile,
                      grammars=Grammars(tokenizer, grammar_bytes), **queue)

    def drafter(self, target: Any) -> Any:
        """`--draft`: ``ngram`` (`k3.serve.engine.ngram`), or a directory: an EAGLE-3 draft (`k3 train-draft`, a run or
        checkpoint directory) or a small kimi-k3 checkpoint with the target's vocabulary (None without ``draft``)."""
        if self.draft is None:
            return None
        if self.draft == "ngram":
            from k3.serve.engine.ngram import NGramDrafter

            low, high = self.lookup()
            return NGramDrafter(max_n=high, min_n=low)
        from k3.model.draft import EagleDraft
        from k3.serve.engine.drafting import EagleDrafter, ModelDrafter

        path = Path(self.draft)
        if (path / "draft.json").exists() or (path / "latest").exists() and not (path / "model.safetensors").exists() \
                and any(path.glob("step-*/draft.json")):
            return EagleDrafter(EagleDraft.load(path, target), compile=self.compile)
        draft, _ = load(self.draft)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"--draft {self.draft}: vocabulary {draft.config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size}")
        return ModelDrafter(draft.to(device=target.device, dtype=target.dtype), compile=self.compile)
