"""The reference worker's ``specctl`` subcommands: ``train-heads``, ``worker``, ``load``.

Registered by ``specctl/cli.py`` through ``add_worker_commands``; kept here
so the worker side stays in one place.
"""

from __future__ import annotations

import argparse
import sys

from worker.reference.threads import set_threads


def _train_heads(args: argparse.Namespace) -> int:
    from worker.reference.heads import TrainConfig, train_heads
    from worker.reference.models import ModelUnavailableError

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


def _worker(args: argparse.Namespace) -> int:
    from worker.reference.models import ModelUnavailableError
    from worker.sdk.security import ClientSecurity, ClientSecurityError
    from worker.reference.server import WorkerOptions, run_worker

    try:
        security = ClientSecurity.from_args(args)
    except ClientSecurityError as err:
        print(f"specctl worker: {err}", file=sys.stderr)
        return 2
    set_threads(args.threads)
    opts = WorkerOptions(model=args.model, drafter=args.drafter, heads=args.heads, controller=args.controller,
                         listen=args.listen, worker_id=args.worker_id, max_batch=args.max_batch,
                         fallback_depth=args.fallback_depth, static=args.static, heads_poll_s=args.heads_poll,
                         security=security, kernels=args.kernels, calibrate=not args.no_calibrate)
    try:
        return run_worker(opts)
    except (ModelUnavailableError, FileNotFoundError, ValueError) as err:
        print(f"specctl worker: {err}", file=sys.stderr)
        return 2


def _load(args: argparse.Namespace) -> int:
    from worker.reference.load import run_load

    return run_load(args.worker, rate=args.rate, concurrency=args.concurrency, prompts=args.prompts,
                    duration_s=args.duration, requests=args.requests, max_new_tokens=args.max_new_tokens,
                    seed=args.seed, out=args.out)


KERNELS_HELP = ("linear-layer kernels on the CPU: 'tuned' (row-count-aware, timed on first use and cached; "
                "worker.reference.engine.kernels) or 'default' (torch's F.linear)")


def add_worker_commands(sub) -> None:
    """Add ``train-heads``, ``worker`` and ``load`` to a subparsers object."""
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
    th.set_defaults(func=_train_heads)

    wk = sub.add_parser("worker", help="reference worker: real model + drafter, HTTP generate endpoint, agent")
    wk.add_argument("--model", default="smollm2-135m")
    wk.add_argument("--drafter", default="eagle", choices=["none", "ngram", "medusa", "eagle"])
    wk.add_argument("--heads", help="heads directory (default: cached heads, trained on first use)")
    wk.add_argument("--heads-poll", type=float, default=0.0, metavar="S",
                    help="check --heads every S seconds and roll to new heads a retraining job wrote (0 = off)")
    wk.add_argument("--controller", help="HOST:PORT of the controller (omit: static decisions)")
    wk.add_argument("--listen", default="127.0.0.1:8471", help="HOST:PORT of the HTTP endpoint")
    wk.add_argument("--worker-id", default="", help="default: ref-<hostname>-<port>")
    wk.add_argument("--max-batch", type=int, default=8)
    wk.add_argument("--fallback-depth", type=int, default=3, help="chain depth until the first plan arrives")
    wk.add_argument("--static", default="", help="without a controller: DEPTH[xWIDTH[:NODES]] (default: fallback)")
    wk.add_argument("--threads", type=int, default=1)
    wk.add_argument("--kernels", choices=["tuned", "default"], default="tuned", help=KERNELS_HELP)
    wk.add_argument("--no-calibrate", action="store_true",
                    help="skip timing the verify step at start-up (the controller then learns costs from traffic only)")
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


def add_bench_engine_options(bench) -> None:
    """Options of ``specctl bench engine`` (added to the shared ``bench`` parser)."""
    g = bench.add_argument_group("engine", "options of `bench engine` (the reference engine on a real model)")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--batches", default="1,4,8", help="comma-separated batch sizes (default 1,4,8)")
    g.add_argument("--prompts", type=int, default=8, help="held-out prompts per run (default 8)")
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--depths", default="2,4", help="static chain depths (default 2,4)")
    g.add_argument("--drafters", default="ngram,medusa,eagle,oracle")
    g.add_argument("--engine-policy", default="goodput", help="controller preset for the controlled runs ('' = none)")
    g.add_argument("--heads", help="heads directory (default: cached, trained on first use)")
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--kernels", choices=["tuned", "default"], default="tuned", help=KERNELS_HELP)
    g.add_argument("--warmup-prompts", type=int, default=0,
                   help="other held-out prompts run untimed under the controller before each batch size (0 = cold)")


def bench_engine(args: argparse.Namespace) -> int:
    from bench.engine import run_engine_bench

    return run_engine_bench(
        out_dir=args.out, model_name=args.model, batches=tuple(int(b) for b in args.batches.split(",")),
        prompts=args.prompts, max_new_tokens=args.max_new_tokens,
        depths=tuple(int(d) for d in args.depths.split(",")), drafters=tuple(args.drafters.split(",")),
        policy=args.engine_policy, threads=args.threads, heads_dir=args.heads, warmup_prompts=args.warmup_prompts,
        kernels=args.kernels)
