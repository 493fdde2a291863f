"""`oneshot()`: the one code path behind the command line and the Python API."""

import dataclasses
import logging
import os
import socket

import torch
import transformers

from elastic_oneshot import events, metrics
from elastic_oneshot.distributed import signals
from elastic_oneshot.distributed.world import World
from elastic_oneshot.durability import layout
from elastic_oneshot.durability.boundaries import parse_every
from elastic_oneshot.durability.coordinator import open_records
from elastic_oneshot.durability.destination import Destination, open_destination
from elastic_oneshot.durability.records import Records
from elastic_oneshot.durability.state import StateStore, default_root
from elastic_oneshot.errors import CorruptStateError, StaleEpochError, UsageError
from elastic_oneshot.loop.data import calibration_samples
from elastic_oneshot.loop.job import Job, job_record
from elastic_oneshot.loop.passes import Pass
from elastic_oneshot.loop.passes import plan as plan_passes
from elastic_oneshot.loop.runner import Passes, Runner
from elastic_oneshot.models.default_model import default_model
from elastic_oneshot.models.exportable import check_exportable
from elastic_oneshot.models.source import SourceModel
from elastic_oneshot.quantization.packing import written_names
from elastic_oneshot.quantization.plan import describe, layer_groups, make_plan, parse_bytes
from elastic_oneshot.quantization.recipe import Recipe
from elastic_oneshot.quantization.recipe_loader import read_recipe
from elastic_oneshot.surface.evaluate import perplexity
from elastic_oneshot.surface.export import Export
from elastic_oneshot.surface.preflight import check_layer_fits, check_locations, check_seq_len
from elastic_oneshot.surface.progress import LayerBar

log = logging.getLogger("elastic_oneshot")


def oneshot(model: str | None = None, dataset: str = "builtin", scheme: str = "W4A16",
            num_calibration_samples: int = 128, max_seq_length: int = 512, output_dir: str | None = None,
            state_dir: str | None = None, recipe=None, seed: int = 0,
            text_column: str = "text", group_size: int | None = None, symmetric: bool = True,
            actorder: str | None = "static", dampening_frac: float = 0.01, block_size: int = 128,
            ignore: tuple[str, ...] = (), restart: bool = False, trust_remote_code_model: bool = False,
            chunk_size: int = 8, eval_samples: int = 0, collective_timeout: float = 60.0,
            moe_calibrate_all_experts: bool = True, coordinator: str | None = None,
            attention: str = "eager", allow_long_seq: bool = False, boundary_every: str | int = "auto",
            mtbf_s: float | None = None, metrics_port: int | None = None, max_memory: str | int | None = None,
            model_changed: str = "refuse") -> str:
    """Compress `model` with a recipe, resumably; return the output directory (a local one, or an object-store
    prefix). Arguments mirror llmcompressor's `oneshot` where they mean the same. `recipe` is what llmcompressor takes
    (modifiers: GPTQ, QuantizationModifier, SmoothQuant, AWQ, SparseGPT, a list of them, a YAML file or text; see
    recipe_loader) or a Recipe; without it, `scheme` and the GPTQ arguments after `text_column` make GPTQ's.
    `state_dir` holds the progress (default: `<output_dir>.state`; a URL puts it on object storage: storage.py);
    calling again with the same arguments resumes. Under torchrun every rank calls this with the same arguments;
    rank 0 writes the checkpoint. `coordinator` (etcd://HOST:PORT/PREFIX) keeps epochs and commits in etcd.
    `allow_long_seq` permits `max_seq_length` past max_position_embeddings. `boundary_every` (auto, 0 or N layers) and
    `mtbf_s` set how often activations are written (boundaries.py). `metrics_port` (None:
    $ELASTIC_ONESHOT_METRICS_PORT; 0: none) serves Prometheus metrics, per rank (metrics.py). `max_memory` (bytes, or
    text such as 24GB; None: 80 % of what the device has free) bounds a layer's working set: a layer of many experts is
    calibrated and solved in batches that fit (plan.memory_batches). `model_changed`: "refuse" (in one line) or "redo"
    a resume whose committed layers were computed from other model content than the files hold now (a model edited in
    place; model_check.py)."""
    max_memory = None if max_memory is None else parse_bytes(max_memory)
    metrics.serve(metrics_port)  # the port is taken first: one that is in use ends this rank before any work
    world = World(timeout_s=collective_timeout)
    bar, model = LayerBar(show=world.rank == 0), model or default_model()
    recipe = _recipe(recipe, Recipe(scheme=scheme, group_size=group_size, symmetric=symmetric, actorder=actorder,
                                    dampening_frac=dampening_frac, block_size=block_size,
                                    ignore=("lm_head", *[i for i in ignore if i != "lm_head"])))
    job = _sized(Job(model=os.path.abspath(model), recipe=recipe, num_samples=num_calibration_samples,
                     dataset=os.path.abspath(dataset) if os.path.exists(dataset) else dataset,
                     seq_len=max_seq_length, seed=seed, text_column=text_column, chunk_size=chunk_size,
                     trust_remote_code=trust_remote_code_model, attention=attention,
                     moe_calibrate="all" if moe_calibrate_all_experts else "routed"))
    output_dir = output_dir or f"{os.path.basename(job.model.rstrip('/'))}-{recipe.name}"
    state_dir = state_dir or default_root(output_dir)
    destination = open_destination(output_dir)
    job, kept, source, record, schemes, passes = _open(job, state_dir, destination, coordinator, allow_long_seq,
                                                       collective_timeout)
    _agree(world, job, record, source)
    runner = Passes(len(passes), lambda index, earlier: Runner(
        job, *kept[index], source, world, schemes, parse_every(boundary_every), mtbf_s, max_memory, model_changed,
        bar, passes, index, earlier))
    _claim_on_rank_0(world, kept, record, job, restart, destination, source.num_layers)
    fault = _record_faults(kept[-1][0], world, runner)
    before = perplexity(job.model, dataset, eval_samples, job.seq_len, text_column) if eval_samples and \
        world.rank == 0 else None
    with Export(kept[-1][0], destination, source, schemes, repair=True) as build:
        if not _run(world, [r for _, r in kept], runner, build, fault):
            return output_dir
        build.finish()  # without a process group: compressed-tensors would run collectives on one
    log.info("wrote %s", output_dir)
    if eval_samples:
        _compare(before, output_dir, dataset, eval_samples, job.seq_len, text_column)
    return output_dir


def _run(world: World, records: list[Records], runner: Passes, build: Export, fault) -> bool:
    """Every layer, then the export's weights (the run's last step, its one read of the committed layers); then every
    rank leaves the process group and the records. True on rank 0, which finishes the export."""
    try:
        runner.run(build.weights)
    except StaleEpochError as e:
        if world.rank == 0:
            fault("stale", error=str(e))
        raise
    world.close()
    for r in records:
        r.detach()
    return world.rank == 0


def _agree(world: World, job: Job, record: dict, source: SourceModel):
    """Every rank runs the same job, with the same coordinator, and can hold the largest layer."""
    world.agree("the job (model, dataset, recipe and sampling arguments)", record["fingerprint"])
    world.agree("the coordinator", job.coordinator)
    routed = job.moe_calibrate == "routed"
    check_layer_fits(source.layer_bytes(streamed=routed), world.gather_objects(world.memory_for_a_layer()),
                     None if routed else source.layer_bytes(streamed=True))


def _compare(before: float, output_dir: str, dataset: str, samples: int, seq_len: int, text_column: str):
    after = perplexity(output_dir, dataset, samples, seq_len, text_column)
    print(f"perplexity on {samples} held-out samples: before {before:.3f}, after {after:.3f} (x{after / before:.4f})")


def _sized(job: Job) -> Job:
    if job.num_samples <= 0 or job.chunk_size <= 0:
        raise UsageError("--num-samples and --chunk-size must be positive")
    if job.seq_len < 2:
        raise UsageError(f"--seq-len must be at least 2 tokens (got {job.seq_len})")
    return job


def _recipe(recipe, options: Recipe) -> Recipe:
    """The recipe given, or the one the GPTQ options make; not both."""
    if recipe is None:
        return options
    if options != Recipe():
        raise UsageError("give either a recipe or GPTQ options (scheme, group size, asym, actorder, dampening, "
                         "block size, ignore), not both")
    return read_recipe(recipe)


def _open(job: Job, state_dir: str, destination: Destination, coordinator: str | None, allow_long_seq: bool,
          collective_timeout: float):
    """Everything checkable before any work: where state and output go, the model's weights, the sequence
    length, the output, the recipe against the model (each pass's modules resolved), the names of the checkpoint
    the export would write (exportable.py); then the state (an object store's retries within half the collective
    timeout, so that peers wait them out), each pass's state and records (`_kept`: the job's last), the job's record,
    each quantized module's scheme (computed once a run: the runner and the export take them) and the passes."""
    state = StateStore(state_dir, retry_s=collective_timeout / 2)
    check_locations(job.model, state, destination)
    records = open_records(state, coordinator)
    job = dataclasses.replace(job, coordinator=records.url)  # given, or job.json's
    source = SourceModel(job.model, job.trust_remote_code, job.attention)
    source.check_weights()
    check_seq_len(job.seq_len, source.config, source.family, allow_long_seq)
    job = dataclasses.replace(job, recipe=job.recipe.with_default_mappings(source.family, source.config))
    schemes = job.recipe.module_schemes(source.skeleton, source.family)
    check_exportable(source, schemes, job.recipe.quantization_config(source.skeleton, schemes), written_names,
                     job.trust_remote_code)
    record = job_record(job, source.digest(), source.num_layers)
    metrics.job(record["fingerprint"])
    destination.check(record["fingerprint"], state.root)
    passes = plan_passes(job.recipe, source, schemes)
    return job, _kept(passes, state, records, coordinator), source, record, schemes, passes


def _record_faults(state: StateStore, world: World, runner: Runner):
    """Faults this process sees go to events.jsonl, history for `status`: a SIGTERM (a spot notice) and a
    silent rank seen by any rank; returns the recorder for the others. Never raises: it runs on the way out."""
    def fault(kind: str, **fields):
        try:
            state.append_event(events.fault(kind, runner.epoch, world.rank, socket.gethostname(), **fields))
        except Exception as e:  # a full or unreachable disk must not stop the way out
            log.warning("could not record the %s event: %s", kind, e)

    signals.on_request(lambda: fault("sigterm"))
    world.on_lost = lambda reason: fault("liveness", reason=reason)
    return fault


def _kept(passes: list[Pass], state: StateStore, records: Records, coordinator: str | None
          ) -> list[tuple[StateStore, Records]]:
    """Each pass's state and records: the last pass's are the job's, the others' their folders of it (layout.stage),
    with their records in them or under the coordinator's prefix."""
    return [(state, records) if p.last else (state.stage(p.folder), open_records(state, coordinator, p.folder))
            for p in passes]


def _claim_on_rank_0(world: World, kept: list[tuple[StateStore, Records]], record: dict, job: Job, restart: bool,
                     destination: Destination, num_layers: int):
    """Rank 0 claims the state and the output (`_claim`), every rank learns its error, if any (a UsageError on
    every rank), then attaches to each pass's records."""
    claim = _claim(kept, record, job, restart, destination) if world.rank == 0 else None
    if error := world.broadcast_object(claim):
        raise UsageError(error)
    for _, records in kept:
        records.attach(world.rank, world.size, num_layers)


def _claim(kept: list[tuple[StateStore, Records]], record: dict, job: Job, restart: bool,
           destination: Destination) -> str | None:
    """Rank 0: resume the state, or start the job there with freshly drawn calibration samples (which
    also surfaces dataset errors before any foreign state is touched); then claim the output. Errors travel to
    every rank as text. `kept`: each pass's state and records, the job's last."""
    try:
        _claim_state(kept, record, job, restart)
        destination.claim(record["fingerprint"])
    except UsageError as e:
        return str(e)
    return None


def _claim_state(kept: list[tuple[StateStore, Records]], record: dict, job: Job, restart: bool):
    """Resume the state, or start the job there (each pass's records with it)."""
    state, _ = kept[-1]
    if not restart and state.holds(record):
        log.info("state %s belongs to this job: resuming", state.root)
        for where, records in kept:
            records.adopt(record, where.root)
        if state.job()["job"].get("coordinator") != record["job"]["coordinator"]:
            state.write_json(layout.JOB, {**state.job(), "job": record["job"]})  # where readers find it
        state.remove_debris()
        _restore_tokens(state, job)
        return
    state.claim(record, _draw(job), restart=restart)
    for where, records in kept:
        records.claim(record, where.root)


def _draw(job: Job):
    """The job's calibration samples, drawn from its dataset: deterministic for the same dataset. A recipe that
    needs none (round to nearest without static inputs) reads no dataset."""
    if not job.recipe.calibrates:
        return torch.zeros(0, job.seq_len, dtype=torch.int64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(job.model, trust_remote_code=job.trust_remote_code)
    return calibration_samples(job.dataset, tokenizer, job.num_samples, job.seq_len, job.seed, job.text_column)


def _restore_tokens(state: StateStore, job: Job):
    """A lost or damaged tokens.safetensors is drawn again, and kept only if job.json's digest vouches for it:
    the committed layers stay valid, where --restart would throw them away."""
    try:
        state.tokens()
    except CorruptStateError as e:
        log.warning("%s: drawing the calibration samples again from the dataset", e)
        state.restore_tokens(_draw(job))


def plan(model: str, world_size: int, recipe: Recipe | None = None, layers: int | None = None,
         all_experts: bool = True) -> list[str]:
    """The weight-parallel GPTQ plan of every layer, as text, consecutive layers with the same plan once; needs
    only the model's config.json. `all_experts`: grouped as `run --moe-calibrate all` (its default) groups them."""
    recipe = recipe or Recipe()
    source = SourceModel(model)
    names = list(recipe.module_schemes(source.skeleton, source.family))
    lines = [f"{source.config.model_type}: {source.num_layers} layers, {len(names)} GPTQ modules, world size "
             f"{world_size}; seconds per rank as modeled for one CPU thread of an AMD EPYC (plan.py, CostModel)"]
    runs: list[tuple[int, int, list[str]]] = []  # (first layer, last layer, their plan)
    for index in range(source.num_layers if layers is None else min(layers, source.num_layers)):
        prefix = f"{source.layer_prefix}{index}."
        local = [n[len(prefix):] for n in names if n.startswith(prefix)]
        groups = layer_groups(source.layers[index], local, source.family.input_key(all_experts))
        described = describe(make_plan(groups, world_size))
        if runs and runs[-1][2] == described:
            runs[-1] = (runs[-1][0], index, described)
        else:
            runs.append((index, index, described))
    for first, last, described in runs:
        lines.append(f"layer {first}:" if first == last else f"layers {first}-{last}:")
        lines.extend(described)
    return lines
