"""The surface: command line, Python API, status, export, pre-work checks."""
