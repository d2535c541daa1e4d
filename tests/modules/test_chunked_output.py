"""TransformerDecoder(num_output_chunks=n): the logits in sequence chunks, equal to the unchunked logits, tied or
untied, plain or wrapped in DDP/FSDP2.

Run as a script under torchrun, this file is the two-process worker of ``test_chunks_under_ddp_and_fsdp2``.
"""


import pytest
import torch

from tests.launch import run_workers
from toolkit.models.llama3 import llama3

DIMS = dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=64)
SEQ_LEN = 13  # prime: no chunk count above 1 divides it


def tiny_model(*, tied: bool, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return llama3(**DIMS, tie_word_embeddings=tied).to(dtype)


def batch(seed: int = 1, batch_size: int = 2) -> torch.Tensor:
    return torch.randint(0, DIMS["vocab_size"], (batch_size, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("num_chunks", [1, 3, 4, 8, SEQ_LEN, 20])
def test_chunks_concatenate_to_the_unchunked_logits(num_chunks, tied, dtype):
    model = tiny_model(tied=tied, dtype=dtype)
    tokens = batch()
    with torch.no_grad():
        logits = model(tokens)
        chunks = model(tokens, num_output_chunks=num_chunks)
    assert isinstance(logits, torch.Tensor)
    assert isinstance(chunks, list) and len(chunks) == num_chunks
    # torch.tensor_split's sizes: the first s % n chunks one longer; past the sequence's end, empty.
    expected = [SEQ_LEN // num_chunks + (i < SEQ_LEN % num_chunks) for i in range(num_chunks)]
    assert [c.shape[1] for c in chunks] == expected
    assert all(c.shape[0] == 2 and c.shape[2] == DIMS["vocab_size"] and c.dtype == dtype for c in chunks)
    # The same projection of fewer rows: equal up to the matmul's blocking (float rounding at most).
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(torch.cat(chunks, dim=1), logits, rtol=0, atol=atol)


def test_default_output_is_unchanged():
    model = tiny_model(tied=False)
    tokens = batch()
    with torch.no_grad():
        h = model.norm(model.layers[1](model.layers[0](model.embed_tokens(tokens))))
        assert torch.equal(model(tokens), model.output(h))


def test_tied_chunks_project_with_the_embedding():
    model = tiny_model(tied=True)
    assert model.output is None
    with torch.no_grad():
        model.embed_tokens.weight.zero_()
        chunks = model(batch(), num_output_chunks=3)
    assert all(torch.count_nonzero(c) == 0 for c in chunks)


def test_no_chunk_count_below_one():
    with pytest.raises(ValueError, match="num_output_chunks must be at least 1"):
        tiny_model(tied=False)(batch(), num_output_chunks=0)


@pytest.mark.slow
def test_chunks_under_ddp_and_fsdp2():
    # Each rank checks the wrapped model's chunked loss and gradients against the plain model's unchunked ones on
    # the whole global batch.
    result = run_workers(__file__, timeout_s=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("ok") == 4, result.stdout


def _check_wrapped(strategy: str) -> None:
    """One rank's share: half the global batch, through ``strategy``, with a chunked loss."""
    import torch.distributed as dist

    from toolkit.parallel import apply_data_parallel, parallel_dims
    from toolkit.modules.loss import chunked_cross_entropy_sum, cross_entropy_sum

    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = batch(batch_size=2 * world)
    labels = batch(seed=2, batch_size=2 * world)
    labels[:, -3:] = -100
    num_tokens = int((labels != -100).sum())

    reference = tiny_model(tied=True)
    cross_entropy_sum(reference(tokens), labels).div(num_tokens).backward()

    model = tiny_model(tied=True)
    dims = parallel_dims(strategy=strategy, world_size=world, local_world_size=world, device_type="cpu")
    model = apply_data_parallel(model, dims=dims, device=torch.device("cpu"))
    mine = slice(2 * rank, 2 * rank + 2)
    chunks = model(tokens[mine], num_output_chunks=4)
    # Gradient reduction averages over ranks: scale by the world size, as toolkit.training.gradient_scale does.
    (chunked_cross_entropy_sum(chunks, labels[mine]) * world / num_tokens).backward()

    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        torch.testing.assert_close(grad, ref.grad, rtol=1e-4, atol=1e-6, msg=f"{strategy}: {name}")
    print(f"{strategy} ok", flush=True)


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for strategy in ("ddp", "zero3"):
        _check_wrapped(strategy)
    dist.destroy_process_group()
