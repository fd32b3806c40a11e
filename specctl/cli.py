"""``specctl``: one console script for the controller, workers, demo and benchmarks."""

from __future__ import annotations

import argparse
from pathlib import Path
import json
import asyncio
import logging
import sys


def _serve(args: argparse.Namespace) -> int:
    from controller.config import ConfigError, load_config
    from controller.server import serve_forever

    try:
        config = load_config(args.config)
    except ConfigError as err:
        from specctl.serve_config import policy_file_mistake

        print(f"specctl serve: {policy_file_mistake(args.config) or err}", file=sys.stderr)
        return 2
    if args.policy:
        config = config.model_copy(update={"policy": args.policy})
    if args.record:
        config = config.model_copy(update={"record": args.record})
    if args.metrics_listen:
        if not _listen_ok(args.metrics_listen, "--metrics-listen", "serve"):
            return 2
        config = config.model_copy(update={"metrics_listen": args.metrics_listen})
    from controller.alerts.store import StoreError

    try:
        asyncio.run(serve_forever(config, args.listen))
    except KeyboardInterrupt:
        pass
    except StoreError as err:
        print(f"specctl serve: {err}", file=sys.stderr)
        return 2
    return 0


def _listen_ok(value: str, flag: str, command: str) -> bool:
    """``value`` is a HOST:PORT to listen on; otherwise say why, naming the flag."""
    from controller.observe.http import parse_host_port

    try:
        parse_host_port(value, flag)
    except ValueError as err:
        print(f"specctl {command}: {err}", file=sys.stderr)
        return False
    return True


def _demo(args: argparse.Namespace) -> int:
    if args.retrain_loop:
        from specctl.retrain_loop import LoopConfig, run_retrain_loop

        report = run_retrain_loop(LoopConfig(work_dir=str(Path(args.out) / "retrain-loop")))
        path = Path(args.out) / "retrain-loop.json"
        path.write_text(json.dumps(report, indent=1))
        print(f"report: {path}")
        return 0
    if args.real:
        from specctl.demo_real import run_real_demo

        return run_real_demo(duration_s=args.duration, policy=args.policy, drafter=args.drafter)
    from specctl.demo import StatusPageError, run_demo

    if args.status_listen and not _listen_ok(args.status_listen, "--status-listen", "demo"):
        return 2
    try:
        return run_demo(duration_s=args.duration, scenario=args.scenario, policy=args.policy, out_dir=args.out,
                        status_listen=args.status_listen)
    except StatusPageError as err:
        print(f"specctl demo: {err}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    if args.what == "controller":
        from bench.controller import run_controller_bench

        return run_controller_bench(out_dir=args.out, workers=args.workers or 256, duration_s=args.duration,
                                    steps_per_s=args.steps_per_s)
    if args.what == "fleet":
        from bench.fleet import BenchError, run_fleet_bench

        try:
            if args.drift_monitor == "both":  # the Redis phase per mode, side by side
                from bench.fleet_drift import run_drift_modes

                return run_drift_modes(args.out, replicas=args.replicas, workers=args.workers or 32,
                                       steps_per_s=args.steps_per_s, measure_s=args.duration,
                                       plots=not args.no_plots)
            return run_fleet_bench(out_dir=args.out, replicas=args.replicas, workers=args.workers or 32,
                                   steps_per_s=args.steps_per_s, measure_s=args.duration,
                                   backends=[b.strip() for b in args.backends.split(",") if b.strip()],
                                   plots=not args.no_plots, drift_monitor=args.drift_monitor)
        except BenchError as err:
            print(f"specctl bench fleet: {err}", file=sys.stderr)
            return 1
    if args.what == "policies":
        from bench.policies import run_policy_bench
        from policies.presets import PresetError
        from worker.sim.scenario import ScenarioError

        try:
            run_policy_bench(args.scenario, args.out, quick=args.quick, jobs=args.jobs,
                             delay_steps=args.delay_steps, presets=args.policies, config_path=args.config,
                             plots=not args.no_plots, hardware=args.hardware, seeds=args.seeds)
        except (PresetError, ScenarioError) as err:
            print(f"specctl bench policies: {err}", file=sys.stderr)
            return 2
        return 0
    if args.what == "drift":
        from bench.drift import run_drift_bench

        return run_drift_bench(out_dir=args.out)
    if args.what == "faults":
        from bench.faults import run_faults_bench

        return run_faults_bench(out_dir=args.out, workers=args.healthy_workers, phase_s=args.phase_s,
                                rounds=args.rounds)
    if args.what == "soak":
        from bench.soak import run_soak_bench

        return run_soak_bench(out_dir=args.out, workers=args.soak_workers, requests=args.requests)
    if args.what == "engine":
        from specctl.worker_cli import bench_engine

        return bench_engine(args)
    if args.what == "catchup":
        from bench.catchup import parse_windows, run_catchup_bench

        try:
            windows = parse_windows(args.catch_up_windows)
        except ValueError as err:
            print(f"specctl bench catchup: --catch-up-windows {args.catch_up_windows!r}: {err}", file=sys.stderr)
            return 2
        return run_catchup_bench(args.heads, out_dir=args.out, model_name=args.model, windows=windows,
                                 batch=max(int(b) for b in args.batches.split(",")), prompts=args.prompts,
                                 max_new_tokens=args.max_new_tokens, off_steps=args.catch_up_off_steps,
                                 threads=args.threads, kernels=args.kernels, plot=not args.no_plots)
    if args.what == "packing":
        from bench.packing import DEFAULT_SHAPES, run_packing_bench

        out = args.out if args.out != "bench/results" else "bench/results/packing"
        return run_packing_bench(out_dir=out, model_name=args.model,
                                 batches=tuple(int(b) for b in args.batches.split(",") if int(b) > 1),
                                 shapes=tuple(args.packing_shapes.split(",")) if args.packing_shapes else DEFAULT_SHAPES,
                                 rounds=args.packing_rounds, threads=args.threads, kernels=args.kernels,
                                 plot=not args.no_plots)
    if args.what == "engine-runs":
        from bench.engine_runs import default_run_folders, run_engine_runs

        folders = args.runs.split(",") if args.runs else default_run_folders()
        try:
            return run_engine_runs(folders, out_dir=args.out, plot=not args.no_plots)
        except (OSError, ValueError) as err:
            print(f"specctl bench engine-runs: {err}", file=sys.stderr)
            return 2
    if args.what == "llamacpp":
        from bench.llamacpp import run_llamacpp_bench
        from policies.presets import PRESET_DIR

        preset = PRESET_DIR / f"{args.engine_policy}.yaml"
        return run_llamacpp_bench(out_dir=args.out, model=args.model,
                                  prompt_sets=tuple(args.prompt_sets.split(",")), prompts=args.prompts,
                                  warmup_prompts=args.lookup_warmup, max_new_tokens=args.lookup_max_new_tokens,
                                  depths=tuple(int(d) for d in args.lookup_depths.split(",")),
                                  threads=args.threads,
                                  policy_file=str(preset if preset.is_file() else args.engine_policy))
    if args.what == "costfit":
        from bench.costfit import QUICK_TIME_SCALE, run_costfit_bench

        run_costfit_bench(out_dir=args.out, time_scale=QUICK_TIME_SCALE if args.quick else 1.0, seed=args.seed,
                          plots=not args.no_plots)
        return 0
    if args.what == "typical":
        from bench.typical import run_typical_bench
        from policies.table import Decision
        from worker.reference.server import parse_static

        return run_typical_bench(out_dir=args.out, model_name=args.model, prompts=args.prompts,
                                 max_new_tokens=args.max_new_tokens,
                                 epsilons=tuple(float(e) for e in args.epsilons.split(",")),
                                 decision=parse_static(args.typical_shape, Decision.off()), threads=args.threads,
                                 kernels=args.kernels, quick=args.quick, plot=not args.no_plots)
    print(f"specctl bench: unknown benchmark {args.what!r}", file=sys.stderr)
    return 2


def _replay(args: argparse.Namespace) -> int:
    from bench.replay import run_replay
    from controller.config import ConfigError
    from policies.presets import PresetError

    try:
        return run_replay(args.file, args.policy, config_path=args.config, delay_steps=args.delay_steps,
                          json_out=args.json)
    except (PresetError, ConfigError, OSError) as err:
        print(f"specctl replay: {err}", file=sys.stderr)
        return 2


def _status(args: argparse.Namespace) -> int:
    from specctl.status import print_status
    from worker.sdk.security import ClientSecurity, ClientSecurityError

    try:
        security = ClientSecurity.from_args(args)
    except ClientSecurityError as err:
        print(f"specctl status: {err}", file=sys.stderr)
        return 2
    return print_status(args.controller, args.worker, security, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specctl", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the speculation controller (gRPC)")
    serve.add_argument("--config", help="controller YAML config (defaults apply without one)")
    serve.add_argument("--listen", help="HOST:PORT, overrides the config's listen")
    serve.add_argument("--policy", help="policy preset name or file, overrides the config")
    serve.add_argument("--record", help="write telemetry to this compressed JSONL file")
    serve.add_argument("--metrics-listen", metavar="HOST:PORT",
                       help="serve Prometheus /metrics and the status page / here (overrides metrics_listen)")
    serve.set_defaults(func=_serve)

    demo = sub.add_parser("demo", help="controller + simulated GPU fleet, live table, then a goodput summary")
    demo.add_argument("--duration", type=float, default=60.0, help="seconds of live run (default 60)")
    demo.add_argument("--scenario", default="demo", help="scenario name or YAML file (default: demo)")
    demo.add_argument("--policy", default="goodput", help="policy preset for the controlled fleet")
    demo.add_argument("--out", default="demo-results", help="directory for demo.json + demo.png")
    demo.add_argument("--status-listen", metavar="HOST:PORT", default="127.0.0.1:0",
                      help="serve the controller's status page here while the fleet runs, its URL printed "
                           "(default 127.0.0.1:0, a free port; '' for none)")
    demo.add_argument("--real", action="store_true",
                      help="controller + a real SmolLM2 worker (engine, drafter, HTTP) + load from 1 to 8, chat to code")
    demo.add_argument("--drafter", default="eagle", help="with --real: none, ngram, medusa or eagle")
    demo.add_argument("--retrain-loop", action="store_true",
                      help="drift alert -> `specctl train-heads` -> worker rolls to new heads -> alert resolves "
                           "(real SmolLM2 worker, Medusa heads trained on chat meeting code; a few minutes)")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("what", choices=["controller", "policies", "drift", "engine", "faults", "soak", "llamacpp",
                                        "costfit", "typical", "fleet", "catchup", "packing", "engine-runs"])
    bench.add_argument("--out", default="bench/results", help="output directory for JSON + PNG")
    bench.add_argument("--workers", type=int, default=None, help="simulated workers (default 256; fleet: 32)")
    bench.add_argument("--duration", type=float, default=10.0, help="seconds of measured load (fleet: per backend)")
    bench.add_argument("--steps-per-s", type=float, default=50.0, help="steps per second per worker")
    pol = bench.add_argument_group("policies", "options of `bench policies`")
    pol.add_argument("--quick", action="store_true", help="the shortened suite (CI): clocks x0.04, one replica per worker kind, coarse grid")
    pol.add_argument("--scenario", action="append", metavar="FILE",
                     help="scenario file or shipped name (repeatable; default: worker/sim/scenarios/* but the demo)")
    pol.add_argument("--policies", nargs="+", metavar="PRESET", help="presets to run (default: all shipped)")
    pol.add_argument("--jobs", type=int, help="parallel processes (default: CPU count)")
    pol.add_argument("--delay-steps", type=int, default=2, help="plan delivery delay in worker steps (default 2)")
    pol.add_argument("--config", help="controller YAML config for the controller-driven runs (bench engine: sections "
                                      "applied to all its controllers, e.g. acceptance)")
    pol.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    pol.add_argument("--seeds", type=int, nargs="+", metavar="N",
                     help="policy seeds: each preset with a seed (goodput) runs once per seed, reported as the mean "
                          "and per seed")
    pol.add_argument("--hardware", default="roofline", choices=["roofline", "H200-measured"],
                     help="cost truth: the roofline (default), or H200-measured: single-GPU H200 workers on the "
                          "measured H200 table (only the scenarios that have one)")
    faults = bench.add_argument_group("faults, soak", "options of `bench faults` and `bench soak`")
    faults.add_argument("--healthy-workers", type=int, default=32, help="faults: healthy workers beside the stuck one")
    faults.add_argument("--phase-s", type=float, default=8.0, help="faults: seconds of each phase")
    faults.add_argument("--rounds", type=int, default=3, help="faults: alternations of the two phases")
    faults.add_argument("--soak-workers", type=int, default=200, help="soak: simulated workers")
    faults.add_argument("--requests", type=int, default=100_000, help="soak: requests to churn")
    from specctl.worker_cli import add_bench_engine_options

    add_bench_engine_options(bench)
    lc = bench.add_argument_group("llamacpp", "options of `bench llamacpp` (also --model, --prompts, --threads, "
                                              "--engine-policy)")
    lc.add_argument("--prompt-sets", default="chat,code,math,summarise", help="shipped sets, held-out prompts")
    lc.add_argument("--lookup-depths", default="0,1,2,3,4,6,8",
                    help="static prompt-lookup lengths to compare (0: the adapter never drafting)")
    lc.add_argument("--lookup-max-new-tokens", type=int, default=96)
    lc.add_argument("--lookup-warmup", type=int, default=4, help="warm-up prompts per set, through every configuration")
    cf = bench.add_argument_group("costfit", "options of `bench costfit` (also --quick: clocks x0.1, --no-plots)")
    cf.add_argument("--seed", type=int, default=None, help="costfit: seed of the scenarios (default: their own)")
    ty = bench.add_argument_group("typical", "options of `bench typical` (also --model, --prompts, --max-new-tokens, "
                                             "--threads, --kernels, --quick: 2 prompts x 12 tokens, --no-plots)")
    ty.add_argument("--epsilons", default="0.3,0.09,0.03", help="typical epsilons (delta = sqrt(epsilon))")
    ty.add_argument("--typical-shape", default="4x2:6", help="the n-gram drafter's static tree DEPTHxWIDTH:NODES")
    pk = bench.add_argument_group("packing", "options of `bench packing` (packed against padded verify; also --model, "
                                             "--batches (those > 1), --threads, --kernels, --no-plots; --out "
                                             "default bench/results/packing)")
    pk.add_argument("--packing-shapes", default="",
                    help="the drafting rows' static shapes DEPTH or DEPTHxWIDTH:NODES, comma-separated "
                         "(default bench.packing.DEFAULT_SHAPES: chains of 1 and 3, trees 2x4:5 and 4x2:6)")
    pk.add_argument("--packing-rounds", type=int, default=15, help="timed verify calls per engine and cell")
    er = bench.add_argument_group("engine-runs", "options of `bench engine-runs` (several `bench engine` runs read "
                                                 "together: each cell's warm ratio over them, runs under 1, sign "
                                                 "test; also --out, --no-plots)")
    er.add_argument("--runs", default="",
                    help="run folders, comma-separated (default: every bench/results/engine-run* with a second pass)")
    cu = bench.add_argument_group("catchup", "options of `bench catchup` (EAGLE's catch-up window; also --heads, "
                                             "--model, --prompts, --max-new-tokens, --threads, --kernels, "
                                             "--no-plots; batch: the largest of --batches)")
    cu.add_argument("--catch-up-windows", default="0,256,64,32,16",
                    help="windows to compare, in pairs; 0 = unbounded, the reference (default 0,256,64,32,16)")
    cu.add_argument("--catch-up-off-steps", type=int, default=12,
                    help="resume / long settings: plain steps per request before it drafts (default 12)")
    fl = bench.add_argument_group("fleet", "options of `bench fleet` (also --workers, --duration, --steps-per-s, "
                                           "--no-plots)")
    fl.add_argument("--replicas", type=int, default=2, help="fleet: specctl serve replicas (one is killed)")
    fl.add_argument("--backends", default="embedded,redis",
                    help="fleet: state backends to run side by side, in order (default embedded,redis)")
    fl.add_argument("--drift-monitor", default="replica", choices=["replica", "fleet", "both"],
                    help="fleet: the Redis replicas' state.drift_monitor (default replica: one monitor per replica, "
                         "alerts deduplicated fleet-wide; fleet: one monitor per drafter version fleet-wide; both: "
                         "the Redis phase once per mode, same load and seed, no kill -9 -> fleet_drift_modes.json)")
    bench.set_defaults(func=_bench)

    from specctl.worker_cli import add_worker_commands  # train-heads, worker, load (the reference worker)

    add_worker_commands(sub)

    replay = sub.add_parser("replay", help="estimate a policy's goodput on a telemetry recording (serve --record)")
    replay.add_argument("file", help="recording written by `specctl serve --record` (gzip JSONL)")
    replay.add_argument("--policy", required=True, help="policy preset name or file to evaluate")
    replay.add_argument("--config", help="controller YAML config for the replayed controller")
    replay.add_argument("--delay-steps", type=int, default=2, help="plan delivery delay in worker steps (default 2)")
    replay.add_argument("--json", help="also write the result as JSON here")
    replay.set_defaults(func=_replay)

    status = sub.add_parser("status", help="show the controller's workers, plans and models")
    status.add_argument("--controller", default="127.0.0.1:50051", help="HOST:PORT of the controller")
    status.add_argument("--worker", default="", help="only this worker id")
    status.add_argument("--json", action="store_true",
                        help="print the GetStatus answer as one JSON document (proto field names) instead of tables")
    from specctl.tokens import add_token_command
    from worker.sdk.security import add_client_security_args

    add_client_security_args(status)
    status.set_defaults(func=_status)

    add_token_command(sub)

    from specctl.alerts import add_alerts_command  # alerts [--follow] [--history] | alerts ack ID

    add_alerts_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
