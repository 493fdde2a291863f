"""The names of a state's files (docs/state-format.md). What a worker writes during an epoch lives under the epoch's
tag: its number and its fence's nonce, which no other epoch of any job can produce, so that two jobs reaching one
state (a mount seen twice, a copied state, a prefix given twice) never overwrite, nor take, each other's files."""

JOB = "job.json"
TOKENS = "tokens.safetensors"
EVENTS = "events.jsonl"
NONCE_CHARS = 12  # of the fence's nonce (128 random bits) in a tag


def tag(epoch: int, nonce: str) -> str:
    return f"e{epoch:05d}.{nonce[:NONCE_CHARS]}"


def epoch_of(tag_or_name: str) -> int | None:
    """The epoch a tag, or a file name that begins with one, belongs to; None if it begins with none."""
    head = tag_or_name.split(".", 1)[0]
    return int(head[1:]) if head[:1] == "e" and head[1:].isdigit() else None


def fence(epoch: int) -> str:
    return f"epochs/{epoch:05d}.json"


def commit(layer: int, epoch: int) -> str:
    return f"commits/{layer:05d}.e{epoch:05d}.json"


def solved_folder(layer: int) -> str:
    return f"layers/{layer:05d}"


def solved(layer: int, epoch_tag: str, name: str) -> str:
    """The stem (add .json, .safetensors) of solved groups of `layer`, named `name` among its epoch's."""
    return f"{solved_folder(layer)}/{epoch_tag}.{name}"


def solved_fence(layer: int, epoch_tag: str) -> str:
    return f"{solved_folder(layer)}/fence.{epoch_tag}.json"


def boundary(layer: int, epoch_tag: str, chunk: int) -> str:
    return f"boundaries/{layer:05d}/{epoch_tag}/chunk-{chunk:05d}.safetensors"
