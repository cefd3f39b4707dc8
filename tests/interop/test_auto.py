"""Kimi K3 through transformers' Auto classes without remote code (`k3.interop.auto`, issue 39 item 6).

``AutoModelForCausalLM.from_pretrained`` loads a ``k3 export`` and a reduced release checkpoint; its logits, loss,
greedy generation (one row and a left-padded batch) and lm-eval's ``hf`` loglikelihoods equal kimi-k3's own."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import serving
from k3.cli import main
from k3.model.checkpoint import save_model
from k3.model.lm import K3ForCausalLM
from release_fixture import write_release

transformers = pytest.importorskip("transformers")
auto = pytest.importorskip("k3.interop.auto")

TEXTS = ["def parse(text):", "import os"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("auto")
    save_model(root / "ckpt", serving.model(), serving.tokenizer())
    assert main(["export", "--ckpt", str(root / "ckpt"), "--out", str(root / "out")]) == 0
    return root / "out"


def greedy(model: K3ForCausalLM, ids: list[int], n: int) -> list[int]:
    """kimi-k3's own greedy continuation: prefill, then one token at a time on the state."""
    state, out = model.new_state(1), []
    with torch.no_grad():
        logits, state = model(torch.tensor([ids]), state=state)
        for _ in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits, state = model(torch.tensor([[out[-1]]]), state=state)
    return out


def test_auto_classes_load_an_export_with_our_logits_and_loss(exported):
    config = transformers.AutoConfig.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert isinstance(config, auto.KimiK3Config) and isinstance(model, auto.KimiK3ForCausalLM)
    ours = K3ForCausalLM.from_pretrained(str(exported))
    ids = torch.tensor([serving.tokenizer().encode(TEXTS[0])])
    with torch.no_grad():
        out = model(ids, labels=ids)
        want = ours(ids)[0]
    assert torch.equal(out.logits, want)
    expected = torch.nn.functional.cross_entropy(want[0, :-1], ids[0, 1:])
    assert torch.allclose(out.loss, expected)


def test_generate_gives_our_greedy_tokens_for_one_row_and_a_left_padded_batch(exported):
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported, padding_side="left")
    ours = K3ForCausalLM.from_pretrained(str(exported))
    wants = [greedy(ours, serving.tokenizer().encode(t), 6) for t in TEXTS]
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True, add_special_tokens=False)
    assert not bool(batch["attention_mask"].all())  # the second row is padded
    got = model.generate(**batch, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert got[:, batch["input_ids"].shape[1]:].tolist() == wants
    one = tokenizer(TEXTS[:1], return_tensors="pt", add_special_tokens=False)
    assert model.generate(**one, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, -6:].tolist() == wants[0]


def test_a_reduced_release_checkpoint_loads_through_the_auto_classes(tmp_path):
    write_release(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32")
    ids = torch.tensor([[1, 5, 9, 200, 33, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, K3ForCausalLM.from_pretrained(str(tmp_path))(ids)[0])


def test_lm_eval_hf_loglikelihoods_equal_ours(exported):
    huggingface = pytest.importorskip("lm_eval.models.huggingface")
    from lm_eval.api.instance import Instance

    pairs = [("def parse(", "text):"), ("import", " os\nimport sys"), ("x =", " 1")]
    lm = huggingface.HFLM(pretrained=str(exported), batch_size=2, device="cpu", dtype="float32")
    got = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i)
                            for i, p in enumerate(pairs)])
    ours, tok = K3ForCausalLM.from_pretrained(str(exported)), serving.tokenizer()
    for (context, continuation), (logprob, _) in zip(pairs, got):
        whole, head = tok.encode(context + continuation), tok.encode(context)
        with torch.no_grad():
            scores = ours(torch.tensor([whole]))[0][0].log_softmax(-1)
        want = sum(float(scores[i - 1, whole[i]]) for i in range(len(head), len(whole)))
        assert math.isclose(logprob, want, rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize("option", [{"device_map": {"model.layers.0": "cpu", "lm_head": "cpu"}},
                                    {"quantization_config": {"quant_method": "bitsandbytes"}},
                                    {"revision": "v2"}])
def test_options_we_do_not_implement_are_refused(exported, option):
    with pytest.raises(ValueError, match="device_map|unsupported"):
        transformers.AutoModelForCausalLM.from_pretrained(exported, **option)


def test_a_right_padded_mask_is_refused(exported):
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    with pytest.raises(ValueError, match="left padding"):
        model(torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[1, 1, 0]]))


def test_outputs_we_do_not_compute_are_refused(exported):
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    with pytest.raises(ValueError, match="output_attentions"):
        model(torch.tensor([[5, 6, 7]]), output_attentions=True)
