"""The synthetic Zipf language (`[data] synthetic`): its token frequencies follow the Zipf exponent
it was given, its entropies equal their closed forms, and a recipe trains on it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from stabkit.harness.data import SyntheticCorpus, SyntheticSpec, load_corpus
from stabkit.harness.data.synthetic import sample_entropy, zipf_exponent
from stabkit.harness.recipes import load_recipe
from stabkit.harness.recipes.results.measures import _sparse_bigram_loss, bigram_loss
from stabkit.harness.recipes.spec.errors import RecipeError


@pytest.mark.parametrize(
    "spec",
    [
        SyntheticSpec(vocab=8192, zipf=1.1, tokens=400_000),
        SyntheticSpec(vocab=16384, zipf=0.9, tokens=400_000, clusters=64, local=0.8, seed=3),
    ],
    ids=["v8k-s1.1", "v16k-s0.9"],
)
def test_zipf_exponent_and_entropies_match_the_parameters(spec: SyntheticSpec) -> None:
    corpus = SyntheticCorpus(spec)
    tokens = torch.cat([corpus.train, corpus.val])
    assert len(tokens) == spec.tokens and int(tokens.max()) < spec.vocab
    assert zipf_exponent(tokens, spec.vocab) == pytest.approx(spec.zipf, abs=0.03)
    # closed forms: unigram entropy H(p) of the Zipf law, and the entropy rate of the chain
    p = torch.arange(1, spec.vocab + 1, dtype=torch.float64).pow(-spec.zipf)
    p = p / p.sum()
    assert corpus.unigram_entropy() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-12)
    assert sample_entropy(tokens, spec.vocab) == pytest.approx(corpus.unigram_entropy(), abs=0.05)
    # the generator's own log-loss on its text: an unbiased estimate of the entropy rate
    empirical = -float(corpus.log_prob(tokens[:-1], tokens[1:]).mean())
    assert empirical == pytest.approx(corpus.entropy_rate(), rel=0.01)
    assert corpus.entropy_rate() < corpus.unigram_entropy() - 0.5  # the local structure is learnable


def test_the_rate_without_local_structure_is_the_unigram_entropy_and_by_hand_otherwise() -> None:
    flat = SyntheticCorpus(SyntheticSpec(vocab=512, tokens=20_000, local=0.0))
    assert flat.entropy_rate() == pytest.approx(flat.unigram_entropy(), rel=1e-12)
    tiny = SyntheticCorpus(SyntheticSpec(vocab=256, tokens=20_000, clusters=3, local=0.6, seed=1))
    rows = torch.arange(256)
    by_hand = 0.0
    for a in range(256):  # Σ_a p_a H(q(·|a)) with the (V,) rows written out
        q = (
            0.4 * tiny.marginal
            + 0.6 * tiny.marginal * (tiny.cluster == tiny.cluster[a]) / tiny.cluster_mass[tiny.cluster[a]]
        )
        assert float(q.sum()) == pytest.approx(1.0)
        assert torch.allclose(q.log()[rows], tiny.log_prob(torch.full((256,), a), rows))
        by_hand += float(tiny.marginal[a] * -(q * q.log()).sum())
    assert tiny.entropy_rate() == pytest.approx(by_hand, rel=1e-10)


def test_same_spec_same_text_and_rare_tokens_occur() -> None:
    spec = SyntheticSpec(vocab=8192, tokens=200_000, seed=5)
    a, b = SyntheticCorpus(spec), SyntheticCorpus(spec)
    assert torch.equal(a.train, b.train) and not torch.equal(
        a.train, SyntheticCorpus(SyntheticSpec(vocab=8192, tokens=200_000)).train
    )
    seen = torch.bincount(a.train, minlength=8192)
    assert (seen > 0).float().mean() > 0.6  # Wortsman's setting: rare tokens do occur
    x, y = a.batch("train", 4, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert load_corpus(spec) is load_corpus(spec)  # made once per process


def test_sparse_bigram_loss_equals_the_dense_one() -> None:
    corpus = load_corpus(None)
    assert _sparse_bigram_loss(corpus.train, corpus.val, 256) == pytest.approx(bigram_loss(None), rel=1e-9)
    spec = SyntheticSpec(vocab=1024, tokens=50_000)
    assert math.isfinite(bigram_loss(spec))


def test_a_recipe_trains_on_the_synthetic_language(tmp_path: Path) -> None:
    from stabkit.harness.recipes.run.worker import Job, run_job

    path = tmp_path / "zipf.toml"
    path.write_text(
        'name = "zipf"\ndescription = "d"\n[model]\nvocab_size = 1024\n'
        "[data]\nsynthetic = { vocab = 1024, tokens = 50000, zipf = 1.0 }\n"
        '[train]\nsteps = 6\n[variants.baseline]\ndescription = "b"\n'
    )
    recipe = load_recipe(path, "tiny")
    assert recipe.data == SyntheticSpec(vocab=1024, tokens=50_000, zipf=1.0)
    result = run_job(Job(recipe, "baseline", str(tmp_path / "out"))).to_dict()
    assert result["status"] == "done" and result["steps_done"] == 6
    path.write_text(path.read_text().replace("vocab_size = 1024", "vocab_size = 256"))
    with pytest.raises(RecipeError, match="vocab_size = 1024"):
        load_recipe(path, "tiny")
    path.write_text(path.read_text().replace("zipf = 1.0", "zipf = -1"))
    with pytest.raises(RecipeError, match="data.synthetic.zipf"):
        load_recipe(path, "tiny")
