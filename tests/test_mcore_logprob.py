"""Vocab-parallel log-prob/entropy math, single process (TP=1): against torch.log_softmax and autograd.

The TP=2 collectives are checked in test_mcore_parity.py (multi-process).
"""

from __future__ import annotations

import pytest
import torch

from megatron_workers.logprob import (
    _VocabParallelLogProbEntropy,
    left_justify,
    unpack_next_token,
    vocab_parallel_logprobs_entropy,
)


def _reference(logits, labels, real_vocab, temperature=1.0):
    logp = torch.log_softmax(logits[..., :real_vocab].double() / temperature, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_matches_log_softmax_and_ignores_padded_vocab():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 256, generator=gen) * 3
    logits[..., 200:] = 50.0  # padding rows with huge logits: must get no probability mass
    labels = torch.randint(0, 200, (3, 5), generator=gen)
    lp, ent = vocab_parallel_logprobs_entropy(logits, labels, real_vocab_size=200, temperature=0.7)
    ref_lp, ref_ent = _reference(logits, labels, 200, temperature=0.7)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)


def test_gradient_matches_autograd_reference():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 160, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    labels = torch.randint(0, 150, (2, 4), generator=gen)
    w_lp, w_ent = torch.randn(2, 4, generator=gen, dtype=torch.float64), torch.randn(2, 4, generator=gen,
                                                                                       dtype=torch.float64)
    lp, ent = vocab_parallel_logprobs_entropy(logits, labels, real_vocab_size=150)
    (lp * w_lp + ent * w_ent).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref_lp, ref_ent = _reference(logits, labels, 150)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    assert torch.allclose(ours, logits.grad, atol=1e-10)
    assert not ours[..., 150:].any()  # padded vocab gets no gradient


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 10, (2, 3), generator=gen)
    fn = lambda x: _VocabParallelLogProbEntropy.apply(x, labels, 0, 10, None, True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits,))


def test_without_entropy_gives_zeros_and_same_logprob():
    logits = torch.randn(2, 3, 20)
    labels = torch.randint(0, 20, (2, 3))
    lp1, ent1 = vocab_parallel_logprobs_entropy(logits, labels, 20, compute_entropy=False)
    lp2, _ = vocab_parallel_logprobs_entropy(logits, labels, 20)
    assert torch.equal(lp1, lp2) and not ent1.any()


def test_left_justify_and_unpack():
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 0, 0, 0], [0, 3, 4, 0, 0]])
    mask = (ids != 0).long()
    packed, pmask, index = left_justify(ids, mask, multiple=2)
    assert packed.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [3, 4, 0, 0]]  # width 3 rounded up to 4
    assert pmask.long().tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    # value j belongs to packed token j+1; encode it as 10*original_column of that token
    values = torch.gather(index, 1, torch.arange(1, 4).expand(3, 3)).float() * 10
    out = unpack_next_token(values, pmask, index, seq_len=5)
    # out[:, k-1] is the value for original token k; zero where token k is padding or first valid
    assert out.tolist() == [[0, 0, 30, 40], [10, 0, 0, 0], [0, 20, 0, 0]]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
