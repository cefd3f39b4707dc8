"""`k3.model.payoff`: the record of what loading a layout's graphs cost, and the rule that decides with it (the
whole `k3 generate --compile` path is `test_compiled.test_k3_generate_compile_...`)."""

from __future__ import annotations

import json
import os

import pytest

from k3.model.payoff import Record


def test_a_record_is_kept_per_thread_count(tmp_path):
    Record(2.5, 0.004).write(tmp_path, 2)
    Record(3.0, 0.006).write(tmp_path, 1)
    assert Record.read(tmp_path, 2) == Record(2.5, 0.004)
    assert Record.read(tmp_path, 1) == Record(3.0, 0.006)
    assert Record.read(tmp_path, 4) is None
    assert sorted(json.loads(Record.path(tmp_path).read_text())) == ["1", "2"]


@pytest.mark.parametrize("text", ["", "not json", "[]", '{"2": 1}', '{"2": {"load_s": "x", "step_s": 1}}',
                                  '{"2": {"load_s": -1, "step_s": 0.1}}', '{"2": {"load_s": 1, "step_s": 0}}',
                                  '{"2": {"load_s": Infinity, "step_s": 0.1}}', '{"2": {"load_s": NaN, "step_s": 1}}',
                                  '{"2": {"load_s": 1}}'])
def test_an_unusable_record_is_none_and_is_replaced_on_write(tmp_path, text):
    Record.path(tmp_path).write_text(text)
    assert Record.read(tmp_path, 2) is None
    Record(1.0, 0.01).write(tmp_path, 2)
    assert Record.read(tmp_path, 2) == Record(1.0, 0.01)


def test_a_record_that_is_not_a_regular_small_file_is_not_read(tmp_path):
    os.mkfifo(Record.path(tmp_path))  # opening a FIFO for reading would block
    assert Record.read(tmp_path, 2) is None
    os.remove(Record.path(tmp_path))
    Record.path(tmp_path).write_text(json.dumps({"2": {"load_s": 1.0, "step_s": 0.01}}) + " " * 70_000)
    assert Record.read(tmp_path, 2) is None


@pytest.mark.parametrize("tokens, eager_s, pays", [
    (200, 0.0387, True),    # d=1024: 2 s + 200 × 14.6 ms = 4.9 s against 7.7 s
    (50, 0.0387, False),    # 2 s + 0.73 s against 1.9 s
    (200, 0.0136, False),   # small-like eager steps: 4.9 s against 2.7 s
    (0, 1.0, False),        # nothing left to decode
])
def test_the_graphs_pay_when_load_and_compiled_steps_beat_eager_steps(tokens, eager_s, pays):
    assert Record(load_s=2.0, step_s=0.0146).pays(tokens, eager_s) is pays


def test_k3_generate_compile_decodes_a_model_with_packed_experts_on_precompiled_graphs(tmp_path, monkeypatch):
    """Packages refuse packed MXFP4 experts (a Python operator), so their runs keep the record of the precompiled
    graphs; other models the record beside their packages."""
    from k3 import K3ForCausalLM
    from k3.config import preset
    from k3.model.payoff import PayingStep
    from k3.model.quantize import pack_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = K3ForCausalLM(preset("tiny")).eval()
    step = PayingStep(model, 10, lambda compiled: [])
    assert step.packaged and step.directory.parent == tmp_path / "k3" / "packages"
    step = PayingStep(pack_model(model), 10, lambda compiled: [])
    assert not step.packaged and step.directory.parent == tmp_path / "k3" / "graphs"
