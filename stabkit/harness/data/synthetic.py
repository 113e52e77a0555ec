"""A synthetic language made in-process: a Zipf-distributed vocabulary of thousands of tokens with
local (bigram) structure — the setting of Wortsman et al. 2023's output-logit divergence (a 32k
sub-word vocabulary whose rare tokens do occur), without downloading a corpus.

The process (seeded, `SyntheticSpec`): token ids 0..V−1 have Zipf probabilities ``p_x ∝ (x+1)^−s``
and are dealt at random into ``C`` clusters ("topics"). The next token after ``a`` is, with
probability ``λ`` (`local`), drawn from ``p`` restricted to ``a``'s cluster ``B(a)``, else from ``p``:

    q(x | a) = (1 − λ)·p_x + λ·p_x·[x ∈ B(a)] / p(B(a))

Every such kernel keeps ``p`` as its stationary distribution (Σ_a p_a q(x|a) = p_x), so the text's
token frequencies are exactly Zipf while its local structure lowers the entropy rate below the
unigram entropy; both are known in closed form (`SyntheticCorpus.entropy_rate`, `unigram_entropy`):
the entropy rate is the lowest loss any model can reach. Made once per recipe run (about a second for
2 M tokens: parallel chains, one vectorised step per position), cached by its spec. Tokens are int64
ids in ``train`` (the first 90 % of the chains) and ``val`` (the rest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ...tables import bounds
from .windows import random_windows

CHAINS = 1024
"""Chains generated side by side (each a contiguous stretch of the corpus)."""


@dataclass(frozen=True)
class SyntheticSpec:
    """A recipe's ``[data] synthetic = {...}`` table."""

    vocab: int = field(default=8192, metadata=bounds(lo=256, hi=1 << 17))
    """Vocabulary size V (Wortsman et al.: 32k sub-words; 8–32k here)."""
    zipf: float = field(default=1.1, metadata=bounds(lo=0, lo_open=True))
    """Zipf exponent s of the token ranks (natural text: ~1)."""
    tokens: int = field(default=2_000_000, metadata=bounds(lo=10_000))
    """Corpus length in tokens (train 90 %, held out 10 %)."""
    clusters: int = field(default=256, metadata=bounds(lo=1))
    """C: clusters of tokens the local structure keeps to (each token in one, dealt at random)."""
    local: float = field(default=0.5, metadata=bounds(lo=0, hi=1))
    """λ: probability that the next token is drawn from the previous token's cluster."""
    seed: int = field(default=0, metadata=bounds(lo=0))
    """Seed of the language (successor sets) and of the text drawn from it."""

    def describe(self) -> str:
        """One line for listings."""
        return (
            f"synthetic Zipf language (V {self.vocab}, s {self.zipf:g}, {self.tokens} tokens, "
            f"C {self.clusters}, λ {self.local:g}, seed {self.seed})"
        )


class SyntheticCorpus:
    """The text of a `SyntheticSpec` with the `ByteCorpus` interface (``train``, ``val``, ``batch``)."""

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        self.name = spec.describe()
        self.vocab = spec.vocab
        g = torch.Generator().manual_seed(spec.seed)
        p = torch.arange(1, spec.vocab + 1, dtype=torch.float64).pow(-spec.zipf)
        self.marginal = p / p.sum()  # (V,) float64
        """Zipf probabilities p of the token ids (id = rank − 1); also the stationary distribution."""
        self.cluster = torch.randint(0, spec.clusters, (spec.vocab,), generator=g)  # (V,)
        """The cluster of each token."""
        self.cluster_mass = torch.zeros(spec.clusters, dtype=torch.float64).index_add_(
            0, self.cluster, self.marginal
        )
        """(C,) p(B) of each cluster."""
        # tokens ordered by (cluster, id); within a cluster, cumulative p / p(B) shifted by the cluster
        # index: searchsorted(c + u) draws from cluster c in one call for a whole batch
        self._order = torch.argsort(self.cluster * spec.vocab + torch.arange(spec.vocab))
        inside = self.marginal[self._order] / self.cluster_mass[self.cluster[self._order]]
        cum = torch.zeros(spec.vocab, dtype=torch.float64)
        for c in range(spec.clusters):  # C small cumsums, once
            idx = (self.cluster[self._order] == c).nonzero().squeeze(-1)
            if len(idx):
                cum[idx] = c + torch.cumsum(inside[idx], 0)
        self._cum = cum
        tokens = self._generate(g)  # (N,)
        cut = int(len(tokens) * 0.9)
        self.train, self.val = tokens[:cut], tokens[cut:]

    def _generate(self, g: torch.Generator) -> torch.Tensor:
        spec = self.spec
        length = -(-spec.tokens // CHAINS)
        fresh = torch.multinomial(self.marginal.float(), CHAINS * length, True, generator=g).view(
            CHAINS, length
        )
        local = torch.rand(CHAINS, length, generator=g) < spec.local
        u = torch.rand(CHAINS, length, generator=g, dtype=torch.float64)
        out = torch.empty(CHAINS, length, dtype=torch.long)
        out[:, 0] = fresh[:, 0]
        last = spec.vocab - 1
        for t in range(1, length):
            c = self.cluster[out[:, t - 1]].double()
            pos = torch.searchsorted(self._cum, c + u[:, t] * (1 - 1e-12)).clamp_max(last)
            out[:, t] = torch.where(local[:, t], self._order[pos], fresh[:, t])
        return out.reshape(-1)[: spec.tokens]

    def log_prob(self, prev: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """(n,) float64: log q(nxt | prev)."""
        lam = self.spec.local
        same = (self.cluster[prev] == self.cluster[nxt]).double()
        p = self.marginal[nxt]
        return torch.log(p * ((1 - lam) + lam * same / self.cluster_mass[self.cluster[nxt]]))

    def entropy_rate(self) -> float:
        """Σ_a p_a H(q(·|a)) in nats: the loss floor of the language (closed form, per cluster)."""
        lam = self.spec.local
        p, mass = self.marginal, self.cluster_mass
        logp = p.log()
        # H(q(·|a)) for a in cluster B: −Σ_x q_x log q_x with q_x = p_x·f_x, f = 1 − λ outside B, and
        # 1 − λ + λ/p(B) inside: −Σ p f (log p + log f)
        out_f = 1 - lam
        total_out = (
            -(p * out_f * (logp + math.log(out_f))).sum() if out_f > 0 else torch.zeros((), dtype=p.dtype)
        )
        by_cluster = torch.zeros_like(mass)
        for_tokens_out = -(p * out_f * (logp + math.log(out_f))) if out_f > 0 else torch.zeros_like(p)
        in_f = out_f + lam / mass.clamp_min(1e-300)  # (C,)
        f_tok = in_f[self.cluster]
        for_tokens_in = -(p * f_tok * (logp + f_tok.log()))
        by_cluster.index_add_(0, self.cluster, for_tokens_in - for_tokens_out)
        h_cluster = total_out + by_cluster  # (C,) entropy of q(·|a) for a in each cluster
        return float((mass * h_cluster).sum())

    def unigram_entropy(self) -> float:
        """H(p) in nats: the loss of the best model that ignores context."""
        return float(-(self.marginal * self.marginal.log()).sum())

    def batch(
        self, split: str, batch_size: int, context: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs (B, T) and next-token targets (B, T), int64 on the CPU."""
        data = self.train if split == "train" else self.val
        return random_windows(data, f"{split} split of {self.name!r}", batch_size, context, generator)


@lru_cache(maxsize=2)
def synthetic_corpus(spec: SyntheticSpec) -> SyntheticCorpus:
    """The corpus of `spec`, made once per process."""
    return SyntheticCorpus(spec)


def zipf_exponent(tokens: torch.Tensor, vocab: int, ranks: tuple[int, int] = (10, 1000)) -> float:
    """The Zipf exponent of a token sample: minus the least-squares slope of log count against log
    rank over the ranks `ranks` (1-based, inclusive start, exclusive end) of the sorted counts."""
    counts = torch.bincount(tokens, minlength=vocab).double().sort(descending=True).values
    lo, hi = ranks
    r = torch.arange(lo, hi, dtype=torch.float64)
    x, y = r.log(), counts[lo - 1 : hi - 1].clamp_min(1).log()
    x, y = x - x.mean(), y - y.mean()
    return -float((x * y).sum() / (x * x).sum())


def sample_entropy(tokens: torch.Tensor, vocab: int) -> float:
    """Plug-in unigram entropy (nats) of a token sample."""
    counts = torch.bincount(tokens, minlength=vocab).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


__all__ = ["SyntheticCorpus", "SyntheticSpec", "sample_entropy", "synthetic_corpus", "zipf_exponent"]
