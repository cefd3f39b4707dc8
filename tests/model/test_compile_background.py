"""Compilation that never blocks users (issue 37): graphs built on a background thread while the engine serves
eagerly (`CompiledModel.compile_in_background`, `k3.model.background.Gate`), and inductor's on-disk cache kept across
processes (`k3.model.compiled_step.persistent_cache`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import serving
from k3.model.background import QUIET, Gate
from k3.model.compiled import CompiledModel
from k3.model.graph_worker import GraphWorker
from k3.model.precompiled import layout_digest
from k3.serve.engine import Engine, SamplingParams


def _run(engine: Engine, prompts: list[list[int]], steps_before: int = 0, between=None) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (all queued at once) stepped inline; ``between()`` runs after ``steps_before``
    steps, with no step running."""
    tokens: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=8 + 3 * i, temperature=0),
                           callback=lambda o, i=i: tokens.setdefault(i, []).extend(o.token_ids))
    done = 0
    while engine.has_work():
        engine.step()
        done += 1
        if done == steps_before and between is not None:
            between()
    return [tokens[i] for i in range(len(prompts))]


def test_requests_served_while_graphs_compile_get_eager_tokens_and_switch_to_the_graphs_mid_request(
        tok, tmp_path, monkeypatch):
    """Requests run eagerly while nothing is built, then (the compilation finished between two steps) on the
    graphs from their next step on — the precompiled ones (compiled by the graph process, only loaded here), then
    the tuned decode graph that replaces its precompiled one; every request's tokens equal the eager engine's, and
    no graph is built after the background compilation (a step never compiles beside it). A warm start loads every
    precompiled graph and starts no process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # precompiled graphs compiled here, not loaded
    model = serving.model()
    prompts = [p for p in serving.prompts() if len(p) > 4][:3]
    eager = _run(Engine(model, tok, max_batch=1, prefill_chunk=16), prompts)

    compiled = CompiledModel(model, batches=(1,), sizes=(4, 1))
    engine = Engine(model, tok, max_batch=1, prefill_chunk=16, compile=compiled)
    engine.warm_up(background=True)
    families = [("decode", 1, 2), ("prefill", 4, 0), ("prefill", 4, 2)]
    assert compiled.plan.planned == [(f, "precompiled") for f in families] + [(("decode", 1, 2), "traced")]
    seen: dict[str, int] = {}

    def finish_compiling() -> None:
        seen.update(eager_steps=compiled.eager_calls, graph_steps=compiled.graph_calls)
        assert compiled.wait_background(timeout=900)

    assert _run(engine, prompts, steps_before=4, between=finish_compiling) == eager
    assert compiled.plan.background_error is None and compiled.plan.built == len(compiled.plan.planned)
    assert compiled.plan.ready == {families[0]: compiled.decode_step, families[1]: compiled.plan.precompiled["prefill"],
                                   families[2]: compiled.plan.precompiled["prefill"]}
    assert seen["eager_steps"] > 0 and compiled.graph_calls > seen["graph_steps"]  # switched mid-request
    assert len(list((tmp_path / "k3" / "graphs").rglob("*.pt2"))) == 3
    assert compiled.plan.worker.failure is None and compiled.plan.worker.process.returncode == 0
    assert [compiled.plan.precompiled[k].cache_hits for k in ("decode", "prefill")] == [1, 2]  # the process's files
    built = compiled.compilations
    assert _run(engine, prompts) == eager and compiled.compilations == built
    again = CompiledModel(model, batches=(1,), sizes=(4, 1))  # a warm start: every graph saved, no process
    again.compile_in_background(families, upgrade=False)
    assert again.wait_background(timeout=900) and again.plan.worker is None and again.plan.built == 3
    assert sum(step.cache_hits for step in again.plan.precompiled.values()) == 3


def test_where_the_graph_process_fails_the_thread_compiles_what_is_left(tok, tmp_path, monkeypatch):
    """A graph process that builds nothing (here: its copy of the model is not of the server's layout, so its files
    would lie where the server never looks) is reported in ``worker.failure``, and the background thread compiles
    the graphs itself; tokens are eager's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    start = GraphWorker.start.__func__
    monkeypatch.setattr(GraphWorker, "start", classmethod(
        lambda cls, model, digest, families: start(cls, model, "another layout", families)))
    model = serving.model()
    prompt = serving.prompts()[3][:9]
    eager = _run(Engine(model, tok, max_batch=1, prefill_chunk=16), [prompt])
    compiled = CompiledModel(model, batches=(1,), sizes=(4, 1), tuned=False)
    compiled.compile_in_background([("decode", 1, 2)], upgrade=False)
    assert compiled.wait_background(timeout=900) and compiled.plan.background_error is None
    assert "exit status 3" in compiled.plan.worker.failure
    step = compiled.plan.precompiled["decode"]
    assert (step.compilations, step.cache_hits) == (1, 0) and compiled.plan.ready == {("decode", 1, 2): step}
    engine = Engine(model, tok, max_batch=1, prefill_chunk=16, compile=compiled)
    assert _run(engine, [prompt]) == eager and compiled.graph_calls > 0


def test_the_graph_process_ends_with_its_server(tmp_path):
    """The graph process exits when the server closes its pipe (`GraphWorker.stop`) and when the server's process
    dies without a word (its pipe then reaches end of file), before building anything."""
    model = serving.model()
    worker = GraphWorker.start(model, layout_digest(model), [("decode", 1, 2)])
    worker.stop()
    assert worker.process.returncode == 0
    script = textwrap.dedent("""
        import os, serving
        from k3.model.graph_worker import GraphWorker
        from k3.model.precompiled import layout_digest
        model = serving.model()
        worker = GraphWorker.start(model, layout_digest(model), [("decode", 1, 2)])
        print(worker.process.pid, flush=True)
        os._exit(0)
        """)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.path.dirname(serving.__file__), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    status = Path(f"/proc/{int(run.stdout)}/status")
    deadline = time.monotonic() + 300
    while status.exists() and "zombie" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not status.exists() or "zombie" in status.read_text()
    assert not list(tmp_path.rglob("*.pt2"))


def test_a_graph_process_is_refused_where_its_copy_would_take_over_half_the_available_memory(monkeypatch):
    """The process holds a zeroed copy of every weight: `GraphWorker.start` refuses it (`MemoryError`, both sizes
    named, no process started) where that is more than half of ``MemAvailable``, and starts it at exactly half."""
    import k3.model.graph_worker as graph_worker

    model = serving.model()
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values())  # tiny has no views or extras
    assert graph_worker.layout_bytes(model) == need
    digest, started = layout_digest(model), []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(graph_worker, "available_bytes", lambda device: 2 * need - 1)
    with pytest.raises(MemoryError, match=f"hold {need:,} bytes .* half of the {2 * need - 1:,} bytes available"):
        GraphWorker.start(model, digest, [("decode", 1, 2)])
    assert not started
    monkeypatch.undo()
    monkeypatch.setattr(graph_worker, "available_bytes", lambda device: 2 * need)
    worker = GraphWorker.start(model, digest, [("decode", 1, 2)])
    worker.stop()
    assert worker.process.returncode == 0


def test_a_packed_model_restored_in_the_graph_process_holds_its_expert_bytes_once():
    """Packed experts' own tensors are views of their stacked bytes in the server; `restore` makes them views again
    (`to_empty` had given each memory of its own), so the process holds those bytes once, and `layout_bytes` (what
    `GraphWorker.start` checks against the free memory) counts what it holds."""
    from k3 import K3ForCausalLM
    from k3.config import preset
    from k3.model.graph_worker import layout_bytes, layout_copy, restore
    from k3.model.packed import PackedExperts, replace_experts

    model = replace_experts(K3ForCausalLM(preset("tiny")).eval(), PackedExperts.pack)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), state=model.new_state(1))  # the first call stacks the packed bytes
    every = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in every.values()}
    stacked_bytes = sum(getattr(m, name).nbytes for m in model.modules() if isinstance(m, PackedExperts)
                        for name in ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"))
    assert stacked_bytes > 0
    assert layout_bytes(model) == sum(storages.values())
    assert sum(t.nbytes for t in every.values()) == layout_bytes(model) + stacked_bytes  # the views counted once
    copy = restore(layout_copy(model), "cpu")
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*copy.parameters(), *copy.buffers()]}
    assert sum(held.values()) == layout_bytes(model)
    with torch.no_grad():
        logits, _ = copy(torch.tensor([[1, 2, 3]]), state=copy.new_state(1))
    assert torch.equal(logits, torch.zeros_like(logits))


def test_a_step_outside_the_planned_families_runs_eagerly_beside_a_background_compilation(tok):
    """A step whose graph is not built runs eagerly while the background thread compiles, even where its family
    claims a graph (a key the plan did not foresee): a step never compiles beside the background thread."""
    model = serving.model()
    compiled = CompiledModel(model, batches=(1,), sizes=(4, 1), tuned=False)
    prompt = torch.tensor([serving.prompts()[2][:9]])
    with torch.inference_mode():
        expected, _ = model(prompt, state=model.new_state(1))
    compiled.compile_in_background([("decode", 1, 2)], upgrade=False)
    try:
        compiled.plan.ready[("prefill", 4, 0)] = compiled.prefill_step  # claimed ready, yet not built: a cold key
        with torch.inference_mode():
            logits, _ = compiled.step(prompt, model.new_state(1))
        torch.testing.assert_close(logits, expected[:, -1], atol=1e-4, rtol=0)
        assert compiled.prefill_step.compilations == 0
    finally:
        compiled.wait_background(timeout=900)


def test_the_gate_parks_the_background_thread_during_steps_but_never_inside_an_import(tmp_path, monkeypatch):
    """While a step runs the background thread does not advance; between steps it does. An import it is running
    is finished even during a step: the step may need the same module (its lock), which parking would deadlock."""
    gate, count, stop = Gate(), [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            _tick(count)

    gate.start(spin, "spin")
    try:
        _advances(count, True)
        with gate.busy():
            time.sleep(0.05)  # the thread reaches its next call and parks
            _advances(count, False)
        _advances(count, False, QUIET / 2)  # nor right after a step
        _advances(count, True, 4 * QUIET)
    finally:
        stop.set()
        gate.close()

    (tmp_path / "slow_module.py").write_text(textwrap.dedent("""
        import time
        import gate_probe
        gate_probe.entered.set()
        def part():
            time.sleep(0.02)
        for _ in range(10):
            part()
        """))
    probe = type(sys)("gate_probe")
    probe.entered = threading.Event()
    monkeypatch.setitem(sys.modules, "gate_probe", probe)
    monkeypatch.syspath_prepend(str(tmp_path))
    gate = Gate()
    gate.start(lambda: __import__("slow_module"), "importer")
    assert probe.entered.wait(30)
    imported = threading.Event()
    with gate.busy():  # the background thread is inside the module's body, which calls functions
        importer = threading.Thread(target=lambda: (__import__("slow_module"), imported.set()), daemon=True)
        importer.start()
        assert imported.wait(30), "an import parked by the gate deadlocked a step that needed the same module"
    gate.close()
    monkeypatch.delitem(sys.modules, "slow_module")


def test_closing_the_gate_restores_the_switch_interval():
    """The thread shortens the interpreter's switch interval while it runs; a gate closed while it is parked for
    good gives the process its interval back (before, it stayed shortened until the process exited)."""
    before, count, gate = sys.getswitchinterval(), [0], Gate()
    gate.start(lambda: [_tick(count) for _ in iter(int, 1)], "spin")  # calls Python until parked
    _advances(count, True)
    assert sys.getswitchinterval() < before
    gate.close()
    assert sys.getswitchinterval() == before
    time.sleep(0.01)  # a call already under way when the gate closed may still finish: it parks at its next one
    _advances(count, False)  # parked for good, and the interval stays the process's
    assert sys.getswitchinterval() == before


def _tick(count: list[int]) -> None:
    count[0] += 1


def _advances(count: list[int], expected: bool, seconds: float = 0.05) -> None:
    before = count[0]
    time.sleep(seconds)
    assert (count[0] > before) == expected


def test_a_second_process_loads_every_graph_from_the_on_disk_caches(tmp_path):
    """With no cache directory set, inductor's cache lies under ``$XDG_CACHE_HOME/k3/inductor`` and precompiled
    graphs under ``…/k3/graphs``; a second process that builds the same graphs compiles none of them anew: the
    traced ones are inductor cache hits, the precompiled ones are loaded — and give the first process's logits."""
    script = textwrap.dedent("""
        import torch, serving
        from k3.model.compiled import CompiledModel
        model = serving.model()
        traced = CompiledModel(model, batches=(1,), sizes=(4, 1), tuned=False)
        traced.warm_up(max_batch=1)
        compiled = CompiledModel(model, batches=(1,), sizes=(4, 1))
        compiled.precompile(compiled.families(1, prefill=True))
        with torch.inference_mode():
            logits, _ = compiled.step(torch.tensor([serving.prompts()[5][:13]]), model.new_state(1))
        print("traced", traced.compilations, traced.cache_hits, "precompiled", compiled.compilations,
              compiled.cache_hits, "logits", logits.sum().item())
        """)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(serving.__file__), env.get("PYTHONPATH", "")])
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=env)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-3000:]
    first, second = (r.stdout.split() for r in runs)
    assert first[1:3] == ["3", "0"] and second[1:3] == ["3", "3"]  # the decode step, the 4-piece on 2 sides
    assert first[4:6] == ["3", "0"] and second[4:6] == ["3", "3"]
    assert first[-1] == second[-1]  # the same graphs: the same logits, bit for bit
    assert (tmp_path / "k3" / "inductor").is_dir() and len(list((tmp_path / "k3" / "graphs").rglob("*.pt2"))) == 3


def test_a_saved_tuned_graph_is_loaded_for_the_same_weights_and_never_for_other_weights(tmp_path):
    """Where inductor saves a tuned graph (frozen weights), its entry holds what inductor derived from the weights (the
    C++ GEMM template's blocked copies) under a key of their shapes; the step keys it by the weights' digest too, so
    a second process with the same weights loads it (a cache hit: the first process's logits bit for bit) and one with
    other weights of the same layout compiles its own (before the digest, it loaded the first one's: logits off by a
    wide margin). MKL's packing, whose mkldnn weights inductor refuses to save, is turned off here to make inductor
    save the graph, as the C++ template alone would."""
    script = textwrap.dedent("""
        import sys, torch, serving
        torch._C.has_mkl = False  # inductor's freezing then blocks the weights for its C++ template: a saved graph
        from k3.model.compiled import CompiledModel
        model = serving.model(int(sys.argv[1]))
        compiled = CompiledModel(model, batches=(1,))
        with torch.inference_mode():
            _, state = model(torch.tensor([serving.prompts()[1][:6]]), state=model.new_state(1))
            token = torch.tensor([[7]])
            logits, _ = compiled.decode(token, state)
            expected, _ = model(token, state=state)
        error = (logits - expected).abs().max().item()
        print(compiled.decode_step.compilations, compiled.decode_step.cache_hits, error, logits.sum().item())
        """)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(serving.__file__), env.get("PYTHONPATH", "")])
    runs = [subprocess.run([sys.executable, "-c", script, seed], capture_output=True, text=True, timeout=900, env=env)
            for seed in ("0", "0", "1")]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    (built, hits, error, total), (built2, hits2, error2, total2), (built3, hits3, error3, _) = (
        r.stdout.split() for r in runs)
    assert (built, hits, built2, hits2, built3, hits3) == ("1", "0", "1", "1", "1", "0")
    assert total == total2  # the same graph: the same logits, bit for bit
    assert max(float(error), float(error2), float(error3)) < 1e-4
