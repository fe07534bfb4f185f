"""Commands that keep a deployment's draft fitted to its traffic: shadow (compare drafts on captured requests) and
promote (a new draft into the running server). Capture is `trtspec serve --capture`, training `trtspec distill`;
docs/runbook.md strings them together."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from trtspec import keys
from trtspec.cli.app import URL_OPTION, cli, console


@cli.command()
@click.option("--draft", required=True, help="The candidate draft checkpoint (e.g. from `trtspec distill`).")
@click.option(
    "--against",
    help="The deployed draft's checkpoint [default: the one the --repo's active draft engine was built from].",
)
@click.option(
    "--data",
    "data",
    multiple=True,
    required=True,
    type=click.Path(exists=True),
    help="Repeatable. A `trtspec serve --capture` directory (or one capture file); greedy requests are replayed.",
)
@click.option(
    "--repo",
    type=click.Path(file_okay=False, exists=True),
    help="The deployment's model repository: its stored calibration, else its BLS's costs, predict the speed-up.",
)
@click.option(
    "--calibration",
    type=click.Path(dir_okay=False, exists=True),
    help="A calibration file to take the costs from instead [default: the one stored for --repo].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def shadow(draft, against, data, repo, calibration, as_json) -> None:
    """Replay captured traffic teacher-forced on two drafts: acceptance at K = 1..6, the predicted speed-up, per route.

    Each draft reads every captured greedy request's prompt and output; greedy speculation accepts the leading run
    of tokens it predicts as the target did, so the replay gives the acceptance the engine would measure, with no
    target pass. It says which draft to keep.

    \b
    Examples:
      trtspec shadow --draft drafts/v2 --data captures/ --repo model_repository
      trtspec shadow --draft drafts/v2 --against pkg:trtspec/data/drafts/smollm2-135m-instruct --data captures/
    """
    from trtspec.promote import deployed_draft_checkpoint
    from trtspec.shadow import KS, OVERALL, run_shadow

    if against is None:
        if repo is None:
            raise click.UsageError("--against: give the deployed draft's checkpoint, or --repo to read it from")
        against = deployed_draft_checkpoint(repo)
        if Path(against).resolve() == Path(draft).resolve():
            raise click.UsageError(
                f"--against: the active draft of {repo} is --draft itself (promoted already); give the draft to "
                "compare with, e.g. the one before: `trtspec promote --previous` names it in promotions.json"
            )
    report = run_shadow(
        draft,
        against,
        list(data),
        repo=repo,
        calibration=calibration,
        progress=lambda line: console.print(escape(line), highlight=False),
    )
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        return
    cost = report.costs.model
    table = Table(title=f"greedy acceptance on {report.records} captured requests (teacher-forced replay)")
    table.add_column("draft")
    table.add_column("route")
    for k in KS:
        table.add_column(f"K={k}", justify="right")
    table.add_column("best K: speed-up", justify="right")
    for name, figures in (("deployed", report.drafts[0]), ("candidate", report.drafts[1])):
        for route, rows in figures.by_route.items():
            best = figures.best(route, cost)
            table.add_row(
                name if route == OVERALL else "",
                escape(route),
                *(f"{r['acceptance']:.3f}" for r in rows),
                f"{best['k']}: {best['speedup']:.2f}x",
            )
    console.print(table)
    console.print(
        f"deployed: {escape(report.drafts[0].name)}; candidate: {escape(report.drafts[1].name)}; costs from "
        f"{escape(report.costs.source)} (c {cost.draft_cost_ratio:.2f}, d0 {cost.draft_cost_fixed:.2f}, "
        f"b {cost.verify_cost_per_token:.2f}, v0 {cost.verify_cost_fixed:.2f})"
        + (f"; {report.left_out} sampled requests left out" if report.left_out else ""),
        highlight=False,
    )
    which = "candidate" if report.keep == report.drafts[1].name and report.keep != report.drafts[0].name else "deployed"
    console.print(f"[bold]keep the {which} draft[/]: {escape(report.reason)}", highlight=False)


@cli.command()
@click.option(
    "--repo",
    required=True,
    type=click.Path(file_okay=False, exists=True),
    help="The served model repository (from `trtspec deploy`).",
)
@click.option("--draft", help="The new draft checkpoint: its engine becomes the next version of tensorrt_llm_draft.")
@click.option("--previous", is_flag=True, help="Go back to the draft version that was active before this one.")
@URL_OPTION
@click.option(
    "--admin-key-file",
    type=click.Path(dir_okay=False, exists=True),
    help=f"The key of Triton's model-repository API (header {keys.ADMIN_HEADER}) [default: ${keys.ADMIN_ENV}, else "
    "the one `trtspec serve` generated for --repo].",
)
@click.option(
    "--timeout",
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds to wait for the new version to be ready.",
)
def promote(repo, draft, previous, url, admin_key_file, timeout) -> None:
    """Load a new draft into the running deployment, without a restart; requests keep running.

    Builds the draft's engine with the repository's build config, writes it as the next version of
    tensorrt_llm_draft and loads it through Triton's repository API: Triton serves the old version until the new one
    is ready. The version labels the BLS's acceptance metrics (draft_version). TensorRT-LLM deployments are refused
    (Triton runs them in model-control mode none): rebuild, redeploy and restart there.

    \b
    Examples:
      trtspec promote --repo model_repository --draft drafts/v2
      trtspec promote --repo model_repository --previous
    """
    from trtspec import promote as P

    if bool(draft) == previous:
        raise click.UsageError("give either --draft CHECKPOINT or --previous")
    url = url or "127.0.0.1:8000"
    headers = _admin_headers(repo, admin_key_file)
    if previous:
        version = P.previous(repo, url=url, headers=headers, timeout=timeout)
        console.print(f"{P.DRAFT_MODEL} is back at version {version}", highlight=False)
        return
    version = P.promote(repo, draft, url=url, headers=headers, timeout=timeout, console=console)
    console.print(
        f"{P.DRAFT_MODEL} version {version} serves {escape(draft)}; go back with "
        f"`trtspec promote --repo {escape(repo)} --previous`",
        highlight=False,
    )


def _admin_headers(repo: str, admin_key_file: str | None) -> dict[str, str]:
    try:
        key = keys.resolve(file=admin_key_file, option="--admin-key-file", env=keys.ADMIN_ENV)
        generated = keys.state_dir(repo) / "admin-key"
        if key is None and generated.is_file():
            key = keys.read_key_file(generated, "the key `trtspec serve` generated")
    except keys.KeyProblem as exc:
        raise click.ClickException(str(exc)) from None
    if key is None:
        raise click.UsageError(
            f"--admin-key-file: the model-repository API needs the admin key; give the file, set ${keys.ADMIN_ENV}, "
            "or run where `trtspec serve` generated it"
        )
    return {keys.ADMIN_HEADER: key.value, "Content-Type": "application/json"}
