"""Tiny Kimi-layout tokenizer files for tests: a small BPE trained here, specials at the release offsets."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import regex

from k3.tokenization.kimi import PAT_STR, KimiTokenizer

#: Offsets (from the first id after the base ranks) of the named special tokens, as in the release where known.
SPECIALS = {
    0: "[BOS]",
    2: "[EOS]",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "<|end_of_msg|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}
TEXTS = [
    "hello world", "Weather in Paris?", "message role=\"user\"", "response think tools call argument",
    'key="city" type="string" tool="get_weather" index="1"', "naïve café — ünïcödé", "中文English混合",
    "北京市 Pascal", "🙂 emoji 🚀", "The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x + 1\n",
]


def train_ranks(texts: Iterable[str], num_base: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair merged until ``num_base`` ranks
    (or no pair is left). Words are the Kimi pre-tokens; ties break on the larger pair, so the result is fixed."""
    ranks = {bytes([b]): b for b in range(256)}
    counts = Counter(w for t in texts for w in regex.findall(PAT_STR, t, flags=regex.V1))
    words = [([bytes([b]) for b in w.encode()], n) for w, n in counts.items()]
    while len(ranks) < num_base:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for parts, n in words:
            for pair in zip(parts, parts[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        ranks.setdefault(best[0] + best[1], len(ranks))
        words = [(_merge(parts, best), n) for parts, n in words]
    return ranks


def _merge(parts: list[bytes], pair: tuple[bytes, bytes]) -> list[bytes]:
    out: list[bytes] = []
    for part in parts:
        if out and (out[-1], part) == pair:
            out[-1] += part
        else:
            out.append(part)
    return out


def kimi_config(base: int, specials: dict[int, str] = SPECIALS, *, bos: str = "[BOS]", eos: str = "[EOS]",
                pad: str = "[PAD]", unk: str = "[UNK]") -> dict:
    """A ``tokenizer_config.json`` in the release's layout naming ``specials`` (offset -> literal) after ``base``."""
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    return {
        "added_tokens_decoder": {str(base + k): {"content": v, **flags} for k, v in sorted(specials.items())},
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk,
        "clean_up_tokenization_spaces": False, "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer",
    }


def build_kimi_tokenizer_files(directory: str | Path, texts: Iterable[str] = TEXTS, num_base: int = 600,
                               specials: dict[int, str] = SPECIALS) -> KimiTokenizer:
    """Train ranks on ``texts``, write ``tiktoken.model`` + ``tokenizer_config.json`` to ``directory``, load them."""
    ranks = train_ranks(texts, num_base)
    KimiTokenizer(ranks, kimi_config(len(ranks), specials)).save(directory)
    return KimiTokenizer.load(directory)
