"""The lean forward pieces: chunked completion log-probs/entropies and the image-sharing plan, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from visionrl.models.sequences import share_plan
from visionrl.train.forward import completion_stats


def _identity_head(vocab: int) -> torch.nn.Linear:
    head = torch.nn.Linear(vocab, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(vocab))
    return head


@pytest.mark.parametrize("chunk", [0, 1, 2, 100])
def test_completion_stats_by_hand(chunk: int) -> None:
    # Vocab 3, identity lm_head: the hidden state IS the logit vector. Prompt length P=2, completion T=2:
    # the logit of completion token t sits at position P-1+t = 1+t.
    hidden = torch.zeros(2, 4, 3, dtype=torch.float64)
    hidden[0, 1] = torch.tensor([0.0, 0.0, 0.0])  # uniform: log-prob -ln 3, entropy ln 3
    hidden[0, 2] = torch.tensor([math.log(2.0), 0.0, -1e9])  # token 2 forbidden-like: p = (2/3, 1/3, 0)
    hidden[1, 1] = torch.tensor([1.0, 2.0, 3.0])
    hidden[1, 2] = torch.tensor([5.0, 5.0, 5.0])  # row 1 token 1 is padding: must come out 0
    ids = torch.tensor([[1, 0], [2, 0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    lp, ent = completion_stats(
        hidden,
        _identity_head(3).double(),
        ids,
        mask,
        torch.tensor([2, 2]),
        temperature=1.0,
        forbidden=torch.tensor([]),
        chunk_tokens=chunk,
    )
    z = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    want_lp = torch.tensor([[-math.log(3), math.log(2 / 3)], [3 - z, 0.0]], dtype=torch.float64)
    p = torch.tensor([math.exp(1 - z), math.exp(2 - z), math.exp(3 - z)])
    h_row1 = float(-(p * p.log()).sum())
    h_two_thirds = -(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3)
    want_ent = torch.tensor([[math.log(3), h_two_thirds], [h_row1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent.double(), want_ent, rtol=0, atol=1e-6)


def test_completion_stats_temperature_and_gradient_through_chunks() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 6, 5, requires_grad=True)
    head = torch.nn.Linear(5, 7, bias=False)
    ids = torch.randint(0, 7, (3, 3))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 fully masked
    forbidden = torch.tensor([6])
    grads, values = [], []
    for chunk in (0, 2):
        lp, _ = completion_stats(
            hidden,
            head,
            ids,
            mask,
            torch.tensor([3, 3, 3]),
            temperature=0.5,
            forbidden=forbidden,
            chunk_tokens=chunk,
        )
        (g,) = torch.autograd.grad(lp.sum(), hidden)
        grads.append(g)
        values.append(lp.detach())
    # reference: full logits / temperature, forbidden token removed, log-softmax at the ids
    logits = head(hidden[:, 2:5]).float() / 0.5
    logits[..., 6] = -1e9
    ref = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1) * mask
    torch.testing.assert_close(values[0], ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(values[1], values[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)
    assert values[0][2].abs().sum() == 0 and grads[0][2].abs().sum() == 0  # the masked row takes no part


@pytest.mark.parametrize("chunk", [0, 2])
def test_entropy_carries_a_gradient_only_when_it_is_trained(chunk: int) -> None:
    torch.manual_seed(1)
    hidden = torch.randn(2, 5, 4, requires_grad=True)
    head = torch.nn.Linear(4, 6, bias=False)
    ids, mask, starts = torch.randint(0, 6, (2, 3)), torch.ones(2, 3), torch.tensor([2, 2])
    kw = {"temperature": 1.0, "forbidden": torch.tensor([]), "chunk_tokens": chunk}
    lp, ent = completion_stats(hidden, head, ids, mask, starts, entropy_grad=False, **kw)
    lp_t, ent_t = completion_stats(hidden, head, ids, mask, starts, entropy_grad=True, **kw)
    assert lp.requires_grad and not ent.requires_grad and ent_t.requires_grad
    torch.testing.assert_close(ent, ent_t.detach(), rtol=0, atol=0)  # the same value, reported
    torch.testing.assert_close(lp, lp_t, rtol=0, atol=0)
    assert ent.min() > 0 and ent.max() < math.log(6)
    (g,) = torch.autograd.grad(ent_t.sum(), hidden)
    assert g.abs().sum() > 0  # trained: the bonus has a gradient


def test_share_plan_maps_every_image_token_to_its_encoded_copy() -> None:
    # Two distinct prompts: A with one 1x4x4 grid (4 merged tokens at merge 2), B with one 1x2x4 grid (2 tokens).
    # Rows use images A, A, B, A: the encoded tokens are A = [0..3], B = [4, 5].
    grid_a, grid_b = torch.tensor([[1, 4, 4]]), torch.tensor([[1, 2, 4]])
    plan = share_plan([grid_a, grid_b], sources=[0, 0, 1, 0], merge=2)
    assert plan is not None
    assert plan.unique_grid_thw.tolist() == [[1, 4, 4], [1, 2, 4]]
    assert plan.token_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert share_plan([grid_a, grid_b], sources=[0, 1], merge=2) is None  # nothing repeats: no plan
