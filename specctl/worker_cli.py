"""The reference worker's ``specctl`` subcommands: ``train-heads``, ``worker``, ``load``.

Registered by ``specctl/cli.py`` through ``add_worker_commands``; kept here
so the worker side stays in one place.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from worker.reference.threads import set_threads

def _use_device(command: str, device: str) -> bool:
    """Make ``device`` the default of ``load_model`` for this process (the
    drafters' heads and their training follow the target there); False, after
    saying why, when torch cannot use it."""
    from worker.reference.models import set_default_device

    try:
        set_default_device(device)
    except ValueError as err:
        print(f"specctl {command}: --device: {err}", file=sys.stderr)
        return False
    return True


def _train_heads(args: argparse.Namespace) -> int:
    from worker.reference.heads import TrainConfig, train_heads
    from worker.reference.models import ModelUnavailableError

    if not _use_device("train-heads", args.device):
        return 2
    set_threads(args.threads)
    cfg = TrainConfig(kind=args.drafter, epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay,
                      draft_vocab=args.draft_vocab, num_heads=args.num_heads, held_out=args.held_out,
                      unroll=args.unroll, seed=args.seed)
    try:
        import glob

        extra = sorted(f for pattern in args.extra_text for f in glob.glob(pattern, recursive=True))
        if args.extra_text and not extra:
            raise FileNotFoundError(f"--extra-text matched no file: {args.extra_text}")
        train_heads(args.drafter, args.model, args.prompts, args.out, config=cfg, max_new_tokens=args.max_new_tokens,
                    gen_batch=args.gen_batch, limit=args.limit, extra_text=extra, extra_tokens=args.extra_tokens,
                    samples=args.samples, temperature=args.sample_temperature,
                    tune_kernels=args.kernels == "tuned", jobs=args.jobs, train_threads=args.train_threads)
    except (ModelUnavailableError, FileNotFoundError, ValueError) as err:
        print(f"specctl train-heads: {err}", file=sys.stderr)
        return 2
    return 0


def controller_targets(args: argparse.Namespace) -> str | None:
    """``--controller`` as the agent takes it: every replica given, comma-separated
    (``SpeculationAgent`` splits them), or None without the flag. A malformed address
    raises ValueError naming it."""
    if not args.controller:
        return None
    from worker.sdk.placement import Targets

    return ",".join(Targets(args.controller).entries)


def _worker(args: argparse.Namespace) -> int:
    from worker.reference.models import ModelUnavailableError
    from worker.sdk.security import ClientSecurity, ClientSecurityError
    from worker.reference.server import WorkerOptions, run_worker

    try:
        security = ClientSecurity.from_args(args)
    except ClientSecurityError as err:
        print(f"specctl worker: {err}", file=sys.stderr)
        return 2
    if not _use_device("worker", args.device):
        return 2
    try:
        controller = controller_targets(args)
    except ValueError as err:
        print(f"specctl worker: --controller: {err}", file=sys.stderr)
        return 2
    if args.catch_up_window < 0:
        print(f"specctl worker: --catch-up-window: must be >= 0 tokens (0 = all), got {args.catch_up_window}",
              file=sys.stderr)
        return 2
    set_threads(args.threads)
    opts = WorkerOptions(model=args.model, drafter=args.drafter, heads=args.heads, controller=controller,
                         listen=args.listen, worker_id=args.worker_id, max_batch=args.max_batch,
                         fallback_depth=args.fallback_depth, static=args.static, heads_poll_s=args.heads_poll,
                         security=security, kernels=args.kernels, calibrate=not args.no_calibrate,
                         calibration=args.calibration or "", catch_up_window=args.catch_up_window,
                         verify_layout=args.verify_layout)
    try:
        return run_worker(opts)
    except (ModelUnavailableError, FileNotFoundError, ValueError) as err:
        print(f"specctl worker: {err}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    """``specctl calibrate``: measure the step-cost table (worker.reference.engine.step_costs) and write it."""
    import time
    from pathlib import Path

    import torch

    from worker.reference.engine.step_costs import (DEFAULT_GRIDS, SHAPE_DRAFT_VOCAB, StepGrid, build_shape_model,
                                                     dump_step_table, measure_step_table)
    from worker.reference.models import ModelUnavailableError, default_device, load_model

    def fail(message: str) -> int:
        print(f"specctl calibrate: {message}", file=sys.stderr)
        return 2

    if not _use_device("calibrate", args.device):
        return 2
    reference = None
    if args.compare:  # read first: a typo must not cost a whole measurement
        from worker.sim.measured import load_table

        try:
            reference = load_table(args.compare)
        except ValueError as err:
            return fail(f"--compare {args.compare}: {err}")
    device = default_device()
    defaults = DEFAULT_GRIDS["cpu" if device.type == "cpu" else "cuda"]
    try:
        grid = StepGrid.parse(args.batches or defaults["batches"], args.tokens or defaults["tokens"],
                              args.contexts or defaults["contexts"], args.widths or defaults["widths"],
                              args.repeats or defaults["repeats"], args.max_kv_tokens or defaults["max_kv_tokens"])
    except ValueError as err:
        return fail(str(err))
    set_threads(args.threads)
    tuned = args.kernels == "tuned" and device.type == "cpu"
    log = lambda message: print(message, flush=True)  # noqa: E731
    started = time.perf_counter()
    try:
        if args.shape:
            model = build_shape_model(args.shape, device, seed=args.seed)  # refuses a GPU shape on the CPU
            name, note = args.shape, f"--shape {args.shape}: random weights ({model.dtype})"
            if tuned:
                from worker.reference.engine.kernels import tune_model

                tune_model(model, log=log)
        else:
            name = args.model or "smollm2-135m"
            lm = load_model(name, tune_kernels=tuned, log=log)
            model, note = lm.model, f"--model {name} ({lm.source}, {lm.model.dtype})"
            for p in model.parameters():
                p.requires_grad_(False)
        table = measure_step_table(model, grid, name, heads_dir=args.heads, seed=args.seed, note=note, log=log,
                                   draft_vocab=args.draft_vocab or SHAPE_DRAFT_VOCAB.get(args.shape))
    except (ModelUnavailableError, FileNotFoundError, ValueError) as err:
        return fail(str(err))
    except torch.OutOfMemoryError as err:
        return fail(f"{device} ran out of memory ({str(err).splitlines()[0]}); lower --max-kv-tokens, --batches, "
                    "--tokens or --contexts")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_step_table(table))
    from worker.sim.measured import load_table  # the simulator's own reader: the table must load there

    try:
        load_table(out)
    except ValueError as err:
        return fail(f"wrote {out}, but the simulator cannot read it: {err}")
    log(f"wrote {out}: {len(table['verify'])} verify and {len(table['draft'])} draft shapes in "
        f"{time.perf_counter() - started:.0f} s. Use it as `specctl worker --calibration {out}` (the Hello's "
        f"calibration) or as `cost_table: {out}` of a scenario worker (the simulator's step costs)")
    if reference is not None:
        import json

        from worker.sim.table_compare import compare_tables

        comparison = compare_tables(load_table(out), reference)
        for line in comparison.lines():
            log(line)
        compared = out.with_name(f"{out.stem}-vs-{Path(reference.source).stem}.json")
        compared.write_text(json.dumps(comparison.to_json(), indent=1))
        log(f"wrote {compared}")
    return 0


def _load(args: argparse.Namespace) -> int:
    from worker.reference.load import run_load

    return run_load(args.worker, rate=args.rate, concurrency=args.concurrency, prompts=args.prompts,
                    duration_s=args.duration, requests=args.requests, max_new_tokens=args.max_new_tokens,
                    seed=args.seed, out=args.out)


KERNELS_HELP = ("linear-layer kernels on the CPU: 'tuned' (row-count-aware, timed on first use and cached; "
                "worker.reference.engine.kernels) or 'default' (torch's F.linear)")
LAYOUT_HELP = ("how a step's draft trees reach the target's forward: 'packed' (default: the matrix products run on "
               "each row's real entries only, worker.reference.engine.packing) or 'padded' (every row pays for the "
               "widest block); the worker's Hello tells the controller which")
DEVICE_HELP = ("torch device of the target model and its KV cache (default cpu; e.g. cuda, cuda:1). Off the CPU "
               "tree verification runs through cascade attention (worker.reference.engine.cascade) and the tuned "
               "CPU kernels are not used; medusa and eagle heads run (and train) where the target is")


def add_worker_commands(sub) -> None:
    """Add ``train-heads``, ``worker``, ``load`` and ``calibrate`` to a subparsers object."""
    from worker.reference.heads.config import DEFAULT_DATA, GEN_BATCH, DistillData, TrainConfig

    train_defaults = TrainConfig()
    th = sub.add_parser("train-heads", help="train Medusa or EAGLE draft heads by self-distillation")
    th.add_argument("--drafter", required=True, choices=["medusa", "eagle"])
    th.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or checkpoint dir")
    th.add_argument("--prompts", default="all", help="prompt set (chat, code, math, summarise, all) or a JSONL file")
    th.add_argument("--out", required=True, help="heads directory (holds <drafter>.safetensors + .json)")
    th.add_argument("--max-new-tokens", type=int, default=DistillData.max_new_tokens,
                    help=f"length of the target's answers (default {DistillData.max_new_tokens})")
    th.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    th.add_argument("--epochs", type=int, default=train_defaults.epochs)
    th.add_argument("--lr", type=float, default=train_defaults.lr)
    th.add_argument("--weight-decay", type=float, default=train_defaults.weight_decay, help="AdamW weight decay")
    th.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0 = full)")
    th.add_argument("--num-heads", type=int, default=4, help="medusa: heads (max depth); eagle: report depth")
    th.add_argument("--unroll", type=int, default=train_defaults.unroll,
                    help="eagle: training passes on its own predictions")
    th.add_argument("--held-out", type=float, default=0.1, help="fraction of prompts held out for the report")
    th.add_argument("--gen-batch", type=int, default=GEN_BATCH,
                    help=f"batch size while the target answers (default {GEN_BATCH})")
    per_kind = ", ".join(f"{d.samples} for {kind}" for kind, d in DEFAULT_DATA.items())
    th.add_argument("--samples", type=int, default=None,
                    help=f"sampled answers per training prompt on top of the greedy one (default {per_kind})")
    th.add_argument("--sample-temperature", type=float, default=DistillData.temperature,
                    help=f"temperature of the sampled answers (default {DistillData.temperature})")
    th.add_argument("--extra-text", action="append", default=[], metavar="GLOB",
                    help="also learn from these text files (target features by prefill, no generation; repeatable)")
    th.add_argument("--extra-tokens", type=int, default=50_000, help="cap on extra-text tokens (default 50000)")
    th.add_argument("--seed", type=int, default=0)
    th.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    th.add_argument("--jobs", type=int, default=0,
                    help="processes that generate distillation parts at once, --threads each (default 0: one per "
                         "--threads cores)")
    th.add_argument("--train-threads", type=int, default=0,
                    help="torch threads while the heads train (default 0: --threads); alone on the machine, "
                         "its core count")
    th.add_argument("--kernels", choices=["tuned", "default"], default="tuned", help=KERNELS_HELP)
    th.add_argument("--device", default="cpu", help=DEVICE_HELP + " (off the CPU the answers come from this "
                    "process alone: --jobs is 1)")
    th.set_defaults(func=_train_heads)

    wk = sub.add_parser("worker", help="reference worker: real model + drafter, HTTP generate endpoint, agent")
    wk.add_argument("--model", default="smollm2-135m")
    wk.add_argument("--drafter", default="eagle", choices=["none", "ngram", "medusa", "eagle"])
    wk.add_argument("--heads", help="heads directory (default: cached heads, trained on first use)")
    wk.add_argument("--heads-poll", type=float, default=0.0, metavar="S",
                    help="check --heads every S seconds and roll to new heads a retraining job wrote (0 = off)")
    wk.add_argument("--controller", action="append", metavar="HOST:PORT",
                    help="the controller (omit: static decisions). Several replicas: repeat the flag or separate "
                         "them with commas, or give one dns:///NAME:PORT that resolves to several; the worker "
                         "picks one by rendezvous hashing of its id and fails over to the next")
    wk.add_argument("--listen", default="127.0.0.1:8471", help="HOST:PORT of the HTTP endpoint")
    wk.add_argument("--worker-id", default="", help="default: ref-<hostname>-<port>")
    wk.add_argument("--max-batch", type=int, default=8)
    wk.add_argument("--fallback-depth", type=int, default=3, help="chain depth until the first plan arrives")
    wk.add_argument("--catch-up-window", type=int, default=0, metavar="TOKENS",
                    help="eagle: a request switched on catches up on at most its newest TOKENS skipped tokens "
                         "(0 = all; bounds a switch-on at long contexts for some acceptance, see "
                         "docs/reference-worker.md)")
    wk.add_argument("--static", default="", help="without a controller: DEPTH[xWIDTH[:NODES]] (default: fallback)")
    wk.add_argument("--threads", type=int, default=1)
    wk.add_argument("--kernels", choices=["tuned", "default"], default="tuned", help=KERNELS_HELP)
    wk.add_argument("--verify-layout", choices=["packed", "padded"], default="packed", help=LAYOUT_HELP)
    wk.add_argument("--device", default="cpu", help=DEVICE_HELP)
    wk.add_argument("--no-calibrate", action="store_true",
                    help="skip timing the verify step at start-up (the controller then learns costs from traffic only)")
    wk.add_argument("--calibration", metavar="FILE",
                    help="send this step-cost table (written by `specctl calibrate` for the same model and device) "
                         "as the Hello's calibration instead of timing at start-up")
    from worker.sdk.security import add_client_security_args

    add_client_security_args(wk)  # --tls, --tls-ca, --tls-cert/--tls-key, --token/--token-file
    wk.set_defaults(func=_worker)

    ld = sub.add_parser("load", help="drive a worker's generate endpoint with prompts")
    ld.add_argument("--worker", default="127.0.0.1:8471", help="HOST:PORT of the worker")
    ld.add_argument("--rate", type=float, default=0.0, help="arrivals per second (0 = closed loop)")
    ld.add_argument("--concurrency", type=int, default=1, help="requests in flight at most")
    ld.add_argument("--prompts", default="chat", help="prompt set or JSONL file")
    ld.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    ld.add_argument("--requests", type=int, default=0, help="stop after N requests (0 = by duration)")
    ld.add_argument("--max-new-tokens", type=int, default=64)
    ld.add_argument("--seed", type=int, default=0)
    ld.add_argument("--out", default="", help="write per-request results to this JSON file")
    ld.set_defaults(func=_load)

    cal = sub.add_parser("calibrate", help="measure the served model's verify and draft costs on this device into "
                                           "one table (Hello calibration and simulator step costs)")
    what = cal.add_mutually_exclusive_group()
    what.add_argument("--model", help="model the worker serves: name, .gguf file or checkpoint dir "
                                      "(default smollm2-135m)")
    what.add_argument("--shape", help="random weights of a shape instead: llama-3-8b (a GPU's; refused on the "
                                      "CPU) or tiny")
    cal.add_argument("--device", default="cpu", help="torch device to measure on: cpu (default), cuda, cuda:N")
    cal.add_argument("--compare", metavar="TABLE",
                     help="then price the new table's points with TABLE too (a name in worker/sim/hardware_tables, "
                          "e.g. h200-llama3-8b.json, or a path): step-time ratios and the ratios of q tokens over 1 "
                          "token per batch, printed and written to OUT-vs-TABLE.json (worker.sim.table_compare)")
    cal.add_argument("--out", required=True, metavar="FILE.json", help="where to write the table")
    cal.add_argument("--batches", help="requests per forward, comma-separated (default cpu 1,2,4,8; "
                                       "cuda 1,2,...,256)")
    cal.add_argument("--tokens", help="tokens per request in a verify, 1 = plain decode (default 1,2,4,8,16)")
    cal.add_argument("--contexts", help="cached tokens per request (default cpu 128,512,2048; "
                                        "cuda 1024,8192,32768)")
    cal.add_argument("--widths", help="tokens per request in one draft level (default cpu 1,2,4; cuda 1,4,8)")
    cal.add_argument("--repeats", type=int, default=0, help="timed calls per shape, median kept (default cpu 5, "
                                                          "cuda 15)")
    cal.add_argument("--max-kv-tokens", type=int, default=0,
                     help="leave out shapes whose batch x context passes this (default 524288)")
    cal.add_argument("--heads", help="EAGLE heads directory for the draft level (default: the cached ones of "
                                     "--model, else a head of its shape on random weights)")
    cal.add_argument("--draft-vocab", type=int, default=0,
                     help="draft vocabulary of a random head (default min(8192, vocab); 32000 for llama-3-8b)")
    cal.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as `specctl worker`)")
    cal.add_argument("--kernels", choices=["tuned", "default"], default="tuned", help=KERNELS_HELP)
    cal.add_argument("--seed", type=int, default=0)
    cal.set_defaults(func=_calibrate)


def add_bench_engine_options(bench) -> None:
    """Options of ``specctl bench engine`` (added to the shared ``bench`` parser)."""
    g = bench.add_argument_group("engine", "options of `bench engine` (the reference engine on a real model)")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--batches", default="1,4,8", help="comma-separated batch sizes (default 1,4,8)")
    g.add_argument("--prompts", type=int, default=8, help="held-out prompts per run (default 8)")
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--depths", default="1,2,4", help="static chain depths (default 1,2,4)")
    g.add_argument("--trees", default="2x4:5,3x2:5,4x2:6,4x4:12",
                   help="static trees DEPTHxWIDTH:NODES, comma-separated, clamped to each drafter's limits "
                        "(default 2x4:5,3x2:5,4x2:6,4x4:12; '' = chains only)")
    g.add_argument("--drafters", default="ngram,medusa,eagle,oracle")
    g.add_argument("--engine-policy", default="goodput", help="controller preset for the controlled runs ('' = none)")
    g.add_argument("--heads", help="heads directory (default: cached, trained on first use)")
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--kernels", choices=["tuned", "default"], default="tuned", help=KERNELS_HELP)
    g.add_argument("--verify-layout", choices=["packed", "padded"], default="packed", help=LAYOUT_HELP)
    g.add_argument("--device", default="cpu", help=DEVICE_HELP + " (off the CPU speedups are on wall time: "
                   "a thread's CPU time does not count the device's work)")
    g.add_argument("--no-confirm", dest="confirm", action="store_false",
                   help="skip the second pass (each drafter's hindsight-best static shape against fresh cold and "
                        "warm controllers in a lockstep of their own: no winner's curse of a best-of-seven pick)")
    g.add_argument("--warmup-prompts", type=int, default=8,
                   help="held-out prompts outside the evaluation set that the warm controller decodes untimed "
                        "before each batch size (default 8; 0 = the cold controller only)")
    g.add_argument("--warmup", choices=["alone", "crowd", "both"], default="alone",
                   help="where the warm controller decodes its warm-up prompts: 'alone' (default), by itself; "
                        "'crowd', in a lockstep of every configuration of the timed one, the conditions it is "
                        "timed in (twice the run time); 'both': a second warm controller (goodput-warm-alone) "
                        "warmed alone beside the crowd-warmed one, timed in the same locksteps")
    g.add_argument("--challenger-policy", default="", metavar="FILE",
                   help="a policy file (or preset name) for one more warm controller (goodput-challenger), warmed "
                        "where the warm one is and timed beside it in every lockstep: two policy configurations "
                        "compared paired (challenger_vs_warm); e.g. bench/challengers/goodput-no-probes.yaml")


def bench_engine(args: argparse.Namespace) -> int:
    from bench.engine import run_engine_bench

    if not _use_device("bench engine", args.device):
        return 2
    overrides = _controller_overrides(getattr(args, "config", None))
    if overrides is None:
        return 2
    if args.challenger_policy:
        from bench.engine import check_challenger

        try:
            check_challenger(args.challenger_policy, args.warmup_prompts)
        except ValueError as err:
            print(f"specctl bench engine: --challenger-policy: {err}", file=sys.stderr)
            return 2
    return run_engine_bench(
        out_dir=args.out, model_name=args.model, batches=tuple(int(b) for b in args.batches.split(",")),
        prompts=args.prompts, max_new_tokens=args.max_new_tokens,
        depths=tuple(int(d) for d in args.depths.split(",")), drafters=tuple(args.drafters.split(",")),
        policy=args.engine_policy, threads=args.threads, heads_dir=args.heads, warmup_prompts=args.warmup_prompts,
        kernels=args.kernels, trees=_tree_shapes(args.trees), controller_overrides=overrides, confirm=args.confirm,
        verify_layout=args.verify_layout, warmup=args.warmup, challenger_policy=args.challenger_policy)


def _controller_overrides(path: str | None) -> dict | None:
    """``--config``'s sections for the engine benchmark's controllers, checked
    against the controller config; ``{}`` without one, None (after an error
    naming the file and the field) when it does not load or validate."""
    if not path:
        return {}
    import yaml
    from pydantic import ValidationError

    from bench.engine import engine_controller_config

    try:
        overrides = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"top level is a {type(overrides).__name__}, expected a mapping of config sections")
        engine_controller_config("goodput", "", overrides)
    except (OSError, ValueError, yaml.YAMLError, ValidationError) as err:
        print(f"specctl bench engine: --config {path}: {err}", file=sys.stderr)
        return None
    return overrides


def _tree_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"2x4:5,4x2"`` -> ``((2, 4, 5), (4, 2, 8))`` (the ``--static`` syntax of ``specctl worker``)."""
    from policies.table import Decision
    from worker.reference.server import parse_static

    decs = [parse_static(t.strip(), Decision.off()) for t in text.split(",") if t.strip()]
    return tuple((d.depth, d.width, d.max_nodes) for d in decs if d.speculate)
