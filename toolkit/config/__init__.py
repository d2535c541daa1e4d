"""Configs: load YAML, apply command-line overrides, check them against a recipe's declared schema, validate and
instantiate ``_component_`` nodes.

A recipe's entry point is::

    SCHEMA = Schema({"epochs": Int(ge=1), ...})

    @recipe_main(schema=SCHEMA)
    def main(cfg: DictConfig) -> None:
        model = instantiate(cfg.model)
        optimizer = instantiate(cfg.optimizer, model.parameters())
        ...

    if __name__ == "__main__":
        main()
"""

from toolkit.config._errors import ConfigError, did_you_mean
from toolkit.config._instantiate import instantiate
from toolkit.config._parse import apply_overrides, load_config, parse_recipe_args, resolve
from toolkit.config._recipe import recipe_main
from toolkit.config._recipe_keys import RecipeKeys, recipe_keys
from toolkit.config._schema import (
    AnyOf,
    Anything,
    Bool,
    Choice,
    Component,
    Context,
    Float,
    Int,
    ListOf,
    Rule,
    Schema,
    Section,
    Spec,
    Str,
    one_of,
    rule,
)
from toolkit.config._tree import config_source
from toolkit.config._validate import RUNTIME_ARGS, validate

__all__ = [
    "RUNTIME_ARGS",
    "AnyOf",
    "Anything",
    "Bool",
    "Choice",
    "Component",
    "ConfigError",
    "Context",
    "Float",
    "Int",
    "ListOf",
    "RecipeKeys",
    "Rule",
    "Schema",
    "Section",
    "Spec",
    "Str",
    "one_of",
    "rule",
    "apply_overrides",
    "config_source",
    "did_you_mean",
    "instantiate",
    "load_config",
    "parse_recipe_args",
    "recipe_keys",
    "recipe_main",
    "resolve",
    "validate",
]
