"""SpecConfig: what the jitted speculative programs need to know about the drafter, as one
hashable value (a static argument, so each drafter configuration is its own program)."""
from __future__ import annotations

import dataclasses

from jaxoverlap.models.config import ModelConfig

ALGORITHMS = ("eagle", "draft_model", "ngram", "ngram_device")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    algorithm: str  # one of ALGORITHMS
    num_draft: int  # k: draft tokens per step; the verify window is 1 + k
    draft_cfg: ModelConfig | None = None  # the EAGLE head (one layer) or the draft model
    ngram_min: int = 1  # shortest trailing n-gram the lookup tries
    ngram_max: int = 4  # longest trailing n-gram the lookup tries (longest match wins)
    accept_backend: str = "xla"  # pallas_kernels.acceptance backend: "xla" (jnp) | "pallas"

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown speculative algorithm {self.algorithm!r}; known: {ALGORITHMS}")
        if self.algorithm in ("eagle", "draft_model") and self.draft_cfg is None:
            raise ValueError(f"{self.algorithm} needs the drafter's ModelConfig")

    @property
    def window(self) -> int:
        return 1 + self.num_draft

    @property
    def lookahead(self) -> int:
        """Positions past the window whose slots a step writes: the EAGLE head keeps the
        state of position p (pair (h_p, t_{p+1})) in the slot of position p + 1."""
        return 1 if self.algorithm == "eagle" else 0

    @property
    def cache_lag(self) -> int:
        """Trailing positions of a request's length whose drafter state is not final: the
        draft model's K/V at seq_len - 1 is written by the next step's first pass."""
        return 1 if self.algorithm == "draft_model" else 0

    @property
    def host_drafts(self) -> bool:
        """The drafts come from the host (the n-gram trie), so a decode batch needs the
        previous step's accepted tokens on the host before it can launch."""
        return self.algorithm == "ngram"
