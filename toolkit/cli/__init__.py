"""The ``tune`` command line (entry point :func:`toolkit.cli.main.main`)."""
