"""SFT on the K3 chat format (SPEC §7, issue 19 deliverable 1): the supervised mask, the masked loss, data errors,
the held-out loss improving on a tiny model, exact resume and the refusal to overwrite a run."""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import serving
from k3.config import preset
from k3.model.checkpoint import load_model, save_model
from k3.model.lm import K3ForCausalLM
from k3.rl import sft
from k3.rl.policy import pad_sequences
from k3.rl.sft import (SFTConfig, SFTRun, _prefix_length, batch_indices, batch_loss, encode_chats, held_out,
                       load_chats, run_sft, supervised_ids)

ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


def spans(ids: list[int], mask: list[bool], tok) -> tuple[list[str], list[str]]:
    """The decoded maximal runs of supervised and of unsupervised ids, in order."""
    runs: tuple[list[str], list[str]] = ([], [])
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            runs[0 if mask[start] else 1].append(tok.decode(ids[start:i]))
            start = i
    return runs


def arithmetic_chats(n: int, seed: int) -> list[dict]:
    """``What is a+b?`` chats, half in thinking mode (the sum worked out in the think channel), half instruct."""
    rng = random.Random(seed)
    chats = []
    for i in range(n):
        a, b = rng.randrange(50), rng.randrange(50)
        mode = ("thinking", "instruct")[i % 2]
        answer = {"role": "assistant", "content": str(a + b)}
        if mode == "thinking":
            answer["reasoning_content"] = f"{a} plus {b} is {a + b}"
        chats.append({"messages": [{"role": "system", "content": "Add."},
                                   {"role": "user", "content": f"What is {a}+{b}?"}, answer],
                      "mode": mode, "domain": "math", "task": i})
    return chats


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return save_model(tmp_path_factory.mktemp("base") / "ckpt", K3ForCausalLM(preset("tiny")), serving.tokenizer())


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", arithmetic_chats(200, seed=0))


def config(base: Path, data: Path, out: Path, **kw) -> SFTConfig:
    defaults = dict(steps=30, batch_size=8, lr=3e-3, eval_every=10, ckpt_every=10, val_fraction=0.2,
                    seq_len=256, threads=1, progress=False)
    return SFTConfig(ckpt=str(base), data=str(data), out=str(out), **{**defaults, **kw})


# ---------------------------------------------------------------------- the mask
def test_mask_thinking_with_a_tool_call_and_result():
    tok = serving.tokenizer()
    record = {"mode": "thinking", "tools": [ADD_TOOL], "effort": "high", "messages": [
        {"role": "system", "content": "You add."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "reasoning_content": "Use the tool.", "content": "Let me add.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "reasoning_content": "It said 5.", "content": "2+3=5"}]}
    ids, mask = supervised_ids(record, tok)
    supervised, context = spans(ids, mask, tok)
    assert supervised == [
        'Use the tool.<|response|>Let me add.<|tools|>[{"id":"c1","name":"add","arguments":{"a":2,"b":3}}]<|end|>',
        "It said 5.<|response|>2+3=5<|end|>"]
    assert context == [
        '<|system|>You add.<|tools|>[{"name":"add","parameters":{"type":"object"}}]<|end|><|user|>What is 2+3?<|end|>'
        "<|assistant|><|think|>",
        "<|tool|>c1\n5<|end|><|assistant|><|think|>"]


def test_mask_instruct_drops_reasoning_and_supervises_the_tools_channel():
    tok = serving.tokenizer()
    record = {"mode": "instruct", "tools": [ADD_TOOL], "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "not rendered in instruct mode", "content": "Hello!"},
        {"role": "user", "content": "Add 2 and 3"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]}
    ids, mask = supervised_ids(record, tok)
    supervised, context = spans(ids, mask, tok)
    assert supervised == ["Hello!<|end|>",
                          '<|tools|>[{"id":"c1","name":"add","arguments":{"a":2,"b":3}}]<|end|>']
    assert context == [
        '<|system|><|tools|>[{"name":"add","parameters":{"type":"object"}}]<|end|><|user|>Hi<|end|>'
        "<|assistant|><|response|>",
        "<|user|>Add 2 and 3<|end|><|assistant|><|response|>",
        "<|tool|>c1\n5<|end|>"]  # a trailing tool result only feeds context


def test_mask_empty_think_channel_is_still_supervised():
    tok = serving.tokenizer()
    ids, mask = supervised_ids({"mode": "thinking", "messages": [{"role": "user", "content": "x"},
                                                                 {"role": "assistant", "content": "y"}]}, tok)
    assert spans(ids, mask, tok) == (["<|response|>y<|end|>"], ["<|user|>x<|end|><|assistant|><|think|>"])


@pytest.mark.parametrize("record, match", [
    ({"mode": "thinking", "messages": [{"role": "assistant", "content": "hi"}]}, "cannot come first"),
    ({"mode": "thinking", "messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"mode": "chatty", "messages": [{"role": "user", "content": "hi"}]}, "mode"),
    ({"mode": "instruct", "messages": []}, "messages"),
    ({"mode": "instruct", "messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
    ({"mode": "instruct", "messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
])
def test_supervised_ids_refuses_bad_records(record, match):
    with pytest.raises(ValueError, match=match):
        supervised_ids(record, serving.tokenizer())


def test_prefix_check_names_the_problem():
    assert _prefix_length([1, 2, 3], [1, 2], "x") == 2
    with pytest.raises(ValueError, match=r"render\(messages\[:1\]\) is not a prefix"):
        _prefix_length([1, 2, 3], [1, 3], "messages[:1]")


# ---------------------------------------------------------------------- the loss
def test_loss_is_the_mean_over_supervised_positions_only():
    tok = serving.tokenizer()
    seqs = [supervised_ids(c, tok) for c in arithmetic_chats(3, seed=1)]
    inputs, targets, mask = pad_sequences(seqs, tok.pad_id)
    torch.manual_seed(0)
    model = K3ForCausalLM(preset("tiny")).eval()
    with torch.no_grad():
        loss_sum, count = batch_loss(model, (inputs, targets, mask))
        logits, _ = model(inputs)
    log_probs = logits.double().log_softmax(-1)
    picked = [-log_probs[b, t, targets[b, t]] for b in range(mask.shape[0]) for t in range(mask.shape[1])
              if mask[b, t]]
    assert count == len(picked) == sum(sum(m[1:]) for _, m in seqs)
    assert float(loss_sum) / count == pytest.approx(float(sum(picked) / len(picked)), rel=1e-5)
    # a user token's (and padding's) target does not enter the loss; a supervised one does
    changed = targets.clone()
    changed[~mask] = (changed[~mask] + 7) % 512
    assert torch.equal(batch_loss(model, (inputs, changed, mask))[0], loss_sum)
    changed = targets.clone()
    b, t = mask.nonzero()[0].tolist()
    changed[b, t] = (changed[b, t] + 7) % 512
    assert batch_loss(model, (inputs, changed, mask))[0] != loss_sum


# ---------------------------------------------------------------------- data
@pytest.mark.parametrize("line, match", [
    ("{not json", "line 2"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ('{"mode": "thinking"}', "line 2: messages"),
    ('{"messages": [{"role": "user", "content": "x"}], "mode": "fast"}', "line 2: mode"),
])
def test_load_chats_names_file_and_line(tmp_path, line, match):
    good = json.dumps(arithmetic_chats(1, seed=0)[0])
    path = tmp_path / "chats.jsonl"
    path.write_text(f"{good}\n{line}\n")
    with pytest.raises(ValueError, match=f"{path}, {match}"):
        load_chats(path)


def test_load_chats_keeps_a_line_separator_inside_a_string(tmp_path):
    """JSON allows U+2028 unescaped in a string (``json.dumps(..., ensure_ascii=False)`` writes it so); splitting the
    file with ``str.splitlines`` broke such a chat in two and refused the file as invalid JSON."""
    chat = arithmetic_chats(1, seed=0)[0]
    chat["messages"][0]["content"] += "\u2028and\u2029more"
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(chat, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_chats(path) == [(1, chat)]


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "too large"])
def test_load_chats_reads_only_a_regular_file_of_bounded_size(tmp_path, monkeypatch, kind):
    """``k3 sft --data /dev/zero`` read until the kernel killed it for memory: a FIFO, a device and a file past the
    data limit are refused by name before anything is read."""
    path = tmp_path / "chats.jsonl"
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes: reading it would block forever
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text(json.dumps(arithmetic_chats(1, seed=0)[0]) + "\n")
        monkeypatch.setattr(sft, "DATA_LIMIT", 16)
    with pytest.raises(ValueError, match=re.escape(f"{path}: cannot read the chat data")):
        load_chats(path)


def test_encode_chats_errors_and_length_cap(tmp_path):
    tok = serving.tokenizer()
    source = tmp_path / "chats.jsonl"
    bad_tool = {"mode": "instruct", "messages": [{"role": "user", "content": "x"},
                                                  {"role": "assistant", "content": "y"},
                                                  {"role": "tool", "content": "5"}]}
    with pytest.raises(ValueError, match=f"{source}, line 7: messages\\[2\\].tool_call_id"):
        encode_chats([(7, bad_tool)], tok, 256, 512, source)
    with pytest.raises(ValueError, match=f"{source}, line 3: no assistant message"):
        encode_chats([(3, {"mode": "instruct", "messages": [{"role": "user", "content": "x"}]})], tok, 256, 512,
                     source)
    chat = arithmetic_chats(1, seed=0)[0]
    with pytest.raises(ValueError, match="line 1: token id .* outside the model's vocabulary \\(vocab_size 300\\)"):
        encode_chats([(1, chat)], tok, 256, 300, source)
    length = len(supervised_ids(chat, tok)[0])
    assert encode_chats([(1, chat)], tok, length, 512, source) == ([supervised_ids(chat, tok)], 0)
    assert encode_chats([(1, chat)], tok, length - 1, 512, source) == ([], 1)


def test_empty_file_and_empty_split_are_errors(tmp_path, base):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no chats"):
        load_chats(empty)
    one = write_jsonl(tmp_path / "one.jsonl", arithmetic_chats(1, seed=0))
    with pytest.raises(ValueError, match="split holds no chat"):
        SFTRun(config(base, one, tmp_path / "out")).prepare(resume=False)


def test_held_out_depends_on_the_record_alone():
    records = arithmetic_chats(400, seed=3)
    sides = [held_out(r, 0.25, seed=0) for r in records]
    assert 60 < sum(sides) < 140
    reordered = [dict(reversed(list(r.items()))) for r in reversed(records)]
    assert [held_out(r, 0.25, seed=0) for r in reordered] == sides[::-1]
    assert [held_out(r, 0.25, seed=1) for r in records] != sides


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), batch=st.integers(1, 5), seed=st.integers(0, 3))
def test_each_epoch_visits_every_chat_once(n, batch, seed):
    drawn = [i for step in range(n) for i in batch_indices(step, batch, n, seed)]  # exactly `batch` epochs
    for epoch in range(batch):
        assert sorted(drawn[epoch * n: (epoch + 1) * n]) == list(range(n))
    assert batch_indices(3, batch, n, seed) == batch_indices(3, batch, n, seed)


def test_config_validation():
    ok = SFTConfig(ckpt="b", data="d.jsonl", out="o")
    assert ok.validate() is ok
    for change, match in [({"steps": 0}, "sft.steps"), ({"batch_size": True}, "sft.batch_size"),
                          ({"ckpt": ""}, "sft.ckpt is required"), ({"lr": 0.0}, "lr > 0"),
                          ({"val_fraction": 1.0}, "val_fraction"), ({"optimizer": "sgd"}, "optimizer"),
                          ({"seed": 1.5}, "sft.seed"), ({"warmup_frac": 1.5}, "warmup_frac"),
                          ({"threads": 0}, "threads")]:
        with pytest.raises(ValueError, match=match):
            replace(ok, **change).validate()


def test_tokenizer_and_seq_len_must_fit_the_model(tmp_path, base, chats):
    small = K3ForCausalLM(replace(preset("tiny"), vocab_size=400))
    ckpt = save_model(tmp_path / "small", small, serving.tokenizer())
    with pytest.raises(ValueError, match="tokenizer has 512 tokens but the model's vocab_size is 400"):
        SFTRun(config(ckpt, chats, tmp_path / "out"))
    with pytest.raises(ValueError, match="context_length"):
        SFTRun(config(base, chats, tmp_path / "out", seq_len=10**6))


# ---------------------------------------------------------------------- runs
def test_held_out_loss_improves_and_outputs_load(tmp_path, base, chats):
    out = tmp_path / "run"
    run_sft(config(base, chats, out, optimizer="adamw"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0], rows[-1]
    assert first["step"] == 0 and first["skipped_too_long"] == 0
    assert first["train_chats"] + first["val_chats"] == 200 and first["val_chats"] > 10
    assert [r["step"] for r in rows] == list(range(31))
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 10, 20, 30]
    assert all(r["supervised"] > 0 and r["tokens"] > r["supervised"] and r["lr"] > 0 for r in rows[1:])
    assert last["val_loss"] < 0.6 * first["val_loss"], (first["val_loss"], last["val_loss"])
    assert (out / "curves.png").stat().st_size > 0
    model, tok = load_model(out)  # what `k3 generate/serve --ckpt DIR` read
    assert tok == serving.tokenizer() and model.config == preset("tiny")
    with pytest.raises(ValueError, match="already holds a checkpoint .*--resume"):
        run_sft(config(base, chats, out))


def test_resume_is_exact(tmp_path, base, chats):
    kw = dict(steps=6, eval_every=3, ckpt_every=3)  # Muon, the default
    whole = run_sft(config(base, chats, tmp_path / "whole", **kw))
    cut = SFTRun(config(base, chats, tmp_path / "cut", **kw))
    cut.prepare(resume=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_sft with threads=1: the same float reduction order
    try:
        for _ in range(3):
            cut.step()
    finally:
        torch.set_num_threads(threads)
    cut.save()  # stopped after 3 of 6 steps
    with pytest.raises(ValueError, match="field 'lr' is 0.003 in the checkpoint but 0.001 was requested"):
        run_sft(config(base, chats, tmp_path / "cut", **{**kw, "lr": 1e-3}), resume=True)
    edited = write_jsonl(tmp_path / "edited.jsonl", arithmetic_chats(201, seed=0))
    with pytest.raises(ValueError, match="the chat data changed"):
        run_sft(config(base, edited, tmp_path / "cut", **kw), resume=True)
    resumed = run_sft(config(base, chats, tmp_path / "cut", **kw), resume=True)
    assert resumed.step_index == whole.step_index == 6
    a, b = whole.model.state_dict(), load_model(tmp_path / "cut")[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["step"] > 3] for d in ("whole", "cut")]
    assert losses[0] == losses[1] and len(losses[0]) == 3
