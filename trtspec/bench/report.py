"""Showing a benchmark report: tables on a console, the JSON file, and the plot."""

from __future__ import annotations

import json
import os
from pathlib import Path


def table_console():
    """A rich console for a report's wide tables: the terminal itself, or 132 columns when the output goes to a
    file or a pipe (where rich would wrap them at 80)."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=max(out.width, 132))


def write_report(report: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


# ---- output -------------------------------------------------------------------------------------------------


def _fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _p(dist: dict | None, key: str, spec: str = ".0f") -> str:
    return _fmt((dist or {}).get(key), spec)


def cell_label(k: int, adaptive: bool = False) -> str:
    """How a cell's K reads in tables: "4", or "≤4 adaptive" for the adaptive draft length bounded by 4."""
    return f"≤{k} adaptive" if adaptive else str(k)


def _fallback_text(cell: dict) -> str:
    reasons = cell.get("fallbacks") or {}
    if not reasons:
        return "-"
    return f"{cell['requests_with_fallback']}/{cell['requests']} req: " + ", ".join(
        f"{reason} {n}" for reason, n in sorted(reasons.items())
    )


def render(report: dict, console) -> None:
    """The report's tables on a rich console: latency and throughput, speculation, the bound, tuning."""
    from rich.table import Table

    s = report["settings"]
    cells = sorted(report["cells"], key=lambda c: (c["concurrency"], c["k"], c.get("adaptive", False)))
    title = (
        f"{s['num_prompts']} prompts ({s['prompts']}), {s['max_tokens']} tokens, "
        f"{'streamed' if s['stream'] else 'not streamed'}, {s['protocol']}"
    )
    perf = Table(title=f"latency and throughput: {title}")
    for col in (
        "C",
        "K",
        "req",
        "TTFT ms p50/p99",
        "TTFT vs K=0",
        "ITL ms p50/p99",
        "e2e ms p50/p90/p99",
        "tok/s req p50",
        "tok/s all",
        "speedup",
    ):
        perf.add_column(col, justify="right")
    spec = Table(title="speculation (per speculative iteration)")
    for col in (
        "C",
        "K",
        "accept",
        "α",
        "accepted/iter",
        "tokens\n/verif.",
        "draft/verify/other",
        "accepted by position",
        "fell back to plain",
    ):
        spec.add_column(col, justify="right")
    model = Table(title="the bound, fixed K: E = (1-α^(K+1))/(1-α) (Leviathan et al.)")
    for col in ("C", "K", "E", "c", "verify", "S Leviathan", "S predicted", "S achieved", "efficiency"):
        model.add_column(col, justify="right")
    last = None
    for c in cells:
        if last is not None and c["concurrency"] != last:
            for table in (perf, spec, model):
                table.add_section()
        last = c["concurrency"]
        req = f"{c['requests']}" + (f" [red]({c['errors']} failed)[/]" if c["errors"] else "")
        speed = _fmt(c["speedup"], ".2f", "x") if c["k"] else "1.00x"
        label = cell_label(c["k"], c.get("adaptive", False))
        perf.add_row(
            str(c["concurrency"]),
            label,
            req,
            f"{_p(c['ttft_ms'], 'p50')}/{_p(c['ttft_ms'], 'p99')}",
            _fmt(c.get("ttft_ratio"), ".2f", "x") if c["k"] else "-",
            f"{_p(c['itl_ms'], 'p50')}/{_p(c['itl_ms'], 'p99')}",
            f"{_p(c['e2e_ms'], 'p50')}/{_p(c['e2e_ms'], 'p90')}/{_p(c['e2e_ms'], 'p99')}",
            _p(c["tokens_per_s"], "p50", ".1f"),
            _fmt(c["tokens_per_s_aggregate"]),
            speed,
        )
        split = c.get("time_split") or {}
        split_text = "/".join(_fmt(split.get(x), ".0%") for x in ("draft", "verify", "other"))
        positions = " ".join(_fmt(p, ".0%") for p in c["position_acceptance"][:8])
        spec.add_row(
            str(c["concurrency"]),
            label,
            _fmt(c["acceptance_rate"], ".0%"),
            _fmt(c["alpha"], ".2f"),
            _fmt(c["accepted_per_iteration"], ".2f"),
            _fmt(c["tokens_per_iteration"], ".2f"),
            split_text,
            positions or "-",
            _fallback_text(c),
        )
        if c["k"] and not c.get("adaptive"):
            b = c.get("bound") or {}
            model.add_row(
                str(c["concurrency"]),
                label,
                _fmt(b.get("expected_tokens_per_iteration"), ".2f"),
                _fmt(b.get("draft_cost_ratio"), ".2f"),
                _fmt(b.get("verify_cost"), ".2f"),
                _fmt(b.get("leviathan_speedup"), ".2f", "x"),
                _fmt(b.get("predicted_speedup"), ".2f", "x"),
                speed,
                _fmt(b.get("efficiency"), ".0%"),
            )
    console.print(perf)
    console.print(spec)
    console.print(model)
    console.print(
        "α: per-token acceptance (i.i.d. model). c: one draft step / one target step; verify: one verification "
        "/ one target step (a target step: one decoding step at K=0, same concurrency). S Leviathan = E/(K·c+1); "
        "S predicted: end to end from α, c, verify and the measured prefill; efficiency = achieved / predicted.",
        style="dim",
        highlight=False,
    )
    t = report["tuning"]
    tuning = Table(title="tuning", show_header=False)
    tuning.add_column(justify="left")
    tuning.add_column(justify="left")
    tuning.add_row("best K", ", ".join(f"C={c}: K={_fmt(k, 'd')}" for c, k in t["best_k"].items()))
    tuning.add_row("default_num_draft_tokens", _fmt(t["default_num_draft_tokens"], "d"))
    limit = t["max_speculative_concurrency"]
    tuning.add_row("max_speculative_concurrency", f"{limit}" + (" (no limit)" if limit == 0 else ""))
    tuning.add_row("draft_cost_ratio", _fmt(t["draft_cost_ratio"], ".3f"))
    tuning.add_row("verify_cost_fixed", _fmt(t.get("verify_cost_fixed"), ".3f"))
    tuning.add_row("verify_cost_per_token", _fmt(t["verify_cost_per_token"], ".3f"))
    console.print(tuning)
    render_summary(summary_rows(report, s["prompts"]), console)


def write_plot(report: dict, path: str | os.PathLike) -> Path:
    """PNG: speedup vs K per concurrency (achieved, and predicted dashed), and acceptance per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for conc in sorted({c["concurrency"] for c in cells}):
        row = sorted((c for c in cells if c["concurrency"] == conc and not c.get("adaptive")), key=lambda c: c["k"])
        ks = [c["k"] for c in row if c["speedup"] is not None]
        (line,) = left.plot(ks, [c["speedup"] for c in row if c["speedup"] is not None], marker="o", label=f"C={conc}")
        adaptive = [
            (c["k"], c["speedup"])
            for c in cells
            if c["concurrency"] == conc and c.get("adaptive") and c["speedup"] is not None
        ]
        if adaptive:  # the adaptive draft length at its bound K, as separate points
            left.plot(
                *zip(*sorted(adaptive)),
                linestyle="none",
                marker="D",
                color=line.get_color(),
                label=f"C={conc} adaptive (≤K)",
            )
        predicted = [(c["k"], c["bound"]["predicted_speedup"]) for c in row if c.get("bound")]
        if predicted:
            left.plot(
                *zip((0, 1.0), *predicted),
                linestyle="--",
                marker="x",
                color=line.get_color(),
                alpha=0.6,
                label=f"C={conc} predicted",
            )
        for c in (c for c in cells if c["concurrency"] == conc):
            if c["k"] > 0 and c["position_acceptance"]:
                right.plot(
                    range(1, len(c["position_acceptance"]) + 1),
                    [p if p is not None else float("nan") for p in c["position_acceptance"]],
                    marker=".",
                    label=f"C={conc} K={cell_label(c['k'], c.get('adaptive', False))}",
                )
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xticks(sorted({c["k"] for c in cells}))
    right.xaxis.get_major_locator().set_params(integer=True)
    left.set(xlabel="draft tokens K", ylabel="speedup vs K=0 (output tokens/s)", title="speedup")
    left.legend(fontsize=8)
    right.set(
        xlabel="draft position", ylabel="accepted / drafted", title="acceptance by draft position", ylim=(0, 1.05)
    )
    if right.lines:
        right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the summary: each speculative cell against target-only, in one table --------------------------------------


def summary_rows(report: dict, workload: str, identical: dict[int, bool] | None = None) -> list[dict]:
    """One row per speculative cell of `report` (fixed K, or the adaptive draft length bounded by K): its figures
    against the target-only cell of its concurrency, and a sentence on why it paid or did not. `identical`:
    concurrency -> whether greedy outputs matched target-only
    there (a row of a concurrency not in it says "not checked")."""
    cells = report["cells"]
    base = {c["concurrency"]: c for c in cells if c["k"] == 0}
    rows = []
    for c in sorted(
        (c for c in cells if c["k"] > 0), key=lambda c: (c["concurrency"], c["k"], c.get("adaptive", False))
    ):
        b0 = base.get(c["concurrency"]) or {}
        rows.append(
            {
                "workload": workload,
                "speculation": report["settings"].get("speculation") or "deployment default",
                "concurrency": c["concurrency"],
                "k": c["k"],
                "adaptive": c.get("adaptive", False),
                "requests": c["requests"],
                "target_only_tokens_per_s": b0.get("tokens_per_s_aggregate"),
                "speculative_tokens_per_s": c["tokens_per_s_aggregate"],
                "speedup": c["speedup"],
                "acceptance": c["acceptance_rate"],
                "tokens_per_verification": c["tokens_per_iteration"],
                "bound": (c.get("bound") or {}).get("predicted_speedup"),
                "ttft_ms": [(b0.get("ttft_ms") or {}).get("p50"), (c.get("ttft_ms") or {}).get("p50")],
                "identical": (identical or {}).get(c["concurrency"]),
                "errors": c["errors"] + b0.get("errors", 0),
                "why": _why(c),
            }
        )
    return rows


# why a request decoded plainly, in words (the BLS's fallback reasons, RequestStats.fallbacks)
FALLBACK_WORDS = {
    "low_acceptance": "the drafts' acceptance was below what pays at this machine's costs",
    "governor": "the deployment's governor had switched speculation off at this load (it measured no gain there)",
    "draft_error": "the draft model failed",
    "load": "more requests were in flight than the deployment's speculation limit (max_speculative_concurrency)",
    "calibration": "at this load no draft length can pay on this machine's costs measured at start, even with every "
    "draft token accepted",
}


def _plain_why(c: dict) -> str:
    reasons = c.get("fallbacks") or {}
    words = [FALLBACK_WORDS.get(r, r.replace("_", " ")) for r, _ in sorted(reasons.items(), key=lambda rn: -rn[1])]
    return "; ".join(words) if words else "nothing was there to draft from"


def _why(c: dict) -> str:
    """Why a cell paid or did not, in one sentence, from its measured counts and costs."""
    b = c.get("bound") or {}
    name = f"C={c['concurrency']}, K={cell_label(c['k'], c.get('adaptive', False))}"
    speed = _fmt(c["speedup"], ".2f", "x")
    if not c["draft_tokens"]:
        calls = f"{c['iterations']} target calls, none verified a draft"
        return f"{name}: the deployment decoded plainly ({calls}): {_plain_why(c)}; {speed}."
    drafted_calls = f"{c['speculative_iterations']} of {c['iterations']} target calls verified drafts"
    sources = c.get("sources") or {}
    if len(sources) > 1:
        total = sum(sources.values())
        drafted_calls += (
            " (" + ", ".join(f"{SOURCE_NAMES.get(s, s)} {n / total:.0%}" for s, n in sorted(sources.items())) + ")"
        )
    if c.get("requests_with_fallback"):
        plain = f"{c['requests_with_fallback']} of {c['requests']} requests also decoded plainly for a while"
        drafted_calls += f"; {plain} ({_plain_why(c)})"
    tokens, paid = c["tokens_per_iteration"] or 0.0, (c["speedup"] or 0.0) >= 1.0
    verdict = "so it paid" if paid else "so it did not pay"
    accepted = f"{c['acceptance_rate']:.0%} of drafted tokens accepted gave {tokens:.2f} tokens per verification"
    if not b:
        return f"{name}: {drafted_calls}; {accepted}, {verdict}: {speed}."
    cost = b["verify_cost"] + b["mean_draft_length"] * b["draft_cost_ratio"]
    return (
        f"{name}: {drafted_calls}; {accepted}, and each cost {cost:.2f} target steps ({b['verify_cost']:.2f} to "
        f"verify, {b['mean_draft_length'] * b['draft_cost_ratio']:.2f} to draft), {verdict}: "
        f"{speed} of a bound of {_fmt(b['predicted_speedup'], '.2f', 'x')}."
    )


SOURCE_NAMES = {"draft_model": "draft model", "prompt_lookup": "prompt lookup"}


def render_summary(rows: list[dict], console, title: str = "speculative vs target-only, side by side") -> None:
    """The rows of `summary_rows` as one table, each row's sentence under it."""
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "workload",
        "C",
        "K",
        "target-only\ntok/s",
        "speculative\ntok/s",
        "speed-up",
        "accepted",
        "tokens\n/verif.",
        "bound",
        "TTFT ms\nt.-only/spec.",
        "identical",
    ):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for r in rows:
        ttft = "/".join(_fmt(x, ".0f") for x in r["ttft_ms"])
        identical = {None: "not checked", True: "yes", False: "[red]NO[/]"}[r["identical"]]
        table.add_row(
            f"{r['workload']}\n{SOURCE_NAMES.get(r['speculation'], r['speculation'])}",
            str(r["concurrency"]),
            cell_label(r["k"], r.get("adaptive", False)),
            _fmt(r["target_only_tokens_per_s"]),
            _fmt(r["speculative_tokens_per_s"]),
            _fmt(r["speedup"], ".2f", "x"),
            _fmt(r["acceptance"], ".0%"),
            _fmt(r["tokens_per_verification"], ".2f"),
            _fmt(r["bound"], ".2f", "x"),
            ttft,
            identical + (f" [red]({r['errors']} failed)[/]" if r["errors"] else ""),
        )
    console.print(table)
    console.print(
        "accepted: drafted tokens the target accepted; tokens/verif.: tokens per verifying target call; bound: "
        "the speed-up predicted from the measured acceptance and costs (trtspec/bench/__init__.py).",
        style="dim",
        highlight=False,
    )
    for r in rows:
        console.print(f"  {r['workload']}, {r['why']}", highlight=False, markup=False)
