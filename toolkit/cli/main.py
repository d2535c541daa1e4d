"""The ``tune`` command: list, copy, show, validate and run recipes and their configs."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from toolkit.cli import _download, doctor, export, merge, plot
from toolkit.cli._catalog import (
    find_config,
    find_recipe_or_config,
    list_configs,
    list_recipes,
    recipe_path,
    recipe_schema,
)
from toolkit.cli._run import run_command
from toolkit.config import apply_overrides, did_you_mean, load_config, recipe_keys, validate
from toolkit.errors import UserError, print_error
from toolkit.paths import configs_dir, recipes_dir
from toolkit.quiet import quiet_third_party_noise


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line, like every other ``tune`` error."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see `{self.prog} --help`")


# What `tune --help` shows first: the three commands of a user's first minutes.
QUICKSTART = """\
quickstart:
  tune run full_finetune_distributed --config demo        # train the demo (a tiny Llama, 1.5 min on 2 CPUs)
  tune run generate --config demo prompt="reverse: lamp"  # ask the model it trained
  docs: README.md and docs/guide.md in the tunekit repository; `tune COMMAND --help` for each command
"""


class _TopParser(_Parser):
    """The ``tune`` parser, whose help starts with :data:`QUICKSTART`."""

    def format_help(self) -> str:
        return f"{QUICKSTART}\n{super().format_help()}"


def _ls(args: argparse.Namespace) -> int:
    recipes = list_recipes()
    if not recipes:
        print(f"no recipes in {recipes_dir()}")
        return 0
    word = (args.filter or "").lower()
    # A recipe that matches shows every config; otherwise only its configs that match (`tune ls qwen`).
    listing = {
        recipe: configs if word in recipe.lower() else [c for c in configs if word in c.lower()]
        for recipe, configs in ((recipe, list_configs(recipe)) for recipe in recipes)
    }
    listing = {recipe: configs for recipe, configs in listing.items() if configs or word in recipe.lower()}
    if not listing:
        names = {*recipes, *(c for recipe in recipes for c in list_configs(recipe))}
        families = {match.group(0) for name in names if (match := re.match(r"[a-z]+\d*", name))}
        hint = did_you_mean(word, sorted(names | families | {f.rstrip("0123456789") for f in families}))
        raise UserError(f"no recipe or config matches '{args.filter}'{hint} (see `tune ls`)")
    rows = [("RECIPE", "CONFIG")]
    for recipe, configs in listing.items():
        rows += [(recipe if i == 0 else "", config) for i, config in enumerate(configs or ["-"])]
    width = max(len(recipe) for recipe, _ in rows) + 3
    for recipe, config in rows:
        print(f"{recipe:<{width}}{config}")
    print("\nrun one: tune run <recipe>_single_device|_distributed --config <config>")
    return 0


def _cp(args: argparse.Namespace) -> int:
    source = find_recipe_or_config(args.name)
    dest = Path(args.dest)
    # A trailing slash names a folder, also one that does not exist yet (Path() drops the slash).
    if dest.is_dir() or args.dest.endswith(("/", os.sep)):
        dest = dest / source.name
    elif not dest.suffix:
        dest = dest.with_suffix(source.suffix)
    if dest.exists() and not args.force:
        raise UserError(f"'{dest}' already exists; add --force to overwrite it")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
    except OSError as e:
        raise UserError(f"cannot copy to '{dest}': {e.strerror or e}") from None
    print(f"copied {source} to {dest}")
    return 0


def _cat(args: argparse.Namespace) -> int:
    sys.stdout.write(find_recipe_or_config(args.name).read_text(encoding="utf-8"))
    return 0


def _recipe_file(config: Path, recipe: str | None) -> Path | None:
    """The recipe that reads the config: ``recipe`` (a name or a ``.py`` file) if given, else the recipe a shipped
    config belongs to (``recipe_configs/<recipe>/<name>.yaml``); None for a config file elsewhere."""
    if recipe is not None:
        if recipe.endswith(".py") and Path(recipe).is_file():
            return Path(recipe)
        return recipe_path(recipe)
    folder = config.resolve().parent
    if folder.parent != configs_dir().resolve() or folder.name not in list_recipes():
        return None
    return recipes_dir() / f"{folder.name}.py"


def _validate(args: argparse.Namespace) -> int:
    path = Path(args.config)
    if not path.is_file():
        path = find_config(args.config)
    cfg = load_config(path)
    recipe = _recipe_file(path, args.recipe)
    schema = recipe_schema(recipe) if recipe is not None else None
    apply_overrides(cfg, args.overrides, recipe=recipe_keys(recipe) if recipe is not None else None,
                    moved=schema.moved if schema is not None else None)
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise UserError(f"--nproc_per_node must be at least 1, got {args.nproc_per_node}")
    world = None if args.nproc_per_node is None else args.nproc_per_node * args.nnodes
    validate(cfg, schema=schema, world_size=world)
    if recipe is not None:  # a training config's plan, as the run's header will show it (meta device: cheap)
        # (imports torch: only for this command, not every `tune`)
        from toolkit.cli.plan import resolved_plan

        for line in resolved_plan(cfg, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes):
            print(line)
    # Without its recipe, neither the keys nor their values can be checked against what the recipe reads.
    note = "" if recipe is not None else (
        " (components only: pass --recipe to check every key against the recipe's schema)"
    )
    print(f"OK: {path}{note}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``tune`` argument parser (``run`` is parsed by torchrun's parser, see ``_run.py``)."""
    parser = _TopParser(
        prog="tune",
        description="Fine-tune LLMs with recipes: plain Python files you run as they are or copy and edit.",
        epilog="`tune run --help` explains launching on one device, every GPU, or several nodes.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    ls = commands.add_parser(
        "ls", help="list recipes and their configs", description="List recipes and configs.",
        epilog="examples:\n  tune ls\n  tune ls lora      # the LoRA recipe's configs, and every config named lora\n"
        "  tune ls qwen3     # one model family's configs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ls.add_argument(
        "filter", nargs="?", metavar="FILTER",
        help="show only a recipe (all its configs) or the configs whose name contains FILTER, e.g. a model family",
    )
    ls.set_defaults(handler=_ls)

    cp = commands.add_parser(
        "cp",
        help="copy a recipe or config to edit it",
        description="Copy a recipe or a config to edit it.",
        epilog="examples:\n  tune cp full_finetune my_recipe.py\n  tune cp full_finetune/demo my_demo.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cp.add_argument("name", help="recipe, recipe/config, or a config name only one recipe has")
    cp.add_argument("dest", help="file or folder to copy to (.py/.yaml is added when there is no suffix)")
    cp.add_argument("-f", "--force", action="store_true", help="overwrite dest if it exists")
    cp.set_defaults(handler=_cp)

    cat = commands.add_parser(
        "cat", help="print a config or recipe", description="Print a config or a recipe.",
        epilog="examples:\n  tune cat full_finetune/demo\n  tune cat generate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cat.add_argument("name", help="recipe, recipe/config, or a config name only one recipe has")
    cat.set_defaults(handler=_cat)

    check = commands.add_parser(
        "validate",
        help="check a config without running it",
        description="Load a config, apply overrides and check every key against the recipe's declared schema\n"
        "(types, ranges, choices, batch divisibility) and every _component_ against its signature.\n"
        "A config file outside recipe_configs/ names its recipe first (--recipe).",
        epilog="examples:\n  tune validate full_finetune/demo batch_size=64\n"
        "  tune validate --recipe full_finetune my_demo.yaml max_steps=50\n"
        "  tune validate full_finetune/demo --nproc_per_node 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("config", help="config file, recipe/config, or a config name only one recipe has")
    check.add_argument(
        "--recipe", metavar="RECIPE", help="the recipe (name or .py file) that reads the config, for a config file "
        "outside recipe_configs/: overrides are then checked against the top-level keys the recipe reads",
    )
    check.add_argument(
        "--nproc_per_node", "--nproc-per-node", type=int, metavar="N",
        help="processes per node the run will have, to check that the batch divides over them",
    )
    check.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes the run will have (default 1)")
    # default=[]: without it argparse lists the optional overrides as required when the config is missing.
    check.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="overrides, as for tune run")
    check.set_defaults(handler=_validate)

    # Parsed by its own parser (overrides may follow its flags), like `tune run`; listed here for `tune --help`.
    commands.add_parser("plan", help="estimate memory per data-parallel strategy; show what auto picks", add_help=False)

    _download.add_parser(commands)
    merge.add_parser(commands)
    plot.add_parser(commands)
    export.add_parser(commands)
    doctor.add_parser(commands)

    # Listed for `tune --help`; `tune run` itself is handled before argparse (its flags are torchrun's).
    commands.add_parser("run", help="run a recipe on one device or under torchrun", add_help=False)
    return parser


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    """Parse ``tune COMMAND ...``, letting a command's ``key=value`` overrides come before or after its flags
    (``tune validate demo --nproc_per_node 4 batch_size=64``), which plain argparse refuses."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    if args and args[0] in commands.choices:
        namespace = commands.choices[args[0]].parse_intermixed_args(args[1:])
        namespace.command = args[0]
        return namespace
    return parser.parse_args(args)


def _report(error: UserError) -> int:
    print_error(str(error))
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tune`` with ``argv`` (default ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, 2 for a user error (printed as one ``tune: error:`` line per problem), or
        the recipe's own code for ``tune run``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    quiet_third_party_noise()
    try:
        if args[:1] == ["run"]:
            return run_command(args[1:])
        if args[:1] == ["plan"]:
            from toolkit.cli.plan import plan_command  # imports torch: only for this command, not every `tune`

            return plan_command(args[1:])
        parser = build_parser()
        namespace = _parse(parser, args)
        if namespace.command is None:
            parser.print_help(sys.stderr)
            return 2
        return int(namespace.handler(namespace))
    except UserError as e:
        return _report(e)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `tune ls | head`: the reader left; say nothing more (and keep Python from complaining at exit).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
