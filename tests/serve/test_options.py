"""`k3.serve.options.EngineOptions`: the engine flags of ``k3 serve``, ``k3 chat`` and ``k3 generate`` parse to the
options those commands used before it existed, and `EngineOptions.build` makes the engine they made."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

import serving
from k3.cli import serve as serve_commands
from k3.model.checkpoint import save_model
from k3.serve.engine import Engine
from k3.serve.engine.cache import PrefixCache
from k3.serve.engine.drafting import EagleDrafter, ModelDrafter
from k3.serve.engine.ngram import NGramDrafter
from k3.serve.options import EngineOptions

#: the commands' defaults before `EngineOptions` (`k3.cli` at a5b2f96), field by field, and the grammar cache's,
#: adaptive drafting's and the n-gram lookup's (issue 36) and packaged graphs' (issue 37) since
PREVIOUS_DEFAULTS = {"max_model_len": None, "max_batch": 32, "prefill_chunk": 64, "max_waiting": None, "draft": None,
                     "num_draft_tokens": 4, "prompt_lookup_min": None, "prompt_lookup_max": None,
                     "always_draft": False, "compile": False, "compile_packages": False, "prefix_cache": True,
                     "prefix_cache_gb": 1.0,
                     "cache_block_tokens": 64, "cache_checkpoint_every": 8, "cache_page_blocks": 4, "threads": None,
                     "grammar_cache_mb": 256.0}
FLAGS = ["--max-model-len", "512", "--max-batch", "3", "--prefill-chunk", "16", "--draft", "d", "--num-draft-tokens",
         "2", "--compile", "--prefix-cache-gb", "0.5", "--cache-block-tokens", "16", "--cache-checkpoint-every", "2",
         "--cache-page-blocks", "2", "--always-draft"]
CHOSEN = {"max_model_len": 512, "max_batch": 3, "prefill_chunk": 16, "draft": "d", "num_draft_tokens": 2,
          "always_draft": True,
          "compile": True, "prefix_cache_gb": 0.5, "cache_block_tokens": 16, "cache_checkpoint_every": 2,
          "cache_page_blocks": 2}


def parse(*argv: str) -> argparse.Namespace:
    """``argv`` through the serving commands' real parsers (`k3.cli.serve.add_commands`)."""
    parser = argparse.ArgumentParser(prog="k3")
    serve_commands.add_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.mark.parametrize("command", ["serve", "chat", "generate"])
def test_defaults_are_the_commands_previous_defaults(command):
    assert dataclasses.asdict(EngineOptions()) == PREVIOUS_DEFAULTS
    assert EngineOptions.from_args(parse(command, "--ckpt", "c")) == EngineOptions()


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_engine_flags_parse_to_the_options(command):
    options = EngineOptions.from_args(parse(command, "--ckpt", "c", *FLAGS))
    assert options == EngineOptions(**CHOSEN)
    assert not EngineOptions.from_args(parse(command, "--ckpt", "c", "--no-prefix-cache")).prefix_cache


def test_the_commands_keep_their_own_flag_sets(capsys):
    assert EngineOptions.from_args(parse("serve", "--ckpt", "c", "--threads", "3", "--max-queue", "7")) == \
        EngineOptions(threads=3, max_waiting=7)
    assert EngineOptions.from_args(parse("generate", "--ckpt", "c", "--compile")) == EngineOptions(compile=True)
    for argv in (["chat", "--threads", "3"], ["chat", "--max-queue", "7"], ["generate", "--max-batch", "3"]):
        with pytest.raises(SystemExit):
            parse(*argv, "--ckpt", "c")
    assert "unrecognized arguments" in capsys.readouterr().err
    for flag in ("--num-draft-tokens", "--cache-block-tokens", "--max-queue"):
        with pytest.raises(SystemExit):
            parse("serve", "--ckpt", "c", flag, "0")
        assert f"argument {flag}: expected a positive number, got 0" in capsys.readouterr().err


def previous_engine(args: argparse.Namespace, model, tokenizer) -> Engine:
    """How ``k3 serve`` built its engine before `EngineOptions` (`k3.cli._engine` at a5b2f96; no ``--draft``)."""
    cache = None if args.no_prefix_cache else PrefixCache.for_model(
        model, tokenizer, int(args.prefix_cache_gb * 2**30), args.cache_block_tokens, args.cache_checkpoint_every,
        args.cache_page_blocks)
    return Engine(model, tokenizer, max_model_len=args.max_model_len, max_batch=args.max_batch,
                  prefill_chunk=args.prefill_chunk, prefix_cache=cache, num_draft_tokens=args.num_draft_tokens,
                  compile=args.compile, **({"max_waiting": args.max_queue} if args.max_queue else {}))


def settings(engine: Engine) -> dict:
    cache = engine.prefix_cache
    return {"max_model_len": engine.max_model_len, "max_batch": engine.max_batch,
            "prefill_chunk": engine.prefill_chunk, "max_waiting": engine.max_waiting,
            "num_draft_tokens": engine.num_draft_tokens, "compiled": engine.compiled is not None,
            "drafter": type(engine.drafter).__name__,
            "cache": None if cache is None else (cache.budget, cache.block, cache.checkpoint_every, cache.page_blocks,
                                                 cache.namespace)}


@pytest.mark.parametrize("flags", [[], [f for f in FLAGS if f not in ("--draft", "d")] + ["--max-queue", "5"],
                                   ["--no-prefix-cache", "--max-batch", "2"]])
def test_build_gives_the_engine_the_command_built_before(flags):
    model, tokenizer = serving.model(), serving.tokenizer()
    args = parse("serve", "--ckpt", "c", *flags)
    engine = EngineOptions.from_args(args).build(model, tokenizer)
    assert settings(engine) == settings(previous_engine(args, model, tokenizer))


def test_build_with_chosen_options():
    options = EngineOptions(max_model_len=100, max_batch=3, prefill_chunk=16, max_waiting=5, num_draft_tokens=2,
                            compile=True, prefix_cache_gb=0.25, cache_block_tokens=16, cache_checkpoint_every=2,
                            cache_page_blocks=2)
    engine = options.build(serving.model(), serving.tokenizer())
    assert settings(engine) == {"max_model_len": 100, "max_batch": 3, "prefill_chunk": 16, "max_waiting": 5,
                                "num_draft_tokens": 2, "compiled": True, "drafter": "NoneType",
                                "cache": (2**28, 16, 2, 2, engine.prefix_cache.namespace)}
    assert dataclasses.replace(options, prefix_cache=False).build(serving.model(), serving.tokenizer()).prefix_cache \
        is None


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_grammar_cache_flag(command):
    options = EngineOptions.from_args(parse(command, "--ckpt", "c", "--grammar-cache-mb", "8"))
    assert options == EngineOptions(grammar_cache_mb=8.0)
    assert options.build(serving.model(), serving.tokenizer()).grammars.cache_bytes == 8 * 2**20


def test_cache_budgets_past_the_memory_available_are_refused_by_flag(monkeypatch):
    """``--prefix-cache-gb 1e12`` was accepted: a cache allowed to grow past the machine's memory, bounded in name
    only. A budget (or the two together) past the memory available on the model's device is refused by its flag."""
    import k3.sizing.memory as memory

    model, tokenizer = serving.model(), serving.tokenizer()
    with pytest.raises(ValueError, match=r"--prefix-cache-gb: 1,000,000,000,000\.0 GiB is more than the .* GiB "
                                         r"available on cpu"):
        EngineOptions(prefix_cache_gb=1e12).build(model, tokenizer)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 3 * 2**30)
    with pytest.raises(ValueError, match=r"--grammar-cache-mb: 4\.0 GiB is more than the 3\.0 GiB"):
        EngineOptions(grammar_cache_mb=4096).build(model, tokenizer)
    with pytest.raises(ValueError, match=r"--prefix-cache-gb \+ --grammar-cache-mb: 3\.5 GiB is more than the 3\.0"):
        EngineOptions(prefix_cache_gb=2, grammar_cache_mb=1536).build(model, tokenizer)
    assert EngineOptions(prefix_cache_gb=2, grammar_cache_mb=512).build(model, tokenizer).prefix_cache is not None
    assert EngineOptions(prefix_cache=False, prefix_cache_gb=5).build(model, tokenizer).prefix_cache is None  # unused
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)  # unknown: not checked
    assert EngineOptions(prefix_cache_gb=100).build(model, tokenizer).prefix_cache is not None


def test_build_loads_the_draft(tmp_path):
    from k3.model.draft import DraftConfig, EagleDraft

    model, tokenizer = serving.model(), serving.tokenizer()
    small = save_model(tmp_path / "draft", serving.model(seed=1), tokenizer)
    eagle = EagleDraft(model, DraftConfig(layer_kind="mla")).save(tmp_path / "eagle")
    assert isinstance(EngineOptions(draft=str(small)).build(model, tokenizer).drafter, ModelDrafter)
    assert isinstance(EngineOptions(draft=str(eagle)).build(model, tokenizer).drafter, EagleDrafter)


def test_draft_ngram_needs_no_checkpoint_and_always_draft_turns_adaptation_off():
    model, tokenizer = serving.model(), serving.tokenizer()
    adaptive = EngineOptions(draft="ngram").build(model, tokenizer)
    assert isinstance(adaptive.drafter, NGramDrafter) and adaptive.speculator.lengths is not None
    fixed = EngineOptions.from_args(parse("serve", "--ckpt", "c", "--draft", "ngram", "--always-draft")).build(
        model, tokenizer)
    assert isinstance(fixed.drafter, NGramDrafter) and fixed.speculator.lengths is None


@pytest.mark.parametrize(("flags", "bounds"), [([], (NGramDrafter.MIN_N, NGramDrafter.MAX_N)),
                                               (["--prompt-lookup-min", "1", "--prompt-lookup-max", "6"], (1, 6)),
                                               (["--prompt-lookup-max", "1"], (1, 1)),
                                               (["--prompt-lookup-min", "7"], (7, 7))])
def test_prompt_lookup_bounds_reach_the_ngram_drafter(flags, bounds):
    options = EngineOptions.from_args(parse("serve", "--ckpt", "c", "--draft", "ngram", *flags))
    drafter = options.drafter(serving.model())
    assert (drafter.min_n, drafter.max_n) == bounds == options.lookup()


def test_prompt_lookup_bounds_are_refused_out_of_order_or_without_the_ngram_drafter(capsys):
    with pytest.raises(ValueError, match=r"--prompt-lookup-min \(4\) must be at least 1 and at most "
                                         r"--prompt-lookup-max \(3\)"):
        EngineOptions.from_args(parse("serve", "--ckpt", "c", "--draft", "ngram", "--prompt-lookup-min", "4",
                                      "--prompt-lookup-max", "3"))
    for low, high, got in ((1, 33, "1-33"), (40, None, "40-40")):  # an unset max moves up to the min
        message = rf"--prompt-lookup-min/--prompt-lookup-max: at most 32 tokens \(got {got}\)"
        with pytest.raises(ValueError, match=message):
            EngineOptions(draft="ngram", prompt_lookup_min=low, prompt_lookup_max=high)
    for draft in ([], ["--draft", "d"]):
        with pytest.raises(ValueError, match="--prompt-lookup-min/--prompt-lookup-max: only with --draft ngram"):
            EngineOptions.from_args(parse("chat", "--ckpt", "c", *draft, "--prompt-lookup-max", "3"))
    with pytest.raises(SystemExit):
        parse("serve", "--ckpt", "c", "--draft", "ngram", "--prompt-lookup-min", "0")
    assert "argument --prompt-lookup-min: expected a positive number, got 0" in capsys.readouterr().err


def test_the_help_states_the_drafters_lookup_defaults(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert f"the shortest suffix looked up (default {NGramDrafter.MIN_N};" in text
    assert f"the longest suffix looked up, tried first (default {NGramDrafter.MAX_N}, at most 32)" in text


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_compile_packages_puts_the_engines_tuned_steps_on_packages_and_needs_compile(command):
    from k3.model.packaged import PackagedStep

    options = EngineOptions.from_args(parse(command, "--ckpt", "c", "--compile", "--compile-packages"))
    assert options == EngineOptions(compile=True, compile_packages=True)
    engine = options.build(serving.model(), serving.tokenizer())
    assert isinstance(engine.compiled.decode_step, PackagedStep) and isinstance(engine.compiled.verify_step,
                                                                                PackagedStep)
    assert engine.compiled.compilations == 0  # nothing is built before `warm_up`
    with pytest.raises(ValueError, match="--compile-packages: only with --compile"):
        EngineOptions.from_args(parse(command, "--ckpt", "c", "--compile-packages"))


@pytest.mark.parametrize("argv, message", [
    (["serve", "--ckpt", "c", "--port", "99999"], "argument --port: expected an integer in [0, 65535], got 99999"),
    (["route", "--port", "-1", "--replica", "http://127.0.0.1:1"],
     "argument --port: expected an integer in [0, 65535], got -1"),
    (["generate", "--ckpt", "c", "--seed", "-1"], "argument --seed: expected an integer in [0, 9223372036854775807]"),
    (["train", "--seed", str(2**64)], "argument --seed: expected an integer in [0, 9223372036854775807]"),
    (["train", "--data-limit-mb", "nan"], "argument --data-limit-mb: expected a positive number, got nan"),
    (["serve", "--ckpt", "c", "--port", "65535", "--replicas", "2"],
     "--port 65535: with --replicas 2 it must lie in 1..65533 (the replicas listen on PORT+1..PORT+2)"),
    (["serve", "--ckpt", "c", "--port", "0", "--replicas", "2"], "--port 0: with --replicas 2 it must lie in"),
    (["serve", "--ckpt", "c", "--replicas", str(4 * (os.cpu_count() or 1) + 1)], "this machine runs at most"),
    (["serve", "--ckpt", "c", "--max-model-len", "0"], "argument --max-model-len: expected a positive number, got 0"),
    (["serve", "--ckpt", "c", "--threads", "0"], "argument --threads: expected an integer in [1, "),
    # an empty key let an empty bearer token in; a key with a space cannot be sent
    (["serve", "--ckpt", "c", "--api-key", ""], "argument --api-key: expected a non-empty key of visible ASCII"),
    (["route", "--replica", "http://127.0.0.1:1", "--api-key", "a b"], "argument --api-key: expected a non-empty"),
    # the router started and waited for replicas it could never reach (or, with user info, named another host)
    *[(["route", "--replica", url], f"replica {url!r}: expected a base URL") for url in
      ("ftp://x", "notaurl", "http://", "http://u:p@127.0.0.1:1", "http://127.0.0.1:1/v1?x=1")],
    (["train", "--threads", "100000"], "argument --threads: expected an integer in [1, "),  # was a segfault
    (["sft", "--ckpt", "c", "--data", "d", "--out", "o", "--threads", "100000"], "argument --threads: expected an"),
])
def test_ports_seeds_and_limits_out_of_range_are_refused_by_flag_before_anything_runs(argv, message, capsys):
    """A port beyond 65,535 (a bind traceback after the model had loaded), a seed torch cannot take, a NaN data limit,
    replicas whose ports run past the last and more replicas than the machine can hold (1000 would each load the
    model) are refused by name, with no traceback."""
    from k3.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_a_max_model_len_beyond_the_models_context_is_refused_not_clamped():
    """It was cut to the model's context in silence (and 0 meant the model's): vLLM refuses it too."""
    model, tokenizer = serving.model(), serving.tokenizer()
    for length in (0, model.config.context_length + 1):
        with pytest.raises(ValueError, match=rf"max_model_len \(--max-model-len\): {length} is not within 1..4096"):
            Engine(model, tokenizer, max_model_len=length)
    assert Engine(model, tokenizer, max_model_len=4096).max_model_len == 4096
    assert Engine(model, tokenizer).max_model_len == 4096
