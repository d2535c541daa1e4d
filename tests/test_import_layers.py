"""The package's layers: no module of ``toolkit`` imports, even inside a function, one that imports it back, and
each room imports only itself and the rooms below it (:data:`FLOORS`, drawn in docs/design.md).

Read from the source (every ``import`` statement, at the top or in a function body), so an import deferred to
dodge a cycle at start-up counts as the cycle it is.
"""

import ast
from pathlib import Path

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"
# The rooms of toolkit, lowest first: a room imports only itself and the rooms before it. (Rooms on one line do not
# import each other either: the order among them is only the order of the line.) A new room gets its line here and
# in docs/design.md, and a move that breaks the order fails below, naming the import.
FLOORS = (
    ("errors", "versions", "paths", "quiet"),
    ("config",),
    ("tokenizers", "modules"),  # model blocks and their masks know nothing of data, training or checkpoints
    ("models", "data"),
    ("parallel",),  # the process group, the mesh and every dimension
    ("optim",),
    ("training",),  # the step
    ("planning",),  # memory per step and the layout chosen from it
    ("checkpoint",),  # step checkpoints, formats, export and merge
    ("objectives",),  # preference, KTO, distillation: built on the step
    ("pretrained", "generation"),
    ("rl",),  # online RL: rewards, prompts' rollouts
    ("evaluation",),
    ("recipe_setup",),  # the training recipes' shared set-up: the run, the layout, the data, the optimizer, the loop
    ("cli",),
)
ORDER = [room for floor in FLOORS for room in floor]
# The toolkit.training package itself hands on the names that moved to rooms above it, lazily (see its docstring),
# so that recipes written before the move still import; it imports none of them, which this test checks too.


def module_files() -> dict[str, Path]:
    """``{"toolkit.training.step": .../step.py, "toolkit.models": .../models/__init__.py, ...}``"""
    modules = {}
    for file in TOOLKIT.rglob("*.py"):
        parts = list(file.relative_to(TOOLKIT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = file
    return modules


def import_graph() -> dict[str, set[str]]:
    """Each toolkit module and the toolkit modules it imports (``from pkg import name`` names the submodule
    ``pkg.name`` where there is one, else ``pkg``)."""
    modules = module_files()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, file in modules.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                imported |= {owner(alias.name) for alias in node.names if alias.name.startswith("toolkit")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                if base.startswith("toolkit"):
                    imported |= {owner(f"{base}.{alias.name}") or owner(base) for alias in node.names}
        graph[name] = imported - {None, name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def room(module: str) -> str:
    """``toolkit.checkpoint.hf`` -> ``checkpoint``; the package's own ``__init__`` is above every room."""
    return module.split(".")[1] if "." in module else "toolkit"


def test_every_room_is_on_a_floor():
    rooms = {room(name) for name in module_files()} - {"toolkit"}
    assert rooms - set(ORDER) == set(), "a new room: give it its floor in FLOORS (and in docs/design.md)"
    assert set(ORDER) - rooms == set(), "a room in FLOORS that is gone"


def test_no_room_imports_a_room_above_it():
    upward = sorted(
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        for dep in deps
        if room(name) != "toolkit" and room(dep) != "toolkit" and ORDER.index(room(dep)) > ORDER.index(room(name))
    )
    assert upward == []


def test_rooms_on_one_floor_do_not_import_each_other():
    floor_of = {r: i for i, floor in enumerate(FLOORS) for r in floor}
    sideways = sorted(
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        for dep in deps
        if room(name) != room(dep) and "toolkit" not in (room(name), room(dep))
        and floor_of[room(name)] == floor_of[room(dep)]
    )
    assert sideways == []


def test_models_and_modules_import_nothing_above_them():
    """The rule the floors exist for, said once more by name: a model is a plain module; the code that feeds,
    trains, spreads, loads and runs it is above it."""
    above = tuple(f"toolkit.{r}" for r in ORDER[ORDER.index("data"):] if r != "models")
    offending = {
        name: sorted(dep for dep in deps if dep.startswith(above))
        for name, deps in import_graph().items()
        if name.startswith(("toolkit.models", "toolkit.modules"))
    }
    assert {name: deps for name, deps in offending.items() if deps} == {}


def test_the_training_package_imports_no_room_above_it():
    assert {dep for dep in import_graph()["toolkit.training"] if ORDER.index(room(dep)) > ORDER.index("training")} == set()
