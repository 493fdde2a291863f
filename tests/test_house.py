"""The house's rules, read from the source: the import graph of elastic_oneshot, imports inside functions included
(so none can dodge a cycle there), has no cycle and no import that runs upward (docs/architecture.md draws the
layers); no function is longer than 60 lines."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "elastic_oneshot"
# Bottom to top: a module imports only from its own layer or those below (within a layer, no cycle).
LAYERS = [("errors", "jsonforms"), ("events",), ("metrics",), ("retry",), ("distributed",), ("durability",),
          ("models",), ("quantization",), ("loop",), ("surface",), ("testing",), ("__init__", "__main__")]
LONGEST = 60  # lines of a function, its signature and docstring included


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        out[name] = ast.parse(path.read_text())
    return out


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules `tree` imports anywhere (relative names): `from elastic_oneshot.x import y` is y where
    y is a module."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}".removeprefix("elastic_oneshot.") in known
                      else node.module for a in node.names}
    return {name.removeprefix("elastic_oneshot.") for name in found} & known


def layer(module: str) -> int:
    head = module.split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if head in names)


def graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees) | {name.rsplit(".", 1)[0] for name in trees if "." in name}
    return {name: imports(tree, known) - {name} for name, tree in trees.items()}


def test_no_import_runs_upward():
    upward = sorted((a, b) for a, targets in graph().items() for b in targets if layer(b) > layer(a))
    assert not upward, upward


def test_the_import_graph_has_no_cycle():
    edges, cycles, state = graph(), [], {}

    def walk(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            walk(node, [node])
    assert not cycles, cycles


def test_no_function_is_longer_than_60_lines():
    long = sorted((name, node.name, node.end_lineno - node.lineno + 1) for name, tree in modules().items()
                  for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.end_lineno - node.lineno + 1 > LONGEST)
    assert not long, long


def test_a_new_fault_kind_is_one_entry_of_events(tmp_path, monkeypatch):
    """A fault kind the code has never seen, added where fault kinds live (events.FAULTS): written as any fault is,
    `status` lists and renders it, and the history's queries count it, with no other module touched."""
    import torch

    from elastic_oneshot import events
    from elastic_oneshot.durability.state import StateStore
    from elastic_oneshot.surface import status

    monkeypatch.setitem(events.FAULTS, "oom", "a rank was killed for memory")
    state = StateStore(str(tmp_path / "state"))
    state.claim({"fingerprint": "f", "identity": {}, "job": {"model": "m", "coordinator": None}, "num_layers": 2},
                torch.zeros(1, 2, dtype=torch.int64))
    state.append_event(events.start(1, 2, 0, 0))
    state.append_event(events.fault("oom", 1, 1, "node-b", reason="RSS over 24 GB"))
    r = status.report(state)
    assert [f["event"] for f in r["faults"]] == ["oom"]
    assert "fault: oom at " in status.render(r) and "RSS over 24 GB" in status.render(r)
    assert events.History(state.events()).faults == r["faults"]
