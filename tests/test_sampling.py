"""The accept rule (`sampling.accept_draft`) is exact: under sampling the emitted tokens follow the target's
distribution whatever the draft's, checked with chi-square tests on a 6-token vocabulary; under greedy a draft
token is accepted iff it is the target's argmax. Seeds are fixed, so every run draws the same samples."""

from __future__ import annotations

import pytest
import torch

from trtspec.contract import SamplingParams
from trtspec.engine.sampling import accept_draft, probabilities, select

V = 6
N = 20_000
# chi-square critical values at p = 0.001 by degrees of freedom (checked against the regularized gamma function)
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 35: 66.619}

SAMPLE = SamplingParams(temperature=1.0, top_p=1.0)  # top_k 0 and top_p 0 would be greedy, as in TensorRT-LLM
P_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5])  # the target's logits at position 0
Q_LOGITS = torch.tensor([0.0, 1.5, 1.0, 2.0, -1.0, 0.0])  # the draft's: a quite different distribution
BONUS_LOGITS = torch.tensor([0.0, 0.3, -0.2, 0.9, 0.1, -0.4])


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom over the cells with expected mass (none may be seen
    outside them)."""
    counts, expected_probs = counts.flatten().double(), expected_probs.flatten().double()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"tokens drawn outside the support: {counts[~support].tolist()}"
    expected = expected_probs[support] / expected_probs[support].sum() * counts.sum()
    assert expected.min() >= 5, "too few samples per cell for the chi-square approximation"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def assert_distributed_as(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    stat, df = chi_square(counts, expected_probs)
    assert stat < CHI2_CRITICAL_0_001[df], (
        f"chi-square {stat:.1f} >= {CHI2_CRITICAL_0_001[df]} (df {df}): {counts.tolist()}"
    )
    return stat


def assert_rate(hits: int, n: int, p: float) -> None:
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(hits / n - p) < 4.5 * sigma, f"rate {hits / n:.4f}, expected {p:.4f} ± {4.5 * sigma:.4f}"


# ---- modified rejection sampling (draft logits given) ---------------------------------------------------------


def test_first_token_follows_the_target_with_draft_logits():
    p, q = probabilities(P_LOGITS, SAMPLE), probabilities(Q_LOGITS, SAMPLE)
    target_logits = torch.stack([P_LOGITS, BONUS_LOGITS])
    draft_gen, accept_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    drafts = torch.multinomial(q, N, replacement=True, generator=draft_gen).tolist()
    first, bonus = torch.zeros(V), torch.zeros(V)
    accepted = 0
    for d in drafts:
        n_acc, emitted = accept_draft(
            target_logits, [d], params=SAMPLE, draft_logits=Q_LOGITS[None], generator=accept_gen
        )
        assert n_acc in (0, 1) and len(emitted) == n_acc + 1
        assert emitted[:n_acc] == [d][:n_acc]
        first[emitted[0]] += 1
        if n_acc:
            accepted += 1
            bonus[emitted[1]] += 1
    assert_distributed_as(first, p)
    assert_distributed_as(bonus, probabilities(BONUS_LOGITS, SAMPLE))  # after full acceptance: a token from p_k
    assert_rate(accepted, N, float(torch.minimum(p, q).sum()))  # P(accept) = sum min(p, q) = 1 - TV(p, q)
    # the test has power: the draft's own distribution is rejected by a wide margin
    stat, df = chi_square(first, q)
    assert stat > 50 * CHI2_CRITICAL_0_001[df]


def test_two_positions_follow_the_targets_joint_distribution():
    """k=2 with position-1 distributions that depend on the token at position 0 (as a real model's do).
    The first two tokens of the sequence (completed by the target when the verify step stops after one)
    must be distributed as p0(x) * p1(y | x): 36 cells, 35 degrees of freedom."""
    gen = torch.Generator().manual_seed(3)
    p1_logits = torch.randn(V, V, generator=gen) * 1.5  # target's logits at position 1 given token x at 0
    q1_logits = torch.randn(V, V, generator=gen) * 1.5  # draft's
    p0, q0 = probabilities(P_LOGITS, SAMPLE), probabilities(Q_LOGITS, SAMPLE)
    p1, q1 = probabilities(p1_logits, SAMPLE), probabilities(q1_logits, SAMPLE)
    draft_gen, accept_gen = torch.Generator().manual_seed(4), torch.Generator().manual_seed(5)
    d0s = torch.multinomial(q0, N, replacement=True, generator=draft_gen)
    d1s = torch.multinomial(q1[d0s], 1, generator=draft_gen)[:, 0]  # d1 ~ q1(. | d0)
    target_logits = [torch.stack([P_LOGITS, p1_logits[x], BONUS_LOGITS]) for x in range(V)]
    draft_logits = [torch.stack([Q_LOGITS, q1_logits[x]]) for x in range(V)]
    next_step = torch.multinomial(p1, N, replacement=True, generator=draft_gen)  # [V, N]: p1(. | x) draws
    joint = torch.zeros(V, V)
    second_given_accept = torch.zeros(V)
    expected_given_accept = torch.zeros(V)
    emitted_lengths = torch.zeros(4)
    for i, (d0, d1) in enumerate(zip(d0s.tolist(), d1s.tolist())):
        n_acc, emitted = accept_draft(
            target_logits[d0], [d0, d1], params=SAMPLE, draft_logits=draft_logits[d0], generator=accept_gen
        )
        assert emitted[:n_acc] == [d0, d1][:n_acc] and len(emitted) == n_acc + 1
        emitted_lengths[len(emitted)] += 1
        if len(emitted) >= 2:  # position 0 accepted: position 1 came from this verify step
            second_given_accept[emitted[1]] += 1
            expected_given_accept += p1[d0]  # this sample's conditional distribution, p1(. | d0)
            second = emitted[1]
        else:  # rejected at 0: the next step samples position 1 from the target given the corrected token
            second = int(next_step[emitted[0], i])
        joint[emitted[0], second] += 1
    assert_distributed_as(joint, p0[:, None] * p1)
    assert_distributed_as(second_given_accept, expected_given_accept)
    assert emitted_lengths[1:].sum() == N and emitted_lengths[3] > 0  # some steps accepted both


# ---- token matching under sampling (no draft logits) ---------------------------------------------------------


def test_token_matching_under_sampling_follows_the_target():
    p, q = probabilities(P_LOGITS, SAMPLE), probabilities(Q_LOGITS, SAMPLE)
    target_logits = torch.stack([P_LOGITS, BONUS_LOGITS])
    draft_gen, accept_gen = torch.Generator().manual_seed(6), torch.Generator().manual_seed(7)
    drafts = torch.multinomial(q, N // 2, replacement=True, generator=draft_gen).tolist()
    first = torch.zeros(V)
    accepted = 0
    for d in drafts:
        n_acc, emitted = accept_draft(target_logits, [d], params=SAMPLE, generator=accept_gen)
        assert len(emitted) == n_acc + 1 and (n_acc == 0 or emitted[0] == d)
        assert n_acc == 1 or emitted[0] != d  # a rejection emits the target's own, different, token
        first[emitted[0]] += 1
        accepted += n_acc
    assert_distributed_as(first, p)
    assert_rate(accepted, N // 2, float((p * q).sum()))  # accepted iff the target's own sample equals the draft's


# ---- filtered distributions (top-k, top-p) --------------------------------------------------------------------


def test_rejection_sampling_with_top_k_top_p_follows_the_filtered_target():
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    p, q = probabilities(P_LOGITS, params), probabilities(Q_LOGITS, params)
    assert int((p > 0).sum()) == 3 and int((q > 0).sum()) == 3  # both filtered, to different supports
    assert not torch.equal(p > 0, q > 0)
    target_logits = torch.stack([P_LOGITS, BONUS_LOGITS])
    draft_gen, accept_gen = torch.Generator().manual_seed(8), torch.Generator().manual_seed(9)
    drafts = torch.multinomial(q, N // 4, replacement=True, generator=draft_gen).tolist()
    first = torch.zeros(V)
    for d in drafts:
        _, emitted = accept_draft(target_logits, [d], params=params, draft_logits=Q_LOGITS[None], generator=accept_gen)
        first[emitted[0]] += 1
    assert_distributed_as(first, p)  # also: nothing outside the target's support


def test_draft_token_the_target_cannot_produce_is_never_accepted():
    """A drafted token outside both filtered supports (q = 0 and p = 0: the drafter sampled under other
    settings) must be rejected; accepting it would emit a token the target can never produce."""
    params = SamplingParams(temperature=1.0, top_k=2)
    p, q = probabilities(P_LOGITS, params), probabilities(Q_LOGITS, params)
    outside = 4  # the lowest logit in both
    assert p[outside] == 0 and q[outside] == 0
    target_logits = torch.stack([P_LOGITS, BONUS_LOGITS])
    gen = torch.Generator().manual_seed(10)
    counts = torch.zeros(V)
    for _ in range(500):
        n_acc, emitted = accept_draft(
            target_logits, [outside], params=params, draft_logits=Q_LOGITS[None], generator=gen
        )
        assert n_acc == 0 and emitted[0] != outside
        counts[emitted[0]] += 1
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(p).flatten().tolist())


def test_probabilities_support():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()
    order = [1, 3, 4, 2, 0]  # by probability
    params = lambda **kw: SamplingParams(**{"temperature": 1.0, "top_p": 1.0, **kw})  # noqa: E731
    torch.testing.assert_close(probabilities(logits, params()), probs)
    for k in range(1, 6):
        got = probabilities(logits, params(top_k=k))
        kept = sorted(order[:k])
        assert torch.nonzero(got).flatten().tolist() == kept
        torch.testing.assert_close(got[kept], probs[kept] / probs[kept].sum())
    # top-p keeps the smallest prefix (by probability) whose mass reaches top_p
    for top_p, n_kept in [(0.3, 1), (0.45, 2), (0.69, 2), (0.75, 3), (0.9, 4), (0.97, 5), (0.0, 5), (1.0, 5)]:
        got = probabilities(logits, params(top_p=top_p))
        kept = sorted(order[:n_kept])
        assert torch.nonzero(got).flatten().tolist() == kept, top_p
        torch.testing.assert_close(got[kept], probs[kept] / probs[kept].sum())
    # top-k first, then top-p on what is left: top-3 renormalized is [0.4, 0.3, 0.15] / 0.85
    got = probabilities(logits, params(top_k=3, top_p=0.6))
    assert torch.nonzero(got).flatten().tolist() == [1, 3]
    # temperature divides the logits; rows of a [k, V] batch are filtered independently
    torch.testing.assert_close(probabilities(logits, SamplingParams(temperature=2.0)), torch.softmax(logits / 2, -1))
    batch = torch.stack([logits, logits.roll(1)])
    got = probabilities(batch, params(top_k=2))
    assert torch.nonzero(got[0]).flatten().tolist() == [1, 3]
    assert torch.nonzero(got[1]).flatten().tolist() == [2, 4]


def test_select_samples_from_the_filtered_distribution():
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    gen = torch.Generator().manual_seed(11)
    counts = torch.zeros(V)
    for _ in range(N // 4):
        counts[select(P_LOGITS, params, gen)] += 1
    assert_distributed_as(counts, probabilities(P_LOGITS, params))


# ---- greedy ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=0.7)],
    ids=["t0", "topk1", "topk0-topp0"],
)
def test_greedy_accepts_iff_the_argmax_matches(params):
    assert params.greedy
    gen = torch.Generator().manual_seed(12)
    k = 4
    for trial in range(50):
        logits = torch.randn(k + 1, 50, generator=gen)
        best = logits.argmax(-1).tolist()
        m = trial % (k + 1)
        draft = best[:k]
        if m < k:
            draft[m] = (draft[m] + 1 + trial) % 50  # anything but the argmax
        for draft_logits in (None, torch.randn(k, 50, generator=gen)):  # draft logits do not matter under greedy
            n_acc, emitted = accept_draft(logits, draft, params=params, draft_logits=draft_logits)
            assert n_acc == m
            assert emitted == best[: m + 1]
    assert accept_draft(torch.tensor([[0.0, 1.0]]), [], params=params) == (0, [1])  # no draft: one token


def test_greedy_select_is_torch_argmax_ties_and_nan_included():
    """Greedy picks as torch.argmax does (the first of the largest; a NaN wins) in every dtype and layout it gets."""
    gen = torch.Generator().manual_seed(13)
    rows = [
        torch.randn(49152, generator=gen),
        torch.tensor([1.0, 3.0, 3.0, -2.0]),
        torch.tensor([0.0, float("nan"), 5.0]),
    ]
    rows += [torch.randn(2, 300, generator=gen)[:, 7], torch.randn(300, generator=gen).bfloat16()]
    for row in rows:
        assert select(row, SamplingParams(), None) == int(torch.argmax(row))
