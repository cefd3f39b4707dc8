"""How many tokens a request drafts (SPEC §8, issue 36): speculation only where it pays.

A verified run of γ drafts keeps ``1 + a`` tokens (``a`` accepted plus the corrected or bonus token) for one target
pass over γ + 1 positions and γ draft steps. With per-position acceptance α (drafts are accepted in order until the
first rejection), the tokens a run is expected to keep are ``E(γ) = (1 − α^{γ+1}) / (1 − α)``, and its cost in plain
decode steps is ``C(γ) = 1 + c·γ``, ``c`` the drafter's stated price of a drafted position (`NGramDrafter.cost`,
`EagleDrafter.cost`, ...). `DraftLength` estimates α per request from its own runs — the geometric estimate
Σ accepted / Σ examined, each run's counts decayed by ``decay`` so it follows a request whose text changes — and picks
the γ ≤ ``gamma`` maximising E/C. Where verification runs on compiled graphs every run is ``gamma + 1`` wide
(``padded``): any γ > 0 then costs 1 + c·``gamma``, so a request drafts ``gamma`` or nothing. When no γ > 0 beats
plain decoding (E/C ≤ 1) the request decodes plainly until the next multiple of ``pause`` engine steps, then probes
with one draft (``gamma`` when padded: the same price); the pause doubles while probes keep losing
(up to ``max_pause``). Ending pauses at multiples of their length lines the probes of a batch up in the same steps.
A probe that drafted nothing (an n-gram drafter found no match) pauses again for as long, so a request is never
left without probes.
Tokens never depend on this choice (verification is lossless): only how many are drafted does.

The stated ``c`` is a guess; what a drafted position really costs depends on the machine, compiled graphs or not,
and the batch. `StepCost` measures it: the first decode step (no prefill in it) and every ``every``-th after it
draft nothing, timing a plain step at that batch size; a step with ``n`` drafted positions at batch ``B`` that took
``r`` plain steps' time gives ``c = (r − 1)·B / n``, averaged with weight ``decay`` (padded verification counts
``gamma`` positions per verified row, whatever was drafted: a one-draft probe must not look four times dearer).
Once measured, that ``c`` replaces the stated one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DraftLength", "StepCost", "expected_tokens"]


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ): tokens a run of γ drafts keeps on average at per-position acceptance ``alpha`` (bonus included)."""
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


@dataclass
class _Record:
    accepted: float  # decayed Σ accepted drafts
    examined: float  # decayed Σ drafts examined (accepted, plus the rejected one)
    probe_at: int | None = None  # while paused: the step of the next probe
    pause: int = 0  # the length of the last pause


class DraftLength:
    """Per-request draft lengths (module docstring); ``prior`` is α before any run (worth ``prior_weight`` drafts).
    `tick` counts engine steps: a pause ends at a multiple of its length, so requests paused alike probe in the
    same step and share its one verification group (a lone probe in a batch costs that batch a whole group)."""

    def __init__(self, gamma: int, cost: float, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.8,
                 pause: int = 16, max_pause: int = 256, padded: bool = False) -> None:
        if gamma < 0 or cost < 0 or not 0 <= prior <= 1 or not 0 < decay <= 1 or not 1 <= pause <= max_pause:
            raise ValueError(f"draft length: invalid settings gamma={gamma}, cost={cost}, prior={prior}, "
                             f"decay={decay}, pause={pause}, max_pause={max_pause}")
        self.gamma, self.cost, self.decay, self.min_pause, self.max_pause = gamma, cost, decay, pause, max_pause
        self.padded = padded
        self.prior = (prior * prior_weight, prior_weight)
        self.now = 0
        self._records: dict[str, _Record] = {}

    def tick(self) -> None:
        """A new engine step."""
        self.now += 1

    def acceptance(self, request_id: str) -> float:
        """The request's estimated per-position acceptance α."""
        r = self._records.get(request_id)
        accepted, examined = self.prior if r is None else (r.accepted, r.examined)
        return accepted / examined if examined > 0 else 0.0

    def best(self, alpha: float) -> int:
        """The γ ≤ ``gamma`` with the most expected tokens per cost; 0 when none beats plain decoding. ``padded``:
        every verification is ``gamma + 1`` wide (compiled graphs), so any γ > 0 costs 1 + c·``gamma``."""
        gain = [expected_tokens(alpha, g) / (1 + self.cost * (self.gamma if self.padded and g else g))
                for g in range(self.gamma + 1)]
        best = max(range(self.gamma + 1), key=gain.__getitem__)
        return best if gain[best] > 1 else 0

    def length(self, request_id: str) -> int:
        """How many tokens the request drafts this step (0: it decodes plainly)."""
        r = self._records.setdefault(request_id, _Record(*self.prior))
        if r.probe_at is not None:
            if self.now < r.probe_at:
                return 0
            r.probe_at = None
            return self.gamma if self.padded else min(1, self.gamma)  # the pause ends: probe (as wide as it costs)
        best = self.best(self.acceptance(request_id))
        if best == 0:  # no run will come to update α (a probe found nothing to draft, or the price rose): wait again
            self._pause(r, r.pause or self.min_pause)
        return best

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified run of ``drafted`` drafts kept ``accepted`` of them."""
        r = self._records.setdefault(request_id, _Record(*self.prior))
        r.accepted = r.accepted * self.decay + accepted
        r.examined = r.examined * self.decay + accepted + (accepted < drafted)
        if self.best(self.acceptance(request_id)) == 0:
            self._pause(r, min(self.max_pause, 2 * r.pause) if r.pause else self.min_pause)
        else:
            r.pause = 0

    def _pause(self, r: _Record, length: int) -> None:
        """Decode plainly until the next multiple of ``length`` steps, then probe."""
        r.pause, r.probe_at = length, (self.now // length + 1) * length

    def end(self, request_id: str) -> None:
        self._records.pop(request_id, None)


class StepCost:
    """The measured price of a drafted position in plain decode steps (module docstring); ``value`` is the stated
    ``cost`` until a speculative step could be compared with a plain one of its batch size."""

    def __init__(self, cost: float, every: int = 16, decay: float = 0.9) -> None:
        if cost < 0 or every < 2 or not 0 < decay < 1:
            raise ValueError(f"step cost: invalid settings cost={cost}, every={every}, decay={decay}")
        self.stated, self.every, self.decay = cost, every, decay
        self.measured: float | None = None
        self._plain: dict[int, float] = {}  # batch size -> decayed mean seconds of a plain decode step
        self._steps = 0

    @property
    def value(self) -> float:
        return self.stated if self.measured is None else self.measured

    def plain_step(self) -> bool:
        """Whether this decode step drafts nothing, to time a plain step: the first, then one in ``every``."""
        self._steps += 1
        return self._steps % self.every == 1

    def record(self, batch: int, drafted: int, seconds: float) -> None:
        """A decode step of ``batch`` requests with ``drafted`` positions drafted in all took ``seconds``."""
        if batch < 1 or seconds <= 0:
            return
        if drafted == 0:
            old = self._plain.get(batch)
            self._plain[batch] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
            return
        plain = self._plain.get(batch)
        if plain is None:
            return
        cost = max(0.0, (seconds / plain - 1) * batch / drafted)
        self.measured = cost if self.measured is None else self.decay * self.measured + (1 - self.decay) * cost
