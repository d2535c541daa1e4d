import pytest
import torch

from toolkit.data import padded_collate


def _batch() -> list[dict]:
    return [
        {"tokens": [1, 2, 3], "labels": [2, 3, -100]},
        {"tokens": [4, 5, 6, 7, 8], "labels": [-100, 6, 7, 8, -100]},
    ]


def test_right_pads_to_longest() -> None:
    out = padded_collate(_batch(), pad_id=0)
    assert out["tokens"].dtype == torch.long and out["labels"].dtype == torch.long
    assert out["tokens"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert out["labels"].tolist() == [[2, 3, -100, -100, -100], [-100, 6, 7, 8, -100]]


def test_pad_to_multiple_of() -> None:
    out = padded_collate(_batch(), pad_id=9, ignore_index=-1, pad_to_multiple_of=4)
    assert out["tokens"].shape == (2, 8) and out["labels"].shape == (2, 8)
    assert out["tokens"][0].tolist() == [1, 2, 3] + [9] * 5
    assert out["labels"][1].tolist() == [-100, 6, 7, 8, -100] + [-1] * 3
    # Already a multiple: unchanged.
    assert padded_collate(_batch(), pad_id=0, pad_to_multiple_of=5)["tokens"].shape == (2, 5)


def test_bad_batches() -> None:
    with pytest.raises(ValueError, match="empty"):
        padded_collate([], pad_id=0)
    with pytest.raises(ValueError, match="sample 0"):
        padded_collate([{"tokens": [1, 2], "labels": [1]}], pad_id=0)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        padded_collate(_batch(), pad_id=0, pad_to_multiple_of=0)


def test_packed_batches_are_padded_to_the_pack_size_and_unpacked_ones_are_not() -> None:
    packed = padded_collate(
        [{"tokens": [5, 6, 7], "labels": [6, 7, -100], "input_pos": [0, 1, 0]}], pad_id=0, pack_to=6,
        attention_mask=False,
    )
    assert packed["tokens"].tolist() == [[5, 6, 7, 0, 0, 0]] and "mask" not in packed
    assert packed["labels"].tolist() == [[6, 7, -100, -100, -100, -100]]
    assert packed["input_pos"].tolist() == [[0, 1, 0, 0, 1, 2]]  # the padding is a document of its own
    unpacked = padded_collate([{"tokens": [5, 6, 7], "labels": [6, 7, -100]}], pad_id=0, pack_to=6)
    assert unpacked["tokens"].shape == (1, 3)


def test_batches_pad_to_the_shortest_given_length_that_holds_them() -> None:
    # A model compiled for static shapes (tensor parallelism) sees only the lengths static_lengths gives.
    assert padded_collate(_batch(), pad_id=0, lengths=[4, 6, 8])["tokens"].shape == (2, 6)
    assert padded_collate(_batch(), pad_id=0, lengths=[5, 8])["tokens"].shape == (2, 5)
    # Longer than every length: its own, rounded up to the multiple.
    assert padded_collate(_batch(), pad_id=0, lengths=[2, 4], pad_to_multiple_of=2)["tokens"].shape == (2, 6)
    out = padded_collate(_batch(), pad_id=0, lengths=[8])
    assert out["labels"][0].tolist() == [2, 3] + [-100] * 6 and out["lengths"].tolist() == [3, 5]
