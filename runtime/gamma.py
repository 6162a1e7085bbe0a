"""The speedup formula, and the acceptance estimate the batch-aware policy feeds it."""
from __future__ import annotations

from dataclasses import dataclass


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
class AlphaEstimate:
    """A sequence's per-token acceptance estimate α̂ = accepted / (accepted + rejections), over
    exponentially decayed round counts (the MLE of a truncated geometric). The batch-aware policy
    (runtime/batch_policy.py) chooses γ from these; a new sequence starts from the served estimate.
    """

    decay: float = 0.9  # weight kept per round
    prior_alpha: float = 0.6  # α assumed before any round (weight of one round)
    state: tuple | None = None  # (accepted, rejected) decayed counts carried over from earlier sequences

    def __post_init__(self):
        self._accepted, self._rejected = self.state or (self.prior_alpha, 1.0 - self.prior_alpha)

    def export_state(self) -> tuple:
        """The evidence, to seed the next sequence's estimate (acceptance is a property of the pair)."""
        return (self._accepted, self._rejected)

    @property
    def alpha(self) -> float:
        return self._accepted / max(self._accepted + self._rejected, 1e-9)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self._accepted = self.decay * self._accepted + accepted
        self._rejected = self.decay * self._rejected + (1.0 if accepted < proposed else 0.0)
