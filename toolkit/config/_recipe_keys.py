"""The top-level config keys a recipe reads, found in the recipe file itself (there is no list to keep in sync).

Only recipes read the config (toolkit functions take keyword arguments), so the keys a recipe file reads as
``cfg.<key>``, ``cfg.get("<key>")``, ``cfg["<key>"]`` or ``"<key>" in cfg`` are every top-level key that has an
effect. An override that creates a key the config does not have and the recipe never reads is a typo
(``batch_sze=64``) that would otherwise be ignored without a word.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# DictConfig's own methods: `cfg.get(...)` reads the key passed to it, `cfg.items()` reads no particular one.
_METHODS = frozenset({"get", "keys", "items", "values", "pop", "setdefault", "copy", "merge_with", "update"})
_CONFIG_NAME = "cfg"


@dataclass(frozen=True)
class RecipeKeys:
    """What a recipe file reads from its config.

    Attributes:
        recipe: the recipe's name, for messages.
        reads: every top-level key the recipe reads.
        required: the keys it reads only as ``cfg.<key>`` (never with ``get`` or ``in``): a config without
            them fails at run time.
    """

    recipe: str
    reads: frozenset[str]
    required: frozenset[str]


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def recipe_keys(path: str | Path) -> RecipeKeys | None:
    """The top-level keys the recipe file ``path`` reads from ``cfg``.

    Returns:
        None when the file cannot be read or parsed, or reads keys it names only at run time
        (``cfg[name]``, ``cfg.get(name)``, ``getattr(cfg, ...)``): then nothing can be said.
    """
    path = Path(path)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    attribute: set[str] = set()
    optional: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == _CONFIG_NAME:
            if node.attr not in _METHODS:
                attribute.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if isinstance(func.value, ast.Name) and func.value.id == _CONFIG_NAME and func.attr in ("get", "pop"):
                key = _literal(node.args[0]) if node.args else None
                if key is None:
                    return None
                optional.add(key)
            elif isinstance(func, ast.Attribute) and func.attr == "select":
                return None  # OmegaConf.select(cfg, "a.b"): read by a path string
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == _CONFIG_NAME:
            key = _literal(node.slice)
            if key is None:
                return None
            attribute.add(key)
        elif isinstance(node, ast.Compare) and any(
            isinstance(c, ast.Name) and c.id == _CONFIG_NAME for c in node.comparators
        ):
            key = _literal(node.left)
            if key is None:
                return None
            optional.add(key)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == _CONFIG_NAME:
                return None
    return RecipeKeys(recipe=path.stem, reads=frozenset(attribute | optional), required=frozenset(attribute - optional))
