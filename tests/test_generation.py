"""`k3.generation.stream` and ``k3 generate``: no step runs after the last token, nothing is generated past the
model's context (a prompt that fills it is refused by name), and sampling settings no distribution follows from
(a NaN temperature among them) are refused before anything runs."""

from __future__ import annotations

import dataclasses
import math

import pytest

import serving
from k3.cli import main
from k3.generation import check_sampling, stream
from k3.model.checkpoint import save_model


def _counting(model):
    """The model's step, counting its calls by input length."""
    calls: list[int] = []

    def step(input_ids, state):
        calls.append(input_ids.shape[1])
        logits, state = model(input_ids, state=state)
        return logits[:, -1], state

    return step, calls


def test_no_step_runs_after_the_last_token():
    model = serving.model()
    prompt = serving.prompts()[2]
    step, calls = _counting(model)
    tokens = list(stream(model, prompt, 5, temperature=0.0, step=step))
    assert tokens == list(stream(model, prompt, 5, temperature=0.0))  # the model's own step
    assert len(tokens) == 5 and calls == [len(prompt), 1, 1, 1, 1]  # the prompt's step gives the first token


def test_nothing_is_generated_past_the_context_and_a_full_prompt_is_refused():
    model = serving.model()
    model.config = dataclasses.replace(model.config, context_length=20)
    prompt = serving.prompts()[2]  # 17 tokens: room for 3
    step, calls = _counting(model)
    assert len(list(stream(model, prompt, 10, temperature=0.0, step=step))) == 3
    assert calls == [17, 1, 1]
    for length in (20, 25):
        with pytest.raises(ValueError, match=f"prompt: {length} tokens leave no room in the model's context of 20"):
            list(stream(model, serving.prompts()[5][:length], 1, temperature=0.0))


@pytest.mark.parametrize("temperature, top_p, top_k", [
    (math.nan, 1.0, 0), (math.inf, 1.0, 0), (-1.0, 1.0, 0), (1.0, math.nan, 0), (1.0, 0.0, 0), (1.0, 1.5, 0),
    (1.0, 1.0, -1)])
def test_settings_no_distribution_follows_from_are_refused(temperature, top_p, top_k):
    with pytest.raises(ValueError, match="sampling: need temperature >= 0"):
        check_sampling(temperature, top_p, top_k)
    with pytest.raises(ValueError, match="sampling: need temperature >= 0"):
        next(stream(serving.model(), [1, 2], 3, temperature, top_p, top_k))


def _exit_code(argv: list[str]) -> int:
    """``k3``'s exit status: argparse's refusals exit, a command's ValueError is returned (2)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = serving.model()
    model.config = dataclasses.replace(model.config, context_length=24)
    return save_model(tmp_path_factory.mktemp("generate") / "k3-tiny", model, serving.tokenizer())


def test_k3_generate_stops_at_the_context_and_says_so(ckpt, capsys):
    prompt = serving.tokenizer().decode(serving.prompts()[2])  # 17 tokens, 7 left in a context of 24
    assert len(serving.tokenizer().encode(prompt)) == 17
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", prompt, "--max-tokens", "50", "--temperature", "0",
                 "--ignore-eos", "--device", "cpu"]) == 0
    assert "stopped at the model's context of 24 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "-1"], "argument --max-tokens: expected a positive number, got -1"),
    (["--max-tokens", "0"], "argument --max-tokens: expected a positive number, got 0"),
    (["--temperature", "nan"], "sampling: need temperature >= 0"),
    (["--top-p", "2"], "sampling: need temperature >= 0"),
])
def test_k3_generate_refuses_bad_settings_by_name_before_reading_the_checkpoint(flags, message, capsys, tmp_path):
    missing = tmp_path / "no-such-checkpoint"  # read only after the settings are checked
    assert _exit_code(["generate", "--ckpt", str(missing), "--prompt", "def", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and str(missing) not in err


def test_k3_generate_refuses_a_prompt_that_fills_the_context(ckpt, capsys):
    prompt = serving.tokenizer().decode(serving.prompts()[5])  # 120 tokens, a context of 24
    assert _exit_code(["generate", "--ckpt", str(ckpt), "--prompt", prompt, "--device", "cpu"]) == 2
    assert "prompt: 120 tokens leave no room in the model's context of 24" in capsys.readouterr().err

