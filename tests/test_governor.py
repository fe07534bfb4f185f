"""The deployment's speculation governor: down on errors, low acceptance or no speed-up, back up on probes that pay,
each change once, with its reason; requests admitted before a change do not judge the new level. One governor per
load range: a load that does not pay rolls back its own range."""

from __future__ import annotations

from trtspec.orchestrator.governor import Governor, LoadGovernors, Outcome


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(**kw):
    clock, changes = Clock(), []
    gov = Governor(
        8, clock=clock, hold_seconds=10.0, on_change=lambda old, new, why: changes.append((old, new, why)), **kw
    )
    return gov, clock, changes


def run(
    gov,
    clock,
    n,
    *,
    speculative=True,
    tpot=0.01,
    plain_tpot=0.02,
    drafted=8,
    accepted=6,
    failed=False,
    break_even=0.4,
    load=None,
):
    """n requests admitted and finished one after the other, a second apart; those the governor admits without
    drafting (cap 0) decode plainly at `plain_tpot`. `load`: admitted at this load (LoadGovernors)."""
    at_load = () if load is None else (load,)
    for _ in range(n):
        cap, probe, at = gov.admit(*at_load)
        clock.now += 1.0
        spec = speculative and cap > 0
        gov.observe(
            Outcome(
                spec,
                tpot if spec else plain_tpot,
                num_draft_tokens=drafted if spec else 0,
                num_accepted_tokens=accepted if spec else 0,
                failed=failed,
                probe=probe,
                admitted_at=at,
            ),
            break_even,
            *at_load,
        )


def test_it_speculates_at_full_length_while_speculation_pays():
    gov, clock, changes = make()
    run(gov, clock, 5, speculative=False, tpot=0.02)  # the plain baseline
    run(gov, clock, 60, tpot=0.01)
    assert gov.state == "speculating" and gov.cap() == 8 and changes == []


def test_server_errors_roll_back_to_plain_at_once_and_once():
    gov, clock, changes = make()
    run(gov, clock, 1, failed=True)  # one failure is an incident, not a rate
    run(gov, clock, 30, tpot=0.01)
    assert changes == []
    run(gov, clock, 1, failed=True)  # 2 of 32: above 5 %, past the warning straight to plain
    assert gov.state == "plain" and gov.cap() == 0
    assert changes == [("speculating", "plain", "errors")]


def test_a_few_errors_reduce_the_draft_length():
    gov, clock, changes = make(window=100)
    run(gov, clock, 1, failed=True)
    run(gov, clock, 60, tpot=0.01)
    run(gov, clock, 1, failed=True)  # 2 of 62: between 2 % and 5 %
    assert changes == [("speculating", "reduced", "errors")] and gov.cap() == 4


def test_low_acceptance_steps_down_twice_then_probes_bring_it_back():
    gov, clock, changes = make()
    run(gov, clock, 5, speculative=False, tpot=0.02)
    run(gov, clock, 10, accepted=1)  # acceptance 1/8 < break-even 0.4
    assert changes[-1] == ("speculating", "reduced", "low_acceptance") and gov.cap() == 4
    run(gov, clock, 5, accepted=1)  # inside the hold: nothing judged
    assert gov.state == "reduced"
    run(gov, clock, 5, accepted=1)
    assert changes[-1] == ("reduced", "plain", "low_acceptance") and gov.state == "plain"
    # in plain, one request in 8 probes at the reduced length; probes that pay bring reduced back, then full
    caps = [gov.admit()[:2] for _ in range(16)]
    assert [c for c in caps if c[1]] == [(4, True), (4, True)] and caps.count((0, False)) == 14
    assert gov.state == "probing"
    run(gov, clock, 60, tpot=0.01, accepted=7)
    assert [c[1:] for c in changes[-2:]] == [("reduced", "probes_pay"), ("speculating", "pays")]
    assert gov.cap() == 8


def test_a_running_request_is_capped_only_where_its_range_rolled_back():
    gov, clock, changes = make()
    assert gov.rolled_back_cap() is None  # full length: the request's own draft length stands
    run(gov, clock, 10, accepted=1)
    assert gov.state == "reduced" and gov.rolled_back_cap() == 4
    clock.now += 10
    run(gov, clock, 10, accepted=1)
    assert gov.state == "plain" and gov.rolled_back_cap() == 0
    gov.force("speculating", seconds=5)
    assert gov.rolled_back_cap() is None
    clock.now += 6  # the force expires on the next look
    assert gov.rolled_back_cap() == 0 and changes[-1][2] == "force_expired"


def test_speculation_no_faster_than_plain_steps_down():
    gov, clock, changes = make()
    run(gov, clock, 5, speculative=False, tpot=0.02)
    run(gov, clock, 10, tpot=0.02, accepted=7)  # accepted, but no faster than plain
    assert changes == [("speculating", "reduced", "slower_than_plain")]


def test_requests_admitted_before_a_change_do_not_judge_the_new_level():
    gov, clock, changes = make()
    early = [gov.admit() for _ in range(12)]  # admitted at full length
    run(gov, clock, 5, failed=True)
    run(gov, clock, 10, failed=True)
    assert gov.cap() == 0  # plain (probing, with its probes)
    clock.now += 100
    for _cap, probe, at in early:  # they finish late, failing: not this level's doing
        gov.observe(Outcome(True, 0.01, num_draft_tokens=8, failed=True, probe=probe, admitted_at=at), 0.4)
    assert changes == [("speculating", "plain", "errors")]


def test_an_operator_force_holds_then_expires_back_to_the_level_before():
    gov, clock, changes = make()
    run(gov, clock, 5, speculative=False, tpot=0.02)
    run(gov, clock, 20, tpot=0.01)
    gov.force("plain", 60.0, reason="operator")
    assert gov.state == "plain" and gov.cap() == 0 and gov.forced
    for _ in range(40):  # no probes while forced, and nothing judged
        cap, probe, _at = gov.admit()
        assert (cap, probe) == (0, False)
    run(gov, clock, 30, tpot=0.01, failed=True)  # failures under a force do not move it
    assert gov.state == "plain"
    clock.now += 60.0
    gov.admit()  # the first request after the time is up ends it
    assert gov.state == "speculating" and not gov.forced
    assert changes == [("speculating", "plain", "operator"), ("plain", "speculating", "force_expired")]


def test_a_released_force_returns_and_a_new_one_replaces_the_old():
    gov, clock, changes = make()
    gov.force("reduced", 600.0, reason="alertmanager")
    gov.force("plain", 600.0, reason="alertmanager")  # a harsher alert: replaced, the level before kept
    assert gov.cap() == 0
    gov.force(None, reason="force")
    assert gov.state == "speculating" and gov.cap() == 8
    assert [c[2] for c in changes] == ["alertmanager", "alertmanager", "force_release"]
    gov.force(None)  # nothing forced: nothing to report
    assert len(changes) == 3


def test_kv_cache_pressure_puts_a_floor_under_the_level_until_it_eases():
    """Above 92 % of the KV blocks: reduced; above 97 %: plain, without probes (each takes KV); the floor stays
    until the fraction falls below 85 %, and then the judged level is back, with every change reported."""
    gov, clock, changes = make()
    run(gov, clock, 5, speculative=False, tpot=0.02)
    gov.kv_cache(0.5)
    assert gov.state == "speculating" and changes == []
    gov.kv_cache(0.93)
    assert gov.state == "reduced" and gov.cap() == 4
    gov.kv_cache(0.90)  # between release and warning: the floor holds
    assert gov.cap() == 4
    gov.kv_cache(0.98)
    assert gov.state == "plain" and gov.cap() == 0
    assert all(gov.admit()[:2] == (0, False) for _ in range(3 * gov.probe_every))  # no probes
    gov.kv_cache(0.84)
    assert gov.state == "speculating" and gov.cap() == 8
    assert changes == [
        ("speculating", "reduced", "kv_cache"),
        ("reduced", "plain", "kv_cache"),
        ("plain", "speculating", "kv_cache_cleared"),
    ]
    gov.kv_cache(None)  # unknown: no floor, no change
    assert len(changes) == 3


def test_a_draft_outage_reduces_the_draft_length_and_its_end_restores_it():
    """Requests keep drafting (prompt lookup under auto; the draft breaker's probes find the model back)."""
    gov, clock, changes = make()
    gov.draft_down(True)
    gov.draft_down(True)  # reported once
    assert gov.state == "reduced" and gov.admit()[0] == 4 and changes == [("speculating", "reduced", "draft_down")]
    gov.kv_cache(0.99)  # the higher floor wins, and lifting it leaves the other
    assert gov.state == "plain"
    gov.kv_cache(0.2)
    assert gov.state == "reduced"
    gov.draft_down(False)
    assert gov.state == "speculating" and changes[-1] == ("reduced", "speculating", "draft_down_cleared")


def test_a_force_never_lifts_the_floors():
    """A forced `speculating` or `reduced` still decodes plainly while the KV cache is full and drafts at most the
    reduced length while the draft is down; the force's level comes back as each floor lifts, and a forced `plain`
    stays plain through all of it."""
    gov, clock, changes = make()
    run(gov, clock, 5, speculative=False, tpot=0.02)
    gov.kv_cache(0.99)
    clock.now += 20
    gov.force("speculating", 60, reason="operator")
    assert gov.forced and gov.state == "plain" and gov.cap() == 0 and gov.rolled_back_cap() == 0
    assert all(gov.admit()[:2] == (0, False) for _ in range(3 * gov.probe_every))  # and no probes
    gov.kv_cache(0.93)  # easing, but above the release: the floor holds
    assert gov.cap() == 0
    gov.draft_down(True)
    gov.kv_cache(0.5)
    assert gov.state == "reduced" and gov.cap() == 4  # the outage's floor, under the same force
    gov.draft_down(False)
    assert gov.state == "speculating" and gov.cap() == 8 and gov.forced  # the force's own level, once both lift
    assert [why for *_, why in changes] == ["kv_cache", "operator", "kv_cache_cleared", "draft_down_cleared"]

    gov.force("reduced", 60, reason="operator")
    gov.kv_cache(0.99)
    assert gov.cap() == 0
    gov.force(None)
    assert gov.state == "plain" and not gov.forced  # released: the floor, the pressure still on
    gov.force("plain", 60, reason="operator")
    gov.kv_cache(0.1)
    assert gov.forced and gov.state == "plain" and gov.cap() == 0  # a floor's end lifts no force


def test_a_force_never_lifts_the_floors_of_any_range():
    govs, clock, changes = make_ranges()
    govs.draft_down(True)
    govs.force("speculating", 60.0, reason="operator")
    govs.kv_cache(0.99)
    assert [govs.admit(load)[0] for load in (1, 4)] == [0, 0]  # a range made under the force and the floors too
    govs.kv_cache(0.1)
    assert [govs.admit(load)[0] for load in (1, 4, 8)] == [4, 4, 4]


def make_ranges(**kw):
    clock, changes = Clock(), []
    govs = LoadGovernors(8, clock=clock, hold_seconds=10.0, on_change=lambda *change: changes.append(change), **kw)
    return govs, clock, changes


def test_a_load_that_does_not_pay_rolls_back_its_own_range_and_leaves_lone_requests_speculating():
    """A burst of 4 requests whose shared passes cost more than their drafts return steps down the 3-4 range to
    plain; lone requests keep their full draft length, and a heavier range seen later starts where 3-4 is."""
    govs, clock, changes = make_ranges()
    run(govs, clock, 5, speculative=False, tpot=0.02, load=1)
    run(govs, clock, 20, tpot=0.01, load=1)
    # 6 of 8 accepted, where that load's learned costs need 9 in 10 to break even
    run(govs, clock, 10, tpot=0.03, accepted=6, break_even=0.9, load=4)
    clock.now += 20
    run(govs, clock, 10, tpot=0.03, accepted=6, break_even=0.9, load=3)
    # with no plain reference of its own, the range goes to plain at once to take one: its hold at reduced could
    # only have ended there
    assert changes == [("3-4", "speculating", "plain", "no_plain_reference", 0)]
    assert govs.admit(1)[0] == 8 and govs.admit(2)[0] == 8  # 2 was never seen: it starts from 1's level
    assert govs.at(8).state == "plain" and govs.at(8).cap() == 0  # 5-8 starts from 3-4's level
    assert [label for label, _ in govs.ranges()] == ["1", "2", "3-4", "5-8"]
    assert len(changes) == 1  # a new range starting where a lighter one is makes no change


def test_above_one_request_plain_requests_beside_speculating_ones_are_no_reference():
    """Plain requests that shared their passes with verifications are slowed by them: at four requests in flight
    their time per token does not let speculation back up ("pays"); the range's reference comes from requests it
    decoded plainly, and its probes are held against that."""
    govs, clock, changes = make_ranges()
    run(govs, clock, 10, accepted=1, load=4)  # low acceptance, and no reference yet: plain at once, to take one
    assert govs.at(4).state == "plain" and govs.at(4).plain_tpot is None
    lone = make()[0]  # one request in flight: nothing shares its passes, and the same requests are a reference
    run(lone, clock, 5, speculative=False, plain_tpot=0.05)
    assert abs(lone.plain_tpot - 0.05) < 1e-9
    run(govs, clock, 20, accepted=1, load=4)  # the plain requests since then at 0.02 (its probes accept little)
    assert govs.at(4).level == 2 and abs(govs.at(4).plain_tpot - 0.02) < 1e-9
    clock.now += 20
    run(govs, clock, 40, tpot=0.03, plain_tpot=0.02, accepted=7, load=4)  # plainly at 0.02: probes at 0.03 do not pay
    assert govs.at(4).state == "probing" and abs(govs.at(4).plain_tpot - 0.02) < 1e-9
    for _ in range(80):  # probes at 0.01 do
        run(govs, clock, 1, tpot=0.01, plain_tpot=0.02, accepted=7, load=4)
        if govs.at(4).state == "reduced":
            break
    assert govs.at(4).state == "reduced"
    early = govs.admit(4)  # admitted while the range drafts at the reduced length
    # plain requests beside the reduced drafts, slowed by them, and drafts no faster than those: not "pays"
    run(govs, clock, 5, speculative=False, plain_tpot=0.05, load=4)
    govs.observe(Outcome(False, 0.09, admitted_at=early[2]), 0.4, 4)  # finishes later, but shared its passes
    assert abs(govs.at(4).plain_tpot - 0.02) < 1e-9
    clock.now += 20
    run(govs, clock, 10, tpot=0.03, accepted=7, load=4)  # slower than the reference: reduced does not pay
    assert govs.at(4).state == "plain" and changes[-1][3] == "slower_than_plain"
    assert [c[3] for c in changes] == ["no_plain_reference", "probes_pay", "slower_than_plain"]
    assert govs.at(1).cap() == 8 and not govs.at(1).shared and govs.at(2).shared


def test_a_shared_range_where_speculation_pays_keeps_speculating_without_a_reference():
    govs, clock, changes = make_ranges()
    run(govs, clock, 30, tpot=0.01, accepted=7, load=4)
    assert govs.at(4).state == "speculating" and govs.at(4).plain_tpot is None and not changes


def test_floors_and_forces_reach_every_range_those_seen_later_too():
    govs, clock, changes = make_ranges()
    govs.at(2)
    govs.kv_cache(0.98)
    assert [gov.state for _, gov in govs.ranges()] == ["plain", "plain"]
    assert [c[0] for c in changes] == ["1", "2"] and {c[3] for c in changes} == {"kv_cache"}
    govs.kv_cache(0.1)
    govs.draft_down(True)
    govs.force("plain", 60.0, reason="operator")
    changes.clear()
    later = govs.at(4)  # made under the outage's floor and the force: plain, and no change of its own
    assert later.state == "plain" and later.forced and changes == []
    clock.now += 60.0
    assert [govs.admit(load)[0] for load in (1, 2, 4)] == [4, 4, 4]  # the force is over; the outage's floor holds
    govs.draft_down(False)
    assert [gov.cap() for _, gov in govs.ranges()] == [8, 8, 8]
