"""``sandbx-pool run CALLS.jsonl`` and ``sandbx-pool demo``: the batch commands.

Exit codes: 0 when every call of the file ran (now or, with ``--resume``, in an earlier run),
whatever their outcomes; 1 when the run could not go on (the worker template died, the journal
failed or is locked by another run); 2 for a bad batch file, config file or usage, with a
message naming the file, the line or the key; 128 + N when signal N stopped it (the calls in
flight are cancelled with killer ``shutdown`` and journaled first; ``--resume`` runs them
again, except edit and bash calls a worker had already taken: those may have done their side
effect, so they are in doubt and skipped unless ``--rerun-started``). A resumed run that
skipped calls in doubt exits 1 and says how to re-run them. A stopped run prints the command
that resumes it, whole: absolute paths and every option that changes what runs.

Running into a journal that already holds calls of this batch (by id: ``batch.calls``) is
refused (2) unless the run says what it means: ``--resume`` (run the rest) or ``--fresh`` (run
them all again, appended to the same journal). So is a ``--resume`` whose ``--workspace`` is
not the one the journal recorded for these calls: the rest would land somewhere else.

On a Ray cluster (``--ray ADDRESS|auto``) the calls run on the cluster's nodes through
``integrations.ray.RayPool``: a line's ``workspace`` names a folder under ``--workspace`` (all
its calls run on one node), ``--parallel`` is the number of calls in flight across the cluster,
and the summary counts the calls per node. Calls lost with a node are run again by ``--resume``.

Settings: ``--config FILE`` is loaded first and the flags given on the command line override
it (``--parallel`` sets ``pool.workers``); a flag not given leaves the file's value.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from sandbx_pool.batch.calls import BatchFile, BatchFileError, load_batch
from sandbx_pool.cli.arguments import positive_int
from sandbx_pool.cli.checks import workspace_problem
from sandbx_pool.config import ChangeMode, Config, load_config
from sandbx_pool.errors import (
    ConfigError,
    JournalError,
    JournalLocked,
    SandbxPoolError,
    WorkspaceError,
)
from sandbx_pool.logs import logger

if TYPE_CHECKING:
    from sandbx_pool.batch.run import BatchReport, ResumePlan

EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

#: Argument warnings shown before a run; the rest are counted.
SHOWN_WARNINGS: Final = 5

#: Calls in doubt listed after a resumed run; the rest are counted.
SHOWN_IN_DOUBT: Final = 20


def add_batch_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``run`` and ``demo`` to a command line."""
    run = subparsers.add_parser(
        "run",
        help="run a file of tool calls (JSON Lines) with a progress bar and a summary",
        description="Run every call of CALLS.jsonl; each line is "
        '{"tool": ..., "args": {...}, "timeout": S, "id": ..., "cwd": ..., "after": [ids], '
        '"meta": ..., "workspace": NAME}.',
    )
    run.add_argument("calls", metavar="CALLS.jsonl")
    run.add_argument("--workspace", default=".", help="directory every path is confined to")
    run.add_argument("--parallel", type=positive_int, metavar="N", help="calls in flight at most")
    run.add_argument("--journal", metavar="PATH", help="journal file (default: a new one)")
    run.add_argument(
        "--resume",
        action="store_true",
        help="skip the calls that finished in the journal (calls stopped by a signal run"
        " again; edit and bash calls that may have run are in doubt: listed and skipped)",
    )
    run.add_argument(
        "--fresh",
        action="store_true",
        help="run every call again although the journal already holds them (their side"
        " effects happen again); the new records are appended to the journal",
    )
    run.add_argument(
        "--rerun-started",
        action="store_true",
        help="with --resume: also run again the calls in doubt (they may have run already:"
        " their side effect can happen twice)",
    )
    run.add_argument("--config", metavar="FILE", help="TOML settings; flags override them")
    run.add_argument(
        "--output-dir",
        metavar="DIR",
        help="write each bash call's output to DIR/CALL_ID.out as it comes (for tail -f)",
    )
    run.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run on a Ray cluster: its address, or 'auto' (the cluster this machine is part"
        " of); needs the ray extra",
    )
    run.add_argument(
        "--changes",
        choices=[str(mode) for mode in ChangeMode],
        help='what calls may do to the workspace (a line\'s own "changes" wins): see'
        " [workspace] changes",
    )
    run.add_argument(
        "--timeline",
        metavar="FILE.html",
        help="at the end (a stopped run too), draw the journal's calls as a timeline page:"
        " see journal timeline",
    )
    run.set_defaults(func=_cmd_run)

    demo = subparsers.add_parser("demo", help="run a built-in batch on a temporary workspace")
    demo.add_argument("--journal", metavar="PATH", help="journal file (default: a new one)")
    demo.add_argument("--config", metavar="FILE", help="TOML settings")
    demo.set_defaults(func=_cmd_demo)


def effective_config(args: argparse.Namespace) -> Config:
    """The config file (or the defaults) with the command line's flags on top. On Ray,
    ``--parallel`` counts calls across the cluster, not one node's workers."""
    config = load_config(args.config)
    changes = getattr(args, "changes", None)
    if changes is not None:
        config = config.override(workspace={"changes": changes})
    if getattr(args, "ray", None):
        return config
    return config.override(pool={"workers": getattr(args, "parallel", None)})


def _usage_error(command: str, message: str) -> int:
    print(f"sandbx-pool {command}: {message}", file=sys.stderr)
    return EXIT_USAGE


def _cmd_run(args: argparse.Namespace) -> int:
    # Everything that can be wrong with the input is checked before a worker is forked.
    try:
        batch = load_batch(args.calls)
    except BatchFileError as exc:
        return _usage_error("run", f"bad batch file:\n{exc}")
    except OSError as exc:
        return _usage_error("run", f"{args.calls}: {exc.strerror or exc}")
    networked = next((spec for spec in batch.calls if spec.network is not None), None)
    if getattr(args, "ray", None) and networked is not None:
        # Never ignored in silence: a line asking for less network would run with more.
        return _usage_error(
            "run",
            f'line {networked.line}: "network" is not taken with --ray (the nodes\' pools use'
            " the config's [sandbox] network)",
        )
    try:
        config = effective_config(args)
    except ConfigError as exc:
        return _usage_error("run", str(exc))
    if args.resume and not args.journal:
        return _usage_error("run", "--resume needs --journal PATH (the journal of the earlier run)")
    if args.rerun_started and not args.resume:
        return _usage_error("run", "--rerun-started goes with --resume")
    if args.fresh and args.resume:
        return _usage_error("run", "--fresh runs every call again, --resume the rest: not both")
    if args.ray is not None and args.output_dir is not None:
        return _usage_error("run", "--output-dir is not available with --ray (no streaming)")
    if args.ray is not None and (
        config.workspace.changes != "direct" or any(spec.changes for spec in batch.calls)
    ):
        return _usage_error("run", "tracked and transactional calls need a local pool, not --ray")
    if args.ray is not None and any(spec.session for spec in batch.calls):
        return _usage_error("run", "shell sessions need a local pool, not --ray")
    if args.ray is not None and not _ray_installed():
        return _usage_error("run", "--ray needs Ray: pip install 'sandbx-pool[ray]'")
    if args.output_dir is not None:
        # The user's own directory, not the workspace: made here, so a typo fails at once.
        try:
            os.makedirs(args.output_dir, exist_ok=True)
        except OSError as exc:
            return _usage_error("run", f"--output-dir {args.output_dir}: {exc.strerror or exc}")
    problem = _timeline_problem(args.timeline, args.journal)
    if problem is not None:
        return _usage_error("run", problem)
    problem = workspace_problem(args.workspace)
    if problem is not None:
        return _usage_error("run", problem)
    try:
        plan = _earlier_run(args.journal, resume=args.resume)
    except OSError as exc:
        return _usage_error("run", f"cannot read journal {args.journal}: {exc.strerror or exc}")
    ids = {spec.call_id for spec in batch.calls}
    if plan is not None and not args.resume:
        already = len(plan.seen & ids)
        if already and not args.fresh:
            return _usage_error(
                "run",
                f"journal {args.journal} already holds {already} of these {len(ids)} calls:"
                " --resume runs the rest, --fresh runs them all again",
            )
        if already:
            logger.warning(
                "--fresh: {} of these calls are in journal {} already; running all {} again",
                already,
                args.journal,
                len(ids),
            )
        plan = None
    if plan is not None:
        problem = _other_workspace(plan, batch, args)
        if problem is not None:
            return _usage_error("run", problem)
    _warn_about_arguments(batch)
    if plan is None:
        return _run(batch, config, args, set(), set())
    in_doubt = set(plan.in_doubt) & ids
    if in_doubt and args.rerun_started:
        logger.warning("--rerun-started: running {} call(s) in doubt again", len(in_doubt))
    skip = plan.skip(rerun_started=args.rerun_started)
    return _run(batch, config, args, skip, in_doubt, plan.doubts)


def _earlier_run(journal: str | None, *, resume: bool) -> ResumePlan | None:
    """What the journal says of its calls, or None when there is no journal yet."""
    from sandbx_pool.batch.run import resume_plan

    if journal is None or not os.path.exists(journal):
        if resume:
            logger.info("--resume: {} does not exist yet; running every call", journal)
        return None
    return resume_plan(journal)


def _other_workspace(plan: ResumePlan, batch: BatchFile, args: argparse.Namespace) -> str | None:
    """Why ``--resume`` must not run in ``--workspace``: the journal ran these calls in
    another one (the pool's root; a line's own ``workspace`` is a folder under it)."""
    recorded = plan.workspace_root(batch.calls)
    given = os.path.abspath(args.workspace)
    if recorded is None or _same_directory(recorded, given):
        return None
    return f"--resume: journal {args.journal} ran these calls in {recorded}, not in {given}"


def _same_directory(recorded: str, given: str) -> bool:
    # What the pool recorded is lexical (abspath): a symlink may name the same place.
    if os.path.normpath(recorded) == given:
        return True
    try:
        return os.path.realpath(recorded) == os.path.realpath(given)
    except (OSError, ValueError):
        return False


def resume_command(args: argparse.Namespace, journal: str, *, rerun_started: bool = False) -> str:
    """The command that resumes this run, to paste from any directory: absolute paths, the
    options that change what runs, shell-quoted."""
    words = ["sandbx-pool", "run", os.path.abspath(args.calls)]
    words += ["--workspace", os.path.abspath(args.workspace)]
    words += ["--journal", os.path.abspath(journal)]
    if args.config is not None:
        words += ["--config", os.path.abspath(args.config)]
    if args.parallel is not None:
        words += ["--parallel", str(args.parallel)]
    if args.output_dir is not None:
        words += ["--output-dir", os.path.abspath(args.output_dir)]
    if args.ray is not None:
        words += ["--ray", args.ray]  # an address or "auto", not a path
    if getattr(args, "changes", None) is not None:
        words += ["--changes", args.changes]
    words.append("--resume")
    if rerun_started:
        words.append("--rerun-started")
    return shlex.join(words)


def _warn_about_arguments(batch: BatchFile) -> None:
    for problem in batch.warnings[:SHOWN_WARNINGS]:
        logger.warning(
            "{}:{}: the tool will refuse these arguments: {}",
            batch.path,
            problem.line,
            problem.message,
        )
    if len(batch.warnings) > SHOWN_WARNINGS:
        logger.warning("... and {} more such line(s)", len(batch.warnings) - SHOWN_WARNINGS)


def _run(
    batch: BatchFile,
    config: Config,
    args: argparse.Namespace,
    skip: set[str],
    in_doubt: set[str],
    doubts: Mapping[str, str] | None = None,
) -> int:
    from sandbx_pool.batch.progress import Progress, format_summary, showing
    from sandbx_pool.batch.run import run_batch
    from sandbx_pool.integrations.ray import RayPool
    from sandbx_pool.pool import Pool
    from sandbx_pool.signals import Stopper, run_until_signalled

    async def main(stopper: Stopper) -> int:
        todo = sum(spec.call_id not in skip for spec in batch.calls)
        if skip:
            logger.info(
                "resuming: {} call(s) finished before, {} to run", len(batch.calls) - todo, todo
            )
        report: BatchReport | None = None
        try:
            pool: Pool | RayPool
            if args.ray is not None:
                pool = RayPool(
                    args.workspace, address=args.ray, journal=args.journal, config=config
                )
            else:
                pool = Pool(args.workspace, journal=args.journal, config=config)
            async with stopper.watch(pool):
                progress = Progress(todo)  # once the pool is up: the rate is the calls'
                async with showing(progress):
                    report = await run_batch(
                        pool,
                        batch.calls,
                        parallel=args.parallel or config.workers(),
                        skip=skip,
                        in_doubt=in_doubt if args.resume and not args.rerun_started else (),
                        stop=stopper.stopping,
                        on_submit=progress.started,
                        on_outcome=lambda _, outcome: progress.record(outcome),
                        output_dir=args.output_dir,
                    )
        except SandbxPoolError as exc:  # a locked journal, a template that cannot start
            print(f"sandbx-pool run: {exc}", file=sys.stderr)
            if report is None:
                # A --journal that cannot be opened, or that another pool holds, is the
                # command's input, as a bad workspace is: refused before anything ran.
                refused = isinstance(exc, JournalError | JournalLocked | WorkspaceError)
                return EXIT_USAGE if refused else EXIT_FAILED
        assert report is not None
        if stopper.signum is not None:
            report.stopped = True
        # After the pool closed: the journal is flushed, so the summary's path is complete.
        print("\n".join(format_summary(report)), flush=True)
        if report.in_doubt:
            print("\n".join(_in_doubt_lines(report, batch, args, doubts)), flush=True)
        # --resume runs what a stop or a failure left; what is in doubt (or held after it)
        # only --rerun-started runs, which the lines above name.
        if report.not_run > len(report.held) and report.journal:
            print(f"resume with: {resume_command(args, report.journal)}", flush=True)
        if args.timeline is not None:
            _write_timeline(args.timeline, report.journal)
        return 0 if report.complete else EXIT_FAILED

    return run_until_signalled(main)


def _timeline_problem(path: str | None, journal: str | None) -> str | None:
    """Why ``--timeline`` cannot be written there, checked before the batch: a typo found
    after a long batch would lose its picture (or, naming the journal, the journal)."""
    if path is None:
        return None
    from sandbx_pool.timeline import same_file

    if journal is not None and same_file(path, journal):
        return f"--timeline {path} is the --journal: the page would replace it"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--timeline {path}: no such directory {folder}"
    if os.path.isdir(path):
        return f"--timeline {path}: is a directory"
    return None


def _write_timeline(path: str, journal: str | None) -> None:
    """``run --timeline``: the journal's calls drawn, once the pool closed (the journal is
    whole). A failure here is reported and leaves the run's exit code as its calls made it."""
    from sandbx_pool.journal.reader import read_journal
    from sandbx_pool.timeline import write_timeline

    if journal is None:
        print("sandbx-pool run: --timeline: this run kept no journal to draw", file=sys.stderr)
        return
    try:
        timeline = write_timeline(read_journal(journal), path)
    except ValueError as exc:
        print(f"sandbx-pool run: --timeline: {exc}", file=sys.stderr)
        return
    except OSError as exc:
        print(f"sandbx-pool run: --timeline {path}: {exc.strerror or exc}", file=sys.stderr)
        return
    print(f"timeline: {path} ({len(timeline.bars)} calls)", flush=True)


def _ray_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


#: How each reason a call is in doubt (journal.reader.Doubt) reads after its line.
_DOUBT_TEXT: Final = {
    "no outcome": "no outcome: the run that started it never saw it end",
    "stopped after it started": "cancelled by a stop after it had started",
    "lost with its node after it started": "lost with its Ray node after it had started",
}


def _in_doubt_lines(
    report: BatchReport,
    batch: BatchFile,
    args: argparse.Namespace,
    doubts: Mapping[str, str] | None,
) -> list[str]:
    by_id = {spec.call_id: spec for spec in batch.calls}
    lines = [
        f"skipped {len(report.in_doubt)} call(s) in doubt: an earlier run started them, so"
        " their side effect may have happened:"
    ]
    for call_id in report.in_doubt[:SHOWN_IN_DOUBT]:
        spec = by_id[call_id]
        why = (doubts or {}).get(call_id)
        lines.append(
            f"  {call_id}  {spec.tool}  (line {spec.line})"
            + (f": {_DOUBT_TEXT.get(why, why)}" if why else "")
        )
    if len(report.in_doubt) > SHOWN_IN_DOUBT:
        lines.append(f"  ... and {len(report.in_doubt) - SHOWN_IN_DOUBT} more")
    if report.held:
        lines.append(f"held back {len(report.held)} call(s) that come after them")
    journal = report.journal or args.journal
    lines.append(
        "--resume runs them no more; check them, then run them again with: "
        + resume_command(args, journal, rerun_started=True)
    )
    return lines


def _cmd_demo(args: argparse.Namespace) -> int:
    from sandbx_pool.cli.demo import run_demo_command

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return _usage_error("demo", str(exc))
    return run_demo_command(config, args.journal)
