"""The serving commands of ``k3``: ``k3 generate`` (continue a prompt), ``k3 serve`` (the OpenAI-compatible HTTP
server, or with ``--replicas`` a fleet behind a router), ``k3 chat`` (the terminal) and ``k3 route`` (a cache-aware
router in front of running servers). Their engine flags are `k3.serve.options.EngineOptions`'."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from k3.serve.options import PORT, SEED, EngineOptions, add_placement_arguments, api_key, load, positive
from k3.sizing.machine import MOST_PER_MACHINE, PER_CORE


def _generate(args: argparse.Namespace) -> int:
    from k3.generation import check_sampling, room, stream

    check_sampling(args.temperature, args.top_p, args.top_k)  # before the checkpoint is read
    model, tokenizer = load(args.ckpt, not args.no_verify, args.device, args.dtype)
    prompt = tokenizer.encode(args.prompt) or [tokenizer.bos_id]
    tokens = min(args.max_tokens, room(model, prompt))  # none past the model's context
    step = None
    if EngineOptions.from_args(args).compile:  # the decode graph from the on-disk cache where it pays for the run
        from k3.model.payoff import PayingStep

        context = len(prompt) + tokens
        step = PayingStep(model, tokens, lambda compiled: compiled.families(1, context, prefill=False))
    print(args.prompt, end="", flush=True)
    ids: list[int] = []
    for token in stream(model, prompt, tokens, args.temperature, args.top_p, args.top_k, args.seed,
                        stop_ids=() if args.ignore_eos else (tokenizer.eos_id,), step=step):
        ids.append(token)
    print(tokenizer.decode(ids))
    if tokens < args.max_tokens and len(ids) == tokens:
        print(f"k3: stopped at the model's context of {model.config.context_length} tokens", file=sys.stderr)
    if step is not None:
        print(step.finish(), file=sys.stderr)
    return 0


#: ``k3 serve`` flags of `k3.serve.asgi.guard.Limits`: flag, field, type, scale (flag → field), help.
_LIMIT_FLAGS = (
    ("--max-body-mb", "max_body_bytes", float, 2**20, "largest request body in MiB (413 beyond)"),
    ("--max-choices", "max_choices", int, 1, "most generations per request, prompts x n (400 beyond)"),
    ("--max-connections", "max_connections", int, 1, "most connections served at once (503 beyond; /health is "
     "always answered)"),
    ("--max-connections-per-client", "max_connections_per_client", int, 1, "most connections from one client "
     "address (429 beyond)"),
    ("--header-timeout", "header_timeout", float, 1, "seconds for a client to send a request's headers (the "
     "connection is closed)"),
    ("--body-timeout", "body_timeout", float, 1, "seconds for a request body to arrive (408)"),
    ("--keep-alive-timeout", "keep_alive_timeout", float, 1, "idle seconds before a keep-alive connection is closed"),
    ("--request-timeout", "request_timeout", float, 1, "seconds for a generation to finish (408, the work is "
     "cancelled; 0: no limit)"),
    ("--drain-timeout", "drain_timeout", float, 1, "on SIGTERM, seconds to let running requests finish before "
     "cancelling them"),
    ("--max-images", "max_images", int, 1, "most image_url parts in one request (400 beyond)"),
    ("--max-logprob-entries", "max_logprob_entries", int, 1, "most log-probability entries (a token or an "
     "alternative) in one answer, over its prompt, generated tokens and choices (400 beyond)"),
    ("--max-decoded-image-mb", "max_decoded_image_bytes", float, 2**20, "MiB that one request's images may take "
     "decoded, pixels and their RGB copy (400 beyond, from the image header)"),
    ("--max-image-decodes", "max_image_decodes", int, 1, "requests decoding images at once (the others wait)"),
)


def _limits(args: argparse.Namespace):
    from k3.serve.asgi.guard import Limits

    defaults = Limits()
    values = {field: type(getattr(defaults, field))(getattr(args, flag[2:].replace("-", "_")) * scale)
              for flag, field, _, scale, _ in _LIMIT_FLAGS}
    return Limits(**{**values, "request_timeout": values["request_timeout"] or None}, public_docs=args.public_docs)


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    from k3.serve.asgi.guard import Limits

    defaults = Limits()
    group = parser.add_argument_group("limits (README, 'Limits')")
    for flag, field, kind, scale, help_ in _LIMIT_FLAGS:
        group.add_argument(flag, type=positive(kind, zero=field == "request_timeout"),
                           default=kind(getattr(defaults, field) / scale), help=help_)
    EngineOptions.add_queue_argument(group)
    group.add_argument("--public-docs", action="store_true", help="serve /docs and /openapi.json without the API key")


def _serve(args: argparse.Namespace) -> int:
    if args.replicas > 1:
        from k3.serve.fleet.launch import run_fleet

        if args.replicas > MOST_PER_MACHINE:  # each loads the model: 1000 would exhaust the memory
            raise ValueError(f"--replicas {args.replicas}: this machine runs at most {MOST_PER_MACHINE} ({PER_CORE} "
                             f"per CPU core); for more, start replicas on other machines behind k3 route")
        if not 0 < args.port <= 65535 - args.replicas:  # 0 (any free port) has no PORT+1
            raise ValueError(f"--port {args.port}: with --replicas {args.replicas} it must lie in "
                             f"1..{65535 - args.replicas} (the replicas listen on PORT+1..PORT+{args.replicas})")

        return run_fleet(args.ckpt, args.replicas, args.port, args.argv[1:], host=args.host, limits=_limits(args),
                         api_key=args.api_key)
    import torch

    from k3.serve.api.app import create_app
    from k3.serve.asgi.server import Server

    limits = _limits(args)  # invalid limits are refused before the model is loaded
    options = EngineOptions.from_args(args)
    torch.set_num_threads(options.threads or max(1, (os.cpu_count() or 1) - 1))
    engine = options.build(*load(args.ckpt, not args.no_verify, args.device, args.dtype))
    if engine.compiled is not None:  # no graph is ever built inside a running batch's step
        seconds = engine.warm_up(background=not args.compile_wait)
        compiled, what = engine.compiled, (f"decode batches up to {engine.compiled.bucket(engine.max_batch)}, prefill "
                                           f"pieces {engine.compiled.sizes}, context {engine.max_model_len} tokens")
        if (plan := compiled.plan) is not None:
            where = f" (precompiled ones by process {plan.worker.process.pid})" if plan.worker else ""
            print(f"k3 serve: building {len(plan.planned)} graphs in the background{where} ({what}); until a "
                  f"shape's graph is ready its steps run eagerly (GET /metrics: k3_compile_graphs_built)", flush=True)
        else:
            print(f"k3 serve: {compiled.compilations} graphs compiled in {seconds:.1f} s, {compiled.cache_hits} of "
                  f"them from the on-disk cache ({what})", flush=True)
    engine.start()
    name = args.model_name or Path(args.ckpt).resolve().name
    app = create_app(engine, name, api_key=args.api_key, default_mode=args.mode, limits=limits,
                     separate_reasoning=not args.reasoning_in_content, allowed_origins=args.allowed_origins)
    server = Server(app, host=args.host, port=args.port)
    port = server.listen()  # --port 0: the free port chosen, printed
    print(f"k3 serve: model {name!r} at http://{args.host}:{port}/v1 (context {engine.max_model_len} tokens)",
          flush=True)
    try:
        server.run()
    finally:
        engine.stop()
    print("k3 serve: stopped", flush=True)
    return 0


def _route(args: argparse.Namespace) -> int:
    from k3.serve.fleet.launch import run_router

    return run_router(args.replica, args.host, args.port, api_key=args.api_key, long_threshold=args.long_threshold,
                      short_budget=args.short_budget, long_budget=args.long_budget)


def _chat(args: argparse.Namespace) -> int:
    from k3.chat import chat_format
    from k3.serve.engine import SamplingParams

    # the settings checked before the checkpoint is read (the vocabulary does not enter these fields' checks)
    SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed).check(1)
    engine = EngineOptions.from_args(args).build(*load(args.ckpt, not args.no_verify, args.device, args.dtype))
    tokenizer = engine.tokenizer
    fmt = chat_format(tokenizer)
    mode, history = args.mode, []
    stops = fmt.stop_ids(tokenizer)
    visuals = _chat_images(args.image, engine, fmt)
    print(f"k3 chat ({mode} mode). Commands: /reset, /mode thinking|instruct, /quit", flush=True)
    for line in sys.stdin:
        line = line.rstrip("\n")
        if line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/reset" or line.startswith("/mode"):
            mode, history = _chat_command(line, mode, history)
            continue
        images = [{"type": "image_url", "image_url": {"url": path}} for path in args.image] if not history else []
        history.append({"role": "user", "content": [*images, {"type": "text", "text": line}] if images else line})
        try:
            prompt = fmt.render(history, tokenizer, mode, **_slots(visuals))  # the images lead the first message
        except ValueError as err:  # text that is not valid Unicode: the line is dropped, the conversation kept
            print(f"(not sent: {err})", flush=True)
            history.pop()
            continue
        budget = engine.max_model_len - len(prompt)
        if budget < 1:
            print("(the conversation fills the context; /reset to start over)", flush=True)
            history.pop()
            continue
        params = SamplingParams(max_tokens=min(args.max_tokens, budget), temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, stop_token_ids=stops)
        parts = _chat_reply(engine, fmt, mode, prompt, params, visuals)
        history.append({"role": "assistant", "content": parts["content"] + parts["tools"],
                        "reasoning_content": parts["reasoning"]})
    return 0


def _chat_command(line: str, mode: str, history: list) -> tuple[str, list]:
    """``/reset`` or ``/mode thinking|instruct``: the chat's mode and history after it."""
    from k3.chat.native import MODES

    if line.strip() == "/reset":
        print("(history cleared)", flush=True)
        return mode, []
    wanted = line.split()[-1]
    if wanted not in MODES:
        print(f"(unknown mode {wanted!r}; choose {' or '.join(MODES)})", flush=True)
        return mode, history
    print(f"({wanted} mode)", flush=True)
    return wanted, history


def _chat_reply(engine, fmt, mode: str, prompt: list[int], params, visuals: list) -> dict[str, str]:
    """The assistant's turn, printed as it streams with a ``[channel]`` tag at each change; its text per channel."""
    parts = {"reasoning": "", "content": "", "tools": ""}
    channel = None
    for output in engine.generate(prompt, params, processor=fmt.AssistantParser(engine.tokenizer, mode),
                                  images=visuals or None):
        for ch, text in output.deltas:
            if ch != channel:
                print(f"\n[{ch}] " if channel else f"[{ch}] ", end="")
                channel = ch
            print(text, end="", flush=True)
            parts[ch] += text
    print(flush=True)
    return parts


def _slots(visuals: list) -> dict:
    """``render``'s ``media`` for the ``--image`` parts: the images, in order."""
    images = iter(visuals)
    return {"media": lambda part, where: next(images)} if visuals else {}


def _chat_images(paths: list[str], engine, fmt) -> list:
    """The ``--image`` files as model inputs (a ValueError naming the file if one does not decode)."""
    if not paths:
        return []
    if engine.model.vision is None or not getattr(fmt, "IMAGES", False):
        raise ValueError("--image: this model has no vision encoder, or its chat format has no image slots")
    from k3.tokenization.image import image_input

    out = []
    for path in paths:
        try:
            out.append(image_input(path, engine.model.config.vision.patch_budget))
        except ValueError as err:
            raise ValueError(f"--image {path}: {err}") from err
    return out


_NO_VERIFY = "load a kimi-k3 checkpoint without checking its checksums.json (e.g. one whose manifest was lost); a " \
             "warning says so"


def _add_generate(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="continue a prompt with a trained checkpoint")
    gen.add_argument("--ckpt", required=True, help="a run, checkpoint or released Kimi K3 directory")
    gen.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    gen.add_argument("--prompt", default="")
    gen.add_argument("--max-tokens", type=positive(int), default=100, help="most tokens generated (fewer where the "
                     "model's context ends first; default %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=SEED)
    gen.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-text token: exactly "
                     "--max-tokens tokens (benchmarks; the API's ignore_eos)")
    add_placement_arguments(gen)
    EngineOptions.add_generate_arguments(gen)
    gen.set_defaults(run=_generate)


def _add_engine_command(commands: argparse._SubParsersAction, name: str, help_: str, run, mode: str):
    """``k3 serve`` or ``k3 chat`` with the flags they share: the checkpoint, the default chat mode, the engine's."""
    sub = commands.add_parser(name, help=help_)
    sub.add_argument("--ckpt", required=True, help="a run directory, a checkpoint directory, or a released "
                     "Kimi K3 directory (config.json with model_type kimi_k3, shards, tiktoken tokenizer)")
    sub.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    sub.add_argument("--mode", choices=("thinking", "instruct"), default=mode,
                     help="the chat mode when a request does not choose one (default: %(default)s)")
    add_placement_arguments(sub)
    EngineOptions.add_arguments(sub)
    sub.set_defaults(run=run)
    return sub


def _add_serve(commands: argparse._SubParsersAction) -> None:
    sub = _add_engine_command(commands, "serve", "an OpenAI-compatible HTTP server for a checkpoint", _serve,
                              "instruct")
    sub.add_argument("--host", default="127.0.0.1")
    sub.add_argument("--port", type=PORT, default=8000)
    sub.add_argument("--replicas", type=positive(int), default=1,
                     help="engine processes behind a cache-aware router (k3 route): replicas on ports "
                          "PORT+1..PORT+N, the router on --port (default: %(default)s, no router)")
    sub.add_argument("--api-key", type=api_key, help="require 'Authorization: Bearer KEY'")
    sub.add_argument("--model-name", help="the served model id (default: the checkpoint directory name)")
    sub.add_argument("--compile-wait", action="store_true", help="with --compile, build every graph before "
                     "listening (default: listen at once, serve eagerly and switch each shape family to its graph "
                     "when the background compilation has built it)")
    EngineOptions.add_threads_argument(sub)
    sub.add_argument("--reasoning-in-content", action="store_true",
                     help="put the thinking into 'content' as <think>...</think> unless a request asks "
                          "'separate_reasoning: true' (default: 'reasoning_content', as vLLM and DeepSeek)")
    sub.add_argument("--allowed-origins", type=lambda text: [o.strip() for o in text.split(",") if o.strip()],
                     default=[], help="comma-separated origins allowed by CORS, or '*' (default: none)")
    _limit_flags(sub)


def _add_chat(commands: argparse._SubParsersAction) -> None:
    sub = _add_engine_command(commands, "chat", "chat with a checkpoint in the terminal", _chat, "thinking")
    sub.add_argument("--max-tokens", type=positive(int), default=256)
    sub.add_argument("--temperature", type=float, default=0.7)
    sub.add_argument("--top-p", type=float, default=0.95)
    sub.add_argument("--seed", type=SEED)
    sub.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image (PNG, JPEG, WebP or a still GIF) shown with the first message (repeatable)")


def _add_route(commands: argparse._SubParsersAction) -> None:
    ro = commands.add_parser("route", help="a cache-aware router in front of running `k3 serve` replicas")
    ro.add_argument("--replica", action="append", required=True, metavar="URL",
                    help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat the flag for each)")
    ro.add_argument("--host", default="127.0.0.1")
    ro.add_argument("--port", type=PORT, default=8000)
    ro.add_argument("--api-key", type=api_key, help="require 'Authorization: Bearer KEY' (also for /router/status); "
                    "the replicas get the same header")
    ro.add_argument("--long-threshold", type=positive(int), default=32768,
                    help="body bytes beyond which a request is 'long' (default: %(default)s)")
    ro.add_argument("--short-budget", type=positive(int), default=64,
                    help="short requests relayed at once (429 beyond; default: %(default)s)")
    ro.add_argument("--long-budget", type=positive(int), default=4,
                    help="long requests relayed at once (429 beyond; default: %(default)s)")
    ro.set_defaults(run=_route)


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``generate``, ``serve``, ``chat`` and ``route``."""
    for add in (_add_generate, _add_serve, _add_chat, _add_route):
        add(commands)
