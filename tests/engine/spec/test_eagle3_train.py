"""EAGLE-3 training's batched unroll (models/eagle3_train.py): a batch of right-padded sequences
of different lengths gives, at every training-time-test step, the same counted positions,
correct predictions and summed cross-entropy as the sequences one by one, and the same
gradients for the same summed loss."""

import torch

from atoll.models.eagle3_train import TrainHead, pad_batch

H, HEADS, KVH, D, VOCAB, DRAFT = 32, 4, 2, 8, 50, 20
CFG = {"hidden_size": H, "rms_norm_eps": 1e-6, "head_dim": D, "num_attention_heads": HEADS,
       "num_key_value_heads": KVH, "intermediate_size": 64, "rope_theta": 10000.0}
LENGTHS = [(11, 3), (5, 2), (8, 1)]  # (tokens, prompt length)
STEPS = 3


def _setup():
    torch.manual_seed(0)
    head = TrainHead(CFG, torch.ones(H), torch.randn(DRAFT, H) * 0.3)
    embed = torch.randn(VOCAB, H)
    to_draft = torch.full((VOCAB,), -1, dtype=torch.long)
    to_draft[torch.arange(0, 2 * DRAFT, 2)] = torch.arange(DRAFT)  # odd ids lie outside the draft vocabulary
    items = []
    for n, prompt in LENGTHS:
        weights = torch.zeros(n)
        weights[prompt - 1:] = 1.0
        items.append((torch.randint(0, VOCAB, (n,)), torch.randn(n, 3 * H), torch.randint(0, 2 * DRAFT, (n,)),
                      weights))
    return head, embed, to_draft, items


def test_batched_unroll_equals_one_by_one():
    head, embed, to_draft, items = _setup()
    batched_loss, batched = head.unroll(*pad_batch(items, embed, to_draft), STEPS)
    singles = [head.unroll(*pad_batch([item], embed, to_draft), STEPS)[1] for item in items]
    for k in range(STEPS):
        per_step = [s[k] for s in singles if k < len(s)]
        assert batched[k][0] == sum(c for c, _, _ in per_step)
        assert batched[k][1] == sum(n for _, n, _ in per_step) > 0
        assert abs(batched[k][2] - sum(ce for _, _, ce in per_step)) < 1e-4 * max(1.0, batched[k][2])
    assert torch.is_tensor(batched_loss) and batched_loss.requires_grad


def test_batched_gradients_equal_one_by_one():
    """The summed cross-entropy (each step weighted 0.8 ** k) has the same gradient either way."""
    head, embed, to_draft, items = _setup()

    def grads(batches):
        head.zero_grad()
        for batch in batches:
            loss, _ = head.unroll(*pad_batch(batch, embed, to_draft), STEPS, mean=False)
            loss.backward()
        return {n: p.grad.clone() for n, p in head.named_parameters()}

    together, apart = grads([items]), grads([[item] for item in items])
    for name, g in together.items():
        assert torch.allclose(g, apart[name], atol=1e-5, rtol=1e-4), name
