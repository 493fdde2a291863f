"""The names of a state's files (docs/state-format.md), and of the markers an output holds: every module that reads
or writes one asks here.

What a worker writes during an epoch lives under the epoch's tag: its number and its fence's nonce, which no other
epoch of any job can produce, so that two jobs reaching one state (a mount seen twice, a copied state, a prefix given
twice) never overwrite, nor take, each other's files.
"""

JOB = "job.json"
TOKENS = "tokens.safetensors"
EVENTS = "events.jsonl"  # on a directory; an object store keeps each event as an object of EVENT_FOLDER
EVENT_FOLDER = "events"
EPOCHS, COMMITS, SOLVED, BOUNDARIES = "epochs", "commits", "layers", "boundaries"
STAGES = "stages"  # the passes of a recipe before its last, each a state of its own (`stage`)
EVERYTHING = (COMMITS, SOLVED, BOUNDARIES, EPOCHS, STAGES, JOB, TOKENS, EVENTS, EVENT_FOLDER)  # what --restart clears
MARKER = "elastic-oneshot.json"  # in every checkpoint: the job's fingerprint and the files written
PENDING = "elastic-oneshot.pending.json"  # on an output prefix, while an upload is under way
NONCE_CHARS = 12  # of the fence's nonce (128 random bits) in a tag


def stage(index: int, modifier: str) -> str:
    """The folder of a recipe's pass `index` (not its last: that one is the state itself), named by its modifier:
    a state of its own (commits, solved groups, boundaries, epochs, events) beside the job's job.json and tokens."""
    return f"{STAGES}/{index:02d}-{modifier}"


def tag(epoch: int, nonce: str) -> str:
    return f"e{epoch:05d}.{nonce[:NONCE_CHARS]}"


def epoch_of(tag_or_name: str) -> int | None:
    """The epoch a tag, or a file name that begins with one, belongs to; None if it begins with none."""
    head = tag_or_name.split(".", 1)[0]
    return int(head[1:]) if head[:1] == "e" and head[1:].isdigit() else None


def fence(epoch: int) -> str:
    return f"{EPOCHS}/{epoch:05d}.json"


def fenced(name: str) -> int | None:
    """The epoch whose fence a name of EPOCHS is; None for any other name."""
    stem, _, ext = name.partition(".")
    return int(stem) if ext == "json" and stem.isdigit() else None


def commit(layer: int, epoch: int) -> str:
    return f"{COMMITS}/{layer:05d}.e{epoch:05d}.json"


def committed(name: str, epoch: int) -> int | None:
    """The layer a name of COMMITS commits in `epoch`; None for any other name."""
    layer, _, rest = name.partition(".e")
    return int(layer) if rest == f"{epoch:05d}.json" and layer.isdigit() else None


def solved_folder(layer: int) -> str:
    return f"{SOLVED}/{layer:05d}"


def solved(layer: int, epoch_tag: str, name: str) -> str:
    """The stem (add .json, .safetensors) of solved groups of `layer`, named `name` among its epoch's."""
    return f"{solved_folder(layer)}/{epoch_tag}.{name}"


def solved_fence(layer: int, epoch_tag: str) -> str:
    return f"{solved_folder(layer)}/fence.{epoch_tag}.json"


def boundary(layer: int, epoch_tag: str, chunk: int) -> str:
    return f"{boundary_folder(layer)}/{epoch_tag}/chunk-{chunk:05d}.safetensors"


def boundary_folder(layer: int) -> str:
    return f"{BOUNDARIES}/{layer:05d}"


def event_object(time_ns: int, token: str) -> str:
    """An event on an object store: a name no other writer uses, in time order."""
    return f"{EVENT_FOLDER}/{time_ns:020d}.{token}.json"
