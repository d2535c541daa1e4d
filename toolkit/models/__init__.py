"""Model families: each sub-package composes ``toolkit.modules`` into architectures and public sizes."""
