"""``python -m harness``: list the matrix, run it, replay a reproducer.

Bad input (an unknown backend, a malformed case file, no GPU for a GPU run) ends with one line on stderr
and exit status 2; a property failure ends with exit status 1 after every finding has been written, and a run
whose only failures are the harness's own (adapter errors around an engine's classes) with exit status 3.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from harness.options import (
    MPS_HELP,
    UsageError,
    add_selection,
    check_device_name,
    check_modes,
    check_out_folder,
    check_positive,
    check_properties,
    make_out_folder,
    parse_budget,
    parse_shard,
    profile_named,
    resolve_device,
)
from harness.outlock import OutFolderLock
from harness.procs import CASE_TIMEOUT_DEFAULTS

# Commands whose parser needs nothing heavy: for these, the sweep's parser (whose module imports torch) is
# left out, so their bad input is reported before torch is imported.
LIGHT_COMMANDS = ("list", "run", "mutants", "repro", "summarize", "bisect", "export", "warmup")


def cmd_list(args) -> int:
    from collections import defaultdict

    from backends.registry import all_compositions
    from search.matrix import composition_axes, composition_modes, matrix
    from search.strategies import describe_axes

    device = resolve_device(args.device)
    profile = profile_named(args.profile)
    m = matrix(device, profile, args.backends)
    unavailable = dict(m.unavailable)
    left_out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))  # composition -> why -> what
    compositions = all_compositions()  # once: each call derives every composition's support again
    names = sorted((str(c) for c in compositions), key=len, reverse=True)  # the longest term a row id starts with
    for what, why in m.excluded:
        comp = next(n for n in names if what.startswith(f"{n}-"))
        left_out[comp][why].append(what[len(comp) + 1:])
    print(f"device: {device}   profile: {profile.name} ({profile.description})")
    print("axes the batches are drawn from:")
    for line in describe_axes(profile):
        print(f"  {line}")
    print("rows = modes x properties; under each available composition, the rows left out and why")
    width = max(len(str(c)) for c in compositions)
    derived = {str(c) for c in compositions}
    for name, why in m.unavailable:  # terms named on the command line that no declaration derives
        if name not in derived:
            print(f"  {name:<{width}}  unavailable: {why}")
    for c in compositions:
        name = str(c)
        if args.backends and name not in {str(r.composition) for r in m.rows} and name not in unavailable \
                and name not in left_out:
            continue
        if name in unavailable:
            print(f"  {name:<{width}}  unavailable: {unavailable[name]}")
            continue
        n = sum(1 for r in m.rows if str(r.composition) == name)
        modes = ",".join(m_.value for m_ in sorted(composition_modes(c), key=lambda m_: m_.value))
        print(f"  {name:<{width}}  available   {n:3d} rows  modes: {modes}{drawn_axes(c, profile)}")
        if args.why:
            print(f"  {'':<{width}}    {composition_axes(c, profile)}")
            for why, whats in left_out[name].items():
                print(f"  {'':<{width}}    left out ({len(whats)}): {why}: {', '.join(whats)}")
    print(f"{len(m.rows)} rows runnable here; {len(m.excluded)} left out by declaration "
          f"({'listed' if args.why else 'add --why to list them with their reasons'})")
    if args.why:
        engine_inventory(m)
    return 0


def engine_inventory(m) -> None:
    """Every attention backend the installed SGLang registers (--attention-backend NAME): the leaf that runs it here
    and its rows, or why it is not a leaf yet, with whether its class imports on this machine (the level it could
    reach without kernels: conformance)."""
    from backends.registry import LEAVES, leaf_class
    from backends.sglang import features, runtime

    registered = features.registered_backends()
    if not registered:
        return
    leaves: dict[str, list[str]] = {}
    for n in LEAVES:
        if n.startswith("sglang."):
            leaves.setdefault(getattr(leaf_class(n), "sglang_name", None), []).append(n)
    unavailable = dict(m.unavailable)
    imports = features.registered_import_failures()  # cached per installed SGLang: the first asking costs ~15 s
    print(f"SGLang's registered attention backends ({len(registered)}, sglang {runtime.installed_version()}):")
    for b in registered:
        classes = ", ".join(cls for _, cls in b.classes) or "no class found in its factory"
        if b.name in leaves:
            said = []
            for leaf in leaves[b.name]:
                rows = sum(1 for r in m.rows if leaf in r.composition.leaves())
                caps = leaf_class(leaf).capabilities
                level = (f"classes only, conformance ({caps.class_only})" if caps.class_only else
                         f"its planning, metadata and conformance ({caps.plan_only})" if caps.plan_only else
                         "every property")
                why = unavailable.get(leaf, "no rows here").removeprefix(f"{leaf}: ")
                said.append(f"{leaf}: {level}, {rows} rows here" if rows else f"{leaf}: {why}")
            print(f"  {b.name:<20} {'; '.join(said)} ({classes})")
            continue
        fails = [f"{cls}: {imports[mod]}" for mod, cls in b.classes if imports.get(mod)]
        where = ("its class does not import here: " + "; ".join(fails)) if fails else \
            ("its class imports here (a class-level leaf, backends/sglang/classes.py, would check it)" if imports
             else "import check failed")
        print(f"  {b.name:<20} not a leaf yet; {where} ({classes})")


def drawn_axes(c, profile) -> str:
    """The storage axes the profile draws for ``c``: its KV cache dtypes (with or without KV scales), and the
    linear-attention state-slot layouts."""
    from batch.spec import RECURRENT_KINDS, STATE_SLOT_LAYOUTS
    from search.matrix import strategy_options

    options = strategy_options(c, profile)
    kv = options["kv_cache_dtypes"]
    text = ""
    if "mha" in c.attention_kinds() and kv != ("auto",):
        text += f"  kv cache: {','.join(kv)}{'' if options['kv_scales'] else ' (unit scales only)'}"
    if c.attention_kinds() & RECURRENT_KINDS:
        text += f"  state slots: {','.join(STATE_SLOT_LAYOUTS)}"
    return text


def cmd_run(args) -> int:
    if args.max_examples is not None and args.max_examples < 1:
        raise UsageError(f"--max-examples must be >= 1, got {args.max_examples}")
    if args.budget is not None:
        parse_budget(args.budget)  # a bad duration is one line before anything starts
    check_positive("--stall-seconds", args.stall_seconds)
    check_positive("--case-timeout", args.case_timeout)
    check_positive("--workers", args.workers)
    if args.shrink_seconds is not None and args.shrink_seconds < 0:
        raise UsageError(f"--shrink-seconds must be >= 0, got {args.shrink_seconds}")
    shard = parse_shard(args.shard) if args.shard else None
    check_out_folder("--out", args.out)

    from harness.mutants.catalogue import mutant_named
    from harness.run import run
    from search.matrix import matrix

    mutant = mutant_named(args.mutant)
    device = resolve_device(args.device)
    profile = profile_named(args.profile, shard[0] if shard else 0)  # the shard's head rotation
    m = matrix(device, profile, args.backends, args.properties, args.modes)
    rows, skipped = m.rows, m.unavailable
    if not rows:
        raise UsageError(m.why_empty())
    if shard:
        from search.matrix import shard_rows

        rows = shard_rows(rows, shard)  # the sweep's split: a stable hash of the row id
    if mutant is not None:
        # Built, not applied: a mutant whose code this release lacks says so here, in one line (MutantUnavailable),
        # before any worker process starts
        mutant.patch()
    if mutant and mutant.needs_device and mutant.needs_device != device:
        print(f"note: mutant {mutant.name} only has an effect on {mutant.needs_device}", file=sys.stderr)
    out_dir = make_out_folder("--out", args.out)
    lock = OutFolderLock(out_dir).acquire()  # one writer per output folder
    try:
        for stale in (out_dir / "pending").glob("*.json"):  # a stopped run's cases, not this run's crashes
            stale.unlink()
        return run(args, rows, skipped, profile, device, out_dir, mutant)
    finally:
        lock.release()


def cmd_repro(args) -> int:
    from search.casefile import CaseFile, check_fits, package_versions

    if args.dump:
        check_out_folder("--dump", args.dump)
    case = CaseFile.read(args.file)  # a bad case file is reported before torch is imported
    check_fits(case.spec, where=args.file)  # before anything is allocated
    fault = contextlib.nullcontext()
    if args.mutant:
        from harness.mutants.catalogue import mutant_named

        fault = mutant_named(args.mutant).patch()  # built here: one this release lacks says so in one line
    if args.device != "auto":
        device = resolve_device(args.device)
    elif case.device == "cuda":
        try:
            device = resolve_device("cuda")
        except UsageError:
            raise UsageError(f"{args.file} was recorded on cuda, but no CUDA GPU is visible here "
                             f"(add --device cpu to replay it on the CPU)") from None
    else:
        device = resolve_device("cpu")
    from harness.repro import replay

    now = package_versions()
    for pkg, then in (case.versions or {}).items():
        if then != now.get(pkg) and then is not None:
            print(f"note: case made with {pkg} {then}, this machine has {now.get(pkg)}", file=sys.stderr)
    with fault:
        return replay(case, device, Path(args.dump) if args.dump else None, args.known_passes)


def cmd_export(args) -> int:
    from search.casefile import CaseFile, check_fits

    case = CaseFile.read(args.file)  # a bad case file is reported before torch is imported
    check_fits(case.spec, where=args.file)
    from harness.export import exportable_reason

    reason = exportable_reason(case.composition, case.property, case.spec.mode.value, case.spec.kv_cache_dtype)
    if reason:
        raise UsageError(f"cannot export {args.file}: {reason}")
    out = Path(args.out) if args.out else Path("harness-out/export") / f"test_{Path(args.file).stem.replace('-', '_')}.py"
    if out.suffix != ".py":
        raise UsageError(f"--out {out}: the exported file is a pytest file and must end in .py")
    check_out_folder("--out", str(out.parent))
    device = resolve_device(case.device if args.device == "auto" else args.device)
    from harness.export import CHECK_ARGS, build, run_exported, unlike_the_replay, write

    export = build(case, device, Path(args.file))
    written = write(export, out)
    print(f"wrote {', '.join(map(str, written))}\nthe harness's replay {'failed' if export.failed else 'passed'}: "
          f"{export.summary}")
    if not args.check:
        return 0
    status, output = run_exported(out, extra=list(CHECK_ARGS), stand_ins=args.stand_ins)
    print(output.rstrip())
    agrees = (status == 1) == export.failed and status in (0, 1)
    # A file that fails must fail by the case's mechanism, not on its own setup (an import, a configuration step)
    unlike = unlike_the_replay(export, output, out.name) if agrees and status == 1 else None
    agrees = agrees and unlike is None
    print(f"the exported file {'fails' if status == 1 else 'passes' if status == 0 else f'ended with {status}'} on its "
          f"own, {'as' if agrees else 'NOT as'} the harness's replay did" + (f": {unlike}" if unlike else ""))
    return 0 if agrees else 1


def cmd_summarize(args) -> int:
    import json

    from harness.report import campaign_markdown

    reports = []
    for folder in args.folders:
        path = Path(folder) / "report.json" if Path(folder).is_dir() else Path(folder)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
                raise ValueError("no rows")
        except (OSError, ValueError) as e:
            raise UsageError(f"{folder}: not a harness report (report.json of a run or sweep): {e}") from None
        reports.append((str(folder), data))
    print(campaign_markdown(reports), end="")
    return 0


def cmd_mutants(args) -> int:
    budget = parse_budget(args.budget)
    check_positive("--case-timeout", args.case_timeout)
    if not args.list:
        check_out_folder("--out", args.out)
    from harness.mutants.catalogue import CATALOGUE, MUTANTS
    from harness.mutants.run import print_table, run_mutant, run_mutant_isolated, write_json

    device = resolve_device(args.device)
    profile = profile_named(args.profile)
    unknown = [n for n in args.only or [] if n not in MUTANTS]
    if unknown:
        raise UsageError(f"unknown mutant(s) {', '.join(unknown)}; see `python -m harness mutants --list`")
    catalogue = [m for m in CATALOGUE if m.engine == args.engine]
    if args.list:
        for m in catalogue:
            print(f"{m.name}: {m.doc}")
        return 0
    chosen = [MUTANTS[n] for n in args.only] if args.only else catalogue
    out_dir = make_out_folder("--out", args.out)
    results = []
    for m in chosen:
        print(f"{m.name} ...", end=" ", flush=True)
        run = run_mutant_isolated if (args.isolate or device == "cuda") else run_mutant
        r = run(m, profile, device, out_dir / "mutants", budget, args.case_timeout)
        results.append(r)
        print(f"{r.status} {'' if r.status == 'unavailable' else f'{r.seconds:.1f}s'} {r.property or r.reason}",
              flush=True)
        write_json(results, out_dir / "mutants.json")
    print()
    print_table(results)
    # A mutant that survived, or whose "kill" was a crash of its own patch (not its fault at work), fails the run
    return 1 if any(r.status in ("survived", "broken") for r in results) else 0


def build_parser(with_sweep: bool = True) -> argparse.ArgumentParser:
    """The command line's parser; ``with_sweep=False`` leaves out ``sweep`` (its module imports torch)."""
    p = argparse.ArgumentParser(prog="python -m harness", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("list", help="print the matrix: what runs here, and why the rest does not")
    add_selection(sp)
    sp.add_argument("--why", action="store_true", help="also list each row left out, with its reason")
    sp.set_defaults(fn=cmd_list)

    sp = sub.add_parser("run", help="run the matrix (the main job)")
    add_selection(sp)
    sp.add_argument("--properties", nargs="*", help="property names (default: all)")
    sp.add_argument("--modes", nargs="*", help="forward modes (default: all the composition supports)")
    sp.add_argument("--max-examples", type=int, help="examples per row (default: the profile's)")
    sp.add_argument("--seed", type=int, help="fix the random choices: the same seed draws the same cases (given the "
                                             "same example database; default: fresh ones each run)")
    sp.add_argument("--shard", help="I/N: run only shard I of N (rows split by a stable hash of their id, as in sweep)")
    sp.add_argument("--budget", help="end the search after this long, e.g. 12m (in worker processes): every row gets "
                                     "its first 3 examples before any gets its full search, and a row the budget "
                                     "cut short ends with the cases it ran")
    sp.add_argument("--out", default="harness-out", help="folder for case files and the report")
    sp.add_argument("--db", help="Hypothesis example database folder (default .hypothesis/examples)")
    sp.add_argument("--stall-seconds", type=float, default=180.0,
                    help="a group of rows that makes no progress this long says so (one line while a JIT compiler "
                         "runs, else every thread's stack), and again each period")
    sp.add_argument("--mutant", help="inject this bug from the catalogue (`python -m harness mutants --list`)")
    sp.add_argument("--isolate", action="store_true",
                    help="search the rows in worker processes, so a crash or a hang is a finding with its case file "
                         "and the other rows still run (always on a GPU, and with a mutant that crashes)")
    sp.add_argument("--workers", type=int,
                    help="worker processes at a time (implies --isolate; default with isolation: up to 4 per GPU, "
                         "about 4 cores each; 1-2 on a CPU)")
    sp.add_argument("--mps", action="store_true", help=MPS_HELP)
    sp.add_argument("--case-timeout", type=float,
                    help=f"with isolation: seconds one case may run before it counts as a hang "
                         f"({CASE_TIMEOUT_DEFAULTS}); time while a JIT compiler runs is not counted")
    sp.add_argument("--shrink-seconds", type=float,
                    help="seconds to spend shrinking one row's failure (default: the profile's, 10 for ci, 30 for "
                         "the others), and four times that over the run; 0 reports failures as found")
    sp.set_defaults(fn=cmd_run)

    sp = sub.add_parser("mutants", help="run the catalogue of injected bugs and report which are caught")
    sp.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    sp.add_argument("--profile", default="ci", help="ci, dev, nightly or gpu")
    sp.add_argument("--only", nargs="*", help="mutant names")
    sp.add_argument("--engine", default="harness", choices=["harness", "sglang"],
                    help="whose code the faults go into: the harness's own backends (default) or SGLang's real "
                         "classes (the bugs of the SGLang PRs this project started from)")
    sp.add_argument("--list", action="store_true", help="list the catalogue and exit")
    sp.add_argument("--budget", default="300s",
                    help="time per mutant before it counts as survived, e.g. 90s, 5m or plain seconds (default 300s)")
    sp.add_argument("--out", default="harness-out", help="folder for the table (mutants.json) and case files")
    sp.add_argument("--case-timeout", type=float,
                    help=f"seconds one case may run before the mutant counts as a hang ({CASE_TIMEOUT_DEFAULTS}; a "
                         f"GPU's first case may compile)")
    sp.add_argument("--isolate", action="store_true",
                    help="one process per mutant (always on a GPU, where a device-side assert is sticky)")
    sp.set_defaults(fn=cmd_mutants)

    from harness import bisect, warmup
    bisect.add_parser(sub)
    warmup.add_parser(sub)

    sp = sub.add_parser("summarize", help="one table of several runs' reports: cases, findings, headroom")
    sp.add_argument("folders", nargs="+", help="output folders of run or sweep (or their report.json)")
    sp.set_defaults(fn=cmd_summarize)

    sp = sub.add_parser("repro", help="replay a case file and show where outputs differ")
    sp.add_argument("file")
    sp.add_argument("--device", default="auto", help="auto (the case's device if present), cpu or cuda")
    sp.add_argument("--dump", help="folder to save the case's tensors (outputs, reference) into")
    sp.add_argument("--mutant", help="replay it with this bug from the catalogue injected (as the sweep that found "
                                     "it ran)")
    sp.add_argument("--known-passes", action="store_true",
                    help="exit 0 when the case fails as a known-failures ledger entry describes (what a sweep asks "
                         "when it replays a case alone: has it a bug no entry explains?)")
    sp.set_defaults(fn=cmd_repro)
    sp = sub.add_parser("export", help="write a case file as one standalone pytest file (torch and SGLang only)")
    sp.add_argument("file")
    sp.add_argument("--out", help="the pytest file to write (default harness-out/export/test_CASE.py); tensors too "
                                  "large to inline go into a .pt of the same name beside it")
    sp.add_argument("--device", default="auto", help="auto (the case's device), cpu or cuda")
    sp.add_argument("--check", action="store_true",
                    help="then run the file in a fresh process without this project, and say whether it fails "
                         "as the harness's replay does (exit 1 if not)")
    sp.add_argument("--stand-ins", action="store_true",
                    help="with --check, on a machine whose SGLang install lacks packages a user's has (the lent GPU "
                         "image: sgl_kernel, IPython): load the harness's stand-ins for them before the file")
    sp.set_defaults(fn=cmd_export)
    if with_sweep:
        from harness import sweep
        sweep.add_parser(sub)
    return p


def check_common(args) -> None:
    """Options several commands share, checked before any command starts (and, but for --properties,
    before torch is imported)."""
    if getattr(args, "device", None) is not None:
        check_device_name(args.device)
    if getattr(args, "profile", None) is not None:
        profile_named(args.profile)
    check_modes(getattr(args, "modes", None))
    check_properties(getattr(args, "properties", None))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(with_sweep=not argv or argv[0] not in LIGHT_COMMANDS).parse_args(argv)
    try:
        check_common(args)
        return args.fn(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: findings so far are under the output folder", file=sys.stderr)
        return 130
    except Exception as e:  # bad input surfaces as one of these; anything else is a harness bug
        from batch.spec import SpecError

        # CompositionError can only have been raised if its module is loaded (which imports torch).
        registry = sys.modules.get("backends.registry")
        if isinstance(e, SpecError) or (registry is not None and isinstance(e, registry.CompositionError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
