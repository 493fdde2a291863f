from elastic_oneshot.surface.cli import entry

entry()
