"""The compiled decode step (`k3.model.compiled`, issue 18) against eager decoding: the same greedy tokens, logits
within fp32 reassociation (stated: 1e-4 absolute on logits of magnitude ~1), one compilation per batch size however
long the context grows, QAT's MX experts included, and `k3 generate --compile` giving eager's text."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import serving
from k3 import K3ForCausalLM
from k3.config import preset
from k3.model.compiled import CompiledDecode
from k3.model.state import DecoderState

LOGIT_TOLERANCE = 1e-4


def _decode_both(model: K3ForCausalLM, compiled: CompiledDecode, prompt: torch.Tensor, steps: int):
    """Greedy decode ``steps`` tokens eagerly and compiled from the same prefill; returns both token lists and the
    largest logit difference."""
    with torch.no_grad():
        logits, state = model(prompt, state=model.new_state(prompt.shape[0]))
    token = logits[:, -1:].argmax(-1)
    eager: tuple[torch.Tensor, DecoderState] = (token, state)
    fast: tuple[torch.Tensor, DecoderState] = (token, state)
    tokens_eager, tokens_fast, worst = [], [], 0.0
    for _ in range(steps):
        with torch.no_grad():
            le, se = model(eager[0], state=eager[1])
        lc, sc = compiled(fast[0], fast[1])
        worst = max(worst, float((le - lc).abs().max()))
        eager, fast = (le[:, -1:].argmax(-1), se), (lc[:, -1:].argmax(-1), sc)
        tokens_eager.append(eager[0].flatten().tolist())
        tokens_fast.append(fast[0].flatten().tolist())
        assert sc.position == se.position
    return tokens_eager, tokens_fast, worst


def test_compiled_decode_equals_eager_with_one_graph_per_batch_size():
    model = serving.model()
    compiled = CompiledDecode(model)
    prompt = torch.tensor([serving.prompts()[1][:5]])
    eager, fast, worst = _decode_both(model, compiled, prompt, steps=12)  # the MLA cache grows every step
    assert fast == eager and worst < LOGIT_TOLERANCE
    assert compiled.compilations == 1  # no recompilation as the context grows
    pair = torch.tensor([serving.prompts()[1][:5], serving.prompts()[2][:5]])
    eager, fast, worst = _decode_both(model, compiled, pair, steps=6)
    assert fast == eager and worst < LOGIT_TOLERANCE
    assert compiled.compilations == 2 and set(compiled.compile_seconds) == {1, 2}  # one more for batch size 2
    _decode_both(model, compiled, prompt, steps=3)
    assert compiled.compilations == 2  # batch size 1 again: no new graph
    _decode_both(model, compiled, torch.tensor([[7]]), steps=3)  # a 1-entry cache: dynamo specialises size 1
    assert compiled.compilations == 3
    with pytest.raises(ValueError, match="token ids"):
        compiled(torch.tensor([[10**6]]), model.new_state(1))
    with pytest.raises(ValueError, match=r"\[B, 1\]"):
        compiled(torch.tensor([[1, 2]]), model.new_state(1))


@pytest.mark.slow
def test_compiled_decode_of_a_qat_model_equals_eager():
    from k3.train.loop import QAT_MX

    config = dataclasses.replace(preset("tiny"), mx=dataclasses.replace(QAT_MX))
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    eager, fast, worst = _decode_both(model, CompiledDecode(model), torch.tensor([[5, 9, 3, 7]]), steps=6)
    assert fast == eager and worst < LOGIT_TOLERANCE


def test_k3_generate_compile_gives_the_eager_text_and_imports_no_compiler_without_it(tmp_path):
    from k3.model.checkpoint import save_model

    save_model(tmp_path / "ckpt", serving.model(), serving.tokenizer())
    command = [sys.executable, "-c", "import sys; from k3.cli import main; rc = main(sys.argv[1:]); "
               "print('inductor imported:', 'torch._inductor' in sys.modules); sys.exit(rc)",
               "generate", "--ckpt", str(tmp_path / "ckpt"), "--prompt", "def f", "--max-tokens", "12",
               "--temperature", "0"]
    eager = subprocess.run(command, capture_output=True, text=True, timeout=600)
    compiled = subprocess.run([*command, "--compile"], capture_output=True, text=True, timeout=600)
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-2000:]
    text = eager.stdout.replace("inductor imported: False", "")
    assert "inductor imported: False" in eager.stdout  # --compile absent: no compiler import cost
    assert compiled.stdout.replace("inductor imported: True", "") == text
    assert "first compiled decode step" in compiled.stderr


def test_engine_with_the_compiled_decode_step_gives_eager_tokens_with_one_graph_per_bucket(tok):
    """Requests of unequal lengths join a running batch one per step and leave as they finish: every decode batch
    size from 1 to 6 occurs, padded to the buckets 1, 2, 4 and 8 — four graphs — and every request's greedy tokens
    equal the eager engine's."""
    from k3.serve.compiled import BucketedDecode
    from k3.serve.engine import Engine, SamplingParams

    model = serving.model()
    prompts = [p for p in serving.prompts() if len(p) > 1][:6]  # a 1-token prompt specialises its own graph
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0) for i in range(len(prompts))]

    def run(engine: Engine) -> list[list[int]]:
        tokens: dict[int, list[int]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(prompt, p, callback=lambda o, i=i: tokens.setdefault(i, []).extend(o.token_ids))
            engine.step()
        while engine.has_work():
            engine.step()
        return [tokens[i] for i in range(len(prompts))]

    decode = BucketedDecode(model)
    assert run(Engine(model, tok, decode=decode)) == run(Engine(model, tok))
    assert set(decode.step.compile_seconds) <= {1, 2, 4, 8} and decode.step.compilations == \
        len(decode.step.compile_seconds)
