import pytest
import torch
from torch.utils.data import DataLoader

from toolkit.data import GlobalBatchSampler
from toolkit.errors import UserError

N, B = 103, 12  # 8 full global batches per epoch; 7 samples dropped


def _global_batches(
    world_size: int, *, epoch: int = 0, seed: int = 0, state: dict | None = None, shuffle: bool = True
) -> list[list[int]]:
    """The global batches of the rest of an epoch, reassembled from every rank's slices."""
    per_rank = []
    for rank in range(world_size):
        sampler = GlobalBatchSampler(
            N, global_batch_size=B, rank=rank, world_size=world_size, seed=seed, shuffle=shuffle
        )
        if state is not None:
            sampler.load_state_dict(state)
        else:
            sampler.set_epoch(epoch)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        local = B // world_size
        per_rank.append([indices[i : i + local] for i in range(0, len(indices), local)])
    return [sum(slices, []) for slices in zip(*per_rank)]


def test_union_of_ranks_is_world_size_independent() -> None:
    reference = _global_batches(1)
    assert len(reference) == N // B == GlobalBatchSampler(N, global_batch_size=B).steps_per_epoch
    flat = sum(reference, [])
    assert len(set(flat)) == len(flat) == (N // B) * B
    for world_size in (2, 4):
        assert _global_batches(world_size) == reference


def test_rank_slices_are_contiguous() -> None:
    order = list(GlobalBatchSampler(N, global_batch_size=B))
    rank1 = list(GlobalBatchSampler(N, global_batch_size=B, rank=1, world_size=4))
    assert rank1[:3] == order[3:6] and rank1[3:6] == order[15:18]


def test_epochs_differ_and_are_deterministic() -> None:
    e0, e1 = _global_batches(1, epoch=0), _global_batches(1, epoch=1)
    assert e0 != e1
    assert e1 == _global_batches(2, epoch=1)
    assert _global_batches(1, epoch=1, seed=1) != e1
    # seed 0 epoch 1 must not replay seed 1 epoch 0.
    assert _global_batches(1, epoch=0, seed=1) != e1
    unshuffled = GlobalBatchSampler(N, global_batch_size=B, shuffle=False)
    unshuffled.set_epoch(3)
    assert list(unshuffled) == list(range((N // B) * B))


@pytest.mark.parametrize("resume_world_size", [1, 2, 4])
def test_resume_continues_exactly(resume_world_size: int) -> None:
    full = _global_batches(1, epoch=2)
    # Save after 3 optimizer steps on 2 ranks, while a DataLoader had prefetched further.
    saved = []
    for rank in range(2):
        sampler = GlobalBatchSampler(N, global_batch_size=B, rank=rank, world_size=2)
        sampler.set_epoch(2)
        loader = iter(DataLoader(list(range(N)), sampler=sampler, batch_size=3))
        for _ in range(3):
            next(loader), next(loader)  # one global batch: two micro batches of 3 per rank
            sampler.advance()
        next(loader)  # read ahead, not trained on
        saved.append(sampler.state_dict())
    assert saved[0] == saved[1]
    assert saved[0]["epoch"] == 2 and saved[0]["consumed_global_batches"] == 3 and saved[0]["seed"] == 0

    resumed = _global_batches(resume_world_size, state=saved[0])
    assert resumed == full[3:]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_unshuffled_is_the_dataset_order_on_any_world_size(world_size: int) -> None:
    in_order = list(range((N // B) * B))  # the incomplete tail (7 samples) dropped, as when shuffled
    for epoch in (0, 3):
        assert sum(_global_batches(world_size, epoch=epoch, shuffle=False), []) == in_order
    # Rank 1 of 2 reads the second half of each global batch of consecutive samples.
    rank1 = list(GlobalBatchSampler(N, global_batch_size=B, rank=1, world_size=2, shuffle=False))
    assert rank1[:12] == [6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23]


@pytest.mark.parametrize("resume_world_size", [1, 2, 4])
def test_unshuffled_resume_continues_in_order(resume_world_size: int) -> None:
    sampler = GlobalBatchSampler(N, global_batch_size=B, rank=0, world_size=2, shuffle=False)
    sampler.set_epoch(1)
    sampler.advance(5)
    state = sampler.state_dict()
    assert state["shuffle"] is False
    resumed = _global_batches(resume_world_size, state=state, shuffle=False)
    assert sum(resumed, []) == list(range(5 * B, (N // B) * B))


def test_resuming_with_shuffle_changed_is_refused() -> None:
    shuffled = GlobalBatchSampler(N, global_batch_size=B).state_dict()
    with pytest.raises(UserError, match="saved with shuffle=true, but this run has shuffle=false"):
        GlobalBatchSampler(N, global_batch_size=B, shuffle=False).load_state_dict(shuffled)
    unshuffled = GlobalBatchSampler(N, global_batch_size=B, shuffle=False).state_dict()
    with pytest.raises(UserError, match="saved with shuffle=false, but this run has shuffle=true"):
        GlobalBatchSampler(N, global_batch_size=B).load_state_dict(unshuffled)
    # A checkpoint written before the key existed was shuffled: it resumes a shuffled run.
    del shuffled["shuffle"]
    GlobalBatchSampler(N, global_batch_size=B).load_state_dict(shuffled)


def test_len_tracks_advance_and_epoch_end() -> None:
    sampler = GlobalBatchSampler(N, global_batch_size=B, rank=0, world_size=2)
    assert len(sampler) == 8 * 6
    sampler.advance(2)
    assert len(sampler) == 6 * 6 and len(list(sampler)) == 6 * 6
    sampler.advance(6)
    assert len(sampler) == 0 and list(sampler) == []
    with pytest.raises(ValueError):
        sampler.advance()
    sampler.set_epoch(1)
    assert sampler.state_dict()["consumed_global_batches"] == 0 and len(sampler) == 8 * 6


def test_iteration_under_way_ignores_later_advance() -> None:
    sampler = GlobalBatchSampler(N, global_batch_size=B)
    expected = list(sampler)
    it = iter(sampler)
    sampler.advance(4)
    assert list(it) == expected


def test_bad_sizes() -> None:
    with pytest.raises(UserError, match="multiple of the number of data-parallel processes"):
        GlobalBatchSampler(N, global_batch_size=10, world_size=4)
    with pytest.raises(UserError, match="batch_size"):
        GlobalBatchSampler(N, global_batch_size=0)
    with pytest.raises(UserError, match="fewer than one global batch"):
        GlobalBatchSampler(5, global_batch_size=8)
    with pytest.raises(ValueError):
        GlobalBatchSampler(N, global_batch_size=B, rank=2, world_size=2)


def test_mismatched_state_is_rejected() -> None:
    state = GlobalBatchSampler(N, global_batch_size=B, seed=1).state_dict()
    with pytest.raises(UserError, match="seed=1"):
        GlobalBatchSampler(N, global_batch_size=B, seed=0).load_state_dict(state)
    with pytest.raises(UserError, match="batch_size=12"):
        GlobalBatchSampler(N, global_batch_size=24, seed=1).load_state_dict(state)
    sampler = GlobalBatchSampler(N, global_batch_size=B)
    with pytest.raises(UserError, match="outside"):
        sampler.load_state_dict({"epoch": 0, "consumed_global_batches": 9, "seed": 0})
    # The three documented keys suffice, and tensors (as a checkpoint may hold) are accepted.
    sampler.load_state_dict({"epoch": torch.tensor(1), "consumed_global_batches": torch.tensor(2), "seed": 0})
    assert sampler.epoch == 1 and sampler.consumed_global_batches == 2
