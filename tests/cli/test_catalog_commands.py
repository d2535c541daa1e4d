"""tune ls / cp / cat / validate, and --help."""

from __future__ import annotations

from tests.cli.conftest import TOY_RECIPE, one_line


def test_help(tune_process) -> None:
    result = tune_process("--help")  # also proves `python -m toolkit.cli.main` is the command
    assert result.returncode == 0
    # A quickstart first: the demo, asking the trained model, where the docs are.
    first = result.stdout.splitlines()[:4]
    assert first[0] == "quickstart:" and "--config demo" in first[1] and "tune run generate" in first[2], first
    assert "docs/guide.md" in first[3]
    for command in ("ls", "cp", "cat", "validate", "run"):
        assert command in result.stdout
    result = tune_process("run", "--help")
    assert result.returncode == 0 and "--nproc_per_node" in result.stdout and "_distributed" in result.stdout
    # Its examples follow its own rule: torchrun flags before the recipe.
    examples = result.stdout.split("\nexamples:\n", 1)[1].splitlines()
    for example in examples:
        words = example.split("#")[0].split()
        recipe = next(i for i, word in enumerate(words) if word.endswith(("_single_device", "_distributed", ".py")))
        assert not any(word.startswith("--") and word != "--config" for word in words[recipe:]), example


def test_bad_subcommand_is_one_line(tune) -> None:
    result = tune("lss")
    assert result.returncode != 0
    assert one_line(result.stderr).startswith("tune: error: argument COMMAND: invalid choice: 'lss'")


def test_ls_discovers_recipes_and_configs(tune) -> None:
    result = tune("ls")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()]
    assert rows[:4] == [["RECIPE", "CONFIG"], ["other", "demo"], ["toy", "demo"], ["small"]]
    assert "_shared" not in result.stdout


def test_ls_filters_by_recipe_or_config_name(tune) -> None:
    def rows(*args: str) -> list[list[str]]:
        result = tune("ls", *args)
        assert result.returncode == 0, result.stderr
        return [line.split() for line in result.stdout.splitlines()[1:] if line.strip() and "run one" not in line]

    assert rows("toy") == [["toy", "demo"], ["small"]]  # a recipe: all its configs
    assert rows("SMA") == [["toy", "small"]]  # a config's name, in any case
    assert rows("demo") == [["other", "demo"], ["toy", "demo"]]
    result = tune("ls", "smal1")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "tune: error: no recipe or config matches 'smal1'; did you mean 'small'? (see `tune ls`)"
    )


def test_cp_recipe_adds_suffix_and_refuses_to_overwrite(tune, tree) -> None:
    result = tune("cp", "toy", "my_toy")
    assert result.returncode == 0, result.stderr
    copy = tree.work / "my_toy.py"
    assert copy.read_text() == TOY_RECIPE

    copy.write_text("# my edits\n")
    result = tune("cp", "toy", "my_toy.py")
    assert result.returncode == 2
    assert one_line(result.stderr) == "tune: error: 'my_toy.py' already exists; add --force to overwrite it"
    assert copy.read_text() == "# my edits\n"

    assert tune("cp", "toy", "my_toy.py", "--force").returncode == 0
    assert copy.read_text() == TOY_RECIPE


def test_cp_config_by_every_kind_of_name(tune, tree) -> None:
    source = (tree.configs / "toy" / "small.yaml").read_text()
    assert tune("cp", "toy/small", "a").returncode == 0
    assert (tree.work / "a.yaml").read_text() == source
    assert tune("cp", "small", "b.yaml").returncode == 0  # bare name: only toy has it
    assert (tree.work / "b.yaml").read_text() == source
    (tree.work / "sub").mkdir()
    assert tune("cp", "toy/small", "sub").returncode == 0  # into a folder, keeping the name
    assert (tree.work / "sub" / "small.yaml").read_text() == source


def test_cp_to_a_folder_that_does_not_exist_yet(tune, tree) -> None:
    # The trailing slash says it is a folder: the copy keeps its name inside it, not `new/dir.yaml`.
    assert tune("cp", "toy/small", "new/dir/").returncode == 0
    assert (tree.work / "new" / "dir" / "small.yaml").read_text() == (tree.configs / "toy" / "small.yaml").read_text()
    assert not (tree.work / "new" / "dir.yaml").exists()


def test_cp_to_a_place_that_cannot_be_written_is_one_line(tune, tree) -> None:
    (tree.work / "taken").write_text("a file, not a folder\n")
    result = tune("cp", "toy/small", "taken/copy.yaml")
    assert result.returncode == 2
    assert one_line(result.stderr).startswith("tune: error: cannot copy to 'taken/copy.yaml': ")


def test_cp_ambiguous_config_lists_candidates(tune, tree) -> None:
    result = tune("cp", "demo", "x.yaml")
    assert result.returncode == 2
    assert "ambiguous: other/demo, toy/demo" in one_line(result.stderr)
    assert not (tree.work / "x.yaml").exists()


def test_cat(tune, tree) -> None:
    result = tune("cat", "toy/small")
    assert result.returncode == 0 and result.stdout == (tree.configs / "toy" / "small.yaml").read_text()
    assert tune("cat", "toy").stdout == TOY_RECIPE
    result = tune("cat", "smal")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "tune: error: no recipe or config named 'smal'; did you mean 'small'? (see `tune ls`)"
    )


def test_validate_good(tune, tree) -> None:
    result = tune("validate", "toy/small")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"OK: {tree.configs / 'toy' / 'small.yaml'}\n"
    assert tune("validate", "small").returncode == 0
    assert tune("validate", str(tree.configs / "toy" / "small.yaml"), "optimizer.momentum=0.9").returncode == 0


def test_validate_typo_names_file_key_and_suggestion(tune, tree) -> None:
    result = tune("validate", "toy/small", "optimizer.lrr=0.1")
    assert result.returncode == 2
    path = tree.configs / "toy" / "small.yaml"
    target = "tests.config._targets.fake_optimizer"
    expected = f"tune: error: {path}: optimizer.lrr: not an argument of {target}; did you mean 'lr'?"
    assert one_line(result.stderr) == expected


def test_validate_reports_every_problem_one_line_each(tune) -> None:
    result = tune("validate", "toy/small", "optimizer.lrr=0.1", "message=${nowhere}")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("tune: error: ") for line in lines)


def test_validate_refuses_a_new_key_the_recipe_never_reads(tune) -> None:
    # A typo in a top-level key would otherwise create a key nothing reads, and the run would ignore it.
    result = tune("validate", "toy/small", "mesage=hi")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "tune: error: override 'mesage=hi': no key 'mesage' in the config, and recipe toy does not read one; "
        "did you mean 'message'?"
    )



def test_validate_checks_a_copied_config_against_the_recipe_given(tune, tree) -> None:
    copy = tree.work / "mine.yaml"
    copy.write_text((tree.configs / "toy" / "small.yaml").read_text())
    # Outside recipe_configs/ the recipe is not known: the override passes, and the output says what was not checked.
    result = tune("validate", str(copy), "mesage=hi")
    assert result.returncode == 0 and "pass --recipe" in result.stdout
    for recipe in ("toy", "toy_distributed", str(tree.recipes / "toy.py")):
        result = tune("validate", "--recipe", recipe, str(copy), "mesage=hi")
        assert result.returncode == 2
        assert "no key 'mesage' in the config, and recipe toy does not read one; did you mean 'message'?" in result.stderr
    assert tune("validate", "--recipe", "toy", str(copy), "message=hi").stdout == f"OK: {copy}\n"
    result = tune("validate", "--recipe", "tyo", str(copy))
    assert result.returncode == 2 and "unknown recipe 'tyo'" in result.stderr

def test_validate_refuses_deleting_a_key_the_recipe_reads(tune) -> None:
    result = tune("validate", "toy/small", "~message")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "tune: error: override '~message': recipe toy reads 'message'; set it to null instead of deleting it"
    )


def test_validate_without_a_config_names_only_what_is_missing(tune) -> None:
    result = tune("validate")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "tune: error: the following arguments are required: config; see `tune validate --help`"
    )


def test_validate_unknown_config(tune) -> None:
    result = tune("validate", "toy/smal")
    assert result.returncode == 2
    assert one_line(result.stderr) == "tune: error: unknown config 'toy/smal'; did you mean 'toy/small'?"
