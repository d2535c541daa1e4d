"""tunekit: a PyTorch-native toolkit for fine-tuning LLMs on one device, every GPU of a machine, or many machines.

Recipes (``recipes/``) import their building blocks from here; see ``DESIGN.md``-style notes in CONTRIBUTING.md.
"""

__version__ = "0.1.0"
