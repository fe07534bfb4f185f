"""`trtspec shadow`: two drafts replayed on captured traffic, teacher-forced, and which one to keep.

For every captured request with a greedy output (the target's argmax at each step, trtspec.capture), each draft reads
the prompt and the output in one forward pass; `match[i]` says whether its greedy choice after the first i output
tokens is the target's. Greedy speculative decoding with K draft tokens accepts exactly the leading run of matches
from where it drafts, then adds the target's own token, so replaying that loop over `match`
(trtspec.distill.train.acceptance, the orchestrator's rule of at most the remaining budget minus one, drafting from
the second output token as the loop does) gives the acceptance and the tokens per target call the engine would
measure on the same requests: no target pass is needed.

Predicted speed-up at K: tokens per call / cost(K), where cost(K) is one speculative iteration in plain target steps
(trtspec.orchestrator.adaptive.CostModel): the deployment's start-up calibration when it stored one
(trtspec.calibration), else the costs `trtspec bench --apply` wrote into the BLS's config, else the defaults (said so).
Sampled outputs (temperature > 0) are not the target's argmax: they are counted and left out.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trtspec import capture
from trtspec.errors import TrtspecError
from trtspec.orchestrator.adaptive import CostModel

KS = (1, 2, 3, 4, 5, 6)
WINDOW = 2048  # tokens of a request replayed (the prompt's start is cut first)
OVERALL = "(all)"


class ShadowError(TrtspecError):
    """A shadow comparison that cannot run: drafts, data or costs that do not fit; the message names the option."""


@dataclass
class Costs:
    model: CostModel
    source: str  # where they come from, printed with the figures


@dataclass
class DraftFigures:
    """One draft's replay: per route (and OVERALL) the acceptance and tokens per call at each K."""

    name: str
    by_route: dict[str, list[dict]] = field(default_factory=dict)

    def best(self, route: str, costs: CostModel) -> dict:
        """The K with the highest predicted speed-up on `route`, with that speed-up."""
        rows = self.by_route[route]
        return max(({"k": r["k"], "speedup": predicted_speedup(r, costs)} for r in rows), key=lambda r: r["speedup"])


def predicted_speedup(row: dict, costs: CostModel) -> float:
    """Tokens per target call over the iteration's cost in plain steps: the speed-up over plain decoding."""
    return row["tokens_per_call"] / costs.cost(row["k"])


# ---- the replay ---------------------------------------------------------------------------------------------------


def load_draft(spec: str, option: str):
    """A draft as a float32 Hugging Face model (a `trtspec distill` draft takes its shared weights from its target)."""
    from trtspec.checkpoint import CheckpointError, inspect_checkpoint, load_model, resolve_checkpoint_path

    try:
        info = inspect_checkpoint(resolve_checkpoint_path(spec, Path.cwd()))
        model = load_model(info, torch.float32)
    except CheckpointError as exc:
        raise ShadowError(f"{option} {spec}: {exc}") from None
    return model.eval(), info.vocab_size


@torch.inference_mode()
def replay_matches(model, records: list[dict], *, window: int = WINDOW) -> list[list[bool]]:
    """Per record, whether the draft's greedy choice at each output position is the captured output's token."""
    out = []
    for record in records:
        prompt, answer = record["input_ids"], record["output_ids"][: window - 1]
        prompt = prompt[-(window - len(answer)) :]
        ids = torch.tensor([prompt + answer])
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : -1]
        choice = model.lm_head(hidden).argmax(-1)
        # the first output token is the target's own, alone (the loop's first iteration): drafting starts after it
        out.append((choice == torch.tensor(answer)).tolist()[1:])
    return out


def figures(name: str, matches: list[list[bool]], routes: list[str], ks=KS) -> DraftFigures:
    from trtspec.distill.train import acceptance

    grouped: dict[str, list[list[bool]]] = defaultdict(list)
    for match, route in zip(matches, routes):
        grouped[route].append(match)
    result = DraftFigures(name, {OVERALL: [acceptance(matches, k) for k in ks]})
    if len(grouped) > 1:
        for route in sorted(grouped):
            result.by_route[route] = [acceptance(grouped[route], k) for k in ks]
    return result


def greedy_records(data: list[str], vocab_size: int) -> tuple[list[dict], int]:
    """The captured requests of every --data directory whose outputs are greedy, and how many sampled were left out."""
    records = []
    for spec in data:
        try:
            records += capture.read_records(spec)
        except (capture.CaptureError, OSError) as exc:
            raise ShadowError(f"--data {exc}") from None
    greedy = [r for r in records if r.get("greedy", r.get("temperature", 0.0) == 0.0)]
    if not greedy:
        raise ShadowError(
            f"--data {', '.join(data)}: none of its {len(records)} captured requests was decoded greedily; "
            "acceptance is replayed on greedy outputs (the target's argmax)"
        )
    for n, record in enumerate(greedy, 1):
        bad = next((t for t in record["input_ids"] + record["output_ids"] if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise ShadowError(
                f"--data: captured request {n} holds token id {bad}, outside the drafts' vocabulary [0, {vocab_size}): "
                "it was captured from another model"
            )
    return greedy, len(records) - len(greedy)


# ---- the costs ----------------------------------------------------------------------------------------------------


def deployment_costs(repo: str | os.PathLike | None, calibration: str | os.PathLike | None = None) -> Costs:
    """The costs the deployment runs with: a stored calibration, else the BLS's (bench --apply), else defaults."""
    from trtspec.calibration import Calibration, CalibrationError

    if calibration is not None:
        try:
            return Costs(Calibration.load(calibration).cost_model(1), f"calibration {calibration}")
        except (CalibrationError, OSError) as exc:
            raise ShadowError(f"--calibration {calibration}: {exc}") from None
    if repo is None:
        return Costs(CostModel(), "trtspec's default costs (give --repo for the deployment's)")
    from trtspec.promote import bls_parameters, stored_calibration

    found = stored_calibration(repo)
    if found is not None:
        try:
            return Costs(Calibration.load(found).cost_model(1), f"the start-up calibration {found}")
        except (CalibrationError, OSError):
            pass  # a stale or broken file: the BLS's own costs below, as the BLS itself would fall back
    params = bls_parameters(repo)
    defaults = CostModel()
    values = {}
    for name in ("draft_cost_ratio", "verify_cost_per_token", "verify_cost_fixed"):
        try:
            values[name] = float(params[name]) if params.get(name) else getattr(defaults, name)
        except ValueError:
            raise ShadowError(f"--repo {repo}: the BLS parameter {name} is {params[name]!r}, not a number") from None
    measured = any(params.get(n) for n in values)
    return Costs(
        CostModel(**values),
        f"{repo}'s BLS parameters" + ("" if measured else " (trtspec's defaults: run `trtspec bench --apply`)"),
    )


# ---- the comparison ---------------------------------------------------------------------------------------------


@dataclass
class ShadowReport:
    drafts: list[DraftFigures]
    costs: Costs
    records: int
    left_out: int
    keep: str = ""
    reason: str = ""

    def to_json(self) -> dict:
        return {
            "records": self.records,
            "sampled_left_out": self.left_out,
            "costs": dataclasses.asdict(self.costs.model) | {"source": self.costs.source},
            "drafts": {
                d.name: {
                    route: {"by_k": rows, "best": d.best(route, self.costs.model)} for route, rows in d.by_route.items()
                }
                for d in self.drafts
            },
            "keep": self.keep,
            "reason": self.reason,
        }


def decide(report: ShadowReport, margin: float = 0.01) -> None:
    """Keep the candidate (the second draft) where its best predicted speed-up overall beats the deployed one's by
    more than `margin`, and no route loses more than that; else keep the deployed draft."""
    deployed, candidate = report.drafts
    cost = report.costs.model
    old, new = deployed.best(OVERALL, cost)["speedup"], candidate.best(OVERALL, cost)["speedup"]
    losses = [
        route
        for route in deployed.by_route
        if route != OVERALL and candidate.best(route, cost)["speedup"] < deployed.best(route, cost)["speedup"] - margin
    ]
    if new > old + margin and not losses:
        report.keep, report.reason = candidate.name, f"predicted speed-up {new:.2f}x against {old:.2f}x"
    elif new > old + margin:
        report.keep = deployed.name
        report.reason = (
            f"the candidate is faster overall ({new:.2f}x against {old:.2f}x) but slower on {', '.join(losses)}"
        )
    else:
        report.keep, report.reason = deployed.name, f"the candidate predicts {new:.2f}x against {old:.2f}x"


def run_shadow(
    draft: str,
    against: str,
    data: list[str],
    *,
    repo: str | None = None,
    calibration: str | None = None,
    progress=None,
) -> ShadowReport:
    costs = deployment_costs(repo, calibration)
    models = []
    for spec, option in ((against, "--against"), (draft, "--draft")):
        models.append((spec, *load_draft(spec, option)))
    if models[0][2] != models[1][2]:
        raise ShadowError(
            f"--draft has a vocabulary of {models[1][2]} tokens, --against {models[0][2]}: they are drafts of "
            "different targets"
        )
    records, left_out = greedy_records(data, models[0][2])
    routes = [capture.route_of(r) for r in records]
    drafts = []
    for spec, model, _ in models:
        if progress:
            progress(f"replaying {len(records)} captured requests on {spec}")
        drafts.append(figures(spec, replay_matches(model, records), routes))
    report = ShadowReport(drafts, costs, len(records), left_out)
    decide(report)
    return report
