"""The continuous-batching engine (SPEC §8): `Engine` and what its callers hand it and get back."""

from k3.serve.engine.core import (
    ContextLengthExceeded,
    Engine,
    Output,
    Processor,
    QueueFull,
    SamplingParams,
    TextProcessor,
    TokenLogprob,
)

__all__ = ["ContextLengthExceeded", "Engine", "Output", "Processor", "QueueFull", "SamplingParams", "TextProcessor",
           "TokenLogprob"]
