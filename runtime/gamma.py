"""The speedup formula and the adaptive-γ controller that uses it with measured costs."""
from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[tokens per verify pass] = (1 - α^(γ+1)) / (1 - α)  (γ+1 at α = 1)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, c: float, verify_ratio: float = 1.0) -> float:
    """Speedup over plain decoding: E[tokens] / (γ c + T(γ+1)/T(1)).

    With verify_ratio = 1 this is the reference text's formula E[tokens] / (γ c + 1); specrt
    passes the MEASURED T(γ+1)/T(1), since verifying γ+1 positions is not free on a CPU.
    """
    if gamma == 0:
        return 1.0
    return expected_tokens(alpha, gamma) / (gamma * c + verify_ratio)


@dataclass
class GammaController:
    """Chooses γ per round: the γ in 0..gamma_max whose predicted speedup is largest.

    α is the acceptance estimate α̂ = accepted / (accepted + rejections) over exponentially
    decayed round counts (the MLE of a truncated geometric); costs come from the models'
    measured latencies. γ = 0 is plain decoding; while at 0, every ``probe_every`` rounds one
    round runs at γ = 1 so that α keeps being measured.
    """

    gamma_max: int  # largest γ considered (the exported verify shape - 1)
    fixed: int | None = None  # a user's fixed γ: no adaptation
    decay: float = 0.9  # weight kept per round by the α estimate
    prior_alpha: float = 0.6  # α assumed before any round (weight of one round)
    probe_every: int = 8  # rounds at γ = 0 between probe rounds at γ = 1
    state: tuple | None = None  # (accepted, rejected) decayed counts carried over from earlier requests
    history: list = field(default_factory=list)  # γ chosen per round

    def __post_init__(self):
        self._accepted, self._rejected = self.state or (self.prior_alpha, 1.0 - self.prior_alpha)
        self._idle_rounds = 0

    def export_state(self) -> tuple:
        """The α evidence, to seed the next request's controller (acceptance is a property of the pair)."""
        return (self._accepted, self._rejected)

    @property
    def alpha(self) -> float:
        return self._accepted / max(self._accepted + self._rejected, 1e-9)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self._accepted = self.decay * self._accepted + accepted
        self._rejected = self.decay * self._rejected + (1.0 if accepted < proposed else 0.0)

    def choose(self, cost) -> int:
        """cost(γ) -> (c, verify_ratio) measured on this machine; returns γ for the next round."""
        if self.fixed is not None:
            g = self.fixed
        else:
            best = max(range(self.gamma_max + 1), key=lambda g: predicted_speedup(self.alpha, g, *cost(g)))
            g = best
            if g == 0:
                self._idle_rounds += 1
                if self._idle_rounds >= self.probe_every:
                    self._idle_rounds, g = 0, 1
            else:
                self._idle_rounds = 0
        self.history.append(g)
        return g
