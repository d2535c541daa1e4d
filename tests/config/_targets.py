"""Tiny callables that test configs point ``_component_`` at."""

from __future__ import annotations

from typing import Any, Literal


def point(x: int, y: int = 0) -> dict[str, int]:
    return {"x": x, "y": y}


class Box:
    def __init__(self, item: Any = None, size: int = 1, tags: list[str] | None = None) -> None:
        self.item = item
        self.size = size
        self.tags = tags


def pair(first: Any, second: Any = None) -> tuple[Any, Any]:
    return first, second


def collect(*items: Any, **named: Any) -> dict[str, Any]:
    return {"items": items, "named": named}


def with_tokenizer(tokenizer: Any, max_seq_len: int = 8) -> dict[str, Any]:
    return {"tokenizer": tokenizer, "max_seq_len": max_seq_len}


def raises_inside(x: int = 1) -> None:
    raise TypeError("a bug inside the callable")


def spacer(*, width: int, fill: str = " ") -> str:
    return fill * width


def fake_optimizer(params: Any, lr: float, momentum: float = 0.0) -> dict[str, Any]:
    return {"params": params, "lr": lr, "momentum": momentum}


def schedule(optimizer: Any, total_steps: int, warmup_steps: int = 0) -> tuple[Any, int, int]:
    return optimizer, total_steps, warmup_steps


def typed(
    count: int = 1,
    rate: float = 0.5,
    flag: bool = False,
    name: str = "a",
    limit: int | None = None,
    mode: Literal["fast", "slow"] = "fast",
    anything: Any = None,
) -> dict[str, Any]:
    return {"count": count, "rate": rate, "flag": flag, "name": name, "limit": limit, "mode": mode}
