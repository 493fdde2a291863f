"""`oneshot()`: the one code path behind the command line and the Python API."""

import logging
import os

import transformers

from .data import calibration_samples
from .default_model import default_model
from .errors import UsageError
from .evaluate import perplexity
from .export import export
from .job import Job, job_record
from .model import SourceModel
from .recipe import Recipe
from .runner import Runner
from .state import StateStore

log = logging.getLogger("elastic_oneshot")


def oneshot(model: str | None = None, dataset: str = "builtin", scheme: str = "W4A16",
            num_calibration_samples: int = 128, max_seq_length: int = 512, output_dir: str | None = None,
            state_dir: str | None = None, recipe: Recipe | None = None, seed: int = 0,
            text_column: str = "text", group_size: int | None = None, symmetric: bool = True,
            actorder: str | None = "static", dampening_frac: float = 0.01, block_size: int = 128,
            ignore: tuple[str, ...] = (), restart: bool = False, trust_remote_code: bool = False,
            chunk_size: int = 8, eval_samples: int = 0) -> str:
    """Compress `model` with GPTQ, resumably; return the output directory.

    Arguments mirror llmcompressor's `oneshot` where they mean the same. `state_dir` holds the
    progress (default: `<output_dir>.state`); calling again with the same arguments resumes.
    """
    model = model or default_model()
    if recipe is None:
        recipe = Recipe(scheme=scheme, group_size=group_size, symmetric=symmetric, actorder=actorder,
                        dampening_frac=dampening_frac, block_size=block_size,
                        ignore=("lm_head", *[i for i in ignore if i != "lm_head"]))
    if num_calibration_samples <= 0 or max_seq_length <= 1 or chunk_size <= 0:
        raise UsageError("--num-samples, --seq-len and --chunk-size must be positive")
    job = Job(model=os.path.abspath(model), dataset=dataset, recipe=recipe,
              num_samples=num_calibration_samples, seq_len=max_seq_length, seed=seed,
              text_column=text_column, chunk_size=chunk_size, trust_remote_code=trust_remote_code)
    output_dir = output_dir or f"{os.path.basename(job.model.rstrip('/'))}-{recipe.scheme}"
    state = StateStore(state_dir or f"{output_dir.rstrip('/')}.state")

    source = SourceModel(job.model, trust_remote_code)
    tokenizer = transformers.AutoTokenizer.from_pretrained(job.model, trust_remote_code=trust_remote_code)
    tokens = calibration_samples(dataset, tokenizer, job.num_samples, job.seq_len, seed, text_column)
    runner = Runner(job, state, source, tokens)  # validates the recipe against the model first
    if state.claim(job_record(job, source.digest(), tokens, source.num_layers), restart=restart):
        log.info("state %s belongs to this job: resuming", state.root)
    else:
        state.write_tensors("tokens.safetensors", {"input_ids": tokens})

    if eval_samples:
        before = perplexity(job.model, dataset, eval_samples, job.seq_len, text_column)
    runner.run()
    export(state, output_dir, source)
    log.info("wrote %s", output_dir)
    if eval_samples:
        after = perplexity(output_dir, dataset, eval_samples, job.seq_len, text_column)
        print(f"perplexity on {eval_samples} held-out samples: before {before:.3f}, after {after:.3f} "
              f"(x{after / before:.4f})")
    return output_dir
