"""Command line: arguments only; everything else lives behind `api.oneshot` (a restart's reads begin here, before
it is imported: read_ahead.py)."""

import argparse
import contextlib
import errno
import gc
import logging
import os
import sys

from elastic_oneshot.errors import StaleEpochError, StorageError, UsageError, exit_now, report
from elastic_oneshot.surface.progress import close_all


class _Presets:
    """--scheme's choices: compressed-tensors' presets (schemes.PRESETS), imported only when a --scheme is given or
    listed, so that the other commands' arguments parse without importing compressed-tensors (seconds)."""

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())

    @staticmethod
    def _names() -> tuple[str, ...]:
        from elastic_oneshot.quantization.schemes import PRESETS

        return PRESETS


SCHEMES = _Presets()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-oneshot", description="Elastic, resumable compression: GPTQ, and "
                                "llmcompressor's recipes.")
    sub = p.add_subparsers(dest="command", required=True)
    _run_arguments(sub.add_parser("run", help="compress a model (run again to resume)"))
    _other_commands(sub)
    return p


def _run_arguments(run):
    run.add_argument("--model", help="Hugging Face model directory (default: the embedded SmolLM2-135M)")
    run.add_argument("--dataset", default="builtin",
                     help="builtin, a .jsonl/.json/.txt/.parquet file, a save_to_disk directory, or a hub name")
    run.add_argument("--text-column", default="text")
    run.add_argument("--recipe", help="llmcompressor recipe: a YAML file (or text) of GPTQModifier or "
                     "QuantizationModifier, after SmoothQuantModifier, AWQModifier, SparseGPTModifier; replaces "
                     "--scheme and the GPTQ options below")
    run.add_argument("--scheme", default="W4A16", choices=SCHEMES, metavar="SCHEME",
                     help="a compressed-tensors preset scheme, such as W4A16 (the default), W8A8, FP8, FP8_BLOCK, "
                          "NVFP4 or MXFP4; an unknown name lists them all")
    run.add_argument("--num-samples", type=int, default=128)
    run.add_argument("--seq-len", type=int, default=512)
    run.add_argument("--allow-long-seq", action="store_true",
                     help="allow --seq-len past the model's context (max_position_embeddings)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--group-size", type=int, help="int weights: default the scheme's (128); -1 for per-channel")
    run.add_argument("--asym", action="store_true", help="int weights: asymmetric quantization (with zero points)")
    run.add_argument("--actorder", default="static", choices=["static", "none"])
    run.add_argument("--dampening-frac", type=float, default=0.01)
    run.add_argument("--block-size", type=int, default=128)
    run.add_argument("--ignore", action="append", default=[],
                     help="module name or re:pattern to leave unquantized (repeatable; lm_head always)")
    run.add_argument("--chunk-size", type=int, default=8, help="calibration samples per chunk file")
    run.add_argument("--attention", default="eager", choices=["eager", "sdpa"],
                     help="eager reproduces llmcompressor's numerics; sdpa is faster, equal to the last bits")
    run.add_argument("--moe-calibrate", default="all", choices=["all", "routed"],
                     help="MoE: every expert calibrates on every token (all), or only on its routed tokens")
    run.add_argument("--state", help="state directory, or an s3:// gs:// az:// URL (default: OUTPUT.state)")
    run.add_argument("--output", help="output directory (default: MODEL-SCHEME)")
    run.add_argument("--restart", action="store_true", help="discard a state directory of another job")
    run.add_argument("--model-changed", choices=["refuse", "redo"], default="refuse",
                     help="when the model's tensors differ from those the committed layers were computed from (a "
                          "model edited in place): refuse in one line (default), or redo from the first changed "
                          "layer")
    run.add_argument("--trust-remote-code", action="store_true")
    run.add_argument("--eval-samples", type=int, default=0,
                     help="print perplexity on this many held-out samples before and after")
    run.add_argument("--boundary-every", default="auto", metavar="{auto,N,0}",
                     help="write every rank's activations to the state every N layers (0: never), or when Young "
                          "and Daly's interval says (auto); commits never wait for them (see docs/operations.md)")
    run.add_argument("--mtbf", type=float, metavar="SECONDS",
                     help="expected time between failures for --boundary-every auto (default: the job's own, "
                          "from its restarts, else an hour)")
    run.add_argument("--max-memory", metavar="BYTES",
                     help="bound a layer's working set on each rank's device, e.g. 24GB (default: 80 %% of what it "
                          "has free): a layer of many experts is calibrated and solved in batches that fit, and "
                          "under --moe-calibrate routed one more than half of it reads its experts with their batch")
    run.add_argument("--collective-timeout", type=float, default=60.0,
                     help="seconds before a collective gives up on a silent rank (under torchrun)")
    run.add_argument("--coordinator", metavar="URL",
                     help="keep epochs and commits in etcd: etcd://HOST:PORT/PREFIX[?cacert=&cert=&key=&user="
                          "&password=] (see elastic_oneshot/etcd_records.py); files stay in --state")
    run.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="serve Prometheus metrics on this port plus the local rank (default: "
                          "ELASTIC_ONESHOT_METRICS_PORT; 0 or unset: none; see docs/operations.md)")



def _other_commands(sub):
    st = sub.add_parser("status", help="progress, ETA, world sizes, restarts and time lost, from a state directory")
    st.add_argument("--state", required=True)
    st.add_argument("--json", action="store_true", help="the same facts as JSON (one line per refresh)")
    st.add_argument("--plot", metavar="PNG", help="also draw layer commits over time to this PNG")
    st.add_argument("--watch", action="store_true", help="refresh until every layer is committed")

    export = sub.add_parser("export", help="write the checkpoint of a finished state")
    export.add_argument("--state", required=True)
    export.add_argument("--output", required=True, help="a directory, or an object-store prefix (s3://...)")

    pl = sub.add_parser("plan", help="preview the weight-parallel GPTQ plan without running; or, with --fleet, the "
                        "time, cost and risk of the job on spot GPU nodes")
    pl.add_argument("--model", required=True, help="model directory, or just its config.json")
    pl.add_argument("--world-size", type=int, help="ranks of the weight-parallel plan (without --fleet)")
    pl.add_argument("--scheme", default="W4A16", choices=SCHEMES, metavar="SCHEME")
    pl.add_argument("--group-size", type=int)
    pl.add_argument("--ignore", action="append", default=[])
    pl.add_argument("--layers", type=int, default=None, help="show only the first N layers (without --fleet)")
    _fleet_arguments(pl)

    ev = sub.add_parser("eval", help="perplexity of a model over held-out samples")
    ev.add_argument("--model", required=True)
    ev.add_argument("--dataset", default="builtin")
    ev.add_argument("--text-column", default="text")
    ev.add_argument("--num-samples", type=int, default=16)
    ev.add_argument("--seq-len", type=int, default=512)


def _fleet_arguments(pl):
    """`plan --fleet`'s options: None when not given (fleet.Fleet holds the defaults stated here)."""
    from elastic_oneshot.surface.fleet import ACCELERATORS, Fleet

    d = Fleet()
    pl.add_argument("--fleet", action="store_true",
                    help="predict wall time (expected, p10, p90), GPU-hours and cost on MIN..MAX spot nodes, beside "
                         "restarting from scratch and one on-demand node (docs/operations.md)")
    fl = pl.add_argument_group("--fleet")
    fl.add_argument("--samples", type=int, help=f"calibration samples (default {d.samples})")
    fl.add_argument("--seq-len", type=int, help=f"tokens per sample (default {d.seq_len})")
    fl.add_argument("--accelerator", choices=list(ACCELERATORS),
                    help=f"GPU, by its datasheet (default {d.accelerator})")
    fl.add_argument("--nodes", metavar="MIN:MAX", help=f"node counts to compare (default {d.nodes[0]}:{d.nodes[1]})")
    fl.add_argument("--gpus-per-node", type=int, help=f"(default {d.gpus_per_node})")
    fl.add_argument("--mtbp-hours", type=float, help=f"mean time between preemptions of one node (default "
                    f"{d.mtbp_hours:g}; inf: never)")
    fl.add_argument("--replacement-minutes", type=float,
                    help=f"time a replacement node takes to arrive (default {d.replacement_minutes:g})")
    fl.add_argument("--storage-gbps", type=float,
                    help=f"GB/s per node to and from the state and the model (default {d.storage_gbps:g})")
    fl.add_argument("--spot-price", type=float, help=f"$ per GPU-hour (default {d.spot_price}, an H100's)")
    fl.add_argument("--on-demand-price", type=float, help=f"$ per GPU-hour (default {d.on_demand_price}, an H100's)")
    fl.add_argument("--moe-calibrate", choices=["all", "routed"], help=f"as for run (default {d.moe_calibrate})")
    fl.add_argument("--seed", type=int, help=f"of the Monte Carlo (default {d.seed})")
    fl.add_argument("--trials", type=int, help=f"Monte Carlo trials per node count (default {d.trials})")
    fl.add_argument("--calibrate", action="store_true",
                    help="replace the datasheet by this machine: run one layer of the model (a directory with its "
                         "weights) on min(samples, 8) samples at one thread (forwards and Hessians scaled linearly "
                         "to the busiest rank's), measure the disk and a start; every node and rank is then taken "
                         "to run on this machine, ranks of one thread sharing its cores (bench/fleet_check.py)")
    fl.add_argument("--json", action="store_true", help="the same facts as JSON")
    fl.add_argument("--plot", metavar="PNG", help="also draw wall time and cost by node count (needs matplotlib)")


_OWN_PROCESS = False  # entry(): the process is ours, and so are its collector's settings


def entry(argv=None):
    """`elastic-oneshot` and `python -m elastic_oneshot`: `main`, then the process ends. What it made is frozen first
    (gc.freeze), so that the interpreter's teardown does not traverse every object torch and transformers made, about a
    second of every CLI's and every worker's exit. Nothing is lost: each write of ours is closed (and synced) before
    `main` returns, and atexit handlers and the flushes of stdio still run."""
    global _OWN_PROCESS
    _OWN_PROCESS = True
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's (2 for its errors)
        code = e.code
    if code == 2:  # a usage error: not for torchrun to restart (distributed/agent.py)
        from elastic_oneshot.distributed import agent, signals

        signals.ending()
        agent.end_restarts()
    gc.freeze()
    sys.exit(code)


@contextlib.contextmanager
def _heavy_imports():
    """torch, transformers and compressed-tensors make some 400,000 objects as they import, and almost no garbage. In a
    process of our own the cyclic collector is paused while they import, and what they made is then frozen out of its
    later passes, each of which would otherwise traverse all of it: most of a second of every worker's start and run.
    A caller's process (main() called in it) keeps its collector as it was."""
    if not _OWN_PROCESS:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def main(argv=None) -> int:
    from elastic_oneshot.distributed import signals

    signals.install()  # before any other thread starts
    args = _parser().parse_args(argv)
    quiet = os.environ.get("RANK", "0") != "0"  # under torchrun only rank 0 reports progress
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        _command(args)
    except UsageError as e:
        return _fail(str(e), 2)
    except StorageError as e:
        return _fail(f"{e}: free space or make it writable, then run again to resume", 4)
    except OSError as e:  # a file outside the state's own writes (the export's, the model's)
        where = f" on {e.filename}" if e.filename else ""
        return _fail(f"I/O error{where}: {e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)}): fix it, "
                     "then run again to resume", 4)
    except signals.Preempted as e:
        close_all()
        logging.getLogger("elastic_oneshot").warning("%s; nothing partial was committed: run again to resume", e)
        return signals.EXIT_CODE
    except StaleEpochError as e:
        return _fail(f"fenced off: {e}", 3)
    except RuntimeError as e:
        from elastic_oneshot.distributed.world import lost_line

        if (line := lost_line(e)) is None:
            raise
        _fail(line, 1)
        exit_now(1)  # not through interpreter teardown: a broken process group can abort there (SIGABRT)
    return 0


def _fail(message: str, code: int) -> int:
    """The one line of an error (EXIT_CODES in docs/troubleshooting.md), below the progress bar, not on it."""
    close_all()
    report(message)
    return code


FLEET_ONLY = ("samples", "seq_len", "accelerator", "nodes", "gpus_per_node", "mtbp_hours", "replacement_minutes",
              "storage_gbps", "spot_price", "on_demand_price", "moe_calibrate", "seed", "trials", "calibrate", "plot")


def _plan(args):
    with _heavy_imports():
        from elastic_oneshot.quantization.recipe import Recipe

    def flags(names):
        return ", ".join("--" + n.replace("_", "-") for n in names)

    recipe = Recipe(scheme=args.scheme, group_size=args.group_size, ignore=("lm_head", *args.ignore))
    if args.fleet:
        from elastic_oneshot.surface import fleet

        if given := [n for n in ("world_size", "layers") if getattr(args, n) is not None]:
            raise UsageError(f"{flags(given)}: plan without --fleet only")
        options = fleet.options({n: getattr(args, n) for n in FLEET_ONLY if n not in ("calibrate", "plot")},
                                args.calibrate)
        fleet.show(args.model, recipe, options, as_json=args.json, plot=args.plot, scheme=args.scheme,
                   calibrate=args.calibrate)
        return
    if given := [n for n in (*FLEET_ONLY, "json") if getattr(args, n) not in (None, False) and n != "moe_calibrate"]:
        raise UsageError(f"{flags(given)}: plan --fleet only")
    if args.world_size is None:
        raise UsageError("plan needs --world-size W (the weight-parallel plan), or --fleet (time, cost and risk on "
                         "spot nodes)")
    from elastic_oneshot.surface.api import plan

    print("\n".join(plan(args.model, args.world_size, recipe, args.layers, args.moe_calibrate != "routed")))


def _command(args):
    if args.command == "run":
        from elastic_oneshot.durability.state import default_root
        from elastic_oneshot.loop import read_ahead  # no torch: the rest imports while a restart's reads begin

        ahead = read_ahead.start(args.state or (args.output and default_root(args.output)), args.restart)
        with _heavy_imports():
            from elastic_oneshot.surface.api import oneshot

        ahead.join()
        oneshot(model=args.model, dataset=args.dataset, scheme=args.scheme,
                num_calibration_samples=args.num_samples, max_seq_length=args.seq_len,
                output_dir=args.output, state_dir=args.state, seed=args.seed,
                text_column=args.text_column, group_size=args.group_size, symmetric=not args.asym,
                actorder=None if args.actorder == "none" else args.actorder,
                dampening_frac=args.dampening_frac, block_size=args.block_size,
                ignore=tuple(args.ignore), restart=args.restart, model_changed=args.model_changed,
                trust_remote_code_model=args.trust_remote_code, chunk_size=args.chunk_size,
                moe_calibrate_all_experts=args.moe_calibrate == "all", attention=args.attention,
                eval_samples=args.eval_samples, collective_timeout=args.collective_timeout,
                recipe=args.recipe, coordinator=args.coordinator, allow_long_seq=args.allow_long_seq,
                boundary_every=args.boundary_every, mtbf_s=args.mtbf, metrics_port=args.metrics_port,
                max_memory=args.max_memory)
    elif args.command == "export":
        with _heavy_imports():
            from elastic_oneshot.durability.coordinator import open_records
            from elastic_oneshot.durability.destination import open_destination
            from elastic_oneshot.durability.state import StateStore
            from elastic_oneshot.surface.export import export

        state = StateStore(args.state)
        export(state, open_records(state), open_destination(args.output))
        print(args.output)
    elif args.command == "plan":
        _plan(args)
    elif args.command == "status":
        with _heavy_imports():
            from elastic_oneshot.surface.status import show

        show(args.state, as_json=args.json, plot=args.plot, watch=args.watch)
    elif args.command == "eval":
        with _heavy_imports():
            from elastic_oneshot.surface.evaluate import perplexity

        ppl = perplexity(args.model, args.dataset, args.num_samples, args.seq_len, args.text_column)
        print(f"perplexity {ppl:.4f} on {args.num_samples} held-out samples of {args.seq_len} tokens")
