"""The top-level config keys a recipe reads, found in the recipe file itself (there is no list to keep in sync).

Only recipes read the config (toolkit functions take keyword arguments), so the keys a recipe file reads as
``cfg.<key>``, ``cfg.get("<key>")``, ``cfg["<key>"]`` or ``"<key>" in cfg`` are every top-level key that has an
effect. An override that creates a key the config does not have and the recipe never reads is a typo
(``batch_sze=64``) that would otherwise be ignored without a word.

The one exception is the recipes' own set-up (:mod:`toolkit.recipe_setup`), which the recipes hand ``cfg`` to
whole: a function imported from ``toolkit`` and called with ``cfg`` is read too (its parameter named ``cfg``, by the
same rules, and the functions it hands ``cfg`` on to), so what a recipe reads through it counts as the recipe's.
"""

from __future__ import annotations

import ast
import functools
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


# The package whose functions a recipe may hand `cfg` to (toolkit/config/_recipe_keys.py -> toolkit/).
_TOOLKIT = Path(__file__).resolve().parents[1]


def recipe_keys(path: str | Path) -> RecipeKeys | None:
    """The top-level keys the recipe file ``path`` reads from ``cfg``, itself or through the toolkit functions it
    hands ``cfg`` to.

    Returns:
        None when the file cannot be read or parsed, or reads keys it names only at run time
        (``cfg[name]``, ``cfg.get(name)``, ``getattr(cfg, ...)``), or hands ``cfg`` to a toolkit function with no
        parameter named ``cfg``: then nothing can be said.
    """
    path = Path(path)
    tree = _parse(path)
    if tree is None:
        return None
    attribute: set[str] = set()
    optional: set[str] = set()
    if not _read_keys(tree, tree, attribute, optional, followed=set()):
        return None
    return RecipeKeys(recipe=path.stem, reads=frozenset(attribute | optional), required=frozenset(attribute - optional))


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _read_keys(
    node: ast.AST, module: ast.Module, attribute: set[str], optional: set[str], *, followed: set[tuple[int, str]]
) -> bool:
    """Add the keys ``node`` (in ``module``) reads from ``cfg`` to ``attribute`` (as ``cfg.<key>`` or
    ``cfg["<key>"]``) and ``optional`` (with ``get``, ``pop`` or ``in``), following ``cfg`` into the toolkit
    functions it is handed to; False where that cannot be known."""
    for node in ast.walk(node):  # (node: each node below the one given)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == _CONFIG_NAME:
            if node.attr not in _METHODS:
                attribute.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if isinstance(func.value, ast.Name) and func.value.id == _CONFIG_NAME and func.attr in ("get", "pop"):
                key = _literal(node.args[0]) if node.args else None
                if key is None:
                    return False
                optional.add(key)
            elif isinstance(func, ast.Attribute) and func.attr == "select":
                return False  # OmegaConf.select(cfg, "a.b"): read by a path string
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == _CONFIG_NAME:
            key = _literal(node.slice)
            if key is None:
                return False
            attribute.add(key)
        elif isinstance(node, ast.Compare) and any(
            isinstance(c, ast.Name) and c.id == _CONFIG_NAME for c in node.comparators
        ):
            key = _literal(node.left)
            if key is None:
                return False
            optional.add(key)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "hasattr"):
                if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == _CONFIG_NAME:
                    return False
            elif _hands_on_config(node):
                target = _function(module, node.func.id)
                if target is False:
                    return False
                if target is not None and (id(target[0]), target[1].name) not in followed:
                    followed.add((id(target[0]), target[1].name))
                    if not _read_keys(target[1], target[0], attribute, optional, followed=followed):
                        return False
    return True


def _hands_on_config(call: ast.Call) -> bool:
    """Whether ``call`` passes ``cfg`` itself as an argument."""
    values = [*call.args, *(keyword.value for keyword in call.keywords)]
    return any(isinstance(value, ast.Name) and value.id == _CONFIG_NAME for value in values)


def _function(module: ast.Module, name: str) -> tuple[ast.Module, ast.FunctionDef] | None | bool:
    """Where ``name``, called in ``module``, is defined: a function of ``module`` itself, or of the toolkit module it
    is imported from (following re-exports). None where it is no such function (a name from outside the toolkit, a
    class, which keeps ``cfg`` to save it rather than reading it); False for a function whose parameters do not
    say which one is the config (none is named ``cfg``)."""
    for statement in module.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
            arguments = statement.args
            names = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}
            return (module, statement) if _CONFIG_NAME in names else False
    for statement in module.body:
        if not isinstance(statement, ast.ImportFrom) or statement.level or not statement.module:
            continue
        for alias in statement.names:
            if (alias.asname or alias.name) != name:
                continue
            if statement.module.split(".")[0] != _TOOLKIT.name:
                return None
            imported = _toolkit_module(statement.module)
            return None if imported is None else _function(imported, alias.name)
    return None


@functools.cache
def _toolkit_module(module: str) -> ast.Module | None:
    """The parsed source of the toolkit module ``module`` (``toolkit.recipe_setup``), if there is one (parsed once:
    the functions followed are told apart by the tree they are in)."""
    base = _TOOLKIT.joinpath(*module.split(".")[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return _parse(candidate)
    return None
