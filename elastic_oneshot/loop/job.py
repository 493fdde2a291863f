"""What is being compressed, and the fingerprint that ties a state directory to it."""

import dataclasses
import hashlib

from elastic_oneshot.durability.state import FORMAT
from elastic_oneshot.jsonforms import fingerprint_json
from elastic_oneshot.quantization.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class Job:
    model: str
    dataset: str = "builtin"
    recipe: Recipe = Recipe()
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    text_column: str = "text"
    chunk_size: int = 8
    trust_remote_code: bool = False
    moe_calibrate: str = "all"  # "all": every expert sees every token; "routed": only its own
    attention: str = "eager"  # the peer's numerics; "sdpa" is faster and differs in the last bits
    coordinator: str | None = None  # etcd URL holding the epochs and commits (password removed); not in the identity

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "recipe": self.recipe.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        return cls(**{**d, "recipe": Recipe.from_dict(d["recipe"])})


def job_record(job: Job, model_digest: str, num_layers: int) -> dict:
    """job.json's body. The identity (model content, dataset, recipe, sampling, state format) decides
    whether a state directory belongs to this job. The samples themselves are fixed in the state when
    the job starts, so a resume neither re-reads the dataset nor depends on it staying unchanged."""
    identity = {
        "format": FORMAT,
        "model": model_digest,
        "dataset": {"spec": job.dataset, "text_column": job.text_column},
        "recipe": job.recipe.to_dict(),
        "samples": {"num_samples": job.num_samples, "seq_len": job.seq_len, "seed": job.seed,
                    "chunk_size": job.chunk_size, "moe_calibrate": job.moe_calibrate,
                    "attention": job.attention},
    }
    fingerprint = hashlib.sha256(fingerprint_json(identity)).hexdigest()
    return {"fingerprint": fingerprint, "identity": identity, "job": job.to_dict(), "num_layers": num_layers}
