"""Packing documents into sequences of ``max_seq_len`` tokens without letting them see each other.

A packed sample is several documents laid end to end. Its ``input_pos`` restarts at 0 at each document, which
is all the model needs: rotary embeddings take positions from it, and :func:`packed_attention_mask` derives from
it a block-diagonal causal mask (:class:`toolkit.modules.DocumentMasks`: the same as FlexAttention block masks),
so every document is computed exactly as if it were alone. Labels are each document's own shifted labels, so the
label of a document's last token is the ignore index and no loss crosses a boundary.
"""

from bisect import bisect_left, insort

from toolkit.errors import UserError
# The masks a packed row needs are the attention's, a level below the data pipeline; re-exported for the data's users.
from toolkit.modules.masks import document_attention_mask, document_ids, packed_attention_mask  # noqa: F401

STRATEGIES: tuple[str, ...] = ("best_fit", "in_order")


def pack_documents(lengths: list[int], max_seq_len: int, *, strategy: str = "best_fit") -> list[list[int]]:
    """Groups documents into packs of at most ``max_seq_len`` tokens.

    Args:
        lengths: tokens per document; none may exceed ``max_seq_len``.
        max_seq_len: capacity of a pack.
        strategy: ``"best_fit"``: longest documents first, each into the fullest pack it fits (best-fit
            decreasing; on typical length mixes it leaves a pack or so more than the fewest possible);
            ``"in_order"``: documents in order, a new pack whenever the next one does not fit (next-fit).

    Returns:
        Document indices per pack; the order is deterministic (ties keep document order).
    """
    if strategy not in STRATEGIES:
        raise UserError(f"packing_strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    too_long = next((i for i, n in enumerate(lengths) if n > max_seq_len), None)
    if too_long is not None:
        raise ValueError(f"document {too_long} has {lengths[too_long]} tokens, more than {max_seq_len}")
    if strategy == "in_order":
        return _next_fit(lengths, max_seq_len)
    return _best_fit_decreasing(lengths, max_seq_len)


def _next_fit(lengths: list[int], max_seq_len: int) -> list[list[int]]:
    packs: list[list[int]] = []
    used = max_seq_len  # forces a first pack
    for i, n in enumerate(lengths):
        if used + n > max_seq_len:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += n
    return packs


def _best_fit_decreasing(lengths: list[int], max_seq_len: int) -> list[list[int]]:
    packs: list[list[int]] = []
    # Open packs by free space: `free` is the sorted list of free-space values that some open pack has, and
    # `by_free[f]` the packs with exactly f free tokens. A lookup is then a bisection, O(log max_seq_len),
    # instead of a scan over all packs.
    free: list[int] = []
    by_free: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep document order
        n = lengths[i]
        slot = bisect_left(free, n)
        if slot == len(free):
            pack, space = len(packs), max_seq_len
            packs.append([])
        else:
            space = free[slot]
            pack = by_free[space].pop()
            if not by_free[space]:
                del by_free[space]
                free.pop(slot)
        packs[pack].append(i)
        space -= n
        if space > 0:
            if space not in by_free:
                by_free[space] = []
                insort(free, space)
            by_free[space].append(pack)
    return packs
