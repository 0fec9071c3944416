import torch

from megatron_lora.data import PackedDataset, Sample, pack_samples
from megatron_lora.data.packing import inputs_labels_mask


def _samples():
    return [Sample([1, 2, 3], [0, 1, 1]), Sample([4, 5], [1, 1]), Sample([6, 7, 8, 9], [1, 1, 1, 1])]


def test_packing_keeps_samples_whole_and_pads():
    rows = pack_samples(_samples(), seq_length=5, pad_id=0)  # rows of 6 tokens
    assert rows.tokens.tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    assert rows.sample_ids.tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]


def test_loss_and_attention_never_cross_a_sample_boundary():
    rows = pack_samples(_samples(), seq_length=5, pad_id=0)
    inputs, labels, loss_mask, attn = inputs_labels_mask(rows.tokens, rows.targets, rows.sample_ids)
    assert inputs[0].tolist() == [1, 2, 3, 4, 5] and labels[0].tolist() == [2, 3, 4, 5, 0]
    # 1->2, 2->3 train; 3->4 crosses into sample 1; 4->5 trains; 5->pad does not.
    assert loss_mask[0].tolist() == [1, 1, 0, 1, 0]
    allowed = ~attn[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                             [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_batches_are_deterministic_and_addressed_by_consumed_samples():
    rows = pack_samples([Sample([i, i + 1], [1, 1]) for i in range(0, 40, 2)], seq_length=3, pad_id=0)
    a, b = PackedDataset(rows, seed=3), PackedDataset(rows, seed=3)
    stream = torch.cat([a.batch(k * 4, 4).tokens for k in range(6)])  # crosses an epoch (10 rows)
    again = torch.cat([b.batch(k * 4, 4).tokens for k in (3, 4, 5)])
    assert torch.equal(stream[12:], again)
    first_epoch = stream[:10]
    assert sorted(first_epoch[:, 0].tolist()) == sorted(rows.tokens[:, 0].tolist())
    assert not torch.equal(PackedDataset(rows, seed=4).batch(0, 4).tokens, stream[:4])
