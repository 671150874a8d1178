import pytest
import torch

from kvserve.forward import SamplingBatch
from kvserve.model.sampler import ban_tokens, hash_uniform, sample


def params(n, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=-1):
    def full(v, dtype):
        return torch.full((n,), v, dtype=dtype)

    return SamplingBatch(full(temperature, torch.float32), full(top_k, torch.int32),
                         full(top_p, torch.float32), full(min_p, torch.float32),
                         full(seed, torch.int64), torch.zeros(n, dtype=torch.bool))


def logits(n=4, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_top_k_1_tiny_top_p_and_min_p_1_are_greedy():
    x = logits()
    pos = torch.arange(4)
    greedy = x.argmax(-1)
    for p in (params(4, temperature=0.0), params(4, top_k=1), params(4, top_p=1e-6),
              params(4, min_p=1.0)):
        assert torch.equal(sample(x, p, pos), greedy)


def test_seeded_rows_do_not_depend_on_the_batch():
    x = logits(n=6, vocab=1000)
    pos = torch.tensor([5, 9, 9, 12, 3, 7])
    seeds = torch.tensor([1, 2, 3, 4, 5, 6])
    p = SamplingBatch(torch.full((6,), 0.8), torch.full((6,), -1, dtype=torch.int32),
                      torch.full((6,), 0.95), torch.zeros(6), seeds,
                      torch.zeros(6, dtype=torch.bool))
    together = sample(x, p, pos)
    for i in range(6):
        alone = SamplingBatch(*(getattr(p, f)[i : i + 1] for f in p.__dataclass_fields__))
        assert sample(x[i : i + 1], alone, pos[i : i + 1]).item() == together[i].item()


def test_seeded_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    x = probs.log().expand(4000, 3).clone()
    p = params(4000, seed=7)
    tokens = sample(x, p, torch.arange(4000))  # a different position each row
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_top_k_and_top_p_restrict_the_support():
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(500, 5).clone()
    pos = torch.arange(500)
    assert set(sample(x, params(500, top_k=2, seed=1), pos).tolist()) <= {0, 1}
    # softmax: 0.64, 0.24, 0.09, ... top_p=0.8 keeps the first two
    assert set(sample(x, params(500, top_p=0.8, seed=1), pos).tolist()) == {0, 1}
    # min_p=0.2 keeps tokens with prob >= 0.2 * 0.64
    assert set(sample(x, params(500, min_p=0.2, seed=1), pos).tolist()) == {0, 1}


def test_hash_uniform_is_in_range_and_deterministic():
    u = hash_uniform(torch.tensor([0, 5]), torch.tensor([0, 100]), 4096)
    assert u.shape == (2, 4096) and float(u.min()) > 0 and float(u.max()) < 1
    assert torch.equal(u, hash_uniform(torch.tensor([0, 5]), torch.tensor([0, 100]), 4096))
    assert abs(float(u.mean()) - 0.5) < 0.02


@pytest.mark.parametrize("n", [1, 3])
def test_unseeded_rows_use_the_generator(n):
    x = torch.zeros(n, 1000)
    a = sample(x, params(n), torch.arange(n), torch.Generator().manual_seed(1))
    b = sample(x, params(n), torch.arange(n), torch.Generator().manual_seed(1))
    c = sample(x, params(n), torch.arange(n), torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_ban_tokens_masks_only_each_rows_listed_ids():
    x = torch.arange(18, dtype=torch.float32).view(3, 6)
    banned = torch.tensor([[5, 4], [5, -1], [-1, -1]])  # -1 is padding, not a token id
    masked = ban_tokens(x, banned)
    assert masked.argmax(-1).tolist() == [3, 4, 5]  # greedy takes the next best
    assert torch.isinf(masked).sum().item() == 3
    assert torch.equal(x, torch.arange(18, dtype=torch.float32).view(3, 6))  # not in place
    assert ban_tokens(x, None) is x
    for seed in range(20):  # sampling never picks a banned id either
        p = params(3, temperature=5.0, seed=seed)
        assert sample(masked, p, torch.arange(3)).tolist()[0] not in (4, 5)
