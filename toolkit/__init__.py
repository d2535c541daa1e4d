"""tunekit: a PyTorch-native toolkit for fine-tuning LLMs on one device, every GPU of a machine, or many machines.

Recipes (``recipes/``) import their building blocks from here. Its rooms, one per job, and the floors they stand on
are in docs/design.md; CONTRIBUTING.md has the checklists for adding to them.
"""

__version__ = "0.1.0"
