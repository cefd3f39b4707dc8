"""What the compiled-step tests share: greedy decoding eagerly and on a `CompiledModel` side by side, and the
stated logit tolerance (fp32 reassociation: 1e-4 absolute on logits of magnitude ~1)."""

from __future__ import annotations

import torch

from k3 import K3ForCausalLM
from k3.model.compiled import CompiledModel
from k3.model.state import DecoderState

LOGIT_TOLERANCE = 1e-4


def generate_both(model: K3ForCausalLM, compiled: CompiledModel, prompt: torch.Tensor, steps: int):
    """Prefill ``prompt`` and greedily decode ``steps`` tokens, eagerly (one model call for the whole prompt) and
    compiled (prompt pieces, then decode steps); returns both token lists and the largest logit difference."""
    with torch.no_grad():
        logits, state = model(prompt, state=model.new_state(prompt.shape[0]))
    eager: tuple[torch.Tensor, DecoderState] = (logits[:, -1], state)
    fast = compiled.step(prompt, model.new_state(prompt.shape[0]))
    tokens_eager, tokens_fast, worst = [], [], float((eager[0] - fast[0]).abs().max())
    for _ in range(steps):
        te, tf = eager[0].argmax(-1, keepdim=True), fast[0].argmax(-1, keepdim=True)
        tokens_eager.append(te.flatten().tolist())
        tokens_fast.append(tf.flatten().tolist())
        with torch.no_grad():
            le, se = model(te, state=eager[1])
        eager, fast = (le[:, -1], se), compiled.step(tf, fast[1])
        worst = max(worst, float((eager[0] - fast[0]).abs().max()))
        assert fast[1].position == se.position
    return tokens_eager, tokens_fast, worst
