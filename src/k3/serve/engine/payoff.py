"""How many tokens a request drafts (SPEC §8, issue 36): speculation only where it pays.

A verified run of γ drafts keeps ``1 + a`` tokens (``a`` accepted plus the corrected or bonus token) for one target
pass over γ + 1 positions and γ draft steps. With per-position acceptance α (drafts are accepted in order until the
first rejection), the tokens a run is expected to keep are ``E(γ) = (1 − α^{γ+1}) / (1 − α)``, and its cost in plain
decode steps is ``C(γ) = 1 + f + c·γ`` for γ > 0: ``f`` what verifying a row costs whatever its width (the accept,
the verification's bookkeeping; 0 until measured), ``c`` the price of a drafted position, at first the drafter's
stated one (`NGramDrafter.cost`, `EagleDrafter.cost`, ...). `DraftLength` estimates α per request from its own
runs — the geometric estimate Σ accepted / Σ examined, each run's counts decayed by ``decay`` so it follows a request
whose text changes — and picks the γ ≤ ``gamma`` maximising E/C. Where verification runs on compiled graphs every
run is ``gamma + 1`` wide (``padded``): any γ > 0 then costs 1 + f + c·``gamma``, so a request drafts ``gamma`` or
nothing. When no γ > 0 beats plain decoding (E/C ≤ 1) the request decodes plainly until the next multiple of
``pause`` engine steps, then probes with ``gamma`` drafts (a run as long as drafting would make: its price is what
the probe must show); the pause doubles while probes keep losing (up to ``max_pause``). Ending pauses at multiples
of their length lines the probes of a batch up in the same steps. A probe that drafted nothing (an n-gram drafter
found no match) pauses again for as long, so a request is never left without probes. A drafter whose proposals
cost nothing (the n-gram's lookup) keeps proposing for a paused greedy request, and the target's own next token
tells whether the proposal's first token would have been accepted (`DraftLength.shadow`): evidence without a
verification, which ends the pause as soon as drafting pays.
Tokens never depend on this choice (verification is lossless): only how many are drafted does.

The stated ``c`` is a guess; what a drafted position really costs depends on the machine, compiled graphs or not,
and the batch. `StepCost` measures ``f`` and ``c``: the first decode step (no prefill in it) and every
``every``-th after it draft nothing, timing a plain step at that batch size; a step at batch ``B`` with ``k``
verified rows and ``n`` drafted positions that took ``r`` plain steps' time is one observation
``(r − 1)·B = f·k + c·n``, and ``(f, c)`` is their least-squares fit, older steps weighted down by ``decay`` per
step (padded verification counts ``gamma`` positions per verified row, whatever was drafted: a one-draft probe must
not look four times dearer). While every observed run had the same width the two cannot be told apart and ``f`` stays
0 — ``c = Σ(r − 1)·B·n / Σn²``, which prices runs of that width right and shorter ones too cheaply, so a request
that then drafts shorter runs separates the two. (Pricing every run by a short one's width — probes of one draft,
as before — made long runs look dear: the verification's fixed part counted per position, and a request that only
ever drafted short runs never learnt otherwise.) Once measured, ``(f, c)`` replaces the stated price.
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
        self.fixed = 0.0  # f: a verified row's price whatever its width (`StepCost`)
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
        every verification is ``gamma + 1`` wide (compiled graphs), so any γ > 0 costs 1 + f + c·``gamma``."""
        gain = [expected_tokens(alpha, g) / (1 + self.fixed * (g > 0) + self.cost * (self.gamma if self.padded and g
                                                                                     else g))
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
            return self.gamma  # the pause ends: probe
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

    def shadow(self, request_id: str, accepted: bool) -> None:
        """A paused request's drafter proposed a first token for free (`Drafter.free`) and the target's own greedy
        token then confirmed it or not: one examined position for α, paid for by nothing. When drafting pays by it,
        the pause ends at once, so a request whose text starts repeating its context drafts from the next step, not
        from the next probe."""
        r = self._records.setdefault(request_id, _Record(*self.prior))
        r.accepted = r.accepted * self.decay + accepted
        r.examined = r.examined * self.decay + 1
        if r.probe_at is not None and self.best(self.acceptance(request_id)) > 0:
            r.probe_at = None

    def _pause(self, r: _Record, length: int) -> None:
        """Decode plainly until the next multiple of ``length`` steps, then probe."""
        r.pause, r.probe_at = length, (self.now // length + 1) * length

    def end(self, request_id: str) -> None:
        self._records.pop(request_id, None)


class StepCost:
    """The measured price of verification in plain decode steps (module docstring): ``value`` is ``(f, c)`` — a
    verified row's fixed price and a drafted position's — ``(0, cost)`` as stated until a speculative step could be
    compared with a plain one of its batch size."""

    def __init__(self, cost: float, every: int = 16, decay: float = 0.9) -> None:
        if cost < 0 or every < 2 or not 0 < decay < 1:
            raise ValueError(f"step cost: invalid settings cost={cost}, every={every}, decay={decay}")
        self.stated, self.every, self.decay = cost, every, decay
        self.measured: tuple[float, float] | None = None
        self._plain: dict[int, float] = {}  # batch size -> decayed mean seconds of a plain decode step
        self._moments = [0.0] * 5  # decayed Σk², Σkn, Σn², Σk·y, Σn·y of the observations y = f·k + c·n
        self._steps = 0

    @property
    def value(self) -> tuple[float, float]:
        return (0.0, self.stated) if self.measured is None else self.measured

    def plain_step(self) -> bool:
        """Whether this decode step drafts nothing, to time a plain step: the first, then one in ``every``."""
        self._steps += 1
        return self._steps % self.every == 1

    def record(self, batch: int, rows: int, drafted: int, seconds: float) -> None:
        """A decode step of ``batch`` requests, ``rows`` of them verifying ``drafted`` positions in all, took
        ``seconds``."""
        if batch < 1 or seconds <= 0:
            return
        if drafted == 0:
            old = self._plain.get(batch)
            self._plain[batch] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
            return
        plain = self._plain.get(batch)
        if plain is None:
            return
        y = (seconds / plain - 1) * batch
        observed = (rows * rows, rows * drafted, drafted * drafted, rows * y, drafted * y)
        self._moments = [self.decay * m + o for m, o in zip(self._moments, observed)]
        self.measured = self._fit()

    def _fit(self) -> tuple[float, float]:
        """The non-negative least-squares ``(f, c)`` of the observations; ``f = 0`` while they cannot tell the two
        apart (every run of one width)."""
        kk, kn, nn, ky, ny = self._moments
        det = kk * nn - kn * kn
        if det > 1e-9 * kk * nn:
            f, c = (nn * ky - kn * ny) / det, (kk * ny - kn * ky) / det
            if f >= 0 and c >= 0:
                return f, c
            if c < 0 <= ky:  # the price does not grow with the width: it is all fixed
                return ky / kk, 0.0
        return 0.0, max(0.0, ny / nn)
