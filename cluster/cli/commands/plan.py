"""`rayshard plan schedule | compare | layers`: build, check, simulate and draw pipeline plans."""
from __future__ import annotations

import json

from rayshard.cluster.pictures.schedule_picture import draw_schedule
from rayshard.cluster.run.pipeline_timings import MeasuredCosts
from rayshard.plans.errors import ConfigError, ScheduleError
from rayshard.plans.pipeline.checker import check
from rayshard.plans.pipeline.csv_order import lowered_as_written, parse_pipeline_csv, schedule_of
from rayshard.cluster.run.pipeline_order_file import read_csv_rows
from rayshard.plans.pipeline.lowering import lower
from rayshard.plans.pipeline.partition import Placement, parse_layout, partition_layers
from rayshard.plans.pipeline.schedules import SPECS, build_schedule, memory_bounds, schedule_spec
from rayshard.plans.pipeline.simulator import PipelineCosts, Simulation, simulate, simulate_measured
from rayshard.plans.pipeline.text_grid import LEGEND, text_grid


def _prepare(name: str, args, measured=None) -> tuple[Simulation, object]:
    """Build, lower, check and simulate one schedule for the shape and costs in `args`."""
    spec = schedule_spec(name)
    vpp = args.vpp if (args.vpp is not None and not spec.fixed_vpp) else None
    compute = build_schedule(spec.name, args.pp, args.microbatches, vpp)
    costs = (measured.costs_for(compute) if measured is not None
             else PipelineCosts.parse(args.costs, compute.num_stages, vpp=compute.vpp))
    lowered = lower(compute, costs.duration)
    report = check(lowered)
    if not report.ok:
        return None, report
    if measured is not None and measured.same_plan(compute):
        # The run executed exactly this plan: replay it with every action's own median time.
        return simulate_measured(lowered, measured.durations, comm=args.comm, checked=report), report
    return simulate(lowered, costs, comm=args.comm, checked=report), report


def run_schedule(args) -> int:
    if args.from_csv:
        return _run_schedule_file(args)
    measured = None
    if args.costs_from:
        measured = MeasuredCosts.load(args.costs_from, args.store)
        if measured.trained_from_file and args.schedule is None:
            raise ConfigError("--costs-from", args.costs_from, "trained a pipeline order read from a file (--schedule-csv), "
                              "which has no schedule name to rebuild", "pass that file with --from-csv (the costs then "
                              "come from the run), or name a schedule with --schedule to compare against it")
        args.schedule = args.schedule or measured.schedule
        args.pp = args.pp or measured.pp
        args.microbatches = args.microbatches or measured.microbatches
        if (args.vpp is None and not measured.trained_from_file
                and schedule_spec(args.schedule).name == schedule_spec(measured.schedule).name):
            args.vpp = measured.vpp
    missing = [flag for flag, value in (("--schedule", args.schedule), ("--pp", args.pp),
                                        ("--microbatches", args.microbatches)) if value is None]
    if missing:
        raise ConfigError("plan schedule", " ".join(missing), "is required", "pass it, or --costs-from a pipeline run")
    spec = schedule_spec(args.schedule)
    if args.vpp is not None and spec.fixed_vpp and args.vpp != spec.default_vpp:
        raise ConfigError("vpp", args.vpp, f"{spec.title} runs exactly {spec.default_vpp} stage(s) per rank",
                          f"drop --vpp or use --vpp {spec.default_vpp}")
    simulation, report = _prepare(args.schedule, args, measured)
    schedule = report.schedule
    print(f"{spec.title} ({spec.name}): pp={schedule.pp}, vpp={schedule.vpp}, "
          f"{schedule.microbatches} microbatches, {schedule.num_stages} stages "
          f"({spec.placement} placement)")
    if simulation is None:
        print(report.describe())
        return 1
    print("check: " + report.describe().split(": ", 1)[1] + " under blocking send/recv")
    if measured is None:
        print(f"costs per rank's share of the model: {PipelineCosts.parse(args.costs, 1).describe()}; "
              f"transfers {args.comm}")
    else:
        print(measured.describe(schedule))
        if measured.same_plan(schedule):
            ratio = simulation.step_time / measured.plan_seconds
            print(f"measured plan time {measured.plan_seconds:.4g} s (median), simulated {simulation.step_time:.4g} s: "
                  f"simulated/measured {ratio:.3f}; whole step measured {measured.step_seconds:.4g} s "
                  "(adds gradient reduction, clipping and the optimizer)")
    ideal = max(simulation.busy)
    print(f"step time {simulation.step_time:g} (compute alone {ideal:g}); bubble fraction "
          f"{simulation.bubble_fraction:.1%} = idle / (ranks x step time)")
    bounds = memory_bounds(schedule)
    share = 1.0 / schedule.vpp
    print("peak activations in microbatches of one rank's share of the model:")
    print(f"  {'rank':>4}  {'stages':<10} {'compute':>8} {'idle':>8} {'peak':>6} {'bound':>6}")
    for rank in range(schedule.pp):
        stages = ",".join(map(str, schedule.stages_of(rank)))
        print(f"  {rank:>4}  {stages:<10} {simulation.busy[rank]:>8g} {simulation.idle[rank]:>8g} "
              f"{simulation.peak_memory[rank]:>6g} {bounds[rank] * share:>6g}")
    _show(simulation, schedule, args)
    return 0


def _run_schedule_file(args) -> int:
    """A pipeline order from a file (torch.distributed.pipelining's CSV): check, simulate, draw."""
    order = parse_pipeline_csv(read_csv_rows(args.from_csv), str(args.from_csv))
    lowered = lowered_as_written(order) if order.has_transfers else None
    measured = MeasuredCosts.load(args.costs_from, args.store) if args.costs_from else None
    costs = (measured.costs_for(schedule_of(order)) if measured is not None
             else PipelineCosts.parse(args.costs, len(order.stage_ranks), vpp=order.vpp))
    if lowered is None:
        lowered = lower(schedule_of(order), costs.duration)
    print(f"{args.from_csv}: pp={order.pp}, vpp={order.vpp}, {order.microbatches} microbatches, "
          f"{len(order.stage_ranks)} stages ({order.placement} placement); transfers "
          + ("as written" if order.has_transfers else "derived by rayshard's lowering"))
    report = check(lowered)
    if not report.ok:
        print(report.describe())
        return 1
    print("check: " + report.describe().split(": ", 1)[1] + " under blocking send/recv")
    if measured is not None:
        print(measured.describe(schedule_of(order)))
    simulation = simulate(lowered, costs, comm=args.comm, checked=report)
    print(f"step time {simulation.step_time:g} (compute alone {max(simulation.busy):g}); bubble fraction "
          f"{simulation.bubble_fraction:.1%} = idle / (ranks x step time)")
    _show(simulation, lowered, args)
    return 0


def _show(simulation: Simulation, schedule, args) -> None:
    """The text grid, and the picture and action lists where asked for."""
    if not args.no_grid:
        print()
        print(text_grid(simulation))
        print(LEGEND)
    if args.png:
        print(f"wrote {draw_schedule(simulation, args.png)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(schedule.to_dict()))
        print(f"wrote {args.json}")


def run_compare(args) -> int:
    print(f"pp={args.pp}, {args.microbatches} microbatches; costs per rank's share: "
          f"{PipelineCosts.parse(args.costs, 1).describe()}; transfers {args.comm}")
    print("bubble = idle / (ranks x step time); memory in microbatches of one rank's share\n")
    header = f"{'schedule':<17} {'vpp':>3} {'check':<6} {'step time':>9} {'bubble':>7} {'peak max':>8}  peak per rank"
    print(header)
    print("-" * len(header))
    failures = 0
    for name, spec in SPECS.items():
        try:
            simulation, report = _prepare(name, args)
        except ScheduleError as error:
            reason = str(error).split(": it needs ", 1)[-1].split(". Fix", 1)[0]
            print(f"{name:<17} {'-':>3} {'n/a':<6} needs {reason}")
            continue
        schedule = report.schedule
        if simulation is None:
            failures += 1
            print(f"{name:<17} {schedule.vpp:>3} {'FAILED':<6} {report.describe().splitlines()[1]}")
            continue
        peaks = " ".join(f"{peak:g}" for peak in simulation.peak_memory)
        print(f"{name:<17} {schedule.vpp:>3} {'ok':<6} {simulation.step_time:>9g} "
              f"{simulation.bubble_fraction:>7.1%} {max(simulation.peak_memory):>8g}  {peaks}")
    return 1 if failures else 0


def run_layers(args) -> int:
    if args.schedule:
        spec = schedule_spec(args.schedule)
        placement = spec.placement
        vpp = args.vpp if args.vpp is not None else spec.default_vpp
    else:
        vpp = args.vpp or 1
        placement = Placement.LOOPED if vpp > 1 else Placement.SINGLE
    if args.layer_costs:
        try:
            costs = [float(cost) for cost in args.layer_costs.split(",")]
        except ValueError:
            raise ConfigError("layer-costs", args.layer_costs, "is not a list of numbers",
                              'write one number per layer, comma-separated: "1,1,1.5"') from None
        if len(costs) != args.layers:
            raise ConfigError("layer-costs", f"{len(costs)} values", f"the model has {args.layers} layers",
                              "give exactly one cost per layer")
    else:
        costs = [1.0] * args.layers
    partition = partition_layers(
        costs, args.pp, vpp, placement, args.embedding_cost, args.head_cost,
        parse_layout(args.layout) if args.layout else None,
    )
    print(f"{args.layers} layers on pp={args.pp} x vpp={vpp} = {partition.num_stages} stages, "
          f"{placement} placement" + (f" ({schedule_spec(args.schedule).title})" if args.schedule else ""))
    print(f"\n  {'stage':>5} {'rank':>4}  {'layers':<18} {'count':>5} {'cost':>8}")
    for stage, layers in enumerate(partition.stage_layers):
        extras = (["+embedding"] if stage == 0 else []) + (["+head"] if stage == partition.num_stages - 1 else [])
        text = " ".join([_span(layers)] + extras)
        print(f"  {stage:>5} {partition.stage_ranks[stage]:>4}  {text:<18} {len(layers):>5} "
              f"{partition.stage_costs[stage]:>8g}")
    print(f"\n  {'rank':>4}  {'stages':<10} {'layers':<28} {'cost':>8}")
    rank_costs = partition.rank_costs()
    for rank in range(args.pp):
        stages = partition.stages_of_rank(rank)
        spans = ", ".join(_span(partition.stage_layers[stage]) for stage in stages)
        print(f"  {rank:>4}  {','.join(map(str, stages)):<10} {spans:<28} {rank_costs[rank]:>8g}")
    mean = sum(partition.stage_costs) / partition.num_stages
    slowest = max(partition.stage_costs)
    if mean > 0:
        print(f"\nslowest stage costs {slowest:g}, {slowest / mean - 1:+.1%} over the mean {mean:g}")
    return 0


def _span(layers: range) -> str:
    if len(layers) == 0:
        return "(none)"
    return str(layers.start) if len(layers) == 1 else f"{layers.start}-{layers.stop - 1}"
