"""How many tokens a request drafts (SPEC §8, issue 36): speculation only where it pays.

A verified run of γ drafts keeps ``1 + a`` tokens (``a`` accepted plus the corrected or bonus token) for one target pass
over γ + 1 positions and γ draft steps. With per-position acceptance α (drafts are accepted in order until the first
rejection), the tokens a run is expected to keep are ``E(γ) = (1 − α^{γ+1}) / (1 − α)``, and its cost in plain decode
steps is ``C(γ) = 1 + f + c·γ`` for γ > 0: ``f`` what verifying a row costs whatever its width (the accept, the
verification's bookkeeping; 0 until measured), ``c`` the price of a drafted position, at first the drafter's stated one
(`NGramDrafter.cost`, `EagleDrafter.cost`, ...). `DraftLength` estimates α per request from its own runs — the geometric
estimate Σ accepted / Σ examined, each run's counts decayed by ``decay`` so it follows a request whose text changes,
starting from the α of the requests before it — and picks the γ ≤ ``gamma`` maximising E/C. Where verification runs on
compiled graphs every run is ``gamma + 1`` wide (``padded``): any γ > 0 then costs 1 + f + c·``gamma``, so a request
drafts ``gamma`` or nothing. When no γ > 0 beats plain decoding (E/C ≤ 1) the request decodes plainly until the next
multiple of ``pause`` engine steps, then probes with ``gamma`` drafts (a run as long as drafting would make: its price
is what the probe must show); the pause doubles while probes keep losing (up to ``max_pause``), and a new request
starts from the pause the last losing probe reached (a probe that wins resets it): short requests then do not each pay
for the probes that taught the requests before them the same (stop 57, compiled `mini`, EAGLE at batch 1: two losing
probes per 64-token answer cost adaptive decoding a tenth of plain decoding's speed). Ending pauses at multiples of
their length lines the probes of a batch up in the same steps. A probe that drafted nothing (an n-gram
drafter found no match) pauses again for as long, so a request is never left without probes. A drafter whose proposals
cost nothing (the n-gram's lookup) keeps proposing for a paused request, and the target's own next token tells whether
the proposal's first token would have been accepted (`DraftLength.shadow`): evidence without a verification, which ends
the pause as soon as drafting pays — and replaces the probes of such a *watched* request (a probe's verification costs a
whole batch its group price: at stop 50, probes and verifications padded to the batch kept compiled adaptive n-gram rows
at batch 8 at 0.71–0.93× of plain decoding). Tokens never depend on this choice (verification is lossless): only how
many are drafted does.

A step's verification group also has a price of its own, ``G`` plain steps whatever its rows (a second group in the
model call beside the decode rows; measured at batch 8 on `mini`: the first verifying row added 5.6 ms to a 7.8-ms
step, each further row ~2 ms). The whole batch pays it, so no row can judge it alone: `Speculator` lets a step verify
only when its rows' `DraftLength.gain` together exceed ``G·B`` row shares (or one of them is probing), and holds the
others until their next probe (`DraftLength.hold`).

The stated ``c`` is a guess; what verification really costs depends on the machine, compiled graphs or not,
and the batch. `StepCost` measures ``G``, ``f`` and ``c``: the first decode step (no prefill in it) and every
``every``-th after it draft nothing, timing a plain step at that batch size; a step at batch ``B`` with ``k``
verified rows and ``n`` drafted positions that took ``r`` plain steps' time is one observation
``(r − 1)·B = G·B + f·k + c·n`` — ``r`` counting what the plain step after it spends beyond a plain step's time
(the verified rows rejoin the decode batch, whose stacked state is rebuilt), which is then no plain step's sample —
and ``(G, f, c)`` is their non-negative least-squares fit, older steps weighted
down by ``decay`` per step (padded verification counts ``gamma`` positions per verified row, whatever was drafted: a
one-draft probe must not look four times dearer). What the observations cannot tell apart goes to ``c`` first:
while every run had one width (at batch 1, ``B = k``), ``c = Σ(r − 1)·B·n / Σn²`` prices runs of that width right
and shorter ones too cheaply, so a request that then drafts shorter runs separates them. (Pricing every run by a
short one's width — probes of one draft, as before — made long runs look dear: the verification's fixed part
counted per position, and a request that only ever drafted short runs never learnt otherwise.) Once measured,
``(G, f, c)`` replaces the stated price.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["READ_AHEAD", "DraftLength", "StepCost", "expected_tokens"]

#: Steps before a paused request's probe from which a drafter that reads the target's features gets them again
#: (`DraftLength.reading`): a paused request's steps run the target's plain graphs, and the draft reads the last
#: positions before the probe (stop 57: an EAGLE engine capturing every step's features but never drafting decoded
#: compiled `mini` at batch 1 at 0.87× of plain decoding, and adaptive EAGLE, mostly paused, at 0.88×).
READ_AHEAD = 4


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ): tokens a run of γ drafts keeps on average at per-position acceptance ``alpha`` (bonus included)."""
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


@dataclass
class _Record:
    accepted: float  # decayed Σ accepted drafts (the prior's share first)
    examined: float  # decayed Σ drafts examined (accepted, plus the rejected one)
    probe_at: int | None = None  # while paused: the step of the next probe
    pause: int = 0  # the length of the last pause
    probed: int = -1  # the step of the last probe


class DraftLength:
    """Per-request draft lengths (module docstring). A new request's α starts from the *population's*: every
    verified run of every request, each run's counts decayed by ``population_decay`` (``prior`` before any run), worth
    ``prior_weight`` drafts, decayed with the request's own runs; its first pause is the population's too
    (``population_pause``). Requests are short beside what a handful of runs can tell (a 64-token answer holds ~20
    runs): a request that started from a fixed guess spent its first runs relearning what the requests before it had
    shown, and a few unlucky early runs paused it for the rest of its answer (stop 54: adaptive EAGLE rows at 0.93×
    where drafting always ran at 1.08–1.28×). `tick` counts engine steps: a pause ends at a multiple of its length, so
    requests paused alike probe in the same step and share its one verification group (a lone probe in a batch costs
    that batch a whole group)."""

    def __init__(self, gamma: int, cost: float, prior: float = 0.6, prior_weight: float = 4.0, decay: float = 0.8,
                 pause: int = 16, max_pause: int = 256, padded: bool = False, population_decay: float = 0.95) -> None:
        if gamma < 0 or cost < 0 or not 0 <= prior <= 1 or not 0 < decay <= 1 or not 1 <= pause <= max_pause \
                or prior_weight <= 0 or not 0 < population_decay <= 1:
            raise ValueError(f"draft length: invalid settings gamma={gamma}, cost={cost}, prior={prior}, "
                             f"prior_weight={prior_weight}, decay={decay}, pause={pause}, max_pause={max_pause}, "
                             f"population_decay={population_decay}")
        self.gamma, self.cost, self.decay, self.min_pause, self.max_pause = gamma, cost, decay, pause, max_pause
        self.fixed = 0.0  # f: a verified row's price whatever its width (`StepCost`)
        self.padded = padded
        self.prior_weight, self.population_decay = prior_weight, population_decay
        self.population = [prior * prior_weight, prior_weight]  # decayed Σ accepted, Σ examined of every run
        self.population_pause = 0  # the pause after the last losing probe, a new request's first (0: none lost)
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

    @property
    def prior(self) -> tuple[float, float]:
        """A new request's (accepted, examined): the population's α, worth ``prior_weight`` drafts."""
        accepted, examined = self.population
        return accepted / examined * self.prior_weight, self.prior_weight

    def best(self, alpha: float) -> int:
        """The γ ≤ ``gamma`` with the most expected tokens per cost; 0 when none beats plain decoding. ``padded``:
        every verification is ``gamma + 1`` wide (compiled graphs), so any γ > 0 costs 1 + f + c·``gamma``."""
        gain = [expected_tokens(alpha, g) / self.price(g) for g in range(self.gamma + 1)]
        best = max(range(self.gamma + 1), key=gain.__getitem__)
        return best if gain[best] > 1 else 0

    def length(self, request_id: str, watched: bool = False) -> int:
        """How many tokens the request drafts this step (0: it decodes plainly). A ``watched`` request's free
        proposals are checked against the target's own tokens while it is paused (`shadow`): its pause ends by that
        evidence, never by a probe, so it pays for no verification that the evidence does not call for. A new watched
        request starts paused: the prior is no evidence, and its first shadowed hit is."""
        r = self._records.get(request_id)
        if r is None:
            r = self._records[request_id] = _Record(*self.prior)
            if watched:
                self._pause(r, self.min_pause)
        if r.probe_at is not None:
            if self.now < r.probe_at or watched:
                return 0
            r.probe_at, r.probed = None, self.now
            return self.gamma  # the pause ends: probe
        best = self.best(self.acceptance(request_id))
        if best == 0:  # no run will come to update α (a probe found nothing to draft, or the price rose): wait again
            self._pause(r, r.pause or self.population_pause or self.min_pause)
        return best

    def reading(self, request_id: str, ahead: int) -> bool:
        """Whether the request may draft within ``ahead`` steps: it is new, not paused, or its probe is that close."""
        r = self._records.get(request_id)
        return r is None or r.probe_at is None or self.now + ahead >= r.probe_at

    def probing(self, request_id: str) -> bool:
        """Whether the request's draft this step is a probe (its pause just ended)."""
        r = self._records.get(request_id)
        return r is not None and r.probed == self.now

    def price(self, gamma: int) -> float:
        """A step's price for a row drafting ``gamma`` tokens, in plain-step shares of that row: 1 + f + c·γ (γ
        positions verified; ``gamma`` when padded), 1 for a row that drafts nothing."""
        if gamma == 0:
            return 1.0
        return 1 + self.fixed + self.cost * (self.gamma if self.padded else gamma)

    def gain(self, request_id: str, gamma: int) -> float:
        """Tokens a run of ``gamma`` drafts is expected to keep beyond its own `price`: what the request brings to a
        step's verification group."""
        return expected_tokens(self.acceptance(request_id), gamma) - self.price(gamma)

    def hold(self, request_id: str) -> None:
        """The step's verification group would not pay for itself (`Speculator`): decode plainly until the next
        probe, as after a pause."""
        r = self._records.setdefault(request_id, _Record(*self.prior))
        self._pause(r, r.pause or self.min_pause)

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified run of ``drafted`` drafts kept ``accepted`` of them."""
        r = self._records.setdefault(request_id, _Record(*self.prior))
        examined = accepted + (accepted < drafted)
        r.accepted = r.accepted * self.decay + accepted
        r.examined = r.examined * self.decay + examined
        d = self.population_decay
        self.population = [self.population[0] * d + accepted, self.population[1] * d + examined]
        if self.best(self.acceptance(request_id)) == 0:
            self._pause(r, min(self.max_pause, 2 * r.pause) if r.pause else self.population_pause or self.min_pause)
            self.population_pause = r.pause
        else:
            r.pause = self.population_pause = 0

    def shadow(self, request_id: str, accepted: bool) -> None:
        """A paused request's drafter proposed a first token for free (`Drafter.free`) and the target's own token
        then confirmed it or not: one examined position for α, paid for by nothing (for a deterministic draft, as the
        n-gram's, the target samples the proposed token with exactly the probability that verification would accept
        it, so sampled requests give this evidence too). When drafting pays by it, the pause ends at once, so a
        request whose text starts repeating its context drafts from the next step, not from the next probe. Only a hit
        ends a pause: a miss after a decayed run of hits must not start a verification it argues against."""
        r = self._records.setdefault(request_id, _Record(*self.prior))
        r.accepted = r.accepted * self.decay + accepted
        r.examined = r.examined * self.decay + 1
        if accepted and r.probe_at is not None and self.best(self.acceptance(request_id)) > 0:
            r.probe_at = None

    def _pause(self, r: _Record, length: int) -> None:
        """Decode plainly until the next multiple of ``length`` steps, then probe."""
        r.pause, r.probe_at = length, (self.now // length + 1) * length

    def end(self, request_id: str) -> None:
        self._records.pop(request_id, None)


#: `StepCost`'s prices in the order it prefers them while the observations cannot tell them apart: per drafted
#: position first (right for the widths seen, too cheap for shorter runs, so drafting shorter runs reveals the rest),
#: then per verified row, then per step; indices into (G, f, c).
_SUBSETS = ((2,), (1,), (0,), (1, 2), (0, 2), (0, 1), (0, 1, 2))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None when ``a`` is (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(abs(v) for row in a for v in row) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(m[i][col]))
        if abs(m[pivot][col]) <= 1e-9 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for i in range(col + 1, n):
            factor = m[i][col] / m[col][col]
            m[i] = [v - factor * w for v, w in zip(m[i], m[col])]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


class StepCost:
    """The measured price of verification in plain decode steps (module docstring): ``value`` is ``(G, f, c)`` —
    a verification group's price per step, a verified row's and a drafted position's — ``(0, 0, cost)`` as stated
    until a speculative step could be compared with a plain one of its batch size."""

    def __init__(self, cost: float, every: int = 16, decay: float = 0.9) -> None:
        if cost < 0 or every < 2 or not 0 < decay < 1:
            raise ValueError(f"step cost: invalid settings cost={cost}, every={every}, decay={decay}")
        self.stated, self.every, self.decay = cost, every, decay
        self.measured: tuple[float, float, float] | None = None
        self._plain: dict[int, float] = {}  # batch size -> decayed mean seconds of a plain decode step
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed Σ x xᵀ, Σ x y, Σ y² of the observations
        self._xy, self._yy = [0.0] * 3, 0.0  # y = G·B + f·k + c·n, x = (B, k, n)
        self._held: tuple[int, int, int, float] | None = None  # the last verification, until the next step is timed
        self._steps = 0

    @property
    def value(self) -> tuple[float, float, float]:
        return (0.0, 0.0, self.stated) if self.measured is None else self.measured

    def plain_step(self) -> bool:
        """Whether this decode step drafts nothing, to time a plain step: the first, then one in ``every``."""
        self._steps += 1
        return self._steps % self.every == 1

    def record(self, batch: int, rows: int, drafted: int, seconds: float) -> None:
        """A decode step of ``batch`` requests, ``rows`` of them verifying ``drafted`` positions in all, took
        ``seconds``. A verification's price includes what the step after it pays for it (its rows rejoin the decode
        batch, whose stacked state is rebuilt): its observation is complete once that step is timed, and a plain
        step right after a verification is not a plain step's price."""
        if batch < 1 or seconds <= 0:
            return
        held, self._held = self._held, None
        if held is not None:
            after = self._plain.get(held[0]) if drafted == 0 and batch == held[0] else None
            self._observe(*held[:3], held[3] + (0.0 if after is None else (seconds / after - 1) * batch))
            if after is not None:
                return
        if drafted == 0:
            old = self._plain.get(batch)
            self._plain[batch] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
            return
        plain = self._plain.get(batch)
        if plain is not None:
            self._held = (batch, rows, drafted, (seconds / plain - 1) * batch)

    def _observe(self, batch: int, rows: int, drafted: int, y: float) -> None:
        """One observation ``y = G·B + f·k + c·n`` into the decayed sums, and the new fit."""
        x, d = (batch, rows, drafted), self.decay
        self._xx = [[d * self._xx[i][j] + x[i] * x[j] for j in range(3)] for i in range(3)]
        self._xy = [d * self._xy[i] + x[i] * y for i in range(3)]
        self._yy = d * self._yy + y * y
        self.measured = self._fit()

    def _fit(self) -> tuple[float, float, float]:
        """The non-negative least-squares ``(G, f, c)``: of the price subsets the observations determine, the one
        with the least residual (the earlier of `_SUBSETS` on a tie)."""
        best, out = None, (0.0, 0.0, 0.0)
        for subset in _SUBSETS:
            x = _solve([[self._xx[i][j] for j in subset] for i in subset], [self._xy[i] for i in subset])
            if x is None or min(x) < 0:
                continue
            residual = self._yy - sum(v * self._xy[i] for v, i in zip(x, subset))
            if best is None or residual < best - 1e-9 * max(self._yy, 1e-12):
                best, out = residual, tuple(next((v for v, i in zip(x, subset) if i == k), 0.0) for k in range(3))
        return out
